"""LoRA adapters as the HTTP API serves them: each adapter a ``model`` of its own.

The ingress keeps the table (adapter name -> the engine serving its base model, the
folder, an id), so that every engine replica behind it serves every adapter: a request
names an adapter as its ``model`` (or, as Ray Serve LLM's clients do,
``"<base model>:<adapter>"``), and the ingress hands the adapter to the engine replica
with the request; the engine checks the folder once and its workers load it on first
use. The table starts with the server's ``lora_modules`` (vLLM's ``--lora-modules``);
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (vLLM's runtime
endpoints) change it while the server runs, when ``allow_runtime_lora_updating`` (or
vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) allows it.

Each load gets a fresh id (an unloaded and reloaded adapter is read again, never a
worker's old copy).
"""

from __future__ import annotations

import itertools
import os
import time
import zlib
from typing import Any

from pydantic import BaseModel, ConfigDict

from deploy.openai.errors import APIError
from worker import LoRAAdapterError, check_adapter_name
from worker.lora_fetch import join, location

#: vLLM's switch for the runtime endpoints (truthy: "1", "true")
RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_path: str
    #: the served model it adapts (needed only when the server serves several)
    base_model_name: str | None = None
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body; ``lora_int_id`` is ignored)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_int_id: int | None = None


def runtime_updates_allowed(flag: bool) -> bool:
    return flag or os.environ.get(RUNTIME_ENV, "").strip().lower() in ("1", "true", "yes")


def parse_lora_module(entry: Any) -> dict[str, str | None]:
    """One of vLLM's ``--lora-modules`` entries: ``name=path``, or a JSON object (or
    dict) with ``name``, ``path`` and optionally ``base_model_name``."""
    if isinstance(entry, str) and not entry.lstrip().startswith("{"):
        name, sep, path = entry.partition("=")
        if not sep or not path:
            raise ValueError(f"lora_modules: {entry!r} is not name=path")
        entry = {"name": name, "path": path}
    elif isinstance(entry, str):
        import json

        try:
            entry = json.loads(entry)
        except ValueError as exc:
            raise ValueError(f"lora_modules: {entry!r} is not JSON ({exc})") from None
    if not isinstance(entry, dict) or set(entry) - {"name", "path", "base_model_name"} or \
            not isinstance(entry.get("path"), str) or not entry["path"]:
        raise ValueError(f"lora_modules: {entry!r} needs name and path (and optionally base_model_name)")
    try:
        check_adapter_name(entry.get("name"))
    except LoRAAdapterError as exc:
        raise ValueError(f"lora_modules: {exc}") from None
    base = entry.get("base_model_name")
    if base is not None and not isinstance(base, str):
        raise ValueError(f"lora_modules: base_model_name must be a string, got {base!r}")
    return {"name": entry["name"], "path": entry["path"], "base_model_name": base}


def wire(entry: dict[str, Any]) -> dict[str, Any]:
    """What an engine replica is told of an entry: the adapter (name, id, folder) and
    the ``model`` the request named it by (its answers echo that)."""
    return {k: entry[k] for k in ("name", "id", "path", "model")}


class AdapterTable:
    """The adapters the ingress serves, by name (``engines``: the served base models)."""

    def __init__(self, engines: list[str], modules: list[dict[str, Any]], runtime_updates: bool,
                 dynamic: dict[str, str] | None = None) -> None:
        """``dynamic``: per served model, the folder whose ``<adapter>/`` a request for
        ``"<model>:<adapter>"`` loads on first use (Ray Serve LLM's lora_config)."""
        self.engines = engines
        self.runtime_updates = runtime_updates
        self.dynamic = dynamic or {}
        self.adapters: dict[str, dict[str, Any]] = {}
        self._loads = itertools.count(1)
        for module in modules:
            self.add(module["name"], module["path"], module.get("base_model_name"))

    def _base(self, base_model_name: str | None) -> str:
        if base_model_name is None:
            if len(self.engines) != 1:
                raise ValueError(f"an adapter needs base_model_name: one of {sorted(self.engines)}")
            return self.engines[0]
        if base_model_name not in self.engines:
            raise ValueError(f"base_model_name {base_model_name!r} is not served (this server has "
                             f"{sorted(self.engines)})")
        return base_model_name

    def add(self, name: str, path: str, base_model_name: str | None = None, model: str | None = None
            ) -> dict[str, Any]:
        """A new entry (ValueError for a bad name, a taken one, an unknown base);
        ``model``: the ``model`` requests name it by (default: its name)."""
        check_adapter_name(name)
        model = model or name
        if model in self.adapters or model in self.engines:
            raise ValueError(f"The lora adapter '{model}' has already been loaded.")
        load = next(self._loads)
        adapter_id = zlib.crc32(f"{name}\x00{path}\x00{load}\x00{time.time_ns()}".encode()) & 0x7FFFFFFF or 1
        entry = {"name": name, "model": model, "id": adapter_id, "path": location(path),
                 "engine": self._base(base_model_name), "created": int(time.time())}
        self.adapters[model] = entry
        return entry

    def remove(self, name: str) -> dict[str, Any]:
        entry = self.adapters.pop(name, None)
        if entry is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError", "lora_name")
        return entry

    def resolve(self, model: str | None) -> tuple[str | None, dict[str, Any] | None]:
        """The engine a request's ``model`` goes to, and the adapter it names (None:
        the base model). ``"<base>:<adapter>"`` is Ray Serve LLM's form."""
        if model is None or model in self.engines:
            return model, None
        entry = self.adapters.get(model)
        if entry is None and ":" in model:
            base, _, name = model.rpartition(":")
            entry = self.adapters.get(name)
            if entry is not None and entry["engine"] != base:
                entry = None
        if entry is None:
            return model, None
        return entry["engine"], wire(entry)

    def dynamic_candidate(self, model: str | None) -> tuple[str, str, str] | None:
        """For a ``"<model>:<adapter>"`` not yet in the table whose model loads adapters
        dynamically: (the adapter's name, its folder, the model); else None."""
        if model is None or model in self.adapters or ":" not in model:
            return None
        base, _, name = model.rpartition(":")
        folder = self.dynamic.get(base)
        if folder is None:
            return None
        try:
            check_adapter_name(name)
        except LoRAAdapterError as exc:
            raise APIError(400, f"model: {exc}", "BadRequestError", "model") from None
        return name, join(folder, name), base

    def cards(self) -> list[dict[str, Any]]:
        """The adapters' entries in ``/v1/models`` (vLLM's: ``parent`` the base model,
        ``root`` the folder)."""
        return [{"id": a["model"], "object": "model", "created": a["created"], "owned_by": "raydecode",
                 "root": a["path"], "parent": a["engine"]} for a in self.adapters.values()]
