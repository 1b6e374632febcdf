"""A GPU timeline for CPU tests of code that times batches with CUDA events.

Example::

    gpu = SimulatedGpu()
    start = gpu.event(); start.record()
    gpu.run(0.003)                       # a batch of 3 ms, launched now
    end = gpu.event(); end.record()
    gpu.now = 0.002; end.query()         # False: the GPU is not past it yet
    gpu.now = 0.004; start.elapsed_time(end)   # 3.0 (ms), as torch.cuda.Event gives it
"""

from __future__ import annotations


class SimulatedGpu:
    """Batches run back to back in launch order (:meth:`run`); the host looks at ``now``."""

    def __init__(self):
        self.busy_until = 0.0  # when the last batch launched ends, s
        self.now = 0.0  # the host's time, s

    def run(self, seconds: float) -> None:
        self.busy_until += seconds

    def event(self) -> SimulatedEvent:
        return SimulatedEvent(self)


class SimulatedEvent:
    """``torch.cuda.Event(enable_timing=True)``'s ``record``, ``query`` and ``elapsed_time``."""

    def __init__(self, gpu: SimulatedGpu):
        self.gpu, self.at = gpu, None

    def record(self, stream=None) -> None:
        self.at = self.gpu.busy_until  # the stream reaches it once what was launched before has run

    def query(self) -> bool:
        return self.gpu.now >= self.at

    def elapsed_time(self, end: SimulatedEvent) -> float:
        return (end.at - self.at) * 1000
