"""benchmark/probes/step_fit.py recovers a decode step and a prefill cost from SGLang's log lines."""

import pytest

from benchmark.probes.step_fit import fit, intervals


def log_lines(step_fixed_s: float, step_per_req_s: float, prefill_s_per_token: float) -> list[str]:
    """SGLang-formatted lines of a server whose decode step and prefill cost are exactly these."""
    lines = ["[t] Decode batch, #running-req: 10, #token: 1, token usage: 0.1, cuda graph: True, "
             "gen throughput (token/s): 100.00, #queue-req: 0"]  # fmt: skip
    for running, prefill_tokens in [(10, 0), (20, 8192), (40, 0), (80, 4096), (60, 12288), (30, 0)]:
        if prefill_tokens:
            lines.append(
                f"[t] Prefill batch, #new-seq: 1, #new-token: {prefill_tokens}, #cached-token: 0, token usage: 0.5"
            )
        seconds = 40 * (step_fixed_s + step_per_req_s * running) + prefill_s_per_token * prefill_tokens
        rate = 40 * running / seconds
        lines.append(f"[t] Decode batch, #running-req: {running}, #token: 1, token usage: 0.5, cuda graph: True, "
                     f"gen throughput (token/s): {rate:.6f}, #queue-req: 3")  # fmt: skip
    return lines


def test_the_fit_recovers_the_step_and_the_prefill_cost():
    rows = intervals(log_lines(0.006, 0.00016, 3.6e-5), steps_per_line=40)
    assert len(rows) == 6  # the first decode line's interval (from the server's start) is dropped
    got = fit(rows, steps_per_line=40)
    assert got["step_ms_fixed"] == pytest.approx(6.0, abs=0.01)
    assert got["step_ms_per_request"] == pytest.approx(0.16, abs=1e-4)
    assert got["prefill_s_per_10k_tokens"] == pytest.approx(0.36, abs=1e-3)
    assert got["prefill_tokens"] == 8192 + 4096 + 12288
    assert got["decode_only_by_batch"]["40-59"] == {"median_step_ms": pytest.approx(12.4, abs=0.01), "intervals": 1}
    assert 0 < got["prefill_share"] < 1
