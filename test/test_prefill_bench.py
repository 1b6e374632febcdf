"""benchmark/prefill.py's arithmetic: decode gaps inside the prefill window, and the summary."""

import pytest

from benchmark.prefill import gaps_within, one_layer_kv_bytes, percentile, summarize


def test_gaps_count_tokens_that_arrived_during_the_prefill_stalls_included():
    arrivals = [(0.0, 1), (0.1, 2), (0.2, 3), (2.2, 4), (2.3, 6), (2.4, 6), (3.0, 7)]
    # the prefill runs (0.15, 2.35): the gap into 0.2 (0.1), the stalled one (2.0) and a two-token
    # event (0.1 / 2 each); the count repeated at 2.4 adds nothing, and 2.4 -> 3.0 starts after it
    assert gaps_within(arrivals, 0.15, 2.35) == pytest.approx([0.1, 2.0, 0.05])
    assert gaps_within(arrivals, 5.0, 6.0) == []
    assert gaps_within([(0.0, 1), (9.0, 2)], 1.0, 5.0) == [9.0]  # stalled across the whole prefill
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile([1.0] * 99 + [9.0], 0.99) == 9.0


def test_summary_ratios():
    layer = one_layer_kv_bytes(1000)
    assert layer == 2 * 1000 * 8 * 128 * 2
    systems = {
        "chunked": {"next_to_decodes": {"ttft_s": 10.0, "tbt_p99_s": 8.0}},
        "segmented": {
            "next_to_decodes": {"ttft_s": 9.0, "tbt_p99_s": 0.2},
            "peaks": {
                "long": {"tokens": 1000, "peak_over_before_bytes": 3 * layer, "prefix_staging_bytes": layer},
                "chunk": {"tokens": 100, "peak_over_before_bytes": 2 * layer},
            },
        },
    }
    s = summarize(systems, 1000)
    assert s["ttft_ratio_vs_chunked"] == pytest.approx(0.9) and s["tbt_ratio_vs_chunked"] == pytest.approx(0.025)
    assert s["peak_hbm_over_one_layer"] == pytest.approx(4.0)  # the staging buffer + the peak over what was there
    assert s["tbt_p99_long_prompt_s"] is None  # no 128K run in this record
    assert s["peak_kv_hbm_over_one_layer"] == pytest.approx(2.1)  # staging 1 + (3 - 2) layers + the chunk's own 0.1
    assert s["max_prompt_ratio"] is None
