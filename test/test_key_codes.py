"""Key codes (``--sparse-rerank-by quantized``): every key kept in 2 or 4 bits per channel between
its page's channel min and max. The save kernel runs in Triton's interpreter on CPU against its
torch reference; what the codes read back is held to KIVI's per-page quantization."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sparse_sglang.mem_cache.kernels import SaveRuns, encode_runs
from sparse_sglang.mem_cache.key_codes import PageKeyCodes, code_row_bytes, frame_step, pack_codes, unpack_codes
from sparse_sglang.mem_cache.reference import encode_codes_reference

P, D, H = 8, 16, 2
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel compiled there, else interpreted
PAGES = [3, 4, 5]  # the request's host pages


def _slots(positions) -> torch.Tensor:
    return torch.tensor([PAGES[p // P] * P + p % P for p in positions])


def _codes(bits: int, dtype=torch.bfloat16) -> PageKeyCodes:
    return PageKeyCodes(1, H, 10, P, D, bits, dtype, DEVICE)


def _fill(save, bits: int, prefill: int, decode: int, seed: int = 0, dtype=torch.bfloat16) -> PageKeyCodes:
    """A request's ``prefill`` tokens saved in one extend, then ``decode`` one by one, each decoded
    key larger than the last (its page's frame keeps widening)."""
    codes = _codes(bits, dtype)
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(prefill, H, D, generator=gen).to(dtype)
    save(codes, k, _slots(range(prefill)), SaveRuns.for_extend([1], [0], [prefill], P, "cpu"))
    for pos in range(prefill, prefill + decode):
        k = (torch.randn(1, H, D, generator=gen) * (1 + pos / 4)).to(dtype)
        save(codes, k, _slots([pos]), SaveRuns.for_decode(torch.tensor([1]), torch.tensor([pos + 1]), P))
    return codes


def _kernel(codes, k, slots, runs):
    runs = SaveRuns(*(t.to(DEVICE) for t in dataclasses.astuple(runs)))
    encode_runs(codes, 0, k.contiguous().to(DEVICE), slots.to(DEVICE), runs)


def _reference(codes, k, slots, runs):
    encode_codes_reference(codes, 0, k.to(DEVICE), slots.to(DEVICE))


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_the_save_kernel_matches_its_reference(bits, dtype):
    got, want = _fill(_kernel, bits, 13, 7, dtype=dtype), _fill(_reference, bits, 13, 7, dtype=dtype)
    filled = [PAGES[0], PAGES[1], PAGES[2]]
    for name in ("codes", "lo", "hi"):
        a, b = got.layer(0)[name][:, filled].cpu(), want.layer(0)[name][:, filled].cpu()
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name


@pytest.mark.parametrize("bits", [2, 4])
def test_a_page_saved_whole_reads_back_as_its_keys_rounded_between_its_min_and_max(bits):
    """KIVI's per-channel key quantization with the page as its group: the nearest of 2**bits
    levels from the page's channel min to its max, so no key is off by more than half a level."""
    codes = _fill(_kernel, bits, 2 * P, 0)
    k = torch.randn(2 * P, H, D, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).float()
    keys = k.view(2, P, H, D).permute(2, 0, 1, 3)  # [H, page, P, D]
    lo, hi = keys.amin(2), keys.amax(2)
    step = (hi - lo) / (2**bits - 1)
    want = ((keys - lo.unsqueeze(2)) / step.unsqueeze(2)).round() * step.unsqueeze(2) + lo.unsqueeze(2)
    got = codes.decode(0, torch.tensor(PAGES[:2], device=DEVICE)).cpu()
    assert torch.equal(codes.layer(0)["lo"][:, PAGES[:2]].float().cpu(), lo)
    assert torch.equal(codes.layer(0)["hi"][:, PAGES[:2]].float().cpu(), hi)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert ((got - keys).abs() <= step.unsqueeze(2) / 2 + 1e-5).all()


def test_a_page_filled_token_by_token_keeps_every_key_within_a_few_levels():
    """Each widening of the frame re-codes the earlier tokens from their decoded values: the error
    grows by at most half a (new) level per widening, and the frame stays the keys' min and max."""
    gen = torch.Generator().manual_seed(1)
    keys = (torch.randn(P, H, D, generator=gen) * torch.linspace(1, 3, P).view(-1, 1, 1)).to(torch.bfloat16)
    codes = _codes(2)
    for pos in range(P):
        _kernel(codes, keys[pos : pos + 1], _slots([pos]),
                SaveRuns.for_decode(torch.tensor([1]), torch.tensor([pos + 1]), P))  # fmt: skip
    k = keys.float().transpose(0, 1)  # [H, P, D]
    lo, hi = codes.layer(0)["lo"][:, PAGES[0]].float().cpu(), codes.layer(0)["hi"][:, PAGES[0]].float().cpu()
    assert torch.equal(lo, k.amin(1)) and torch.equal(hi, k.amax(1))
    error = (codes.decode(0, torch.tensor(PAGES[0], device=DEVICE)).cpu() - k).abs() / frame_step(lo, hi, 2).unsqueeze(
        1
    )
    assert error.max() <= 2.0  # levels; a page saved whole: <= 0.5
    assert error.mean() < 0.5


def test_a_page_started_anew_forgets_its_previous_owner():
    """A run at offset 0 starts the page: the frame is the new keys' alone."""
    codes = _fill(_kernel, 2, P, 0)
    k = torch.full((P, H, D), 0.5, dtype=torch.bfloat16)
    k[1] = 0.75
    _kernel(codes, k, _slots(range(P)), SaveRuns.for_extend([1], [0], [P], P, "cpu"))
    assert (codes.layer(0)["lo"][:, PAGES[0]].float() == 0.5).all().item()
    assert (codes.layer(0)["hi"][:, PAGES[0]].float() == 0.75).all().item()


def test_padding_runs_write_nothing():
    codes = _codes(2)
    before = [t.clone() for t in codes.layer(0).values()]
    k = torch.randn(2, H, D).to(torch.bfloat16)
    runs = SaveRuns.for_decode(torch.tensor([0, 0]), torch.tensor([1, 1]), P)
    _kernel(codes, k, torch.tensor([-1, -1]), runs)
    for old, new in zip(before, codes.layer(0).values()):
        assert torch.equal(old, new)


@pytest.mark.parametrize("bits", [2, 4])
def test_packing_round_trips(bits):
    values = torch.randint(0, 2**bits, (3, P, D))
    packed = pack_codes(values, bits)
    assert packed.shape == (3, P * D * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed, bits, D), values)


def test_a_page_of_2_bit_codes_is_under_a_fifth_of_its_bf16_keys():
    """What the GPU keeps per (layer, kv head, page) at the Llama-3-8B shape: 32 tokens x 128
    channels, 2 bits each, and the frame (min and max per channel)."""
    assert code_row_bytes(32, 128, 2, torch.bfloat16) == 32 * 128 // 4 + 2 * 128 * 2
    assert code_row_bytes(32, 128, 2, torch.bfloat16) < 32 * 128 * 2 / 5


def test_the_store_codes_what_it_saves():
    """SparseKVStore(key_bits=2) codes every saved key (the CPU store runs the reference)."""
    from sparse_sglang.mem_cache.kv_store import SparseKVStore, StoreShape

    shape = StoreShape(num_layers=1, num_kv_heads=H, head_dim=D, page_size=P, dtype=torch.bfloat16,
                       num_host_pages=10, num_slots=16, max_requests=3, row_width=4, max_pages=4,
                       max_save_tokens=64)  # fmt: skip
    store = SparseKVStore(shape, "cpu", key_bits=2)
    k = torch.randn(P, H, D).to(torch.bfloat16)
    store.bind_runs(SaveRuns.for_extend([1], [0], [P], P, "cpu"))
    store.cache.open_request(1, 4)
    store.save(0, _slots(range(P)), k, k.clone(), staged=True)
    assert torch.equal(store.summaries.key_codes.layer(0)["hi"][:, PAGES[0]], k.transpose(0, 1).amax(1))
    assert store.summaries.nbytes > SparseKVStore(shape, "cpu").summaries.nbytes
