"""The ``--sparse-*`` flags: one per :class:`~sparse_sglang.config.SparseConfig` field, parsed without SGLang.

The launcher parses in two phases. :func:`check_sparse_flags` reads only the ``--sparse-*`` flags
and builds the SparseConfig, so a bad one is refused before SGLang's modules load (they take
seconds to import); then ``integration/server_args.py`` adds these same flags to SGLang's parser
for the full parse. This module imports no SGLang and no torch: the first phase's speed rests on it.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from sparse_sglang.config import (
    BOUND_FORMATS,
    GROUP_REDUCES,
    PAGE_BOUNDS,
    SELECTORS,
    SparseConfig,
    SparseConfigError,
    field_type,
    flag_name,
)

PROG = "python -m sparse_sglang.launch_server"


class CLIError(Exception):
    """A start-up error the user must fix: printed as one line, exit status 2."""


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _typed(base: type):
    def convert(text: str):
        try:
            return base(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {base.__name__}, got {text!r}") from None

    convert.__name__ = base.__name__
    return convert


def _shown(default: Any) -> str:
    if default is None:
        return "auto"
    if isinstance(default, bool):
        return str(default).lower()
    return f"{default:g}" if isinstance(default, float) else str(default)


# The sparse knobs that take one of a few words: --help lists them, argparse refuses others.
CHOICES = {
    "selector": SELECTORS,
    "bound_format": BOUND_FORMATS,
    "group_reduce": GROUP_REDUCES,
    "page_bounds": PAGE_BOUNDS,
}


def add_sparse_cli_args(parser: argparse.ArgumentParser) -> None:
    """One ``--sparse-<name>`` flag per SparseConfig field, help text from its metadata, in a group
    that ``--help`` prints before SGLang's own (2,000 lines of them)."""
    group = parser.add_argument_group("sparse-sglang", "Sparse decode over the per-head KV hierarchy.")
    parser._action_groups.remove(group)  # argparse prints groups in list order; ours after the usage
    parser._action_groups.insert(0, group)
    defaults = SparseConfig()
    for f in dataclasses.fields(SparseConfig):
        base = field_type(f)
        convert = _parse_bool if base is bool else _typed(base)
        default = getattr(defaults, f.name)
        choices = CHOICES.get(f.name)
        group.add_argument(
            flag_name(f.name),
            dest=f"sparse_{f.name}",
            type=convert,
            default=None,  # None = not given: SparseConfig's own default applies
            choices=choices,
            metavar="{" + ",".join(choices) + "}" if choices else base.__name__.upper(),
            help=f"{f.metadata['help']} (default: {_shown(default)})".replace(
                "%", "%%"
            ),  # argparse formats help with %
        )


def sparse_config_from_args(args: argparse.Namespace) -> SparseConfig:
    """The SparseConfig of the parsed ``--sparse-*`` flags (their ``sparse_*`` attributes are
    taken off ``args``, which then holds SGLang's own); raises SparseConfigError."""
    given: dict[str, Any] = {}
    for f in dataclasses.fields(SparseConfig):
        value = getattr(args, f"sparse_{f.name}")
        delattr(args, f"sparse_{f.name}")
        if value is not None:
            given[f.name] = value
    return SparseConfig(**given)


def check_sparse_flags(argv: list[str]) -> SparseConfig:
    """The launcher's first phase: the SparseConfig of the ``--sparse-*`` flags in ``argv``, every
    other argument left for SGLang's parser. A bad value or an unknown ``--sparse-*`` flag exits
    with argparse's one line and status 2, an invalid config raises CLIError naming the flag.

    Flags that a ``--config`` file sets are not seen here; the full parse checks them."""
    parser = OneLineErrorParser(prog=PROG, add_help=False)  # --help is the full parser's
    add_sparse_cli_args(parser)
    args, others = parser.parse_known_args(argv)
    unknown = [arg for arg in others if arg.startswith("--sparse-")]
    if unknown:  # SGLang has no --sparse-* flag, so the full parse would refuse it too
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return sparse_config_from_args(args)
    except SparseConfigError as err:
        raise CLIError(err.cli_message()) from None
