"""A prompt the host KV store cannot hold: SGLang's refusal, naming the sparse flag to change.

SGLang's scheduler refuses a prompt of ``max_req_input_len`` tokens or more with HTTP 400
(``validate_input_length``); the limit is the smaller of the model's context and the KV pool. With
sparse decode the KV pool is the host store, so when the host store is the smaller one the refusal
says so and names ``--sparse-host-cache-gb`` (SGLang's own message only suggests truncation).
"""

from __future__ import annotations

from dataclasses import dataclass

from sparse_sglang.integration.registry import relies_on, rewrap


@dataclass(frozen=True, slots=True)
class HostStoreLimit:
    """The host store's bound on prompts in one scheduler process, known once its sparse pools are
    built (``memory_pool.alloc_sparse_memory_pool``) and bound into the refusal hook there."""

    tokens: int  # token locations of the host store (SGLang's max_total_num_tokens)
    size: str  # how the store was sized (MemoryPlan.host_store_reason)
    context_len: int

    def explain(self, message: str) -> str:
        """SGLang's refusal, plus the host store's size and flag when that is what limits prompts."""
        if self.tokens >= self.context_len:
            return message
        return (f"{message} The sparse host KV store holds {self.tokens} tokens ({self.size}); a server "
                "with a larger --sparse-host-cache-gb takes longer prompts.")  # fmt: skip


@relies_on("sglang.srt.managers.scheduler:validate_input_length", at="sglang/srt/managers/utils.py:193")
def patch_validate_input_length(limit: HostStoreLimit) -> None:
    """Make the scheduler's ``validate_input_length`` refusals go through ``limit.explain``.

    Installed when the scheduler's sparse pools are built, not by ``install()``: SGLang passes the
    function no scheduler, so the limit comes bound in. A later call (another pool built in the
    process) replaces the earlier wrapper, as the pool it describes replaces the earlier one."""
    import sglang.srt.managers.scheduler as scheduler

    def wrap(original):
        def validate_input_length(req, max_req_input_len, allow_auto_truncate):
            message = original(req, max_req_input_len, allow_auto_truncate)
            return limit.explain(message) if message else message

        return validate_input_length

    rewrap(scheduler, "validate_input_length", wrap)
