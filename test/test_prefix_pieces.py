"""Cutting a prefill batch's cached prefixes into staging-buffer pieces (CPU)."""

import random

import pytest
import torch

from sparse_sglang.attention.prefix import (
    STAGING_BUFFERS,
    ResidentPart,
    next_staged_piece,
    prefix_pieces,
    resident_fill_blocks,
    resident_part,
    staged_pages,
)


def tokens_per_request(pieces, num_requests: int, page: int) -> list[int]:
    """Prefix tokens each request attends over all pieces, read back from the plan inputs."""
    seen = [0] * num_requests
    for piece in pieces:
        for i, r in enumerate(piece.reqs):
            n = piece.kv_indptr[i + 1] - piece.kv_indptr[i]
            if n:
                seen[r] += (n - 1) * page + piece.last_page_len[i]
            else:
                assert piece.last_page_len[i] == 0
    return seen


@pytest.mark.parametrize("seed", range(40))
def test_pieces_cover_every_prefix_page_once_within_the_buffer(seed):
    rng = random.Random(seed)
    page = rng.choice([1, 16, 32])
    n = rng.randint(1, 6)
    prefix = [rng.choice([0, rng.randint(1, 40 * page)]) for _ in range(n)]
    prefix[rng.randrange(n)] = rng.randint(1, 40 * page)  # at least one request has a prefix
    extend = [rng.randint(1, 50) for _ in range(n)]
    capacity = rng.randint(1, 30)
    pieces = prefix_pieces(prefix, extend, page, capacity)

    total = sum(-(-p // page) for p in prefix)
    assert [p.pages.start for p in pieces] == list(range(0, total, capacity))
    assert pieces[-1].pages.stop == total
    qo = [sum(extend[:i]) for i in range(n + 1)]
    for piece in pieces:
        width = piece.pages.stop - piece.pages.start
        assert 1 <= width <= capacity and piece.kv_indptr[-1] == width
        assert piece.rows == slice(qo[piece.reqs.start], qo[piece.reqs.stop])
        assert piece.qo_indptr == [q - qo[piece.reqs.start] for q in qo[piece.reqs.start : piece.reqs.stop + 1]]
        # the requests at both ends own pages here (none rides along at the edges)
        assert piece.kv_indptr[1] > 0 and piece.kv_indptr[-1] > piece.kv_indptr[-2]
    assert tokens_per_request(pieces, n, page) == prefix


def test_a_batch_that_fits_is_one_piece_over_the_requests_with_a_prefix():
    (piece,) = prefix_pieces([0, 100, 0, 64, 0], [3, 4, 5, 6, 7], 32, 64)
    assert piece.reqs == range(1, 4) and piece.rows == slice(3, 18)
    assert piece.kv_indptr == [0, 4, 4, 6] and piece.last_page_len == [4, 0, 32]


def test_one_long_prefix_is_cut_into_buffer_sized_pieces():
    pieces = prefix_pieces([131072 - 4096], [4096], 32, 512)  # a 128K prompt's last chunk, 16K-token buffer
    assert len(pieces) == 8 and all(p.rows == slice(0, 4096) for p in pieces)
    assert [p.kv_indptr[-1] for p in pieces] == [512] * 7 + [4096 // 32 * 31 - 512 * 7]


def test_a_buffer_without_room_is_an_error():
    with pytest.raises(ValueError, match="capacity_pages"):
        prefix_pieces([64], [1], 32, 0)


@pytest.mark.parametrize("num_pieces", [1, 2, 3, 4, 7])
def test_staging_prefetches_every_piece_after_the_first_ones_and_never_overwrites_one_unread(num_pieces):
    """PrefixAttention.run's protocol over 5 layers: a layer's first pieces, unless staged
    beforehand, load on demand; after attending (layer, i), next_staged_piece's answer is loaded
    into the buffer just freed. Only the first layer's load on demand, each (layer, piece) loads
    once, each piece is in its buffer when attended, and no load lands in a buffer whose piece
    has not been attended yet."""
    layers, buffers = 5, STAGING_BUFFERS
    staged = [None] * buffers  # (layer, piece) each buffer holds, None once attended
    loads, on_demand = [], []

    def stage(layer, piece):
        assert staged[piece % buffers] is None, f"{(layer, piece)} would overwrite unread {staged[piece % buffers]}"
        staged[piece % buffers] = (layer, piece)
        loads.append((layer, piece))

    for layer in range(layers):
        for i in range(min(buffers, num_pieces)):
            if staged[i] != (layer, i):
                on_demand.append((layer, i))
                stage(layer, i)
        for i in range(num_pieces):
            assert staged[i % buffers] == (layer, i)
            staged[i % buffers] = None  # attended
            nxt = next_staged_piece(layer, i, num_pieces)
            if nxt[0] < layers:
                stage(*nxt)
    assert on_demand == [(0, i) for i in range(min(buffers, num_pieces))]
    assert sorted(loads) == [(layer, i) for layer in range(layers) for i in range(num_pieces)]


@pytest.mark.parametrize("seed", range(20))
def test_skipped_pages_are_left_out_and_the_rest_still_covered_once(seed):
    """A request's resident pages (its first ones) are not staged; its later ones and every other
    request's are, with the request's last page as long as it is."""
    rng = random.Random(100 + seed)
    page, n = 32, rng.randint(1, 5)
    prefix = [rng.randint(1, 40 * page) for _ in range(n)]
    skip = [rng.randint(0, p // page) if rng.random() < 0.5 else 0 for p in prefix]
    pieces = prefix_pieces(prefix, [rng.randint(1, 9) for _ in range(n)], page, rng.randint(1, 30), skip)
    assert sum(p.pages.stop - p.pages.start for p in pieces) == sum(-(-p // page) - s for p, s in zip(prefix, skip))
    assert tokens_per_request(pieces, n, page) == [p - s * page for p, s in zip(prefix, skip)]


def chunked_prompt(chunks: list[int], capacity: int, page: int = 32, slot=(3, 1)):
    """A prompt prefilled in ``chunks`` (token counts), alone in each batch: each forward's
    resident part and the pages the buffer holds after it."""
    owner, held, prefix, parts = None, 0, 0, []
    for x in chunks:
        part, owner, held = resident_part([slot], [prefix], owner, held, capacity, page)
        parts.append((part, held))
        prefix += x
    return parts, owner


def test_a_chunked_prompt_stages_each_page_once_and_attends_its_whole_pages_from_the_buffer():
    parts, owner = chunked_prompt([2048, 2048, 2000, 100], capacity=1000)
    assert owner == (3, 1)
    (first, held0), (second, held1), (third, held2), (fourth, held3) = parts
    assert first == ResidentPart() and held0 == 0  # no prefix yet: the buffer is claimed, holds nothing
    assert (second.request, second.pages, second.fill) == (0, 64, range(0, 64)) and held1 == 64
    assert (third.pages, third.fill) == (128, range(64, 128)) and held2 == 128
    assert (fourth.pages, fourth.fill) == (190, range(128, 190))  # 6096 tokens: 190 whole pages, the 191st staged


def test_the_buffer_holds_at_most_its_capacity_and_the_rest_is_staged():
    parts, _ = chunked_prompt([4096, 4096, 4096], capacity=200)
    assert [(p.pages, p.fill) for p, _ in parts[1:]] == [(128, range(0, 128)), (200, range(128, 200))]


def test_a_slot_given_to_another_request_does_not_read_the_last_ones_pages():
    part, owner, held = resident_part([(3, 1)], [0], None, 0, 100, 32)
    part, owner, held = resident_part([(3, 1)], [2048], owner, held, 100, 32)
    assert (owner, held) == ((3, 1), 64)
    # the slot's next request (generation 2) with a cached prefix of the same length
    part, owner, held = resident_part([(3, 2)], [2048], owner, held, 100, 32)
    assert part == ResidentPart() and (owner, held) == ((3, 2), 0)


def test_the_owner_finishing_beside_new_requests_passes_the_buffer_to_the_batch_last():
    _, owner, held = resident_part([(5, 1)], [0], None, 0, 100, 32)
    _, owner, held = resident_part([(5, 1)], [1024], owner, held, 100, 32)
    part, owner, held = resident_part([(5, 1), (6, 1), (7, 1)], [2048, 0, 64], owner, held, 100, 32)
    assert (part.request, part.pages, part.fill) == (0, 64, range(32, 64))  # the owner's last chunk still reads it
    assert (owner, held) == ((7, 1), 0)  # the new last request's pages come at its next chunk
    # a prefix shorter than what the buffer holds (no chunked prompt has one) starts it again
    _, owner, held = resident_part([(7, 1)], [4096], owner, held, 100, 32)
    part, owner, held = resident_part([(7, 1)], [1024], owner, held, 100, 32)
    assert (part.pages, part.fill, held) == (32, range(0, 32), 32)


def test_no_capacity_no_resident_part():
    assert resident_part([(1, 1)], [4096], (1, 1), 10, 0, 32) == (ResidentPart(), None, 0)


@pytest.mark.parametrize("seed", range(10))
def test_the_staged_pages_are_each_requests_pages_past_its_resident_ones_in_order(seed):
    rng = random.Random(200 + seed)
    page, n = rng.choice([16, 32]), rng.randint(1, 5)
    prefix = [rng.choice([0, rng.randint(1, 30 * page)]) for _ in range(n)]
    skip = [rng.randint(0, p // page) for p in prefix]
    request, prefix_page = staged_pages(prefix, skip, page)
    want = [(r, j) for r in range(n) for j in range(skip[r], -(-prefix[r] // page))]
    assert list(zip(request.tolist(), prefix_page.tolist())) == want


def test_the_resident_fill_lands_each_layers_pages_where_attention_reads_them():
    """FlashH2D's copy (``gpu[dst[i]] = host.view(-1, P, D)[src[i]]``) done with torch indexing:
    the buffer's layer view holds page j of head h at ``[layer][j, h]``, as the host's
    ``[layer, h, host page]``."""
    layers, heads, host_pages, page, dim, capacity = 3, 2, 50, 4, 8, 12
    host = torch.randn(layers, heads, host_pages, page, dim)
    buffer = torch.zeros(layers * capacity * heads, page, dim)
    owner_pages = torch.tensor([41, 7, 19, 3, 28])  # the request's prefix pages 5..9 live in these host pages
    src, dst = resident_fill_blocks(owner_pages, 5, layers, heads, host_pages, capacity)
    buffer[dst] = host.view(-1, page, dim)[src]
    view = buffer.view(layers, capacity, heads, page, dim)
    for layer in range(layers):
        for j, host_page in enumerate(owner_pages.tolist(), start=5):
            for h in range(heads):
                assert torch.equal(view[layer, j, h], host[layer, h, host_page])
    assert not view[:, :5].any() and not view[:, 10:].any()  # nothing else written
