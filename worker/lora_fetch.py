"""LoRA adapter folders in remote storage, copied to this node before they are read.

An adapter's ``lora_path`` (and Ray Serve LLM's / Ray Data LLM's
``dynamic_lora_loading_path``) may be a local folder or a URI of storage pyarrow's
filesystems read (``s3://``, ``gs://``, ``abfs://``, ``hdfs://``, ``file://``). A remote
adapter is copied once per node into a cache folder (``RAYDECODE_LORA_CACHE``, else
``<tmp>/raydecode/lora``), keyed by the URI and the adapter's id (a reload under a new
id is read again, as vLLM's ``load_inplace`` expects), then read as a local folder.
The driver copies it to check it, and each worker that runs it copies it on its own
node (a worker may be on another machine than the driver). Only the two files PEFT's
format needs are fetched (``adapter_config.json``, ``adapter_model.safetensors``),
each within a size bound; a copy is written to a temporary folder and renamed into
place, so a crash or a concurrent fetch never leaves a half-written adapter.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from worker.lora_adapter import CONFIG_FILE, MAX_CONFIG_BYTES, WEIGHTS_FILE, LoRAAdapterError

T = TypeVar("T")

#: the URI schemes an adapter may come from (pyarrow's filesystems)
SCHEMES = ("s3", "gs", "gcs", "abfs", "abfss", "hdfs", "viewfs", "file")
#: the biggest adapter_model.safetensors fetched (rank-64 adapters of 70B models are ~1 GiB)
MAX_WEIGHTS_BYTES = 8 << 30
#: tries of one file's copy before the fetch fails (Ray Serve LLM's max_download_tries)
TRIES = 3


def is_remote(path: str) -> bool:
    """Whether ``path`` is a URI (``scheme://...``) rather than a local path."""
    return isinstance(path, str) and "://" in path


def check_location(path: str, field: str = "lora_path") -> str:
    """``path`` if it is a local path or a URI of a supported scheme; else a
    ``LoRAAdapterError`` naming ``field``."""
    if not isinstance(path, str) or not path.strip() or "\x00" in path:
        raise LoRAAdapterError(f"{field} must be a folder path or a URI, got {path!r}")
    if is_remote(path):
        scheme = path.split("://", 1)[0].lower()
        if scheme not in SCHEMES:
            raise LoRAAdapterError(f"{field}: URI scheme {scheme!r} is not supported (one of "
                                   f"{', '.join(SCHEMES)}), got {path!r}")
        if not path.split("://", 1)[1].strip("/"):
            raise LoRAAdapterError(f"{field}: the URI names no folder, got {path!r}")
    return path


def location(path: str) -> str:
    """How an adapter's place is kept: a URI as given, a local path made absolute."""
    return path if is_remote(path) else os.path.abspath(path)


def join(folder: str, name: str) -> str:
    """``folder/name`` for a local folder or a URI."""
    return posixpath.join(folder.rstrip("/"), name) if is_remote(folder) else os.path.join(folder, name)


def cache_root() -> str:
    return os.environ.get("RAYDECODE_LORA_CACHE") or os.path.join(tempfile.gettempdir(), "raydecode", "lora")


def adapter_folder(path: str, adapter_id: int, root: str | None = None) -> str:
    """The local folder to read adapter ``adapter_id`` at ``path`` from: the absolute
    path of a local one, this node's copy of a remote one (fetched now if not cached)."""
    if not is_remote(path):
        return os.path.abspath(path)
    check_location(path)
    root = root or cache_root()
    key = hashlib.sha256(f"{adapter_id}\0{path}".encode()).hexdigest()[:32]
    local = os.path.join(root, key)
    if os.path.isfile(os.path.join(local, WEIGHTS_FILE)):
        return local
    os.makedirs(root, exist_ok=True)
    staging = os.path.join(root, f".fetch-{key}-{uuid.uuid4().hex[:8]}")
    os.makedirs(staging)
    try:
        _fetch(path, staging)
        try:
            os.rename(staging, local)
        except OSError:  # another fetch of the same adapter finished first
            if not os.path.isfile(os.path.join(local, WEIGHTS_FILE)):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return local


def _fetch(uri: str, into: str) -> None:
    from pyarrow import fs

    try:
        filesystem, base = fs.FileSystem.from_uri(uri)
    except Exception as exc:  # pyarrow's errors for bad URIs, missing credentials
        raise LoRAAdapterError(f"lora_path {uri!r} cannot be opened: {exc}") from None
    info = _info(filesystem, base, uri)
    if info.type != fs.FileType.Directory:
        raise LoRAAdapterError(f"lora_path {uri!r} is not a folder")
    for name, limit in ((CONFIG_FILE, MAX_CONFIG_BYTES), (WEIGHTS_FILE, MAX_WEIGHTS_BYTES)):
        source = posixpath.join(base, name)
        file = _info(filesystem, source, uri)
        if file.type != fs.FileType.File:
            what = "not a PEFT adapter" if name == CONFIG_FILE else "no weights in safetensors"
            raise LoRAAdapterError(f"lora_path {uri!r} has no {name} ({what})")
        if file.size is not None and file.size > limit:
            raise LoRAAdapterError(f"{uri}/{name}: over {limit} bytes")
        _copy(filesystem, source, os.path.join(into, name), limit, f"{uri.rstrip('/')}/{name}")


def _tried(call: Callable[[], T], failure: str) -> T:
    """``call()``, tried ``TRIES`` times over storage errors (``OSError``) with a backoff;
    the last error as a ``LoRAAdapterError`` saying ``failure``."""
    for attempt in range(TRIES):
        try:
            return call()
        except OSError as exc:
            if attempt == TRIES - 1:
                raise LoRAAdapterError(f"{failure}: {exc}") from None
            time.sleep(0.5 * 2**attempt)
    raise AssertionError("unreachable")


def _info(filesystem: Any, path: str, uri: str) -> Any:
    return _tried(lambda: filesystem.get_file_info(path), f"lora_path {uri!r} cannot be read")


def _copy(filesystem: Any, source: str, target: str, limit: int, name: str) -> None:
    def copy() -> None:
        copied = 0
        with filesystem.open_input_stream(source) as src, open(target, "wb") as dst:
            while chunk := src.read(1 << 22):
                copied += len(chunk)
                if copied > limit:
                    raise LoRAAdapterError(f"{name}: over {limit} bytes")
                dst.write(chunk)

    _tried(copy, f"{name} could not be copied")
