"""The attention constants FlashInfer takes at plan time, shared by every layer of a model.

FlashInfer's wrappers take the softmax scale and the logits soft cap in ``plan`` (``run`` reads
them from the plan), so one plan per batch serves every layer only if every layer has the same
ones. SGLang hands each layer's own to the backend per call: :meth:`LayerConstants.check` refuses
a layer whose own differ rather than attending with the wrong scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerConstants:
    sm_scale: float
    logits_soft_cap: float = 0.0  # 0: none (FlashInfer's convention)

    @classmethod
    def of(cls, head_dim: int, sm_scale: float | None = None, logits_soft_cap: float | None = None) -> LayerConstants:
        """The model's constants (``None``: 1/sqrt(head_dim), no soft cap)."""
        return cls(head_dim**-0.5 if sm_scale is None else float(sm_scale), float(logits_soft_cap or 0.0))

    @property
    def soft_cap_or_none(self) -> float | None:
        return self.logits_soft_cap or None

    def check(self, sm_scale: float | None, logits_soft_cap: float | None, planner: str) -> None:
        """A layer's softmax scale (None: not given) and soft cap must be the planned ones (host
        floats: no sync, fine inside CUDA-graph capture). ``planner`` names the plan's owner."""
        if sm_scale is not None and not math.isclose(sm_scale, self.sm_scale, rel_tol=1e-6):
            raise ValueError(f"a layer's softmax scale {sm_scale} is not the {planner}'s {self.sm_scale}: "
                             f"the {planner} plans one scale for every layer")  # fmt: skip
        if float(logits_soft_cap or 0.0) != self.logits_soft_cap:
            raise ValueError(f"a layer's logits soft cap {logits_soft_cap} is not the {planner}'s "
                             f"{self.soft_cap_or_none}: the {planner} plans one for every layer")  # fmt: skip
