"""Prefill chunks sized to a time between tokens: the cost model, its fit, the chunk it picks, and
the batches' times read from events on the GPU (``prefill/chunk_pacing.py``)."""

import numpy as np
import pytest

from sparse_sglang.prefill.chunk_pacing import (
    MAX_SLOWDOWN,
    MIN_CHUNKS,
    BatchTimer,
    ChunkPacer,
    ChunkShape,
    nonnegative_fit,
)
from sparse_sglang.testing.simulated_gpu import SimulatedGpu

TRUE_COST = np.array([0.002, 1e-7, 8e-6, 1e-9])  # fixed, per prefix token staged, per new token, per pair


def cost(x: int, prefix: int) -> float:
    return float(TRUE_COST @ ChunkShape.of([(x, prefix)]).features())


def fitted_pacer(target_s=0.1, decode_s=0.03) -> ChunkPacer:
    pacer = ChunkPacer(target_s, max_chunk_tokens=8192, align=64)
    pacer.note_decode(decode_s)
    for x, p in [(2048, 0), (4096, 2048), (1024, 6144), (2048, 7168), (8192, 9216), (512, 30000)]:
        pacer.note_chunk(ChunkShape.of([(x, p)]), cost(x, p))
    return pacer


def test_a_batch_shape_sums_its_requests_work():
    shape = ChunkShape.of([(100, 0), (50, 1000)])
    assert (shape.new_tokens, shape.prefix_tokens) == (150, 1000)
    assert shape.attended_pairs == 100 * 50 + 50 * (1000 + 25)
    assert shape.features() == (1.0, 1000.0, 150.0, shape.attended_pairs)


def test_the_fit_recovers_a_nonnegative_cost_and_drops_a_term_that_would_be_negative():
    rng = np.random.default_rng(0)
    shapes = [ChunkShape.of([(int(x), int(p))]) for x, p in zip(rng.integers(64, 8192, 40), rng.integers(0, 60000, 40))]
    rows = np.array([s.features() for s in shapes])
    np.testing.assert_allclose(nonnegative_fit(rows, rows @ TRUE_COST), TRUE_COST, rtol=1e-6)
    # a cost that falls with the prefix (noise, or a term the model lacks) is not extrapolated from
    falling = rows @ np.array([0.002, -1e-8, 8e-6, 1e-9])
    fit = nonnegative_fit(rows, falling)
    assert np.all(fit >= 0) and fit[1] == 0


def test_before_its_fit_the_pacer_alternates_sglangs_chunk_and_half_of_it():
    pacer = ChunkPacer(0.1, max_chunk_tokens=8192, align=64)
    assert [pacer.chunk_tokens(0) for _ in range(4)] == [8192, 4096, 8192, 4096]
    for _ in range(MIN_CHUNKS):  # one size only: not enough to tell fixed from per-token cost
        pacer.note_chunk(ChunkShape.of([(8192, 0)]), cost(8192, 0))
    assert pacer.cost is None


def test_the_chunk_is_the_largest_aligned_one_predicted_within_the_target_beside_a_decode_step():
    pacer = fitted_pacer()
    room = 0.1 - 0.03
    for prefix in (0, 8192, 16384, 40000):
        x = pacer.chunk_tokens(prefix)
        assert x % 64 == 0 and 64 <= x <= 8192
        assert cost(x, prefix) <= room + 1e-12
        assert x == 8192 or cost(x + 64, prefix) > room
    assert pacer.chunk_tokens(0) > pacer.chunk_tokens(16384) > pacer.chunk_tokens(40000)  # deeper costs more
    assert fitted_pacer(target_s=1.0).chunk_tokens(0) == 8192  # never above SGLang's chunk


def seconds_per_token(x: int, prefix: int) -> float:
    return cost(x, prefix) / x


@pytest.mark.parametrize("prefix", [0, 16384, 60000])
def test_where_the_target_leaves_no_room_the_chunk_prefills_at_least_half_as_fast_as_sglangs(prefix):
    """A decode step that fills the target: rather than one aligned unit a round (which spends
    the round on the fixed cost and the prefix's staging), the chunk is the fewest tokens that
    prefill within twice SGLang's chunk's time per token. The round goes over the target; the
    prompt does not crawl."""
    x = fitted_pacer(decode_s=0.2).chunk_tokens(prefix)
    limit = MAX_SLOWDOWN * seconds_per_token(8192, prefix)
    assert x % 64 == 0 and 64 < x < 8192
    assert seconds_per_token(x, prefix) <= limit < seconds_per_token(x - 64, prefix)


def test_a_prefix_whose_staging_fills_the_target_gets_the_floors_chunk():
    pacer = ChunkPacer(0.1, max_chunk_tokens=8192, align=64)
    pacer.note_decode(0.03)
    staging = lambda x, p: 0.002 + 2e-6 * p + 8e-6 * x  # noqa: E731  (a 60K prefix: 120 ms to stage)
    for x, p in [(2048, 0), (8192, 2048), (1024, 10240), (4096, 11264), (512, 40000)]:
        pacer.note_chunk(ChunkShape.of([(x, p)]), staging(x, p))
    deep = pacer.chunk_tokens(60000)  # staging alone is past the target: the floor's chunk
    limit = MAX_SLOWDOWN * staging(8192, 60000) / 8192
    assert staging(deep, 60000) / deep <= limit < staging(deep - 64, 60000) / (deep - 64)
    shallower = pacer.chunk_tokens(16384)  # room for more than the floor: the target's chunk
    assert staging(shallower, 16384) <= 0.07 < staging(shallower + 64, 16384)


def test_the_docstring_example_holds():
    pacer = ChunkPacer(target_s=0.1, max_chunk_tokens=8192, align=64)
    pacer.note_decode(0.030)
    for x, p in [(2048, 0), (4096, 2048), (1024, 6144), (2048, 7168)]:
        pacer.note_chunk(ChunkShape.of([(x, p)]), 0.002 + x * 8e-6 + x * (p + x / 2) * 1e-9)
    assert (pacer.chunk_tokens(prefix_tokens=16384), pacer.chunk_tokens(prefix_tokens=0)) == (2624, 6080)
    assert pacer.describe().startswith("chunk pacing: decode step 30.0 ms; a chunk 2.00 ms + 0.00 ms per 1K prefix")
    assert ChunkPacer(0.1, 8192, 64).describe() == "chunk pacing: fitting (0 chunks timed)"


@pytest.mark.parametrize("target, largest", [(0.0, 8192), (float("nan"), 8192), (0.1, 32)])
def test_a_pacer_that_cannot_pace_is_refused(target, largest):
    with pytest.raises(ValueError):
        ChunkPacer(target, max_chunk_tokens=largest, align=64)


def test_the_timer_gives_each_batch_its_gpu_time_once_the_gpu_has_run_it():
    # batches A (3 s) and B (5 s) launched back to back; the host reads the timer at 4 s, then at 9 s
    gpu = SimulatedGpu()
    timer = BatchTimer(gpu.event)
    for label, seconds in (("A", 3.0), ("B", 5.0)):
        start = timer.started()
        gpu.run(seconds)
        timer.ended(label, start)
    assert timer.finished() == []  # the GPU has run neither yet
    gpu.now = 4.0
    assert timer.finished() == [("A", 3.0)]
    gpu.now = 9.0
    assert timer.finished() == [("B", 5.0)] and timer.finished() == []


def test_with_noisy_times_the_waits_stay_near_the_target():
    """Batch times that vary by +-15% around the model (as a GPU's do): over four 64K-token prompts
    the decodes' waits centre on the target and none exceeds it by more than the noise."""
    import random

    rng = random.Random(0)
    pacer = ChunkPacer(0.1, max_chunk_tokens=8192, align=64)
    waits = []
    for _ in range(4):
        done = 0
        while done < 65536:
            decode = 0.03 * rng.uniform(0.85, 1.15)
            pacer.note_decode(decode)
            x = min(pacer.chunk_tokens(done), 65536 - done)
            seconds = cost(x, done) * rng.uniform(0.85, 1.15)
            pacer.note_chunk(ChunkShape.of([(x, done)]), seconds)
            waits.append(decode + seconds)
            done += x
    settled = sorted(waits[MIN_CHUNKS + 2 :])
    assert 0.09 <= settled[len(settled) // 2] <= 0.1 and settled[-1] <= 0.1 * 1.15


def test_a_few_chunks_far_off_the_model_do_not_move_the_fit():
    """The server's two warm-up batches (32 tokens, cold: about 95 ms each on an H200) among
    chunks that follow the model exactly: the fit is the model's, not one dragged toward them."""
    pacer = ChunkPacer(0.1, max_chunk_tokens=8192, align=64)
    for _ in range(2):
        pacer.note_chunk(ChunkShape.of([(32, 0)]), 0.095)
    for x, p in [(4096, 0), (8192, 0), (3712, 8192), (2048, 12000), (1024, 14000), (2048, 15000), (512, 20000)]:
        pacer.note_chunk(ChunkShape.of([(x, p)]), cost(x, p))
    np.testing.assert_allclose(pacer.cost, TRUE_COST, rtol=1e-6)


def test_the_log_gives_the_cost_by_size_beside_the_fit():
    pacer = fitted_pacer()
    logged = pacer.describe()
    assert "(fitted on 1 of ~512 tokens " in logged and "; 2 of ~2048 tokens " in logged
    assert f"2 of ~2048 tokens {np.median([cost(2048, 0), cost(2048, 7168)]) * 1e3:.1f} ms" in logged
