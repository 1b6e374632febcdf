"""The only package that touches SGLang internals.

One module per mechanism, one function per hooked SGLang symbol; each hook is marked with
:func:`~sparse_sglang.integration.registry.relies_on` naming the SGLang 0.5.17
``file:line`` it relies on (``HOOKS`` lists them; a test checks each one).

``install()`` puts everything in place in the current process. The launcher
calls it in the main process and ``run_scheduler_process`` calls it again in the
spawned scheduler process.
"""

from __future__ import annotations

import logging

from sparse_sglang.integration.registry import HOOKS, check_sglang_version

logger = logging.getLogger(__name__)
_installed = False


def install() -> None:
    """Register sparse-sglang with SGLang in this process (idempotent)."""
    global _installed
    if _installed:
        return
    check_sglang_version()
    from sparse_sglang.integration.admission import patch_abort_request, patch_check_decode_mem, patch_prefill_adder
    from sparse_sglang.integration.attention_backend import (
        add_sparse_backend_choice,
        register_sparse_attention_backend,
    )
    from sparse_sglang.integration.flashinfer_decode_plan import patch_flashinfer_decode_max
    from sparse_sglang.integration.forward_batch import patch_forward_batch_init_new
    from sparse_sglang.integration.memory_pool import patch_alloc_memory_pool
    from sparse_sglang.integration.metrics import patch_report_decode_stats
    from sparse_sglang.integration.prefill_interleave import patch_get_new_batch_prefill, patch_run_batch
    from sparse_sglang.integration.request_intake import patch_handle_generate_request
    from sparse_sglang.integration.request_validation import (
        patch_normalize_batch_and_arguments,
        patch_openai_body_must_be_an_object,
        patch_validate_one_request,
    )
    from sparse_sglang.integration.retraction import patch_release_req
    from sparse_sglang.integration.scheduler_state import patch_get_internal_state, patch_tokenizer_get_internal_state
    from sparse_sglang.integration.segmented_prefill import patch_event_loop_normal

    add_sparse_backend_choice()
    register_sparse_attention_backend()
    patch_alloc_memory_pool()
    patch_forward_batch_init_new()
    patch_get_internal_state()
    patch_tokenizer_get_internal_state()
    patch_report_decode_stats()
    # Requests are checked in the main process (the HTTP server and tokenizer manager run there).
    patch_normalize_batch_and_arguments()
    patch_validate_one_request()
    patch_openai_body_must_be_an_object()
    patch_handle_generate_request()
    patch_prefill_adder()
    patch_abort_request()
    patch_check_decode_mem()
    patch_event_loop_normal()
    patch_get_new_batch_prefill()
    patch_run_batch()
    patch_release_req()
    patch_flashinfer_decode_max()
    _installed = True
    logger.info("sparse-sglang installed into SGLang (%d hooks)", len(HOOKS))


__all__ = ["HOOKS", "install"]
