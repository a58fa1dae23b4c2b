"""Static completeness check of the GPU machine's wheel bundle (.gpu-bundle/).

The GPU machine has no network: whatever our code imports that its image lacks travels as
wheels (tests/gpu/bundle.py builds them for CPython 3.12, manylinux x86_64). This module
checks, without importing or installing any of them (this machine's Python may not be 3.12),
that the set is closed: every requirement of every bundled wheel (its METADATA's
Requires-Dist, markers evaluated for CPython 3.12 on Linux x86_64, an ``extra`` marker only
for the extras requested) is met by another wheel of the bundle or by a package the machine
already has (tests/gpu/machine_packages.txt, with the version checked where it is known).
Our own requirements (pyproject.toml's dependencies less the HTTP side's, recorded in the
manifest as ``project_requires``) are checked the same way, as those of ``raydecode``.

Requested extras: those named in the bundle's manifest.json (``"extras": {"ray": []}``),
or passed in, plus the extras that a met requirement names (``uvicorn[standard]``).

Only the standard library and ``packaging`` are needed (both are on the GPU machine).
"""

from __future__ import annotations

import json
import re
import zipfile
from dataclasses import dataclass, field
from email.parser import HeaderParser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

HERE = Path(__file__).resolve().parent
MACHINE_PACKAGES = HERE / "machine_packages.txt"

#: The GPU machine's interpreter, as markers see it (KINDS.md: CPython 3.12.3, x86-64 Linux).
TARGET_ENV: dict[str, str] = {
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "platform_release": "",
    "platform_system": "Linux",
    "platform_version": "",
    "python_full_version": "3.12.3",
    "python_version": "3.12",
    "sys_platform": "linux",
}

#: The name our own requirements (pyproject.toml's) are reported under.
PROJECT = "raydecode"

#: Never carried: the machine's own CUDA build of these is what we run against.
FORBIDDEN = re.compile(r"^(torch|triton|nvidia-.*)$")


@dataclass(frozen=True)
class Problem:
    """One thing that would break on the machine. ``kind`` is one of: missing (nothing
    provides the requirement), version (something provides it at a version outside the
    specifier), duplicate (two wheels of one package), forbidden (torch/triton/nvidia-*
    in the bundle), bad-wheel (unreadable file name or METADATA)."""

    kind: str
    package: str  # the wheel whose requirement (or file) it is
    requirement: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.package} needs {self.requirement!r}: {self.detail}"


@dataclass
class WheelInfo:
    name: str  # canonical
    version: Version
    path: Path
    requires: list[str]  # raw Requires-Dist lines
    provides_extras: list[str]


@dataclass
class Report:
    wheels: dict[str, WheelInfo] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    #: requirement lines met by a machine package whose version is not recorded
    unverified: list[str] = field(default_factory=list)
    #: requirement lines that the target's markers (or unrequested extras) leave out
    not_needed: list[str] = field(default_factory=list)
    #: package -> the extras taken as requested
    extras: dict[str, set[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def kinds(self) -> set[str]:
        return {p.kind for p in self.problems}

    def format(self) -> str:
        lines = [
            f"bundle check: {len(self.wheels)} wheels, {len(self.problems)} problems, "
            f"{len(self.unverified)} requirements met by a machine package of unrecorded "
            f"version, {len(self.not_needed)} left out by markers/extras"
        ]
        lines += [f"  PROBLEM {p}" for p in self.problems]
        return "\n".join(lines)


def read_machine_packages(path: Path | str = MACHINE_PACKAGES) -> dict[str, Version | None]:
    """``name[==version]`` lines, ``#`` comments; names normalized."""
    out: dict[str, Version | None] = {}
    for raw in Path(path).read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, ver = line.partition("==")
        out[canonicalize_name(name.strip())] = Version(ver.strip()) if ver.strip() else None
    return out


def read_wheel(path: Path) -> WheelInfo:
    """Name, version and Requires-Dist of a wheel file, read from the zip (no import)."""
    name, version, _build, _tags = parse_wheel_filename(path.name)
    with zipfile.ZipFile(path) as zf:
        metas = [n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
        if len(metas) != 1:
            raise ValueError(f"{path.name}: {len(metas)} */.dist-info/METADATA members")
        msg = HeaderParser().parsestr(zf.read(metas[0]).decode("utf-8"))
    return WheelInfo(
        name=canonicalize_name(name),
        version=version,
        path=path,
        requires=msg.get_all("Requires-Dist") or [],
        provides_extras=[canonicalize_name(e) for e in (msg.get_all("Provides-Extra") or [])],
    )


def _applies(req: Requirement, extras: set[str], env: dict[str, str]) -> bool:
    """Whether ``req`` is needed on the target, for the package's requested ``extras``."""
    if req.marker is None:
        return True
    for extra in [""] + sorted(extras):
        if req.marker.evaluate({**env, "extra": extra}):
            return True
    return False


def _manifest(bundle_dir: Path) -> dict:
    manifest = bundle_dir / "manifest.json"
    if manifest.exists():
        return json.loads(manifest.read_text())
    return {}


def check_bundle(
    bundle_dir: Path | str,
    machine: dict[str, Version | None] | Path | str | None = None,
    extras: dict[str, list[str] | set[str]] | None = None,
    env: dict[str, str] | None = None,
    project: list[str] | None = None,
) -> Report:
    """Check the wheels in ``bundle_dir`` (see the module's docstring).

    ``machine``: the machine's packages (a mapping, or a file as machine_packages.txt;
    default: that file). ``extras``: package -> extras requested (default: the bundle's
    manifest.json, else none). ``env``: marker environment (default: TARGET_ENV).
    ``project``: our own requirements, checked as those of the wheels are (default: the
    manifest's ``project_requires``: pyproject.toml's dependencies, less the HTTP side's)."""
    bundle_dir = Path(bundle_dir)
    if machine is None or isinstance(machine, (str, Path)):
        machine = read_machine_packages(machine or MACHINE_PACKAGES)
    machine = {canonicalize_name(k): v for k, v in machine.items()}
    env = {**default_environment(), **TARGET_ENV, **(env or {})}
    if extras is None:
        extras = _manifest(bundle_dir).get("extras", {})
    if project is None:
        project = _manifest(bundle_dir).get("project_requires", [])
    report = Report()
    report.extras = {canonicalize_name(k): {canonicalize_name(e) for e in v} for k, v in extras.items()}

    for path in sorted(bundle_dir.glob("*.whl")):
        try:
            info = read_wheel(path)
        except (ValueError, KeyError, zipfile.BadZipFile, InvalidVersion) as exc:
            report.problems.append(Problem("bad-wheel", path.name, "", str(exc)))
            continue
        if FORBIDDEN.match(info.name):
            report.problems.append(
                Problem("forbidden", info.name, "", f"{path.name}: the machine's own build is used")
            )
        if info.name in report.wheels:
            other = report.wheels[info.name]
            report.problems.append(
                Problem("duplicate", info.name, "", f"{other.path.name} and {path.name}: keep one")
            )
            continue
        report.wheels[info.name] = info

    # Walk the requirements until the requested extras stop growing (a met requirement
    # with extras, ``uvicorn[standard]``, requests them of the package that meets it).
    while True:
        problems: list[Problem] = []
        unverified: list[str] = []
        not_needed: list[str] = []
        requested = {k: set(v) for k, v in report.extras.items()}
        needs = [(info.name, info.requires) for info in report.wheels.values()]
        if project:
            needs.append((PROJECT, project))
        for who, lines in needs:
            for line in lines:
                try:
                    req = Requirement(line)
                except InvalidRequirement as exc:
                    problems.append(Problem("bad-wheel", who, line, str(exc)))
                    continue
                if not _applies(req, requested.get(who, set()), env):
                    not_needed.append(f"{who}: {line}")
                    continue
                dep = canonicalize_name(req.name)
                if dep in report.wheels:
                    have = report.wheels[dep].version
                    if req.specifier and not req.specifier.contains(have, prereleases=True):
                        problems.append(
                            Problem("version", who, line, f"the bundle has {dep} {have}")
                        )
                elif dep in machine:
                    have = machine[dep]
                    if have is None:
                        if req.specifier:
                            unverified.append(f"{who}: {line} (machine: {dep}, version unknown)")
                    elif req.specifier and not req.specifier.contains(have, prereleases=True):
                        problems.append(
                            Problem("version", who, line, f"the machine has {dep} {have}")
                        )
                else:
                    problems.append(
                        Problem("missing", who, line, f"{dep} is neither bundled nor on the machine")
                    )
                    continue
                if req.extras:
                    requested.setdefault(dep, set()).update(canonicalize_name(e) for e in req.extras)
        if requested == report.extras:
            break
        report.extras = requested
    report.problems += problems
    report.unverified = unverified
    report.not_needed = not_needed
    return report


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", nargs="?", default=str(HERE.parent.parent / ".gpu-bundle"))
    ap.add_argument("--machine", default=str(MACHINE_PACKAGES))
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    if not Path(args.bundle).is_dir():
        print(f"no bundle at {args.bundle}: make gpu-bundle builds it")
        return 0
    report = check_bundle(args.bundle, args.machine)
    print(report.format())
    if args.verbose:
        for line in report.unverified:
            print("  unverified:", line)
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
