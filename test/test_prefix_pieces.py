"""Cutting a prefill batch's cached prefixes into staging-buffer pieces (CPU)."""

import random

import pytest

from sparse_sglang.attention.prefix import prefix_pieces


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
