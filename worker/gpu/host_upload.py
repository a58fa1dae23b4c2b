"""HostUpload: values written on the host into a fixed device tensor, without a round trip.

``tensor.to("cuda")`` from ordinary host memory returns only once the copy is done, and a
step that builds a dozen small tensors so pays a dozen host-device round trips before its
first kernel. A ``HostUpload`` keeps a pinned host twin of one device tensor: the host
writes the twin, ``send`` queues an asynchronous copy on the device's current stream,
and the next write first waits for that copy to have left the twin (an event: that
stream's work up to the copy, usually long done by the next step). On a CPU device the
twin is the tensor itself.
"""

from __future__ import annotations

import numpy as np
import torch


class HostUpload:
    def __init__(self, target: torch.Tensor) -> None:
        self.target = target
        self._cuda = target.device.type == "cuda"
        if self._cuda:
            self.host = torch.empty(target.shape, dtype=target.dtype, pin_memory=True)
            self.host.copy_(target)
            self._sent = torch.cuda.Event()
        else:
            self.host = target
        self._pending = False

    def host_array(self) -> np.ndarray:
        """The host twin as a numpy array, safe to write (the previous copy out of it has
        finished)."""
        self._wait()
        return self.host.numpy()

    def send(self, part: slice = slice(None)) -> None:
        """Queues the copy of the host twin (of ``part`` of its first dimension) into the
        device tensor; nothing to do on a CPU."""
        if self._cuda:
            self.target[part].copy_(self.host[part], non_blocking=True)
            self._sent.record(torch.cuda.current_stream(self.target.device))
            self._pending = True

    def send_from(self, values: torch.Tensor) -> None:
        """The device tensor takes ``values`` (of its shape: on the host, through the
        twin; already on its device, copied there directly)."""
        if values.device == self.target.device:
            self.target.copy_(values)
            return
        self._wait()
        self.host.copy_(values)
        self.send()

    def _wait(self) -> None:
        if self._pending:
            self._sent.synchronize()
            self._pending = False
