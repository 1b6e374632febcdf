"""A request the scheduler fails to take in fails alone; the scheduler keeps serving.

The main process checks every request before it is sent (``request_validation.py``), so what
reaches the scheduler should be well-formed; this is the net under it. An exception while
``Scheduler.handle_generate_request`` turns one tokenized request into a queued ``Req`` would
propagate into the scheduler's event loop and end the server. Instead the request is answered as
SGLang answers a request it refuses in that method (a ``Req`` finished with an abort, queued so its
reply goes out), and the error is logged with its traceback.

What this cannot catch: a failure inside a forward (a device-side assert poisons the CUDA context
for every request). Those are prevented on the host, before the request is sent.
"""

from __future__ import annotations

import logging

from sparse_sglang.integration.registry import relies_on, wrap_once

logger = logging.getLogger(__name__)


def refuse_alone(scheduler, recv_req, err: BaseException) -> None:
    """Queue ``recv_req`` as a request finished with an abort naming ``err`` (SGLang's own way to
    refuse a request in ``handle_generate_request``: its reply goes out with the next batch's)."""
    from sglang.srt.managers.schedule_batch import Req

    req = Req(recv_req.rid, recv_req.input_text, recv_req.input_ids, recv_req.sampling_params,
              vocab_size=scheduler.model_config.vocab_size, http_worker_ipc=recv_req.http_worker_ipc)  # fmt: skip
    req.tokenizer = scheduler.tokenizer
    req.set_finish_with_abort(f"the scheduler could not take this request: {type(err).__name__}: {err}")
    scheduler.init_req_max_new_tokens(req)
    scheduler._add_request_to_queue(req)


@relies_on(
    "sglang.srt.managers.scheduler:Scheduler.handle_generate_request", at="sglang/srt/managers/scheduler.py:2300"
)
def patch_handle_generate_request() -> None:
    """Make ``Scheduler.handle_generate_request`` refuse a request it fails on (:func:`refuse_alone`)
    instead of raising into the event loop; whatever the failed call queued is taken back first."""
    from sglang.srt.managers.scheduler import Scheduler

    def wrap(original):
        def handle_generate_request(self, recv_req):
            queued = len(self.waiting_queue)
            try:
                return original(self, recv_req)
            except Exception as err:
                logger.exception("request %s failed in the scheduler; refusing it alone", recv_req.rid)
                del self.waiting_queue[queued:]
                try:
                    refuse_alone(self, recv_req, err)
                except Exception:  # the request cannot even be answered: drop it, keep serving
                    logger.exception("request %s could not be answered; dropped", recv_req.rid)

        return handle_generate_request

    wrap_once(Scheduler, "handle_generate_request", wrap)
