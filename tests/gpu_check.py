"""The GPU machine's check of raydecode (`make gpu-check`; there: `python3 tests/gpu_check.py`).

Run from the repository root with the machine's ``python3`` (CPython 3.12, its CUDA torch),
the wheel bundle ``.gpu-bundle/`` (tests/gpu/bundle.py builds it) carried beside the
checkout. Stages, in this order (``--only STAGE`` runs one alone):

  bundle  the bundle's static completeness check (tests/gpu/bundle_check.py), its install
          into a temporary target (pip --no-index --no-deps), then imports of ray, msgspec,
          llguidance, cluster, worker, sampler with their versions, torch.cuda.is_available()
          and the GPU's name, and a Ray start with one GPU task;
  tests   ``pytest -m cuda -v`` over the test files that mark a test ``cuda`` (junit XML
          kept; each failure's traceback printed as it happens), a per-test timeout
          where pytest-timeout is installed, the whole bounded;
  bench   ``tests/bench/gpu.py --quick --profile`` where that file exists (``--bench-args``
          sets its arguments).

Every stage but the static check needs the bundle installed: after the install the script
re-executes itself with PYTHONPATH = <the target>:<repo root>. The whole default run is
bounded by ``--budget`` seconds (default 300: about 4 minutes plus a fresh Ray start).

Results go, as they come, to $RAYDECODE_GPU_RESULTS (default: $OUT when set, else
gpu-results/): a log per stage, the junit XML, summary.md and summary.json (appended after
each stage), so that a run cut short still leaves what it measured. Six files in all: the
device tool brings back at most eight. A short table (stage, status, seconds) comes last.

``--rehearse`` runs every stage without CUDA too, to try the flow on a CPU machine (with
a CPython 3.12 that has the machine's packages). Without CUDA (this machine, CI) it runs the static check, says there is no CUDA and exits
0 (1 if the static check found a problem); without a bundle it says so and still exits 0.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "gpu"))

STAGES = ("bundle", "tests", "bench")
BENCH = REPO / "tests" / "bench" / "gpu.py"
CUDA_MARK = re.compile(r"mark\.cuda\b")

#: Set for every child: the machine has no network (no usage report, no hub look-ups).
CHILD_ENV = {
    "PYTHONUNBUFFERED": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}

PROBE = r"""
import importlib, json, os, sys, time
t0 = time.monotonic()
site = os.environ.get("RAYDECODE_GPU_SITE", "")
out = {"python": sys.version.split()[0]}
for name in ["ray", "msgspec", "llguidance", "cluster", "worker", "sampler",
             "torch", "transformers", "numpy"]:
    mod = importlib.import_module(name)
    where = os.path.dirname(getattr(mod, "__file__", None) or "?")
    src = ("bundle" if site and where.startswith(site) else
           "repo" if os.path.dirname(where) == os.getcwd() else "machine")
    out[name] = f"{getattr(mod, '__version__', '-')} ({src})"
    print(f"  import {name:13} {out[name]}", flush=True)
import torch
out["cuda_available"] = torch.cuda.is_available()
out["gpu"] = torch.cuda.get_device_name(0) if out["cuda_available"] else None
print(f"  torch.cuda.is_available() = {out['cuda_available']}, GPU: {out['gpu']}", flush=True)
print(f"  imports took {time.monotonic() - t0:.1f} s; starting Ray...", flush=True)
import ray
t1 = time.monotonic()
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
out["ray_gpus"] = ray.cluster_resources().get("GPU", 0)

@ray.remote(num_gpus=1 if out["ray_gpus"] else 0)
def on_worker():
    import torch, worker, cluster, sampler  # noqa: F401  (the worker's own imports)
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None

out["ray_task_gpu"] = ray.get(on_worker.remote(), timeout=60)
ray.shutdown()
out["ray_seconds"] = round(time.monotonic() - t1, 1)
print(f"  Ray: {out['ray_gpus']:g} GPU(s) seen, a task on a worker saw {out['ray_task_gpu']!r} "
      f"({out['ray_seconds']} s start to shutdown)", flush=True)
print("PROBE " + json.dumps(out), flush=True)
ok = out["cuda_available"] and out["ray_gpus"] >= 1 and out["ray_task_gpu"]
if os.environ.get("RAYDECODE_GPU_REHEARSE") == "1":
    ok = True  # a rehearsal on a CPU machine: the imports and the Ray task are what it checks
sys.exit(0 if ok else 3)
"""


def results_dir() -> Path:
    env = os.environ.get("RAYDECODE_GPU_RESULTS") or os.environ.get("OUT")
    return Path(env) if env else REPO / "gpu-results"


class Summary:
    """summary.json (every run, each with its stages, rewritten after each stage) and
    summary.md (a line appended after each stage)."""

    def __init__(self, folder: Path, run_id: str, argv: list[str]):
        self.folder = folder
        self.run_id = run_id
        self.json_path = folder / "summary.json"
        self.md_path = folder / "summary.md"
        data = self._load()
        if not any(r["run_id"] == run_id for r in data["runs"]):
            data["runs"].append({
                "run_id": run_id, "argv": argv, "host": platform.node(),
                "python": sys.version.split()[0], "stages": [],
            })
            self._save(data)
            with self.md_path.open("a") as f:
                f.write(f"\n## gpu_check run {run_id} ({platform.node()}, Python "
                        f"{sys.version.split()[0]})\n\n| stage | status | seconds | detail |\n"
                        "| --- | --- | --- | --- |\n")

    def _load(self) -> dict:
        try:
            return json.loads(self.json_path.read_text())
        except (OSError, ValueError):
            return {"runs": []}

    def _save(self, data: dict) -> None:
        tmp = self.json_path.with_suffix(".json.part")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(self.json_path)

    def add(self, stage: str, status: str, seconds: float, detail: str = "", **extra) -> None:
        data = self._load()
        run = next(r for r in data["runs"] if r["run_id"] == self.run_id)
        run["stages"].append({"stage": stage, "status": status, "seconds": round(seconds, 1),
                              "detail": detail, **extra})
        self._save(data)
        with self.md_path.open("a") as f:
            f.write(f"| {stage} | {status} | {seconds:.1f} | {detail.replace('|', '/')} |\n")
        print(f"[gpu_check] {stage}: {status} ({seconds:.1f} s) {detail}", flush=True)

    def stages(self) -> list[dict]:
        run = next((r for r in self._load()["runs"] if r["run_id"] == self.run_id), None)
        return run["stages"] if run else []

    def table(self) -> str:
        rows = [("stage", "status", "seconds", "detail")] + [
            (s["stage"], s["status"], f"{s['seconds']:.1f}", s["detail"][:70]) for s in self.stages()
        ]
        w = [max(len(r[i]) for r in rows) for i in range(3)]
        return "\n".join(f"{r[0]:{w[0]}}  {r[1]:{w[1]}}  {r[2]:>{w[2]}}  {r[3]}" for r in rows)

    def failed(self) -> bool:
        return any(s["status"] in ("fail", "timeout") for s in self.stages())


def tee(cmd: list[str], log: Path, timeout: float, env: dict | None = None) -> tuple[int | None, float, str]:
    """Run ``cmd`` (its own process group), its output to the console and appended to
    ``log``; killed (the group) after ``timeout`` s. Returns (rc or None on timeout,
    seconds, the output)."""
    t0 = time.monotonic()
    lines: list[str] = []
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", bufsize=1, start_new_session=True)

        def pump():
            for line in proc.stdout:
                lines.append(line)
                sys.stdout.write(line)
                sys.stdout.flush()
                f.write(line)
                f.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc: int | None = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            rc = None
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=10)
                    break
                except subprocess.TimeoutExpired:
                    continue
        # Daemons the command left (Ray's) may hold the pipe open: do not wait on them.
        reader.join(timeout=5)
        if rc is None:
            f.write(f"\n[gpu_check] killed after {timeout:.0f} s\n")
    return rc, time.monotonic() - t0, "".join(lines)


class Check:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.stages = [args.only] if args.only else list(STAGES)
        self.bundle = Path(args.bundle)
        self.out = Path(args.results) if args.results else results_dir()
        self.out.mkdir(parents=True, exist_ok=True)
        self.run_id = args.run_id or _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        self.deadline = (args.deadline if args.deadline else time.time() + args.budget)
        self.summary = Summary(self.out, self.run_id, sys.argv[1:])

    def left(self) -> float:
        return self.deadline - time.time()

    def env(self) -> dict:
        env = {**os.environ, **CHILD_ENV, "RAYDECODE_GPU_RESULTS": str(self.out)}
        paths = ([self.args.child] if self.args.child else []) + [str(REPO)]
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        if self.args.child:
            env["RAYDECODE_GPU_SITE"] = self.args.child
        if self.args.rehearse:
            env["RAYDECODE_GPU_REHEARSE"] = "1"
        return env

    # -- the parent: static check, CUDA or not, install, re-exec -------------------------

    def static_check(self) -> None:
        t0 = time.monotonic()
        log = self.out / "bundle.log"
        if not self.bundle.is_dir() or not list(self.bundle.glob("*.whl")):
            msg = f"no bundle: make gpu-bundle builds it ({self.bundle} has no wheels)"
            print(msg, flush=True)
            self.summary.add("static", "skip", time.monotonic() - t0, msg)
            return
        try:
            from bundle_check import check_bundle
        except ImportError as exc:  # packaging missing
            self.summary.add("static", "fail", time.monotonic() - t0, f"cannot import the check: {exc}")
            return
        report = check_bundle(self.bundle)
        text = report.format()
        print(text, flush=True)
        with log.open("a") as f:
            f.write(text + "\n")
            f.writelines(f"  unverified: {u}\n" for u in report.unverified)
        n = len(report.wheels)
        size = sum(w.path.stat().st_size for w in report.wheels.values()) / 2**20
        detail = f"{n} wheels, {size:.1f} MiB, {len(report.problems)} problems"
        self.summary.add("static", "pass" if report.ok else "fail", time.monotonic() - t0, detail)

    def cuda(self) -> tuple[bool, str]:
        try:
            import torch
        except Exception as exc:  # noqa: BLE001  (any reason torch cannot load)
            return False, f"torch does not import ({type(exc).__name__}: {exc})"
        if not torch.cuda.is_available():
            return False, f"torch {torch.__version__}: torch.cuda.is_available() is false"
        return True, f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}"

    def install(self) -> str | None:
        site = tempfile.mkdtemp(prefix="raydecode-site-")
        wheels = sorted(str(p) for p in self.bundle.glob("*.whl"))
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--disable-pip-version-check", "--target", site, *wheels]
        rc, secs, _ = tee(cmd, self.out / "bundle.log", min(180, max(self.left(), 30)))
        ok = rc == 0
        self.summary.add("install", "pass" if ok else ("timeout" if rc is None else "fail"), secs,
                         f"{len(wheels)} wheels into {site}" if ok else f"pip rc={rc}")
        return site if ok else None

    def run_parent(self) -> int:
        print(f"[gpu_check] stages: {', '.join(self.stages)}; results -> {self.out}", flush=True)
        has_cuda, why = self.cuda()
        if "bundle" in self.stages or not has_cuda:
            self.static_check()
        if not has_cuda and self.args.rehearse:
            print(f"[gpu_check] no CUDA here ({why}): a rehearsal, the GPU stages run anyway", flush=True)
        elif not has_cuda:
            msg = f"no CUDA here ({why}): the install, imports, tests and bench stages need a GPU"
            print(msg, flush=True)
            self.summary.add("cuda", "skip", 0.0, msg)
            return self.finish()
        else:
            print(f"[gpu_check] CUDA: {why}", flush=True)
        if self.bundle.is_dir() and list(self.bundle.glob("*.whl")):
            site = self.install()
            if site is None:
                return self.finish()
            argv = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:],
                    "--child", site, "--run-id", self.run_id, "--deadline", str(self.deadline),
                    "--results", str(self.out)]
            self.args.child = site
            sys.stdout.flush()
            os.execve(sys.executable, argv, self.env())
        print("[gpu_check] no bundle: running with what the machine has", flush=True)
        return self.run_child()

    # -- the child: imports, tests, bench -------------------------------------------------

    def stage_imports(self) -> None:
        secs_left = min(self.args.probe_timeout, self.left())
        rc, secs, text = tee([sys.executable, "-c", PROBE], self.out / "bundle.log", secs_left, self.env())
        found = re.search(r"^PROBE (.*)$", text, re.M)
        probe = json.loads(found.group(1)) if found else {}
        if rc == 0:
            detail = (f"ray {probe['ray'].split()[0]}, GPU {probe['gpu']}, "
                      f"Ray start+task {probe['ray_seconds']} s")
            self.summary.add("imports", "pass", secs, detail, probe=probe)
        else:
            tail = [line for line in text.strip().splitlines() if line.strip()][-1:] or [""]
            self.summary.add("imports", "timeout" if rc is None else "fail", secs,
                             f"rc={rc}: {tail[0][:150]}", probe=probe)

    def cuda_test_files(self) -> list[str]:
        files = []
        for path in sorted((REPO / "tests").rglob("test_*.py")):
            try:
                if CUDA_MARK.search(path.read_text(errors="replace")):
                    files.append(str(path.relative_to(REPO)))
            except OSError:
                continue
        return files

    def stage_tests(self) -> None:
        files = ["tests"] if self.args.all_files else self.cuda_test_files()
        if not files:
            self.summary.add("tests", "skip", 0.0, "no test file marks a test cuda (pytest.mark.cuda)")
            return
        budget = min(self.args.tests_timeout, self.left() - 5)
        if budget < 20:
            self.summary.add("tests", "skip", 0.0, f"no time left ({self.left():.0f} s of the budget)")
            return
        junit = self.out / "tests-junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-v", "--tb=short", "-p", "no:cacheprovider",
               "-p", "report_at_once", f"--junitxml={junit}", "--continue-on-collection-errors"]
        import importlib.util

        if importlib.util.find_spec("pytest_timeout") is not None:
            cmd.append(f"--timeout={self.args.per_test_timeout}")
        env = self.env()  # tests/gpu on the path: its report_at_once plugin
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(REPO / "tests" / "gpu")])
        rc, secs, text = tee(cmd + files, self.out / "tests.log", budget, env)
        counts = junit_counts(junit)
        detail = (", ".join(f"{v} {k}" for k, v in counts.items()) if counts else "no junit") + \
            f"; {len(files)} file(s)"
        status = {0: "pass", 5: "skip"}.get(rc, "timeout" if rc is None else "fail")
        if rc == 5:
            detail = "no test marked cuda was collected; " + detail
        self.summary.add("tests", status, secs, f"pytest rc={rc}: {detail}")

    def stage_bench(self) -> None:
        if not BENCH.exists():
            self.summary.add("bench", "skip", 0.0, f"{BENCH.relative_to(REPO)} is absent (not written yet)")
            return
        budget = min(self.args.bench_timeout, self.left())
        if budget < 20:
            self.summary.add("bench", "skip", 0.0, f"no time left ({self.left():.0f} s of the budget)")
            return
        rc, secs, text = tee([sys.executable, str(BENCH.relative_to(REPO)), *self.args.bench_args.split()],
                             self.out / "bench.log", budget, self.env())
        tail = [line for line in text.strip().splitlines() if line.strip()][-1:] or [""]
        self.summary.add("bench", "pass" if rc == 0 else ("timeout" if rc is None else "fail"), secs,
                         f"rc={rc}: {tail[0][:150]}")

    def run_child(self) -> int:
        try:
            for stage in self.stages:
                if stage == "bundle":
                    self.stage_imports()
                elif stage == "tests":
                    self.stage_tests()
                elif stage == "bench":
                    self.stage_bench()
        finally:
            if self.args.child and Path(self.args.child).name.startswith("raydecode-site-"):
                shutil.rmtree(self.args.child, ignore_errors=True)
        return self.finish()

    def finish(self) -> int:
        print("\n" + self.summary.table(), flush=True)
        print(f"(results in {self.out})", flush=True)
        return 1 if self.summary.failed() else 0


def junit_counts(path: Path) -> dict[str, int]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    out = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for k in out:
            out[k] += int(s.get(k, 0))
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--only", choices=STAGES, help="run this stage alone")
    ap.add_argument("--bundle", default=str(REPO / ".gpu-bundle"), help="the wheels (default .gpu-bundle/)")
    ap.add_argument("--results", help="results folder (default $RAYDECODE_GPU_RESULTS, $OUT, gpu-results/)")
    ap.add_argument("--budget", type=float, default=300, help="seconds for the whole run (default 300)")
    ap.add_argument("--probe-timeout", type=float, default=120)
    ap.add_argument("--tests-timeout", type=float, default=170)
    ap.add_argument("--per-test-timeout", type=int, default=90)
    ap.add_argument("--bench-timeout", type=float, default=100)
    ap.add_argument("--bench-args", default="--quick --profile",
                    help="arguments of tests/bench/gpu.py (default: --quick --profile)")
    ap.add_argument("--all-files", action="store_true",
                    help="collect all of tests/ (default: only the files that mark a test cuda)")
    ap.add_argument("--rehearse", action="store_true",
                    help="run the GPU stages even without CUDA (to try the flow on a CPU machine)")
    # Internal: set by the re-execution after the install.
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--run-id", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.chdir(REPO)
    check = Check(args)
    return check.run_child() if args.child else check.run_parent()


if __name__ == "__main__":
    raise SystemExit(main())
