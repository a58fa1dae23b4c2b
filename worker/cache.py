"""Where raydecode keeps what it builds once per machine (converted models, compiled
kernels, GGUF metadata): ``$RAYDECODE_CACHE``, else ``$XDG_CACHE_HOME/raydecode``, else
``~/.cache/raydecode``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    if os.environ.get("RAYDECODE_CACHE"):
        return Path(os.environ["RAYDECODE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "raydecode"
