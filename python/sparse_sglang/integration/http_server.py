"""Starting SGLang's HTTP server with our scheduler entry."""

from __future__ import annotations

from sparse_sglang.integration.registry import relies_on
from sparse_sglang.integration.scheduler_process import run_scheduler_process


@relies_on("sglang.srt.entrypoints.http_server:launch_server", at="sglang/srt/entrypoints/http_server.py:2715")
def launch_http_server(server_args) -> None:
    """SGLang's own ``launch_server``; only the scheduler process entry is ours."""
    from sglang.srt.entrypoints.http_server import launch_server

    launch_server(server_args, run_scheduler_process_func=run_scheduler_process)
