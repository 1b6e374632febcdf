"""Bookkeeping for the places sparse-sglang touches SGLang.

Every function in this package that relies on an SGLang internal is decorated
with :func:`relies_on`, naming the symbol and the ``file:line`` where SGLang
0.5.17 defines it. ``test/test_integration_hooks.py`` resolves every entry and
fails if a symbol is gone or has moved, so an SGLang upgrade shows exactly which
hook to re-read.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

SGLANG_VERSION = "0.5.17"


@dataclass(frozen=True)
class SGLangSymbol:
    """An SGLang object (or one of the pinned stack's, such as FlashInfer's) one of our hooks depends on."""

    module: str  # e.g. "sglang.srt.server_args"
    name: str  # attribute path inside the module, e.g. "ServerArgs"
    file: str  # path inside the wheel, e.g. "sglang/srt/server_args.py"
    line: int  # first line of its definition in SGLang 0.5.17
    hook: str  # qualified name of our function that relies on it

    def resolve(self) -> object:
        obj = importlib.import_module(self.module)
        for part in self.name.split("."):
            obj = getattr(obj, part)
        return obj

    def location(self) -> tuple[str, int]:
        """(file inside the wheel, first line) of the symbol in the installed package (SGLang's,
        or another one of the pinned stack's, e.g. FlashInfer's)."""
        obj = inspect.unwrap(self.resolve())
        path = inspect.getsourcefile(obj) or ""
        package = self.module.split(".")[0] + "/"
        return path[path.rfind(package) :], inspect.getsourcelines(obj)[1]


HOOKS: list[SGLangSymbol] = []


def relies_on(target: str, at: str) -> Callable:
    """Record that the decorated function relies on ``target`` ("module:attr") defined ``at`` ("file:line")."""
    module, name = target.split(":")
    file, line = at.rsplit(":", 1)

    def mark(fn: Callable) -> Callable:
        HOOKS.append(SGLangSymbol(module, name, file, int(line), f"{fn.__module__}.{fn.__qualname__}"))
        return fn

    return mark


def wrap_once(owner: object, name: str, wrap: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` with ``wrap(original)``, keeping the original's name and docs
    (``__wrapped__`` leads back to it). A second call is a no-op: ``install()`` runs in the main
    and the scheduler process, and may run twice in one."""
    original = getattr(owner, name)
    if getattr(original, "sparse_sglang", False):
        return
    patched = functools.wraps(original)(wrap(original))
    patched.sparse_sglang = True
    setattr(owner, name, patched)


def rewrap(owner: object, name: str, wrap: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` with ``wrap(original)``, ``original`` being SGLang's own: a wrapper an
    earlier call installed is replaced, not wrapped again. For hooks bound to state known only
    after ``install()`` (a scheduler's host store size), which may be bound again."""
    original = getattr(owner, name)
    while getattr(original, "sparse_sglang", False):
        original = original.__wrapped__
    patched = functools.wraps(original)(wrap(original))
    patched.sparse_sglang = True
    setattr(owner, name, patched)


def check_sglang_version() -> None:
    import sglang

    if sglang.__version__ != SGLANG_VERSION:
        raise RuntimeError(
            f"sparse-sglang hooks SGLang {SGLANG_VERSION} internals, but SGLang {sglang.__version__} "
            f"is installed: pip install sglang=={SGLANG_VERSION}"
        )
