"""How steps reach a worker: ``actor`` (the Ray actor and ``create_worker``),
``compute_thread`` (every torch call of the actor on one thread), ``step_channel``
(steps and replies on a socket beside Ray calls) and ``niceness`` (the CPU worker's
threads behind the serving processes). The only room of ``worker`` that imports Ray;
the names below are what the driver uses of it."""

from worker.transport.actor import Worker, create_worker, decode_info
from worker.transport.step_channel import ChannelClosed, StepChannel, StepFailed, wait_ready

__all__ = ["ChannelClosed", "StepChannel", "StepFailed", "Worker", "create_worker", "decode_info", "wait_ready"]
