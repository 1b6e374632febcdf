"""Whether two servers' greedy completions of one prompt agree, when their kernels round differently.

Two correct servers whose attention kernels sum in different orders give the same greedy tokens
until a step where the reference's top two tokens are nearly tied: there a rounding difference may
pick the other one, and the texts part for good. A logic error (attending the wrong KV) shows
otherwise: as logprobs far apart while the tokens still agree, or as a switch at a step the
reference was sure of. :func:`greedy_agreement` measures both from what SGLang's ``/generate``
returns with ``return_logprob`` and ``top_logprobs_num=2`` (:func:`completion`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


def completion(response: dict) -> dict:
    """The tokens of a ``/generate`` response, each step's logprob of its token and its top two logprobs."""
    meta = response["meta_info"]
    return {
        "output_ids": response["output_ids"],
        "logprobs": [lp for lp, _token, _text in meta["output_token_logprobs"]],
        "top2": [[lp for lp, _token, _text in step[:2]] for step in meta["output_top_logprobs"]],
        "cached_tokens": meta.get("cached_tokens", 0),
    }


@dataclass(frozen=True)
class GreedyAgreement:
    """How far ``other``'s greedy completion follows ``reference``'s.

    Attributes
    ----------
    equal : bool
        The same tokens.
    first_difference : int or None
        The first step whose tokens differ.
    max_logprob_gap : float
        Largest difference of the two sides' logprobs of their (same) token, over the steps before
        the first difference.
    reference_margin : float or None
        The reference's top-1 minus top-2 logprob at the first difference (near 0: a tie).
    """

    equal: bool
    first_difference: int | None
    max_logprob_gap: float
    reference_margin: float | None

    def within(self, logprob_tol: float, near_tie: float) -> bool:
        """Equal up to rounding: logprobs within ``logprob_tol`` while the tokens agree, and any
        difference at a step whose reference margin is at most ``near_tie``."""
        return self.max_logprob_gap <= logprob_tol and (self.equal or self.reference_margin <= near_tie)

    def as_dict(self) -> dict:
        return asdict(self)


def greedy_agreement(reference: dict, other: dict) -> GreedyAgreement:
    """Compare two :func:`completion` records of the same prompt (``reference``: plain SGLang)."""
    ref_ids, ids = reference["output_ids"], other["output_ids"]
    steps = min(len(ref_ids), len(ids))
    first = next((i for i in range(steps) if ref_ids[i] != ids[i]), None)
    if first is None and len(ref_ids) != len(ids):
        first = steps  # one stopped earlier (EOS): they differ there
    agreed = steps if first is None else first
    gap = max((abs(a - b) for a, b in zip(reference["logprobs"][:agreed], other["logprobs"][:agreed])), default=0.0)
    margin = None
    if first is not None and first < len(reference["top2"]) and len(reference["top2"][first]) == 2:
        top1, top2 = reference["top2"][first]
        margin = top1 - top2
    elif first is not None:
        margin = float("inf")  # nothing to tell a tie by: not one
    return GreedyAgreement(first is None, first, gap, margin)


# TP=2 against TP=1 with real selection, one decode step at a time. The ranks sum their heads'
# attention (and the row-split projections) in another order, so a decode step's logprobs differ
# by rounding. Free-running greedy completions part for good at the first near tie and compound
# every difference after it, so each step is compared on its own forced context instead: the
# prompt plus the first j tokens of one continuation, two new tokens, the second from a decode step
# (:func:`forced_steps`).
#
# Where TP's rounding cannot reach the selection (one layer: its queries and keys come through the
# column-split QKV projection, nothing summed across ranks), both sizes select the same pages and
# the bar is plain SGLang's own TP=2-vs-TP=1 gap on the same contexts (:func:`tp_logprob_tolerance`,
# twice it, never below TP_LOGPROB_TOL): every step within it, a token switched only where the
# reference's top two are within it too (:func:`tp_steps_agree`). A wrong selection (a rank scoring
# the wrong heads, summaries or budget) moves logprobs as far as selection itself does, which the
# GPU test checks this bar rejects.
#
# With more layers, rounding summed across ranks in layer l moves layer l+1's queries, and a
# query that moves may swap a page at the selection's boundary: a swapped page moves the step's
# logprobs by what that page holds, more than rounding, and no TP=1 floor (its contexts batched
# were tried) rounds as TP does. So there TP=2 is held to staying far nearer TP=1 than selection
# itself moves (sparse against dense at TP=1): :func:`nearer_than_selection`.
TP_LOGPROB_TOL = 0.05
TP_MIN_COMPARED = 0.75  # of the forced steps, those whose dense prefill chose the same first token
# At depth, TP=2 against TP=1 switches at most this share of the steps that sparse against dense
# switches, and its largest logprob gap is at most this share of theirs.
DEPTH_SWITCH_SHARE = 0.25
DEPTH_GAP_SHARE = 0.5


def decode_step(record: dict) -> dict:
    """The decode step of a two-token :func:`completion` (its second token; the first came from
    the dense prefill), as a one-token completion."""
    return {"output_ids": record["output_ids"][1:2], "logprobs": record["logprobs"][1:2], "top2": record["top2"][1:2]}


def forced_steps(reference: list[dict], other: list[dict]) -> list[GreedyAgreement | None]:
    """Two servers' two-token completions of the same forced contexts, context by context: the
    decode step's :func:`greedy_agreement`, or None where the dense prefill chose different first
    tokens (the decode steps then saw different contexts)."""
    if len(reference) != len(other):
        raise ValueError(f"{len(reference)} forced contexts against {len(other)}")
    return [
        greedy_agreement(decode_step(a), decode_step(b)) if a["output_ids"][:1] == b["output_ids"][:1] else None
        for a, b in zip(reference, other)
    ]


def tp_logprob_tolerance(*floors: list[GreedyAgreement | None]) -> float:
    """The logprob bar for sparse TP=2 against sparse TP=1: twice the largest gap the ``floors``
    show (:func:`forced_steps` of two runs that differ by rounding only, on the same contexts), at
    least :data:`TP_LOGPROB_TOL`."""
    return max([TP_LOGPROB_TOL, *(2 * a.max_logprob_gap for floor in floors for a in floor if a is not None)])


def switched_steps(steps: list[GreedyAgreement | None]) -> int:
    """Compared steps whose tokens differ."""
    return sum(a is not None and not a.equal for a in steps)


def tp_steps_agree(steps: list[GreedyAgreement | None], logprob_tol: float, max_switched: int | None = None) -> bool:
    """Sparse TP=2's decode steps against TP=1's (:func:`forced_steps`): equal up to rounding at
    every compared step (logprobs within ``logprob_tol``; a switched token only where the
    reference's margin is within it too), at most ``max_switched`` switched steps (None: any
    number), and at least :data:`TP_MIN_COMPARED` of them compared."""
    compared = [a for a in steps if a is not None]
    enough = bool(steps) and len(compared) >= TP_MIN_COMPARED * len(steps)
    few_switches = max_switched is None or switched_steps(steps) <= max_switched
    return enough and few_switches and all(a.within(logprob_tol, near_tie=logprob_tol) for a in compared)


def nearer_than_selection(steps: list[GreedyAgreement | None], selection: list[GreedyAgreement | None]) -> bool:
    """Sparse TP=2's decode steps against TP=1's (``steps``) stay far nearer than selection moves
    (``selection``: dense TP=1 against sparse TP=1 on the same contexts): at most
    :data:`DEPTH_SWITCH_SHARE` of its switched steps, a largest logprob gap at most
    :data:`DEPTH_GAP_SHARE` of its largest, and at least :data:`TP_MIN_COMPARED` of the steps
    compared. Selection that moves nothing (its contexts within the budget) is no scale: False."""
    compared = [a for a in steps if a is not None]
    largest = max((a.max_logprob_gap for a in selection if a is not None), default=0.0)
    if not compared or len(compared) < TP_MIN_COMPARED * len(steps):
        return False
    if largest == 0 and switched_steps(selection) == 0:
        return False
    return (
        switched_steps(steps) <= DEPTH_SWITCH_SHARE * switched_steps(selection)
        and max(a.max_logprob_gap for a in compared) <= DEPTH_GAP_SHARE * largest
    )
