"""Key sketches: every key projected onto a few directions of its (layer, kv head), kept on the GPU.

The ``sketch`` selector scores a page by its best token, ``max_t (sum_g q_g) . k_t``, with each key
``k_t`` seen through a rank-``r`` projection ``s_t = k_t Wk`` and the query through ``Wq``
(:class:`KeyBasis`, fitted on a calibration text; ShadowKV's observation that keys live near a
low-rank subspace): ``(sum_g q_g) . k_t ~= (sum_g q_g) Wq . s_t`` up to a constant per query. The
decoder projects the query once per (request, kv head) and a page's score reads its tokens'
sketches: ``page_size * r`` numbers where Quest's bounds read ``2 * head_dim``. Unlike a bound, a
sketch scores tokens, not a page's bounding box, which a few outlier channels can make large for
pages that hold nothing the query wants (docs/decisions/0015-key-sketch-selection.md).

Contracts
---------
- :class:`KeyBasis`: ``Wk`` and ``Wq``, ``[num_layers, num_kv_heads, head_dim, rank]`` float32
  each; one per model (per tensor-parallel rank: the rank's own kv heads).
- Sketch rows live in :class:`~sparse_sglang.mem_cache.summaries.PageSummaries` as
  ``[num_layers, num_kv_heads, num_pages + 1, page_size * rank]`` bf16, token ``o`` of a page at
  ``[o * rank, (o + 1) * rank)``. A page started anew (its offset-0 token) is zeroed first, so a
  page's tokens past its fill read 0: only the newest page of a request is partial, and it is a
  forced (recent) page, whose score is not read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

BASIS_FILE = "sparse_key_basis.safetensors"  # in a model folder: found without --sparse-key-basis
SKETCH_DTYPE = torch.bfloat16  # what the sketch rows are stored in (and planned for)


@dataclass(frozen=True)
class KeyBasis:
    """Per (layer, kv head) projections of keys and of the group's summed query onto ``rank``
    numbers each, such that ``(q Wq) . (k Wk) ~= q . k`` up to a per-query constant.

    :meth:`fit` takes them from calibration texts' queries and keys: the rank-``r``
    approximation of the bilinear form ``q . k`` under the texts' query second moment ``Sq`` and
    centred key covariance ``Sk`` (the key mean adds the same to every token's score, so it cannot
    change a ranking): with ``U S V'`` the SVD of ``Sq^1/2 Sk^1/2``, ``Wk = Sk^-1/2 V`` and
    ``Wq = Sq^-1/2 U S`` (the CCA-like solution; plain SVD of the keys spends its directions on
    the large, constant parts of keys).

    Example
    -------
    >>> keys = {0: torch.randn(2, 100, 16)}  # layer -> [Hkv, T, D] keys of a calibration text
    >>> queries = {0: torch.randn(2, 100, 16)}  # and the group's summed queries
    >>> basis = KeyBasis.fit(keys, queries, rank=4)
    >>> basis.keys.shape, basis.queries.shape
    (torch.Size([1, 2, 16, 4]), torch.Size([1, 2, 16, 4]))
    >>> project_keys(torch.randn(5, 2, 16), basis.keys[0]).shape  # [T, Hkv, rank]
    torch.Size([5, 2, 4])
    """

    keys: torch.Tensor  # [num_layers, num_kv_heads, head_dim, rank] float32: Wk
    queries: torch.Tensor  # [num_layers, num_kv_heads, head_dim, rank] float32: Wq

    @property
    def rank(self) -> int:
        return self.keys.shape[-1]

    @classmethod
    def fit(cls, keys: dict[int, torch.Tensor], queries: dict[int, torch.Tensor], rank: int) -> KeyBasis:
        """From each layer's ``[Hkv, T, D]`` post-RoPE keys and group-summed queries (layers
        ``0..L-1``, as the KV cache and the decoder see them)."""
        head_dim = keys[0].shape[-1]
        if not 1 <= rank <= head_dim:
            raise ValueError(f"rank must be in [1, head_dim={head_dim}], got {rank}")
        wk, wq = [], []
        for layer in range(len(keys)):
            k, q = keys[layer].double(), queries[layer].double()
            kc = k - k.mean(1, keepdim=True)
            tokens = k.shape[1]
            q_half, q_inv = _sqrt_and_inverse(q.transpose(-1, -2) @ q / tokens)
            k_half, k_inv = _sqrt_and_inverse(kc.transpose(-1, -2) @ kc / tokens)
            u, sv, vh = torch.linalg.svd(q_half @ k_half)
            wk.append(k_inv @ vh[:, :rank].transpose(-1, -2))
            wq.append(q_inv @ u[:, :, :rank] * sv[:, None, :rank])
        return cls(torch.stack(wk).float().contiguous(), torch.stack(wq).float().contiguous())

    @classmethod
    def random(cls, num_layers: int, num_kv_heads: int, head_dim: int, rank: int, seed: int = 0) -> KeyBasis:
        """Random orthonormal columns for both: for dummy weights (timing runs), whose keys have
        no subspace."""
        gen = torch.Generator().manual_seed(seed)
        gauss = torch.randn(num_layers, num_kv_heads, head_dim, rank, generator=gen)
        q = torch.linalg.qr(gauss).Q.contiguous()
        return cls(q, q.clone())

    def save(self, path: str | Path) -> None:
        """Write atomically (servers starting side by side may fit and save the same file)."""
        import os

        from safetensors.torch import save_file

        partial = f"{path}.{os.getpid()}.partial"
        save_file({"keys": self.keys.contiguous(), "queries": self.queries.contiguous()}, partial)
        os.replace(partial, path)

    @classmethod
    def load(cls, path: str | Path) -> KeyBasis:
        from safetensors.torch import load_file

        t = load_file(str(path))
        return cls(t["keys"].float().contiguous(), t["queries"].float().contiguous())

    def check_shape(self, num_layers: int, num_kv_heads: int, head_dim: int, source: str) -> None:
        """Refuse a basis made for another model shape (``source`` names where it came from)."""
        want = (num_layers, num_kv_heads, head_dim)
        if tuple(self.keys.shape[:3]) != want:
            raise ValueError(f"{source}: a key basis for (layers, kv heads, head_dim) = "
                             f"{tuple(self.keys.shape[:3])}, the model has {want}")  # fmt: skip

    def select(self, rank: int | None = None, heads: slice = slice(None)) -> KeyBasis:
        """The leading ``rank`` directions (they come in order of importance) of kv heads ``heads``."""
        if rank is not None and rank > self.rank:
            raise ValueError(f"rank {rank}: the key basis has {self.rank} directions")
        r = slice(None, rank)
        return KeyBasis(self.keys[:, heads, :, r].contiguous(), self.queries[:, heads, :, r].contiguous())


def _sqrt_and_inverse(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M^1/2, M^-1/2)`` of symmetric PSD ``[..., D, D]``, eigenvalues floored at 1e-6 of the largest."""
    w, v = torch.linalg.eigh(m)
    w = w.clamp_min(w.amax(-1, keepdim=True) * 1e-6)
    vt = v.transpose(-1, -2)
    return v @ torch.diag_embed(w.sqrt()) @ vt, v @ torch.diag_embed(w.rsqrt()) @ vt


def project_keys(k: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``[T, Hkv, rank]`` float32 sketches of keys ``[T, Hkv, D]`` under one layer's key
    projection ``[Hkv, D, rank]`` (``Wk``)."""
    return torch.einsum("thd,hdr->thr", k.float(), basis)


def project_query(q: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """The sketch score's query ``[B, Hkv, 1, rank]`` float32: the group's summed queries
    ``[B, Hkv, G, D]`` projected by one layer's query projection ``[Hkv, D, rank]`` (``Wq``)."""
    return torch.einsum("bhd,hdr->bhr", q.float().sum(dim=2), basis).unsqueeze(2)


def sketch_page_scores(q: torch.Tensor, sketch: torch.Tensor) -> torch.Tensor:
    """Reference page scores ``[B, Hkv, 1, N]``: each page's best token, ``max_t`` of the projected
    query ``q`` ``[B, Hkv, 1, rank]`` (:func:`project_query`) against the token's sketch, from
    gathered sketch rows ``sketch`` ``[B, Hkv, N, page_size * rank]``."""
    batch, heads, pages, width = sketch.shape
    rank = q.shape[-1]
    tokens = sketch.float().view(batch, heads, pages, width // rank, rank)
    return (tokens @ q.float().view(batch, heads, 1, rank, 1)).squeeze(-1).amax(-1).unsqueeze(2)
