"""A prompt the host KV store cannot hold: SGLang's refusal, naming the sparse flag to change.

SGLang's scheduler refuses a prompt of ``max_req_input_len`` tokens or more with HTTP 400
(``validate_input_length``); the limit is the smaller of the model's context and the KV pool. With
sparse decode the KV pool is the host store, so when the host store is the smaller one the refusal
says so and names ``--sparse-host-cache-gb`` (SGLang's own message only suggests truncation).
"""

from __future__ import annotations

from dataclasses import dataclass

from sparse_sglang.integration.registry import relies_on, wrap_once


@dataclass(frozen=True, slots=True)
class HostStoreLimit:
    tokens: int  # token locations of the host store (SGLang's max_total_num_tokens)
    size: str  # how the store was sized (MemoryPlan.host_store_reason)
    context_len: int


_limit: HostStoreLimit | None = None  # set in the scheduler process when the sparse pools are built


def note_host_store(tokens: int, size: str, context_len: int) -> None:
    global _limit
    _limit = HostStoreLimit(tokens, size, context_len)


def explain(message: str) -> str:
    """SGLang's refusal, plus the host store's size and flag when that is what limits prompts."""
    if _limit is None or _limit.tokens >= _limit.context_len:
        return message
    return (f"{message} The sparse host KV store holds {_limit.tokens} tokens ({_limit.size}); a server "
            "with a larger --sparse-host-cache-gb takes longer prompts.")  # fmt: skip


@relies_on("sglang.srt.managers.scheduler:validate_input_length", at="sglang/srt/managers/utils.py:193")
def patch_validate_input_length() -> None:
    """Make the scheduler's ``validate_input_length`` refusals go through :func:`explain`."""
    import sglang.srt.managers.scheduler as scheduler

    def wrap(original):
        def validate_input_length(req, max_req_input_len, allow_auto_truncate):
            message = original(req, max_req_input_len, allow_auto_truncate)
            return explain(message) if message else message

        return validate_input_length

    wrap_once(scheduler, "validate_input_length", wrap)
