"""Per-page key summaries kept on the GPU: channel-wise min and max (Quest, ArkVale's cuboid) and
the mean key (SparseServe's cuboid-mean), per (layer, kv head, host page).

Storage types
-------------
- ``kmin``/``kmax`` are stored in one of two bound formats (:data:`BOUND_FORMATS`):
  ``"exact"``, the KV dtype itself (:func:`bound_dtype`): a min or max *is* one of the keys, so
  this is exact for bf16, fp16 and fp8 alike; or ``"int8"``: int8 levels times a power-of-two
  scale ``2**e`` per (page, kv head), ``bound_exp`` holding ``e``, the min rounded down and the max
  up (:func:`quantize_bounds`), so every key of the page stays inside its box and Quest's score
  stays an upper bound of ``q . k``. int8 halves the bytes of bf16 bounds, and the bytes the
  scoring kernel reads every step; ``"auto"`` takes it for 16-bit KV (fp8 bounds are one byte
  already, and exact). A page's bounds are requantized, outward again, whenever a token joins
  it, which loosens them by at most a level each time the page's scale grows.
- With ``page_bounds="meanstd"`` (``--sparse-page-bounds``) ``kmin``/``kmax`` hold other corners
  in the same storage: the page keys' channel-wise mean less and plus ``bound_spread`` population
  standard deviations. Quest's scorer reads them unchanged (``q . mean + spread |q| . std``), so
  they cost what min/max bounds cost; they bound nothing. A token joining a page merges into the
  moments its stored corners and count give back (Chan's pairwise update), and int8 corners round
  to the nearest level (:func:`~sparse_sglang.mem_cache.bounds.quantize_corners`).
- ``mean`` is float32: it is the one running statistic (updated as a page fills across decode
  steps), and bf16 would drift by a rounding error per update.

Exact bounds are ``(2 * itemsize + 4) / (2 * page_size * itemsize)`` of the KV bytes: 6.25 % for
bf16 and 32-token pages, half of it the mean, which only the ``mean`` selector reads: the server
keeps just the summaries its selector reads (``with_mean``, ``with_radius``; see
``sparse_sglang.attention.kept_summaries``), 3.1 % for quest with exact bf16 bounds, 1.6 % with
int8 ones or fp8 keys. fp8 keys are summarized as stored, without their per-tensor scale: it would
multiply all scores of a layer alike, so it does not change which pages rank highest.

Coarse bounds
-------------
With ``coarse_pages`` S > 0 (``--sparse-coarse-pages``) the summaries also hold the bounds of
super-pages: S consecutive pages of a request, whole and before its recent pages
(:func:`coarse_built`). A super-page's bounds (the min and max of its pages' bounds, stored as
theirs) live in the rows of its last page, and ``coarse_first`` of that page names the super-page's
first page. Pages are shared only as radix prefixes, which start at token 0, so a page ends the same
super-page in every request that holds it. :meth:`PageSummaries.build_coarse` (and its kernel)
builds super-pages whose last page does not name their first yet; a page started anew (a token at
offset 0, or a reset) names none, so a super-page is rebuilt after any of its pages changed owner
(the last one is the newest: pages are freed whole, from the newest). This doubles the bounds'
GPU memory.

An empty page (no tokens yet, or reset) has the bounds :func:`empty_bounds` (``kmin = +inf``,
``kmax = -inf``; ``+-448`` for e4m3, which has no infinity; int8 levels ``+-127`` at scale
``2**127``, which read back as ``+-inf``), ``mean = 0`` and count 0; scorers must only look at
pages a request holds tokens in.
"""

from __future__ import annotations

import torch

from sparse_sglang.mem_cache.bounds import (
    EMPTY_EXP,
    bound_dtype,
    dequantize_bounds,
    empty_bounds,
    quantize_bounds,
    quantize_corners,
    resolve_bound_format,
)
from sparse_sglang.mem_cache.key_codes import PageKeyCodes
from sparse_sglang.mem_cache.key_sketch import SKETCH_DTYPE, KeyBasis, project_keys


def cuboid_center(kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """ArkVale's cuboid centre ``(max + min) / 2`` in float32."""
    return (kmax.float() + kmin.float()) / 2


def cuboid_half_extent(kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """ArkVale's cuboid half-extent (radius per channel) ``(max - min) / 2`` in float32."""
    return (kmax.float() - kmin.float()) / 2


class PageSummaries:
    """Channel-wise min, max and mean of the keys of every (layer, kv head, host page).

    Parameters
    ----------
    num_layers, num_kv_heads, num_pages, page_size, head_dim : int
        Shape of the host KV store the summaries describe.
    kv_dtype : torch.dtype
        Type of the keys (bf16, fp16, fp8); with ``bound_format`` sets the storage type of
        ``kmin``/``kmax``.
    device : torch.device or str
        Where the summaries live (the GPU in the server).
    with_radius : bool
        Also keep ArkVale's per-page mean ``|k - centre|`` (the ``arkvale`` selector reads it).
    with_mean : bool
        Keep the mean key (the ``mean`` selector reads it; the server keeps only what its selector
        reads: in float32 it is half the summaries' bytes).
    bound_format : {"exact", "int8", "auto"}
        How ``kmin``/``kmax`` are stored (module doc; :func:`resolve_bound_format`).
    coarse_pages : int
        ``S > 0`` also keeps coarse bounds: those of ``S`` consecutive pages of a request (a
        super-page), stored in the rows of its last page (see "Coarse bounds" in the module doc).
    key_basis : KeyBasis, optional
        Also keep every token's key sketch under this basis (the ``sketch`` selector;
        :mod:`~sparse_sglang.mem_cache.key_sketch`), written by :meth:`update_sketch`; kept
        (on the device) as :attr:`key_basis` for the decoder's query projection.
    key_bits : int
        ``> 0``: also keep every key coded in this many bits per channel between its page's
        channel min and max (the quantized re-rank; :class:`~sparse_sglang.mem_cache.key_codes.PageKeyCodes`),
        written by the save path's :func:`~sparse_sglang.mem_cache.kernels.encode_runs`.

    Attributes
    ----------
    kmin, kmax : torch.Tensor
        ``[num_layers, num_kv_heads, num_pages, head_dim]`` of :func:`bound_dtype`: the stored
        bounds (int8 levels for the int8 format; :meth:`bounds` reads them as values).
    bound_exp : torch.Tensor or None
        ``[num_layers, num_kv_heads, num_pages]`` int8 scale exponents of int8 bounds.
    mean : torch.Tensor or None
        ``[num_layers, num_kv_heads, num_pages, head_dim]`` float32 when ``with_mean``.
    count : torch.Tensor
        ``[num_layers, num_pages]`` int32: tokens summarized per (layer, page).
    radius : torch.Tensor or None
        ``[num_layers, num_kv_heads, num_pages, head_dim]`` float32 when ``with_radius``.
    coarse_kmin, coarse_kmax, coarse_exp : torch.Tensor or None
        With ``coarse_pages``: bounds of the super-page ending at each page, shaped and stored as
        ``kmin``/``kmax``/``bound_exp``.
    coarse_first : torch.Tensor or None
        ``[num_pages]`` int32: the host page that starts the super-page whose coarse bounds the
        page's rows hold, ``-1`` when they hold none.
    sketch : torch.Tensor or None
        ``[num_layers, num_kv_heads, num_pages, page_size * rank]`` bf16 key sketches (with
        ``key_basis``), token ``o`` of a page at ``[o * rank, (o + 1) * rank)``; tokens a page
        does not hold yet read 0.
    key_codes : PageKeyCodes or None
        With ``key_bits``: every key's low-bit code and its page's frame.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        num_pages: int,
        page_size: int,
        head_dim: int,
        kv_dtype: torch.dtype,
        device: torch.device | str = "cpu",
        *,
        with_radius: bool = False,
        with_mean: bool = True,
        bound_format: str = "exact",
        page_bounds: str = "minmax",
        bound_spread: float = 1.0,
        coarse_pages: int = 0,
        key_basis: KeyBasis | None = None,
        key_bits: int = 0,
    ):
        # One extra page at index num_pages: padding tokens fold into it, so updates need no masks.
        shape = (num_layers, num_kv_heads, num_pages + 1, head_dim)
        self.page_size, self.num_pages = page_size, num_pages
        self.bound_format = resolve_bound_format(bound_format, kv_dtype, page_bounds)
        self.page_bounds, self.bound_spread = page_bounds, float(bound_spread)
        bounds = bound_dtype(kv_dtype, self.bound_format)
        self.empty_bounds = empty_bounds(bounds)
        self._kmin = torch.full(shape, self.empty_bounds[0], dtype=bounds, device=device)
        self._kmax = torch.full(shape, self.empty_bounds[1], dtype=bounds, device=device)
        self._exp = None
        if self.bound_format == "int8":
            self._exp = torch.full(shape[:-1], EMPTY_EXP, dtype=torch.int8, device=device)
        self._mean = torch.zeros(shape, dtype=torch.float32, device=device) if with_mean else None
        self._count = torch.zeros(num_layers, num_pages + 1, dtype=torch.int32, device=device)
        self._radius = torch.zeros(shape, dtype=torch.float32, device=device) if with_radius else None
        self.kmin, self.kmax = self._kmin[:, :, :num_pages], self._kmax[:, :, :num_pages]
        self.bound_exp = None if self._exp is None else self._exp[:, :, :num_pages]
        self.mean = None if self._mean is None else self._mean[:, :, :num_pages]
        self.count = self._count[:, :num_pages]
        self.radius = None if self._radius is None else self._radius[:, :, :num_pages]
        self.coarse_pages = coarse_pages
        self._coarse = None
        if coarse_pages:
            self._coarse = {"kmin": torch.full_like(self._kmin, self.empty_bounds[0]),
                            "kmax": torch.full_like(self._kmax, self.empty_bounds[1])}  # fmt: skip
            if self._exp is not None:
                self._coarse["bound_exp"] = torch.full_like(self._exp, EMPTY_EXP)
            self._coarse_first = torch.full((num_pages + 1,), -1, dtype=torch.int32, device=device)
            self.coarse_first = self._coarse_first[:num_pages]
        self.coarse_kmin, self.coarse_kmax, self.coarse_exp = (
            None if self._coarse is None or name not in self._coarse else self._coarse[name][:, :, :num_pages]
            for name in ("kmin", "kmax", "bound_exp")
        )
        if self._coarse is None:
            self.coarse_first = None
        self.key_basis = None
        self._sketch = None
        if key_basis is not None:
            self.key_basis = KeyBasis(key_basis.keys.to(device), key_basis.queries.to(device))
            rank = key_basis.rank
            self._sketch = torch.zeros(*shape[:-1], page_size * rank, dtype=SKETCH_DTYPE, device=device)
        self.sketch = None if self._sketch is None else self._sketch[:, :, :num_pages]
        self.key_codes = None
        if key_bits:
            self.key_codes = PageKeyCodes(num_layers, num_kv_heads, num_pages, page_size, head_dim, key_bits,
                                          kv_dtype, device)  # fmt: skip
        # all_layers(), built once: the tensors never move, and index_runs asks on every save.
        self._all_layers = {"kmin": self._kmin, "kmax": self._kmax, "count": self._count}
        if self._exp is not None:
            self._all_layers["bound_exp"] = self._exp
        if self._coarse is not None:
            self._all_layers.update(
                {f"coarse_{name}": t for name, t in self._coarse.items()}, coarse_first=self._coarse_first
            )

    def layer(self, layer: int) -> dict[str, torch.Tensor]:
        """The summaries of one layer, ``[num_kv_heads, num_pages + 1, head_dim]`` each (the
        row stride the scoring kernel reads; page ``num_pages`` is padding)."""
        out = {"kmin": self._kmin[layer], "kmax": self._kmax[layer]}
        if self._exp is not None:
            out["bound_exp"] = self._exp[layer]  # [num_kv_heads, num_pages + 1]
        if self._mean is not None:
            out["mean"] = self._mean[layer]
        if self._radius is not None:
            out["radius"] = self._radius[layer]
        if self._sketch is not None:
            out["sketch"] = self._sketch[layer]  # [num_kv_heads, num_pages + 1, page_size * rank]
        return out

    def coarse_layer(self, layer: int) -> dict[str, torch.Tensor]:
        """The coarse bounds of one layer, keyed like :meth:`layer`'s (``kmin``, ``kmax``,
        ``bound_exp``), so the score kernel reads them as it reads pages'."""
        return {name: t[layer] for name, t in self._coarse.items()}

    def all_layers(self) -> dict[str, torch.Tensor]:
        """Every layer's summaries with the padding page, for kernels that take all layers in one
        launch: ``kmin``, ``kmax`` (``[num_layers, num_kv_heads, num_pages + 1, head_dim]``),
        ``count`` (``[num_layers, num_pages + 1]``), ``bound_exp`` with int8 bounds, and with
        coarse bounds ``coarse_kmin``, ``coarse_kmax``, ``coarse_bound_exp`` (int8) and
        ``coarse_first`` (``[num_pages + 1]``)."""
        return self._all_layers

    def layer_count(self, layer: int) -> torch.Tensor:
        """Tokens summarized per page of one layer, ``[num_pages + 1]`` int32 (padding page last)."""
        return self._count[layer]

    @property
    def nbytes(self) -> int:
        parts = (self._kmin, self._kmax, self._exp, self._mean, self._count, self._radius, self._sketch)
        if self._coarse is not None:
            parts += (*self._coarse.values(), self._coarse_first)
        codes = 0 if self.key_codes is None else self.key_codes.nbytes
        return codes + sum(t.numel() * t.element_size() for t in parts if t is not None)

    def update(self, layer: int, k: torch.Tensor, token_slots: torch.Tensor) -> None:
        """Fold new keys of one layer into the summaries of their pages.

        Parameters
        ----------
        layer : int
        k : torch.Tensor
            ``[T, num_kv_heads, head_dim]`` new keys (any KV dtype), on the summaries' device.
        token_slots : torch.Tensor
            ``[T]`` int32/int64 host token slots ``page * page_size + offset``; ``-1`` entries are
            padding and ignored. Each slot must be summarized once (tokens of a page may arrive
            over several calls, in any order within a call).

        Notes
        -----
        A token at offset 0 starts its page: the page's old summaries (a previous owner's) are
        cleared first, so freed pages need no reset. Min/max merge by ``scatter_reduce``
        (amin/amax), in float32 over the touched pages (:meth:`_merge_bounds`). The mean of page
        ``p`` with ``c`` old tokens of mean ``m`` and new keys ``x_t`` becomes
        ``m + sum_t (x_t - m) / (c + n)``: each token adds ``(x_t - m) / (c + n)`` by
        ``index_add``. The ArkVale radius (mean ``|k - centre|``) is kept the same way against the
        centre after the update: exact for a page filled in one call, an approximation for a page
        filled over several (its centre moves). No loops, no host synchronization, so the update
        can run inside a CUDA graph.
        """
        page, _, fresh = self._token_pages(token_slots)
        self._kmin[layer][:, fresh], self._kmax[layer][:, fresh] = self.empty_bounds
        if self._exp is not None:
            self._exp[layer][:, fresh] = EMPTY_EXP
        if self._mean is not None:
            self._mean[layer][:, fresh] = 0.0
        self._count[layer][fresh] = 0
        if self._radius is not None:
            self._radius[layer][:, fresh] = 0.0
        if self._coarse is not None:  # a page started anew ends no built super-page
            self._coarse_first[fresh] = -1

        kf = k.float().transpose(0, 1)  # [H, T, D]
        count = self._count[layer]
        if self.page_bounds == "meanstd":
            self._merge_moments(layer, page, kf, count[page])
        else:
            self._merge_bounds(layer, page, kf)

        count.index_add_(0, page, torch.ones_like(page, dtype=count.dtype))
        scale = count[page].view(1, -1, 1).float()  # c + n
        if self._mean is not None:
            mean = self._mean[layer]  # [H, N + 1, D]
            mean.index_add_(1, page, (kf - mean[:, page]) / scale)
        if self._radius is not None:
            lo, hi = self._stored_values(layer, page)
            centre = (hi + lo) / 2
            radius = self._radius[layer]
            radius.index_add_(1, page, ((kf - centre).abs() - radius[:, page]) / scale)

    def update_sketch(self, layer: int, k: torch.Tensor, token_slots: torch.Tensor) -> None:
        """Write the key sketches of new keys ``[T, num_kv_heads, head_dim]`` at host token slots
        ``token_slots`` ``[T]`` (``-1``: padding), as :meth:`update` takes them: a token at offset 0
        zeroes its page's sketches first (a previous owner's). Fixed shapes, no host
        synchronization (CUDA-graph safe)."""
        page, offset, fresh = self._token_pages(token_slots)
        sketch = self._sketch[layer]  # [H, N + 1, P * r]
        sketch.index_fill_(1, fresh, 0)  # (indexed assignment of a scalar copies from the host: no graph)
        tokens = sketch.view(sketch.shape[0], sketch.shape[1], self.page_size, self.key_basis.rank)
        tokens[:, page, offset] = project_keys(k, self.key_basis.keys[layer]).transpose(0, 1).to(sketch.dtype)

    def _token_pages(self, token_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(page, offset, fresh)`` of host token slots (``-1`` padding folds into the spare page
        at offset 0); ``fresh`` is the page of a token at offset 0 (its page starts anew), else the
        spare page."""
        slots = token_slots.long()
        valid = slots >= 0
        page = torch.where(valid, slots // self.page_size, self.num_pages)
        offset = torch.where(valid, slots % self.page_size, 0)
        return page, offset, torch.where(valid & (offset == 0), page, self.num_pages)

    def _stored_values(self, layer: int, page: torch.Tensor | slice) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kmin, kmax)`` of ``page`` (``[T]`` ids or a slice) as stored, in float32 ``[H, T, D]``
        (int8 levels times their scales; exact either way)."""
        lo, hi = self._kmin[layer][:, page], self._kmax[layer][:, page]
        if self._exp is None:
            return lo.float(), hi.float()
        e = self._exp[layer][:, page]
        return dequantize_bounds(lo, e), dequantize_bounds(hi, e)

    def _merge_bounds(self, layer: int, page: torch.Tensor, kf: torch.Tensor) -> None:
        """Fold keys ``kf`` ``[H, T, D]`` (float32) into the bounds of their pages ``page`` ``[T]``
        (repeated when a page gets several tokens).

        torch has no ``scatter_reduce`` (nor ``index_fill_``) for fp8, so the bounds of the touched
        pages are gathered in float32 (exact for every bound type), reduced there and written back
        (int8 ones requantized outward, :func:`quantize_bounds`). Each token's keys reduce into the
        row of one representative token of its page (the page's first in sorted order); then every
        token writes its page's result, the same value for all of a page's tokens, so the
        duplicate writes do not race. Fixed shapes, no host synchronization (CUDA-graph safe)."""
        representative = _page_representatives(page)
        index = representative.view(1, -1, 1).expand_as(kf)
        old = self._stored_values(layer, page)
        lo, hi = (value.scatter_reduce_(1, index, kf, reduce)[:, representative]  # rows of representatives
                  for value, reduce in zip(old, ("amin", "amax")))  # fmt: skip
        self._store_bounds((self._kmin, self._kmax, self._exp), (layer, slice(None), page), lo, hi)

    def _merge_moments(self, layer: int, page: torch.Tensor, kf: torch.Tensor, old_count: torch.Tensor) -> None:
        """Fold keys ``kf`` ``[H, T, D]`` (float32) into the mean/std corners of their pages ``page``
        ``[T]``, which held ``old_count`` ``[T]`` tokens before: the old moments come back from
        the stored corners (mean = their midpoint, std = their half-distance over the spread), the
        new tokens' sums reduce into each page's representative row (as :meth:`_merge_bounds`),
        and Chan's update merges the two. Fixed shapes, no host synchronization."""
        representative = _page_representatives(page)
        sums = torch.zeros_like(kf).index_add_(1, representative, kf)[:, representative]
        squares = torch.zeros_like(kf).index_add_(1, representative, kf * kf)[:, representative]
        added = torch.zeros_like(page, dtype=torch.float32).index_add_(
            0, representative, torch.ones_like(page, dtype=torch.float32)
        )
        old = old_count.float().view(1, -1, 1)
        total = old + added[representative].view(1, -1, 1)
        lo, hi = self._stored_values(layer, page)
        held = old > 0  # a page started anew holds the empty corners (+-inf): no moments
        old_mean = torch.where(held, (hi + lo) * 0.5, 0.0)
        old_std = torch.where(held, (hi - lo) * (0.5 / self.bound_spread), 0.0)
        mean = (old_mean * old + sums) / total
        second = (old * (old_std * old_std + old_mean * old_mean) + squares) / total
        std = (second - mean * mean).clamp_min(0.0).sqrt()
        self._store_bounds((self._kmin, self._kmax, self._exp), (layer, slice(None), page),
                           mean - self.bound_spread * std, mean + self.bound_spread * std, nearest=True)  # fmt: skip

    def _store_bounds(self, dest: tuple, at: tuple, lo: torch.Tensor, hi: torch.Tensor, nearest: bool = False) -> None:
        """Write float32 bounds ``lo``/``hi`` at index ``at`` of ``dest = (kmin, kmax, exp)``
        (``exp`` indexed without the last dim): as they are in the bounds' type (exact: a min or
        max of stored values is one), or as int8 levels and scale rounded outward (to the nearest
        level with ``nearest``: mean/std corners)."""
        kmin, kmax, exp = dest
        if self._exp is None:
            kmin[at], kmax[at] = lo.to(kmin.dtype), hi.to(kmax.dtype)
        else:
            kmin[at], kmax[at], exp[at] = (quantize_corners if nearest else quantize_bounds)(lo, hi)

    def reset(self, pages: torch.Tensor) -> None:
        """Empty the summaries of ``pages`` (host page ids, ``[n]``) in every layer and head,
        e.g. when the allocator frees them (indexed assignment: fp8 has no ``index_fill_``)."""
        pages = pages.to(self.count.device).long()
        self.kmin[:, :, pages], self.kmax[:, :, pages] = self.empty_bounds
        if self.bound_exp is not None:
            self.bound_exp[:, :, pages] = EMPTY_EXP
        if self.mean is not None:
            self.mean[:, :, pages] = 0.0
        self.count[:, pages] = 0
        if self.radius is not None:
            self.radius[:, :, pages] = 0.0
        if self.coarse_first is not None:
            self.coarse_first[pages] = -1
        if self.sketch is not None:
            self.sketch[:, :, pages] = 0

    def bounds(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kmin, kmax)`` of one layer's pages as values, ``[num_kv_heads, num_pages, head_dim]``
        float32 (int8 levels times their scales)."""
        return self._stored_values(layer, slice(0, self.num_pages))

    def set_bounds(self, layer: int, kmin: torch.Tensor, kmax: torch.Tensor) -> None:
        """Overwrite one layer's page bounds with ``kmin <= kmax`` ``[num_kv_heads, num_pages,
        head_dim]`` (finite; stored rounded outward, e.g. random bounds for timing runs). Coarse
        bounds are rebuilt at the next :meth:`build_coarse`."""
        if self.coarse_first is not None:
            self.coarse_first.fill_(-1)
        self._store_bounds((self.kmin, self.kmax, self.bound_exp), (layer,), kmin.float(), kmax.float())

    def center(self, layer: int) -> torch.Tensor:
        """Cuboid centres of one layer, ``[num_kv_heads, num_pages, head_dim]`` float32."""
        return cuboid_center(*self.bounds(layer))

    def half_extent(self, layer: int) -> torch.Tensor:
        """Cuboid half-extents of one layer, ``[num_kv_heads, num_pages, head_dim]`` float32."""
        return cuboid_half_extent(*self.bounds(layer))

    def build_coarse(self, host_pages: torch.Tensor, built: torch.Tensor) -> None:
        """Coarse bounds of every super-page ``s < built[b]`` of every request (plain torch; the
        decode step's kernel, :func:`~sparse_sglang.mem_cache.kernels.build_coarse`, builds only
        those whose ``coarse_first`` does not match, with the same result).

        Parameters
        ----------
        host_pages : torch.Tensor
            ``[B, N]`` host page of each logical page of each request.
        built : torch.Tensor
            ``[B]`` complete super-pages to build per request (:func:`coarse_built`).
        """
        s = self.coarse_pages
        supers = host_pages.shape[1] // s
        idx = torch.arange(supers, device=host_pages.device)
        todo = idx.view(1, -1) < built.to(host_pages.device).view(-1, 1)  # [B, supers]
        pages = host_pages[:, : supers * s].long().view(-1, supers, s)[todo]  # [M, S]
        if pages.numel() == 0:
            return
        last = pages[:, -1]
        for layer in range(self._kmin.shape[0]):
            lo, hi = self._stored_values(layer, pages.reshape(-1))  # [H, M * S, D]
            heads, _, dim = lo.shape
            lo = lo.view(heads, -1, s, dim).amin(2)
            hi = hi.view(heads, -1, s, dim).amax(2)
            dest = tuple(self._coarse.get(name) for name in ("kmin", "kmax", "bound_exp"))
            self._store_bounds(dest, (layer, slice(None), last), lo, hi)
        self._coarse_first[last] = pages[:, 0].to(torch.int32)


def _page_representatives(page: torch.Tensor) -> torch.Tensor:
    """For tokens of pages ``page`` ``[T]`` (repeats allowed), the index of one token of each
    token's page (its page's first in sorted order), so per-page reductions can scatter into the
    rows of those tokens. Fixed shapes, no host synchronization."""
    order = page.argsort()
    sorted_page = page[order]
    position = torch.arange(page.numel(), device=page.device)
    starts = torch.ones_like(sorted_page, dtype=torch.bool)
    starts[1:] = sorted_page[1:] != sorted_page[:-1]
    first = torch.where(starts, position, 0).cummax(0).values  # where each page's run starts
    representative = torch.empty_like(order)
    representative[order] = order[first]
    return representative


def coarse_built(num_pages: torch.Tensor, coarse_pages: int, recent_pages: int) -> torch.Tensor:
    """Complete super-pages of ``coarse_pages`` pages each request scores coarsely: those wholly
    before its ``recent_pages`` newest pages (so the partial newest page, and the recent pages a
    selection keeps anyway, are always scored page by page). ``[B]`` int32."""
    return ((num_pages.to(torch.int32) - recent_pages).clamp_min(0) // coarse_pages).to(torch.int32)
