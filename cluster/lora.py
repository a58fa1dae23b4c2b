"""LoRA adapters on the driver: vLLM's ``LoRARequest``, and the registry that checks
an adapter folder once before any request naming it is queued.

A request names an adapter with a ``LoRARequest(lora_name, lora_int_id, lora_path)``,
as in vLLM. The first time an id is seen, its folder is checked against the model the
workers loaded (``worker.lora_adapter.inspect_adapter``: PEFT's config, the tensor
names and shapes, the ranks against ``max_lora_rank``); a bad folder is a
``ValueError`` naming what is wrong, and nothing was queued. The checked adapter
travels to a worker with each request placed there (``AddedRequest.lora``); the worker
reads the tensors on first use.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from worker import LoRAAdapter, LoRAAdapterError, check_adapter_name, inspect_adapter
from worker.lora_fetch import adapter_folder, check_location, location

#: adapters whose check is remembered (by id); past it the oldest is checked again
#: when next named
MAX_REMEMBERED = 1024


@dataclass(frozen=True)
class LoRARequest:
    """A request's adapter, in vLLM's shape: a unique name, a unique positive integer
    id, and the PEFT folder it loads from (a local path, or a URI of remote storage:
    ``worker/lora_fetch.py``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    #: the model the adapter was trained on (informational, as in vLLM)
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        check_adapter_name(self.lora_name)
        value = self.lora_int_id
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2**31:
            raise ValueError(f"lora_int_id must be an integer from 1 to 2**31 - 1, got {value!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path or "\x00" in self.lora_path:
            raise ValueError(f"lora_path must name the adapter's folder, got {self.lora_path!r}")
        check_location(self.lora_path)

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


class LoRARegistry:
    """The adapters requests have named, each checked once against the served model
    (``targets``: the workers' adaptable linears, name -> [in, out]). Thread-safe."""

    def __init__(self, enabled: bool, max_lora_rank: int, targets: dict[str, list[int]]) -> None:
        self.enabled = enabled
        self.max_lora_rank = max_lora_rank
        self.targets = targets
        self._checked: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, request: LoRARequest | None) -> LoRAAdapter | None:
        """``request`` as the wire's ``LoRAAdapter``, its folder checked (ValueError
        naming what is wrong); None for the base model."""
        if request is None:
            return None
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        if not self.enabled:
            raise ValueError(f"lora_request {request.lora_name!r}: this engine was started without enable_lora")
        path = location(request.lora_path)
        adapter = LoRAAdapter(id=request.lora_int_id, name=request.lora_name, path=path)
        with self._lock:
            known = self._checked.get(adapter.id)
            if known is not None:
                if known != adapter:
                    raise ValueError(
                        f"lora_int_id {adapter.id} already names adapter {known.name!r} at {known.path!r}; "
                        "each adapter needs its own id")
                self._checked.move_to_end(adapter.id)
                return known
        try:
            inspect_adapter(adapter_folder(path, adapter.id), self.max_lora_rank, self.targets)
        except LoRAAdapterError as exc:
            raise ValueError(f"lora_request {request.lora_name!r}: {exc}") from None
        with self._lock:
            self._checked[adapter.id] = adapter
            while len(self._checked) > MAX_REMEMBERED:
                self._checked.popitem(last=False)
        return adapter

    def forget(self, adapter_id: int) -> None:
        """Drops an id (an adapter unloaded): its next use is checked again."""
        with self._lock:
            self._checked.pop(adapter_id, None)
