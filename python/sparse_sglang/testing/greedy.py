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


# TP=2 against TP=1 with real selection: the ranks sum their heads' attention (and the row-split
# projections) in another order, so the tokens agree up to rounding, and the runs must share
# enough decode steps for that to bite (not part at a first-token tie). How far rounding moves a
# logprob depends on the model (random weights amplify it layer by layer), so the logprob bar is
# measured: vanilla SGLang's own TP=1 against TP=2 on the same model and prompts, doubled (a
# rounding difference of the query may also swap a page at the selection's boundary), and never
# below TP_LOGPROB_TOL.
TP_LOGPROB_TOL = 0.05
TP_NEAR_TIE = 0.05
TP_MIN_SHARED_TOKENS = 8


def tp_logprob_tolerance(vanilla: list[GreedyAgreement]) -> float:
    """The logprob gap sparse TP=2 may show against sparse TP=1: twice the largest ``vanilla``
    (SGLang's TP=2 against its TP=1, same prompts) shows, at least :data:`TP_LOGPROB_TOL`."""
    return max([TP_LOGPROB_TOL, *(2 * a.max_logprob_gap for a in vanilla)])


def tp_agrees_with_tp1(agreement: GreedyAgreement, logprob_tol: float = TP_LOGPROB_TOL) -> bool:
    """TP=2's completion against TP=1's (the reference) of one prompt: equal up to rounding
    (logprobs within ``logprob_tol``, any difference at a near tie), and the same for at least
    :data:`TP_MIN_SHARED_TOKENS` tokens."""
    shared = agreement.equal or agreement.first_difference >= TP_MIN_SHARED_TOKENS
    return agreement.within(logprob_tol, TP_NEAR_TIE) and shared
