"""What a benchmark script hands to ``raydecode bench``: rows for the one results table
and, optionally, series for the throughput plot.

A script calls :func:`emit` at the end; when ``RAYDECODE_BENCH_OUT`` names a folder (as
``raydecode bench`` sets it) the rows go to ``<folder>/<bench>.json``, and
``_report.py`` turns every such file into ``results.md`` and ``throughput.png``.
Run alone, a script only prints.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

OUT_ENV = "RAYDECODE_BENCH_OUT"
LOAD_ENV = "RAYDECODE_BENCH_LOAD"
#: the 1-minute load average before the run: as ``raydecode bench`` measured it before
#: its first script (later scripts would see the earlier ones' load), else at import
LOAD_AT_START = float(os.environ.get(LOAD_ENV) or os.getloadavg()[0])


@dataclass
class Row:
    """One line of the results table. ``ratio`` says its own direction ("1.9x" ours
    over peer for throughput, "7.1x floor" for a time against its floor); ``met`` is
    None where the figure has no target."""

    figure: str
    ours: str
    peer: str = "-"
    ratio: str = "-"
    target: str = ""
    met: bool | None = None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> str:
    """The machine a figure was measured on, in words."""
    import torch

    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    text = f"{cpu_model()}, {os.cpu_count()} CPUs, {mem:.0f} GiB; torch {torch.__version__}"
    if torch.cuda.is_available():
        text += f"; GPU {torch.cuda.get_device_name(0)}"
    return text


def emit(bench: str, rows: list[Row], *, series: dict[str, dict[int, float]] | None = None,
         series_label: str = "", notes: list[str] | None = None) -> Path | None:
    """Writes the script's rows (and plot series: ``{system: {batch size: tok/s}}``)
    where ``raydecode bench`` collects them; returns the file, or None when run alone."""
    out = os.environ.get(OUT_ENV)
    if not out:
        return None
    path = Path(out) / f"{bench}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "bench": bench,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load_at_start": LOAD_AT_START,
        "rows": [asdict(r) for r in rows],
        "series": {k: {str(b): v for b, v in s.items()} for k, s in (series or {}).items()},
        "series_label": series_label,
        "notes": notes or [],
    }
    path.write_text(json.dumps(record, indent=1))
    return path
