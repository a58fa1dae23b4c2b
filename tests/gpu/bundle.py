"""Build .gpu-bundle/: the wheels the GPU machine (no network) lacks, for CPython 3.12 on
manylinux x86_64 (`make gpu-bundle`).

What goes in: the packages that worker/, cluster/ and sampler/ import and the GPU image
lacks (tests/gpu/machine_packages.txt lists what it has), with everything they need in
turn: Ray (its Java jar and the dashboard's source maps taken out, so that the tree and the
bundle fit the 64 MiB a device call carries), msgspec, llguidance, jsonschema and its small
dependencies, gguf. Each is pinned to the version this checkout's .venv runs, where that
meets the requirement. Never torch, triton or nvidia-*; nothing the machine has, unless a
requirement (a wheel's, or pyproject.toml's own: transformers>=4.46 against the machine's
5.17.0, say) needs a newer version than it has.

The HTTP side (deploy/: Ray Serve's extras, FastAPI, Starlette, uvicorn, pydantic, openai)
is a second tier, left out by default: ``--http`` adds it (see the report it prints).

Writes .gpu-bundle/manifest.json (names, versions, sizes, why each is there), prints the
total and the size of the project's tracked files, and fails if both together exceed
60 MiB. Downloads are cached in ~/.cache/raydecode/gpu-wheels/cp312 (RAYDECODE_WHEEL_CACHE).
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bundle_check import FORBIDDEN, TARGET_ENV, check_bundle, read_machine_packages, read_wheel  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BUNDLE = REPO / ".gpu-bundle"
CACHE = Path(os.environ.get("RAYDECODE_WHEEL_CACHE", Path.home() / ".cache/raydecode/gpu-wheels"))
LIMIT_MIB = 60

#: What our code imports that the machine lacks (worker/, cluster/, sampler/), with the
#: extras requested. transformers (>=4.46 in pyproject), numpy, psutil, tqdm, accelerate,
#: prometheus-client and ninja are on the machine at versions our pyproject allows.
CORE = {"ray": [], "msgspec": [], "llguidance": [], "jsonschema": [], "gguf": []}
#: deploy/ (the OpenAI-compatible HTTP server) on top: Serve's extras and the API models.
HTTP = {"ray": ["serve"], "openai": [], "fastapi": [], "starlette": [], "pydantic": []}

#: pyproject.toml's dependencies only deploy/ needs (the core tier leaves them out, and asks
#: ray without its serve extra).
HTTP_ONLY = {"openai"}

#: The members of Ray's wheel not needed to run Python Ray: the Java workers' jar (34 MB)
#: and the dashboard UI's source maps.
RAY_STRIP = re.compile(r"^ray/jars/|^ray/dashboard/client/build/.*\.map$")

PLATFORMS = ["manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"] + [
    f"manylinux_2_{n}_x86_64" for n in range(5, 40)
]


def log(msg: str) -> None:
    print(msg, flush=True)


def venv_version(name: str) -> Version | None:
    try:
        return Version(metadata.version(name))
    except metadata.PackageNotFoundError:
        return None


PY_VERSION = "3.12"  # --python-version: only to rehearse the flow on another CPython


def pip_download(spec: str, dest: Path) -> Path:
    """One wheel for CPython 3.12 manylinux x86_64 (no dependencies) into ``dest``."""
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", PY_VERSION, "--implementation", "cp",
               "--abi", "cp" + PY_VERSION.replace(".", ""), "--abi", "abi3", "--abi", "none", "-d", tmp]
        for p in PLATFORMS:
            cmd += ["--platform", p]
        subprocess.run(cmd + [spec], check=True)
        got = list(Path(tmp).glob("*.whl"))
        if len(got) != 1:
            raise RuntimeError(f"pip download {spec}: {len(got)} wheels")
        target = dest / got[0].name
        shutil.move(got[0], target)
        return target


def cached_wheel(name: str, version: Version | None) -> Path | None:
    if version is None:
        return None
    for path in CACHE.glob("*.whl"):
        n, v, _, _ = parse_wheel_filename(path.name)
        if canonicalize_name(n) == name and v == version:
            return path
    return None


def fetch(name: str, spec: SpecifierSet) -> Path:
    """The wheel of ``name`` meeting ``spec``: the .venv's version where it meets it."""
    pinned = venv_version(name)
    if pinned is not None and not spec.contains(pinned, prereleases=True):
        pinned = None
    path = cached_wheel(name, pinned)
    if path is None:
        path = pip_download(f"{name}=={pinned}" if pinned else f"{name}{spec}", CACHE)
        log(f"  downloaded {path.name} ({path.stat().st_size / 2**20:.1f} MiB)")
    return path


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def strip_wheel(src: Path, dest: Path, drop: re.Pattern) -> list[str]:
    """Copy the wheel ``src`` to ``dest`` without the members ``drop`` matches, and with
    their lines taken out of RECORD (pip installs it as any other). Returns what went."""
    dropped: list[str] = []
    with zipfile.ZipFile(src) as zin:
        record_name = next(n for n in zin.namelist() if re.fullmatch(r"[^/]+\.dist-info/RECORD", n))
        tmp = dest.with_suffix(".part")
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as zout:
            for info in zin.infolist():
                if drop.search(info.filename):
                    dropped.append(info.filename)
                    continue
                if info.filename == record_name:
                    continue
                zout.writestr(info, zin.read(info), compress_type=zipfile.ZIP_DEFLATED, compresslevel=6)
            rows = list(csv.reader(io.StringIO(zin.read(record_name).decode("utf-8"))))
            kept = [r for r in rows if r and not drop.search(r[0])]
            buf = io.StringIO()
            csv.writer(buf, lineterminator="\n").writerows(kept)
            zout.writestr(zin.getinfo(record_name), buf.getvalue().encode("utf-8"),
                          compress_type=zipfile.ZIP_DEFLATED)
    tmp.replace(dest)
    return dropped


def verify_record(path: Path) -> list[str]:
    """The ways the wheel's RECORD disagrees with its members (empty: it agrees)."""
    errors: list[str] = []
    with zipfile.ZipFile(path) as zf:
        names = [n for n in zf.namelist() if not n.endswith("/")]
        record_name = next(n for n in names if re.fullmatch(r"[^/]+\.dist-info/RECORD", n))
        rows = {r[0]: r for r in csv.reader(io.StringIO(zf.read(record_name).decode())) if r}
        for n in names:
            row = rows.pop(n, None)
            if row is None:
                errors.append(f"{n}: not in RECORD")
            elif n != record_name:
                data = zf.read(n)
                if row[1] != _record_hash(data) or row[2] != str(len(data)):
                    errors.append(f"{n}: hash or size differs from RECORD")
        errors += [f"{n}: in RECORD, not in the wheel" for n in rows]
    return errors


def resolve(roots: dict[str, list[str]], machine: dict[str, Version | None], project: list[str]):
    """The closure of ``roots`` and ``project`` (requirement lines) over Requires-Dist,
    less what the machine has. Returns {name: (wheel path in the cache, why)} and the
    requested extras per name."""
    picked: dict[str, tuple[Path, str]] = {}
    extras: dict[str, set[str]] = {canonicalize_name(k): set(v) for k, v in roots.items()}
    queue: list[tuple[str, SpecifierSet, str]] = [(canonicalize_name(k), SpecifierSet(), "ours") for k in roots]
    for line in project:
        req = Requirement(line)
        queue.append((canonicalize_name(req.name), req.specifier, "ours"))
    env = dict(TARGET_ENV)
    done_extras: dict[str, set[str]] = {}
    while queue:
        name, spec, why = queue.pop(0)
        if name in picked:
            have = read_wheel(picked[name][0]).version
            if spec and not spec.contains(have, prereleases=True):
                raise SystemExit(f"{why} needs {name}{spec}, {name} {have} is picked")
            if done_extras.get(name, set()) >= extras.get(name, set()):
                continue  # its requirements are walked already, for these extras
        elif name in machine:
            have = machine[name]
            if have is None or not spec or spec.contains(have, prereleases=True):
                if why == "ours":
                    log(f"  {name}{spec}: the machine has {have or 'it (version unknown)'}, not bundled")
                continue
            log(f"  {why} needs {name}{spec}; the machine has {have}: bundled")
        if FORBIDDEN.match(name):
            raise SystemExit(f"{why} needs {name}{spec}: never bundled (the machine's build is used)")
        if name not in picked:
            picked[name] = (fetch(name, spec), why)
        info = read_wheel(picked[name][0])
        done_extras[name] = set(extras.get(name, set()))
        for line in info.requires:
            req = Requirement(line)
            wanted = [""] + sorted(extras.get(name, set()))
            if req.marker is not None and not any(req.marker.evaluate({**env, "extra": e}) for e in wanted):
                continue
            dep = canonicalize_name(req.name)
            if req.extras:
                extras.setdefault(dep, set()).update(canonicalize_name(e) for e in req.extras)
            queue.append((dep, req.specifier, name))
    return picked, extras


def project_requires(http: bool) -> list[str]:
    """pyproject.toml's dependencies, less the HTTP side's unless ``http``: checked (and
    resolved) as a wheel's requirements are, so a machine package older than our floor
    is bundled, or reported."""
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    out = []
    for line in deps:
        req = Requirement(line)
        if not http:
            if canonicalize_name(req.name) in HTTP_ONLY:
                continue
            req.extras = set()
        out.append(str(req))
    return out


def tracked_bytes() -> int:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    total = 0
    for rel in out.decode().split("\0"):
        p = REPO / rel
        if rel and p.is_file() and not p.is_symlink():
            total += p.stat().st_size
    return total


def main(argv: list[str] | None = None) -> int:
    global PY_VERSION, CACHE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--http", action="store_true", help="add the HTTP side (deploy/): ray[serve], openai")
    ap.add_argument("--out", default=str(BUNDLE))
    ap.add_argument("--limit-mib", type=float, default=LIMIT_MIB)
    ap.add_argument("--python-version", default=PY_VERSION,
                    help="another CPython's wheels (a rehearsal elsewhere; the machine's is 3.12)")
    args = ap.parse_args(argv)
    PY_VERSION = args.python_version
    CACHE = CACHE / ("cp" + PY_VERSION.replace(".", ""))  # the wheels' tags differ
    t0 = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    CACHE.mkdir(parents=True, exist_ok=True)
    machine = read_machine_packages()

    roots = {k: list(v) for k, v in CORE.items()}
    if args.http:
        for k, v in HTTP.items():
            roots[k] = sorted(set(roots.get(k, [])) | set(v))
    names = ", ".join(k + (f"[{','.join(v)}]" if v else "") for k, v in roots.items())
    log(f"resolving {names} for CPython {PY_VERSION}, manylinux x86_64")
    project = project_requires(args.http)
    picked, extras = resolve(roots, machine, project)

    wheels = []
    keep: set[str] = set()
    for name, (src, why) in sorted(picked.items()):
        info = read_wheel(src)
        stripped: list[str] = []
        if name == "ray":
            dest = out / src.name
            stamp = CACHE / (src.name + ".stripped")
            cached = CACHE / "stripped" / src.name
            cached.parent.mkdir(exist_ok=True)
            if not (cached.exists() and stamp.exists()):
                log(f"  stripping {src.name} (jar, source maps)...")
                stripped = strip_wheel(src, cached, RAY_STRIP)
                errors = verify_record(cached)
                if errors:
                    raise SystemExit(f"stripped {src.name}: RECORD disagrees: {errors[:5]}")
                stamp.write_text("\n".join(stripped) + "\n")
            stripped = stamp.read_text().split()
            shutil.copyfile(cached, dest)
        else:
            dest = out / src.name
            shutil.copyfile(src, dest)
        keep.add(dest.name)
        wheels.append({
            "name": name,
            "version": str(info.version),
            "file": dest.name,
            "bytes": dest.stat().st_size,
            "sha256": hashlib.sha256(dest.read_bytes()).hexdigest(),
            "why": "ours" if why == "ours" else f"needed by {why}",
            "upstream_bytes": src.stat().st_size,
            "stripped": stripped,
        })
    for stale in out.glob("*.whl"):
        if stale.name not in keep:
            log(f"  removing stale {stale.name}")
            stale.unlink()

    total = sum(w["bytes"] for w in wheels)
    tracked = tracked_bytes()
    manifest = {
        "target": f"CPython {PY_VERSION}, manylinux x86_64 (the GPU machine's python3: 3.12)",
        "built": time.strftime("%Y-%m-%d %H:%M:%S"),
        "tiers": ["core"] + (["http"] if args.http else []),
        "extras": {k: sorted(v) for k, v in extras.items() if v},
        "project_requires": project,
        "left_out": [] if args.http else
        ["HTTP side (deploy/): ray[serve] extras, openai, fastapi, starlette, uvicorn, pydantic "
         "(bundle.py --http adds them)"],
        "wheels": wheels,
        "total_bytes": total,
        "tracked_bytes": tracked,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total += (out / "manifest.json").stat().st_size

    log("")
    log(f"{'package':28} {'version':14} {'MiB':>7}  why")
    for w in wheels:
        note = f" (stripped {len(w['stripped'])} members)" if w["stripped"] else ""
        log(f"{w['name']:28} {w['version']:14} {w['bytes'] / 2**20:7.2f}  {w['why']}{note}")
    log("")
    log(f"bundle:        {total / 2**20:7.2f} MiB in {len(wheels)} wheels ({out})")
    log(f"tracked files: {tracked / 2**20:7.2f} MiB (git ls-files)")
    both = (total + tracked) / 2**20
    log(f"together:      {both:7.2f} MiB (limit {args.limit_mib:g} MiB; a device call carries 64)")

    report = check_bundle(out, machine)
    log(report.format())
    log(f"({time.monotonic() - t0:.0f} s)")
    if both > args.limit_mib:
        log(f"FAIL: {both:.2f} MiB > {args.limit_mib:g} MiB")
        return 1
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
