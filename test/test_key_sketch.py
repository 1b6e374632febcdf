"""CPU tests of key-sketch selection: the basis, the sketches the summaries keep, and the score
kernel (Triton's interpreter here) against the torch reference and a brute-force loop."""

from __future__ import annotations

import pytest
import torch

from sparse_sglang.attention import get_selector
from sparse_sglang.attention.reference import score_pages_reference
from sparse_sglang.attention.selection import force_pages
from sparse_sglang.mem_cache import PageSummaries
from sparse_sglang.mem_cache.key_sketch import KeyBasis, project_keys, project_query

HKV, G, D, PS, R = 2, 3, 16, 8, 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_fitted_projections_keep_the_score_differences_of_keys_in_a_subspace():
    """Keys = a constant + a rank-R part: the fit spends no direction on the constant (it adds the
    same to every token's score) and reproduces q . k up to that constant per query."""
    gen = torch.Generator().manual_seed(0)
    span = torch.linalg.qr(torch.randn(HKV, D, R, generator=gen)).Q  # [Hkv, D, R]
    offset = 5 * torch.randn(HKV, 1, D, generator=gen)
    keys = {layer: offset + torch.randn(HKV, 300, R, generator=gen) @ span.transpose(-1, -2) for layer in range(2)}
    queries = {layer: torch.randn(HKV, 300, D, generator=gen) for layer in range(2)}
    basis = KeyBasis.fit(keys, queries, R)
    assert basis.keys.shape == basis.queries.shape == (2, HKV, D, R) and basis.rank == R
    q = torch.randn(1, HKV, G, D, generator=gen)
    k = keys[1].transpose(0, 1)  # [T, Hkv, D]
    exact = torch.einsum("hd,thd->ht", q[0].sum(1), k)
    sketched = torch.einsum("hr,thr->ht", project_query(q, basis.queries[1])[0, :, 0], project_keys(k, basis.keys[1]))
    diff = exact - sketched  # the constant q . offset per head, nothing else
    torch.testing.assert_close(diff - diff[:, :1], torch.zeros_like(diff), atol=1e-2, rtol=0)
    with pytest.raises(ValueError, match="rank"):
        KeyBasis.fit(keys, queries, D + 1)
    with pytest.raises(ValueError, match="kv heads"):
        basis.check_shape(2, HKV + 1, D, "--sparse-key-basis x")
    head = basis.select(2, slice(1, 2))
    assert head.keys.shape == (2, 1, D, 2) and torch.equal(head.queries, basis.queries[:, 1:2, :, :2])
    with pytest.raises(ValueError, match="directions"):
        basis.select(R + 1)


def test_random_basis_round_trips_through_a_file(tmp_path):
    basis = KeyBasis.random(3, HKV, D, R, seed=1)
    basis.save(tmp_path / "b.safetensors")
    loaded = KeyBasis.load(tmp_path / "b.safetensors")
    torch.testing.assert_close(loaded.keys, basis.keys)
    torch.testing.assert_close(loaded.queries, basis.queries)


def summaries_with_sketches(seed: int, num_pages: int = 12):
    gen = torch.Generator().manual_seed(seed)
    basis = KeyBasis.random(1, HKV, D, R, seed=seed)
    s = PageSummaries(1, HKV, num_pages, PS, D, torch.bfloat16, key_basis=basis)
    return s, basis, gen


def test_update_sketch_writes_each_token_and_a_new_owner_clears_the_page():
    s, basis, gen = summaries_with_sketches(1)
    k = torch.randn(3 * PS, HKV, D, generator=gen)
    slots = torch.arange(3 * PS)
    slots[5] = -1  # padding: ignored
    s.update_sketch(0, k, slots)
    tokens = s.sketch[0].view(HKV, -1, PS, R)
    want = project_keys(k, basis.keys[0]).transpose(0, 1).bfloat16()  # [Hkv, T, R]
    torch.testing.assert_close(tokens[:, 0, :5], want[:, :5])
    assert (tokens[:, 0, 5] == 0).all()
    torch.testing.assert_close(tokens[:, 2].reshape(HKV, PS, R), want[:, 2 * PS : 3 * PS])
    # Page 1 gets a new owner: its offset-0 token clears the old tokens (3 new ones only).
    k2 = torch.randn(3, HKV, D, generator=gen)
    s.update_sketch(0, k2, torch.arange(PS, PS + 3))
    torch.testing.assert_close(tokens[:, 1, :3], project_keys(k2, basis.keys[0]).transpose(0, 1).bfloat16())
    assert (tokens[:, 1, 3:] == 0).all()
    s.reset(torch.tensor([2]))
    assert (tokens[:, 2] == 0).all()


def test_sketch_selector_scores_a_page_by_its_best_token():
    s, basis, gen = summaries_with_sketches(2, num_pages=5)
    k = torch.randn(5 * PS, HKV, D, generator=gen)
    s.update_sketch(0, k, torch.arange(5 * PS))
    q = torch.randn(1, HKV, G, D, generator=gen)
    qp = project_query(q, basis.queries[0])
    got = get_selector("sketch").score(qp, None, None, None, sketch=s.sketch[0].unsqueeze(0))
    sk = project_keys(k, basis.keys[0]).bfloat16().float()  # [T, Hkv, R]
    for h in range(HKV):
        for page in range(5):
            best = max(float(qp[0, h, 0] @ sk[t, h]) for t in range(page * PS, (page + 1) * PS))
            assert abs(float(got[0, h, page]) - best) < 1e-3 * max(1.0, abs(best))


@pytest.mark.parametrize("reuse", [False, True], ids=["full", "reuse"])
def test_score_kernel_on_sketches_equals_the_torch_path(reuse):
    from sparse_sglang.attention.scoring import score_pages
    from sparse_sglang.mem_cache.gpu_cache import CachedRows

    pool, batch, width = 40, 3, 10
    s, basis, gen = summaries_with_sketches(3, num_pages=pool)
    k = torch.randn(pool * PS, HKV, D, generator=gen)
    s.update_sketch(0, k, torch.arange(pool * PS))
    host_pages = torch.stack([torch.randperm(pool, generator=gen)[:30] for _ in range(batch)]).to(torch.int32)
    num_pages = torch.tensor([30, 17, 2], dtype=torch.int32)
    q = project_query(torch.randn(batch, HKV, G, D, generator=gen), basis.queries[0])
    layer = {name: t.to(DEVICE) for name, t in s.layer(0).items()}
    host_pages, num_pages, q = host_pages.to(DEVICE), num_pages.to(DEVICE), q.to(DEVICE)
    rows = None
    if reuse:  # request slots 1..3; each row caches `width` of its request's first pages
        slot_page = torch.full((batch * HKV * width + 1,), -1, dtype=torch.int64)
        rows = torch.full((batch + 1, HKV, width), -1, dtype=torch.int64)
        slot = 0
        for b in range(batch):
            for h in range(HKV):
                for col in range(min(width, int(num_pages[b]))):
                    rows[b + 1, h, col], slot_page[slot] = slot, col
                    slot += 1
        rows = CachedRows(torch.tensor([False, True, False], device=DEVICE), rows.to(DEVICE),
                          torch.tensor([1, 2, 3], dtype=torch.int32, device=DEVICE), slot_page.to(DEVICE))  # fmt: skip
    want = score_pages_reference("sketch", q, layer, host_pages, num_pages, forced=(1, 2), reuse=rows)
    got = score_pages("sketch", q, layer, host_pages, num_pages, forced=(1, 2), reuse=rows)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
    plain = score_pages_reference("sketch", q, layer, host_pages, num_pages)
    if not reuse:
        torch.testing.assert_close(want, force_pages(plain, num_pages, 1, 2))


def test_record_keys_gives_every_layers_post_rope_keys():
    transformers = pytest.importorskip("transformers")
    from sparse_sglang.calibrate import record_keys

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    keys, queries = record_keys(model, torch.randint(0, 64, (1, 20)))
    assert sorted(keys) == sorted(queries) == [0, 1] and keys[0].shape == queries[0].shape == (2, 20, 8)
    assert KeyBasis.fit(keys, queries, 2).keys.shape == (2, 2, 8, 2)


def test_fit_basis_pools_the_windows_of_several_texts(monkeypatch):
    """Each text gets one forward of its first ``window`` tokens; the fit sees all of them."""
    transformers = pytest.importorskip("transformers")
    from types import SimpleNamespace

    from sparse_sglang import calibrate

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()

    def tokenizer(text, add_special_tokens=False, return_tensors="pt"):
        return SimpleNamespace(input_ids=torch.tensor([[ord(c) % 64 for c in text]]))

    seen = []
    record = calibrate.record_keys

    def counting(model, ids):
        seen.append(ids.shape[1])
        return record(model, ids)

    monkeypatch.setattr(calibrate, "record_keys", counting)
    basis = calibrate.fit_basis(model, tokenizer, ["a" * 50, "bcd" * 7], rank=3, window=30)
    assert seen == [30, 21] and basis.keys.shape == basis.queries.shape == (2, 2, 8, 3)
