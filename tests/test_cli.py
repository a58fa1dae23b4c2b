"""The ``raydecode`` command line: help, flag and file errors, generate to JSONL on the
tiny model, and ``serve`` as a real process answering the OpenAI API."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest

from deploy.cli import ENGINE_DEST, _parser, config_docs, engine_kwargs, main
from helpers import free_port

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("command", [[], ["generate"], ["serve"], ["bench"]])
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(command + ["--help"])
    assert exit_.value.code == 0
    assert "usage: raydecode" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["generate", "--max-tokens", "many", "hi"], "invalid int value"),
    (["generate", "--bogus", "hi"], "unrecognized arguments"),
    (["generate"], "no prompts"),
    (["generate", "--input", "/nonexistent.jsonl"], "does not exist"),
    (["generate", "--temperature", "-1", "hi"], "temperature"),
    (["serve", "--port", "http"], "invalid int value"),
    (["serve", "--port", "70000"], "--port must be between 1 and 65535"),
    (["serve", "--port", "0"], "--port must be between 1 and 65535"),
    (["serve", "--chat-template", "/nonexistent.jinja"], "does not exist"),
    (["serve", "--scheduling-policy", "lifo"], "scheduling_policy must be"),
    (["serve", "--max-num-seqs", "0"], "max_num_seqs must be a positive integer"),
    (["serve", "--worker-resources", "{oops"], "--worker-resources: not JSON"),
    (["serve", "--worker-resources", "[1]"], "expected a JSON dict"),
    (["serve", "--logits-processors", "[oops"], "--logits-processors: not JSON"),
    (["serve", "m1", "--model", "m2"], "two models given"),
    (["bench", "nosuchbench"], "unknown benchmark"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_flags_and_files_fail_clearly(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("host, family", [("127.0.0.1", "AF_INET"), ("::1", "AF_INET6")])
def test_serve_checks_its_port_before_starting_anything(host, family, capsys):
    """A free ``--port`` passes and a taken one exits 2 naming it, checked with the
    host's address family (an IPv4 socket refuses "::1")."""
    import socket

    from deploy.cli import _check_port

    try:
        with socket.socket(getattr(socket, family)) as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
    except OSError:
        pytest.skip(f"no {host} here")
    _check_port(_parser(), host, port)  # free: no exit
    with socket.socket(getattr(socket, family)) as taken:
        taken.bind((host, port))
        taken.listen()
        with pytest.raises(SystemExit) as exit_:
            main(["serve", "--host", host, "--port", str(port)])
    assert exit_.value.code == 2
    assert f"--port {port} on {host} cannot be used" in capsys.readouterr().err


def _engine_actions(command: str) -> dict[str, object]:
    sub = next(a for a in _parser()._actions if a.dest == "command").choices[command]
    return {a.dest[len(ENGINE_DEST):]: a for a in sub._actions if a.dest.startswith(ENGINE_DEST)}


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_engine_config_field_is_a_flag_with_its_doc(command):
    """Flags come from EngineConfig itself: a new field without a ``#:`` comment fails here."""
    import msgspec

    from cluster.config import EngineConfig

    docs = config_docs(EngineConfig)
    actions = _engine_actions(command)
    for f in msgspec.structs.fields(EngineConfig):
        assert docs.get(f.name), f"EngineConfig.{f.name} has no #: doc comment"
        assert f.name in actions, f"no flag for EngineConfig.{f.name}"
        assert actions[f.name].help.startswith(docs[f.name].replace("%", "%%")), f.name


def test_engine_flags_take_vllms_names_and_json():
    from cluster.config import EngineConfig

    args = _parser().parse_args([
        "serve", "some/model", "--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
        "--long-prefill-token-threshold", "32", "--block-size", "8", "--max-logprobs", "5", "--seed", "1",
        "--dtype", "float32", "--device", "cpu", "--trust-remote-code", "--scheduling-policy", "priority",
        "--logits-processors", "a:B", "c:D", "--spec-tokens", "2", "-dp", "2", "--kv-cache-memory-bytes", "1000",
        "--worker-resources", '{"gpu_node": 1}', "--ray-init-kwargs", '{"num_cpus": 2}', "--worker-num-cpus", "0.5",
    ])
    kwargs = engine_kwargs(args)
    assert args.model_tag == "some/model"
    assert kwargs == {
        "max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 64, "long_prefill_token_threshold": 32,
        "kv_block_size": 8, "max_logprobs": 5, "seed": 1, "dtype": "float32", "device": "cpu",
        "trust_remote_code": True, "scheduling_policy": "priority", "logits_processors": ["a:B", "c:D"],
        "num_spec_tokens": 2, "num_workers": 2, "kv_cache_memory_bytes": 1000, "worker_resources": {"gpu_node": 1},
        "ray_init_kwargs": {"num_cpus": 2}, "worker_num_cpus": 0.5,
    }
    EngineConfig(**kwargs)  # every value has the field's type
    assert engine_kwargs(_parser().parse_args(["serve"])) == {}  # flags not given keep the config's defaults
    assert engine_kwargs(_parser().parse_args(["serve", "--logits-processors", '["x:Y"]']))["logits_processors"] == ["x:Y"]
    old = engine_kwargs(_parser().parse_args(["serve", "--num-workers", "3", "--kv-block-size", "4", "--no-decodes-first"]))
    assert old == {"num_workers": 3, "kv_block_size": 4, "decodes_first": False}
    spec = '{"method": "draft_model", "model": "self", "quantization": "int4", "num_speculative_tokens": 3}'
    kwargs = engine_kwargs(_parser().parse_args(["serve", "--speculative-config", spec]))
    assert kwargs == {"speculative_config": {"method": "draft_model", "model": "self", "quantization": "int4",
                                             "num_speculative_tokens": 3}}
    assert EngineConfig(**kwargs).spec_tokens == 3
    gen = _parser().parse_args(["generate", "hi", "--seed", "7", "--engine-seed", "9"])
    assert gen.seed == 7 and engine_kwargs(gen) == {"seed": 9}  # generate's --seed samples; the engine's is renamed


def test_bench_finds_its_scripts_by_flag_env_or_checkout(tmp_path, monkeypatch, capfd):
    """``--scripts DIR`` wins over ``$RAYDECODE_BENCH_SCRIPTS``, which wins over this
    checkout's tests/bench; a folder without ``_report.py`` is refused naming where it
    came from. (An installed package with no checkout: tests/test_installed_package.py.)"""
    from deploy.cli import BENCH_SCRIPTS_ENV, bench_folder

    monkeypatch.delenv(BENCH_SCRIPTS_ENV, raising=False)
    here = ROOT / "tests" / "bench"
    assert bench_folder(_parser(), None) == here
    other = tmp_path / "checkout" / "tests" / "bench"
    other.mkdir(parents=True)
    (other / "_report.py").write_text("import sys; print('report of', sys.argv[1])\n")
    (other / "fake.py").write_text(
        "import os, pathlib, sys\n"
        "pathlib.Path(os.environ['RAYDECODE_BENCH_OUT'], 'fake.json').write_text(os.getcwd() + ' ' + sys.argv[-1])\n")
    monkeypatch.setenv(BENCH_SCRIPTS_ENV, str(other))
    assert bench_folder(_parser(), None) == other.resolve()
    assert bench_folder(_parser(), here) == here

    # The named folder's scripts run, from its checkout's root, and its report follows.
    out = tmp_path / "out"
    assert main(["bench", "--quick", "--out", str(out)]) == 0
    assert (out / "fake.json").read_text() == f"{(tmp_path / 'checkout').resolve()} --quick"
    assert f"report of {out.resolve()}" in capfd.readouterr().out
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--scripts", str(here), "fake"])
    assert exit_.value.code == 2 and "unknown benchmark(s) ['fake']" in capfd.readouterr().err

    monkeypatch.setenv(BENCH_SCRIPTS_ENV, str(tmp_path))
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "e2e"])
    assert exit_.value.code == 2
    assert f"${BENCH_SCRIPTS_ENV} {tmp_path}: not raydecode's benchmark folder" in capfd.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--scripts", str(tmp_path / "nowhere")])
    assert exit_.value.code == 2
    assert f"--scripts {tmp_path / 'nowhere'}: not raydecode's benchmark folder" in capfd.readouterr().err


def test_bad_jsonl_names_the_line(tmp_path, capsys):
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "ok"}\n{oops\n')
    with pytest.raises(SystemExit):
        main(["generate", "--input", str(f)])
    assert "in.jsonl:2: not JSON" in capsys.readouterr().err


def test_generate_writes_jsonl(ray_local, tiny_model_path, tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text(json.dumps({"id": "a", "prompt": "the quick brown fox"}) + "\n"
                 + json.dumps({"id": "b", "prompt_token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 3}}) + "\n")
    out = tmp_path / "out.jsonl"
    code = main(["generate", "--model", tiny_model_path, "--input", str(f), "ray schedules actors",
                 "--max-tokens", "6", "--temperature", "0", "--ignore-eos", "-o", str(out), "--no-progress",
                 "--max-model-len", "256"])
    assert code == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows][:2] == ["a", "b"] and len(rows) == 3
    assert [len(r["outputs"][0]["token_ids"]) for r in rows] == [6, 3, 6]
    assert rows[2]["prompt"] == "ray schedules actors"
    assert all(r["outputs"][0]["finish_reason"] == "length" for r in rows)


def _serve(tiny_model_path: str, *extra: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = os.environ | {"RAY_AUTH_MODE": "disabled"}
    # Its output goes to a file: a pipe nobody reads while it runs fills up (Ray forwards
    # every worker's log lines) and the server then blocks on a write, shutdown included.
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "serve", "--model", tiny_model_path, "--port", str(port),
         "--max-model-len", "256", "--served-model-name", "tiny", *extra],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
    )
    proc.log = log  # type: ignore[attr-defined]
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            log.seek(0)
            raise AssertionError(log.read()[-5000:])
        assert time.monotonic() < deadline, "serve did not come up"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            pass
        time.sleep(1)


def _stop(proc: subprocess.Popen, sig: int) -> None:
    proc.send_signal(sig)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()  # reaped: no zombie for the next test to trip over
        log = getattr(proc, "log", None)
        tail = ""
        if log is not None:
            log.seek(0)
            tail = log.read()[-5000:]
        raise AssertionError(f"serve did not stop within 90 s of signal {sig}; its output ends:\n{tail}") from None


def _still_running(procs: list[psutil.Process], timeout: float = 30) -> list[str]:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [_cmdline(p)[:100] for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def _cmdline(p: psutil.Process) -> str:
    """A process's command line; empty for one that is gone or a zombie (a child an
    earlier test left unreaped must not fail this one)."""
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _replica_log(ray_procs: list[psutil.Process], deployment: str) -> str:
    """The Serve log of ``deployment``'s replica, from the session of the Ray whose
    processes are ``ray_procs`` (its GCS names the session's log folder)."""
    (log_dir,) = {arg.split("=", 1)[1] for p in ray_procs if "gcs_server" in _cmdline(p)
                  for arg in p.cmdline() if arg.startswith("--log_dir=")}
    return "".join(f.read_text() for f in Path(log_dir, "serve").glob(f"replica_*_{deployment}_*.log"))


def _aborted(port: int) -> float:
    """Requests the server counts as aborted (``vllm:request_success``, "abort")."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "vllm:request_success"
               for s in f.samples if s.labels.get("finished_reason") == "abort" and s.name.endswith("_total"))


@pytest.mark.parametrize("sig, colocate", [(signal.SIGTERM, True), (signal.SIGINT, False)],
                         ids=["SIGTERM-colocated", "Ctrl-C-separate"])
def test_serve_answers_then_stops_everything_it_started(tiny_model_path, sig, colocate):
    """``raydecode serve`` on its own Ray: SIGTERM (or Ctrl-C) stops it, and with it
    every process it started (GCS, raylet, Serve, workers, the dashboard and runtime-env
    agents). By default the ingress and the engine share one replica; with
    ``--no-colocate`` they are two deployments."""
    proc, port = _serve(tiny_model_path, *([] if colocate else ["--no-colocate"]))
    started = psutil.Process(proc.pid).children(recursive=True)
    assert any("raylet" in _cmdline(p) for p in started)
    try:
        # Direct ingress: the Serve replica itself listens on --port, not Serve's proxy.
        holders = {c.pid for c in psutil.net_connections(kind="tcp")
                   if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
        ingress = "LLMServer" if colocate else "OpenAIIngress"
        assert [_cmdline(psutil.Process(pid)).split()[0] for pid in holders] == [f"ray::ServeReplica:raydecode:{ingress}"]
        replicas = {_cmdline(p).split()[0] for p in started if "ServeReplica" in _cmdline(p)}
        assert replicas == {f"ray::ServeReplica:raydecode:{d}" for d in
                            (["LLMServer"] if colocate else ["OpenAIIngress", "LLMEngine"])}
        if not colocate:
            # Serve's throughput-optimized mode reached the handles: the ingress streams
            # from the engine over gRPC (it had not, while the CLI imported Serve first).
            assert "engine calls over gRPC" in _replica_log(started, "OpenAIIngress")
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert models["data"][0]["id"] == "tiny"
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200
        # A client that leaves mid-stream ends its request (the replica sees the
        # disconnect itself now).
        body = {"prompt": "leave", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= 3:
                    break
        deadline = time.monotonic() + 20
        while _aborted(port) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _aborted(port) == 1
        assert httpx.get(f"http://127.0.0.1:{port}/health").json()["running_requests"] == 0
    finally:
        _stop(proc, sig)
    assert proc.returncode == 0
    assert _still_running(started) == []


def test_serve_on_a_joined_cluster_stops_only_its_own(ray_local, tiny_model_path):
    """With ``--address`` the cluster's own processes live on; only the app goes."""
    cluster_procs = [p for p in psutil.Process().children(recursive=True)
                     if any(name in _cmdline(p) for name in ("raylet", "gcs_server"))]
    assert len(cluster_procs) == 2
    address = ray_local.get_runtime_context().gcs_address
    proc, port = _serve(tiny_model_path, "--address", address)
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200
    finally:
        _stop(proc, signal.SIGTERM)
    assert proc.returncode == 0
    assert all(p.is_running() for p in cluster_procs)
    assert ray_local.cluster_resources().get("CPU") == 4  # the cluster still answers
    from ray import serve
    assert "raydecode" not in serve.status().applications


def test_llm_shutdown_stops_the_ray_it_started(tiny_model_path):
    """``LLM()`` in a process without Ray starts a local Ray; ``shutdown()`` stops all
    of it (checked from a fresh process, since this one already runs Ray)."""
    script = (
        "import json, psutil, sys\n"
        "from cluster import LLM\n"
        f"llm = LLM({tiny_model_path!r}, max_model_len=128, max_num_seqs=2)\n"
        "assert llm.engine.ray.owns\n"
        "kids = psutil.Process().children(recursive=True)\n"
        "out = llm.generate(['hi'], use_tqdm=False)\n"
        "llm.shutdown()\n"
        "gone, alive = psutil.wait_procs(kids, timeout=30)\n"
        "print(json.dumps({'started': len(kids), 'alive': [' '.join(p.cmdline())[:80] for p in alive]}))\n"
    )
    env = os.environ | {"RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["started"] >= 4 and report["alive"] == []


def test_the_configuration_reference_lists_every_field():
    """docs/usage.md's table of settings has a row for every EngineConfig field (a new
    setting is documented where users look for it, not only in --help)."""
    import msgspec

    from cluster.config import EngineConfig

    text = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()
    reference = text[text.index("## Configuration reference"):]
    missing = [f.name for f in msgspec.structs.fields(EngineConfig) if f"| `{f.name}` |" not in reference]
    assert not missing, f"docs/usage.md's configuration reference lacks {missing}"


@pytest.mark.parametrize("argv", [
    ["serve", "m1", "--model", "m2"],  # refused before Serve's variables are set
    ["serve", "--num-replicas", "2", "--min-replicas", "1"],  # refused after: they are undone
])
def test_a_refused_serve_leaves_the_environment_as_it_was(argv, monkeypatch, capsys):
    """``raydecode serve`` sets Serve's variables (direct ingress on its port among them)
    in its own environment before Ray starts. Refused, it must leave none behind: a Ray
    started later in the same process (as every later test's) would otherwise deal its
    ingress replicas that one port, and a second ingress replica could get none."""
    from deploy.cli import _free_port

    monkeypatch.delenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", raising=False)  # as a plain shell has it
    before = dict(os.environ)
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--port", str(_free_port("127.0.0.1")), "--host", "127.0.0.1"])
    assert exit_.value.code == 2, capsys.readouterr().err
    assert dict(os.environ) == before
