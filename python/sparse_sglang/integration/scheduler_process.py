"""Getting sparse-sglang into the scheduler process.

SGLang spawns (not forks) its scheduler, so nothing the launcher registered is
there; ``launch_server`` hands SGLang :func:`run_scheduler_process` instead of
its own, and this installs our hooks in the child before SGLang's body runs.
"""

from __future__ import annotations

from sparse_sglang.integration.registry import relies_on


@relies_on("sglang.srt.managers.scheduler:run_scheduler_process", at="sglang/srt/managers/scheduler.py:4879")
def run_scheduler_process(*args, **kwargs):
    """SGLang's scheduler process entry, with sparse-sglang installed first (module level: picklable)."""
    from sparse_sglang.integration import install

    install()
    from sglang.srt.managers.scheduler import run_scheduler_process as sglang_run_scheduler_process

    return sglang_run_scheduler_process(*args, **kwargs)
