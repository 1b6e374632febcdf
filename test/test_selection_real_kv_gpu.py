"""The server's decode path selects what its torch reference selects, on a real model's KV.

SmolLM2's keys, values and queries over a prompt of the accuracy suite (real prose, four needles of
one phrasing) go into a :class:`SparseKVStore` as the server saves them (bf16, int8 page bounds by
default), and the last decode positions run through the server's path (the fused score kernel with
forced pages, FlashInfer's top-k, ``retrieve_pages``, FlashH2D, FlashInfer's decode over the page
cache). Per (layer, kv head, step), the pages it selects are the torch reference's
(``score_pages_reference`` + ``select_pages`` over the same summaries) up to exact score ties, and
its output is the reference attention over those pages. How many of those pages the float32,
exact-bound selection of ``benchmark/quality.py`` also picks is recorded, not asserted (it differs
by the bounds' rounding, which the accuracy suite judges by answers).
"""

from __future__ import annotations

import pytest
import torch

from sparse_sglang.attention import get_selector, select_pages
from sparse_sglang.attention.reference import score_pages_reference, sparse_attention_reference
from sparse_sglang.config import SparseConfig
from sparse_sglang.testing.decode_setup import DecodeBench, Llama8BShape, make_store
from sparse_sglang.testing.provenance import save_gpu_test_record

pytestmark = pytest.mark.gpu
STEPS = 6  # decode positions: the prompt's last ones, each over its own prefix


@pytest.fixture(scope="module")
def captured():
    """(config, q [T, Hq, D] per layer, k and v [T, Hkv, D] per layer) of SmolLM2 over one item."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmark import accuracy
    from sparse_sglang.default_model import default_model_path

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    item = accuracy.Builder(tokenizer, accuracy.corpus(), seed=3).item("niah_multikey", 2048, 0)
    ids = torch.tensor([tokenizer(item.prompt, add_special_tokens=False).input_ids], device="cuda")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    qs, ks, vs = [], [], []

    def hook(module, args, kwargs, output):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
        shape = (*hidden.shape[:-1], -1, module.head_dim)
        q = module.q_proj(hidden).view(shape).transpose(1, 2)
        k = module.k_proj(hidden).view(shape).transpose(1, 2)
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        v = module.v_proj(hidden).view(shape).transpose(1, 2)
        qs.append(q[0].transpose(0, 1).contiguous())
        ks.append(k[0].transpose(0, 1).contiguous())
        vs.append(v[0].transpose(0, 1).contiguous())

    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
    with torch.inference_mode():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    return model.config, qs, ks, vs


@pytest.mark.parametrize("bound_format", ["auto", "exact"])
def test_server_path_selects_what_the_reference_selects_on_real_kv(captured, bound_format):
    cfg, qs, ks, vs = captured
    tokens = ks[0].shape[0]
    shape = Llama8BShape(num_layers=cfg.num_hidden_layers, num_q_heads=cfg.num_attention_heads,
                         num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)  # fmt: skip
    config = SparseConfig(token_budget=512, host_cache_gb=1.0, bound_format=bound_format)
    store = make_store(shape, config, 1, tokens)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    bench = DecodeBench(store, config, shape.num_q_heads, 1, tokens - 1, workspace, fused=True)
    for layer in range(shape.num_layers):
        bench.write_kv(layer, ks[layer].unsqueeze(0), vs[layer].unsqueeze(0))
    decoder, heads, group = bench.decoder, shape.num_kv_heads, shape.num_q_heads // shape.num_kv_heads
    selected = {}  # what the step's own selection chose (run() selects once per layer)
    select_raw = decoder.select_raw

    def recording(layer, q, plan):
        selected["ids"] = ids = select_raw(layer, q, plan)
        return ids

    decoder.select_raw = recording
    ties = compared = exact_overlap = exact_total = 0
    for step in range(STEPS):
        seq_len = tokens - STEPS + 1 + step
        seq_lens = torch.tensor([seq_len])
        plan = bench.step(bench.req_slots, seq_lens, bench.host_pages)
        num_pages = plan.num_pages
        for layer in range(shape.num_layers):
            q = qs[layer][seq_len - 1].unsqueeze(0)  # [1, Hq, D]: the query of the newest token
            out = decoder.run(layer, q, plan)
            raw = selected["ids"]
            got = torch.where(raw < num_pages.view(-1, 1, 1), raw, -1)
            qg = q.view(1, heads, group, -1)
            summaries = store.summaries.layer(layer)
            scores = score_pages_reference(config.selector, qg, summaries, bench.host_pages, num_pages,
                                           config.group_reduce)  # fmt: skip
            want = select_pages(scores, num_pages, config.budget_pages, config.sink_pages, config.recent_pages).page_ids
            for h in range(heads):
                g = {p for p in got[0, h].tolist() if p >= 0}
                w = {p for p in want[0, h].tolist() if p >= 0}
                assert len(g) == len(w) == config.budget_pages, (step, layer, h)
                differ = g ^ w
                assert len({float(scores[0, h, p]) for p in differ}) <= 1, (
                    f"step {step} layer {layer} head {h}: {sorted(g - w)} selected instead of {sorted(w - g)}"
                )
                ties += bool(differ)
                compared += 1
            # the float32 selection over exact corners of the same keys (quality.py's reference):
            # min/max, or mean -+ spread std, as the config's page bounds are
            k32 = ks[layer][:seq_len].float().transpose(0, 1)  # [Hkv, T, D]
            pages = -(-seq_len // config.page_size)
            padded = torch.nn.functional.pad(k32, (0, 0, 0, pages * config.page_size - seq_len))
            blocks = padded.view(heads, pages, config.page_size, -1)
            valid = (torch.arange(pages * config.page_size, device="cuda") < seq_len).view(1, pages, -1, 1)
            if config.page_bounds == "meanstd":
                count = valid.sum(2, keepdim=True).clamp_min(1)
                mean = torch.where(valid, blocks, 0.0).sum(2, keepdim=True) / count
                std = (torch.where(valid, (blocks - mean) ** 2, 0.0).sum(2, keepdim=True) / count).sqrt()
                kmin = (mean - config.bound_spread * std).squeeze(2).unsqueeze(0)
                kmax = (mean + config.bound_spread * std).squeeze(2).unsqueeze(0)
            else:
                kmin = torch.where(valid, blocks, torch.inf).amin(2).unsqueeze(0)
                kmax = torch.where(valid, blocks, -torch.inf).amax(2).unsqueeze(0)
            s32 = get_selector("quest").score(qg, kmin, kmax, None, config.group_reduce)
            exact = select_pages(s32, num_pages, config.budget_pages, config.sink_pages, config.recent_pages).page_ids
            for h in range(heads):
                exact_overlap += len(
                    {p for p in got[0, h].tolist() if p >= 0} & {p for p in exact[0, h].tolist() if p >= 0}
                )
                exact_total += config.budget_pages
            # and the step attended exactly over what it selected
            ref = sparse_attention_reference(q, ks[layer][:seq_len].transpose(0, 1).unsqueeze(0),
                                             vs[layer][:seq_len].transpose(0, 1).unsqueeze(0), got, config.page_size,
                                             seq_lens.cuda())  # fmt: skip
            torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2, msg=f"step {step} layer {layer}")
    save_gpu_test_record(f"selection-real-kv-{bound_format}.json", {
        "tokens": tokens, "steps": STEPS, "layers": shape.num_layers, "compared_rows": compared, "rows_differing_by_ties": ties,
        "overlap_with_float32_exact_corners": round(exact_overlap / exact_total, 4)})  # fmt: skip
