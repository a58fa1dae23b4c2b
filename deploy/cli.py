"""The ``raydecode`` command: ``generate``, ``serve`` and ``bench``. Each subcommand is
a function that adds its parser (``_generate_parser``, ``_serve_parser``,
``_bench_parser``) and one that runs it (``_generate``, ``_serve``, ``_bench``), beside
its own helpers; ``main`` parses and dispatches. The ``EngineConfig`` flags that
``generate`` and ``serve`` share are ``deploy.engine_flags``; the environment ``serve``
gives Ray Serve is ``deploy.serve_env`` (both re-exported here, as before).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from deploy import run_batch
from deploy.engine_flags import ENGINE_DEST, FLAG_NAMES, add_engine_flags, config_docs, engine_kwargs, json_of
from deploy.serve_env import direct_ingress_env, quiet_serve_env, serving_priority_env, throughput_serve_env

#: Names kept importable from here: the command's own, and those that moved to
#: ``deploy.engine_flags`` and ``deploy.serve_env``.
__all__ = [
    "BENCH_HELP", "BENCH_SCRIPTS_ENV", "ENGINE_DEST", "FLAG_NAMES", "GENERATE_HELP", "bench_folder", "config_docs",
    "direct_ingress_env", "engine_kwargs", "main", "quiet_serve_env", "serving_priority_env", "throughput_serve_env",
]

GENERATE_HELP = """Prompts come from the arguments or from a JSONL file (--input), one object per
line: {"prompt": "..."}, {"prompt_token_ids": [...]} or {"messages": [...]}
(rendered with the chat template), optionally with "id" and "sampling_params"
(SamplingParams fields overriding the flags). Writes one JSON object per line."""


#: Names the benchmark folder where ``--scripts`` does not.
BENCH_SCRIPTS_ENV = "RAYDECODE_BENCH_SCRIPTS"

BENCH_HELP = f"""Runs the benchmark scripts of a raydecode source checkout (tests/bench), then
builds one results table. They are development tools, not part of the installed
package: they use the test helpers and the dev extras, and import the raydecode of
the checkout they are in (not an installed one). From a checkout they are found
next to the package; elsewhere name them: --scripts CHECKOUT/tests/bench or
${BENCH_SCRIPTS_ENV}."""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="raydecode", description="Ray-based LLM serving: generate, serve, bench.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="{generate,run-batch,serve,bench}")
    _generate_parser(sub)
    run_batch.add_parser(sub)
    _serve_parser(sub)
    _bench_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    args = ap.parse_args(argv)
    if args.command == "generate":
        return _generate(ap, args)
    if args.command == "run-batch":
        return run_batch.run(ap, args)
    if args.command == "serve":
        return _serve(ap, args)
    return _bench(ap, args)


# -- generate -------------------------------------------------------------------------


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    """``raydecode generate``: prompts (arguments or JSONL), sampling flags, engine flags."""
    gen = sub.add_parser("generate", help="run prompts to completion and write JSONL",
                         description=GENERATE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    gen.add_argument("prompts", nargs="*", help="prompt texts")
    gen.add_argument("-i", "--input", type=Path, help="JSONL file of prompts")
    gen.add_argument("-o", "--output", default="-", help="output JSONL file (default: stdout)")
    gen.add_argument("--chat", action="store_true", help="treat argument prompts as user messages (chat template)")
    gen.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    s = gen.add_argument_group("sampling (SamplingParams)")
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--temperature", type=float, default=1.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("-n", type=int, default=1, help="samples per prompt")
    s.add_argument("--logprobs", type=int, default=None, help="top logprobs per token")
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true")
    add_engine_flags(gen, taken={"--seed"})


def _generate(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Runs the prompts to completion on an ``LLM`` and writes one JSON object per line."""
    from sampler.params import SamplingParams

    items = _read_jsonl(ap, args.input) if args.input else []
    for text in args.prompts:
        items.append({"messages": [{"role": "user", "content": text}]} if args.chat else {"prompt": text})
    if not items:
        ap.error("no prompts: give them as arguments or with --input FILE.jsonl")
    try:
        base = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            min_p=args.min_p, seed=args.seed, n=args.n, logprobs=args.logprobs, stop=args.stop,
            ignore_eos=args.ignore_eos,
        )
        params = [base.clone(**item.get("sampling_params", {})) for item in items]
    except (ValueError, TypeError) as exc:
        ap.error(f"sampling parameters: {exc}")

    from cluster.inputs import render_chat
    from cluster.llm import LLM

    llm = _llm(LLM, ap, args)
    try:
        prompts = []
        for n, item in enumerate(items, start=1):
            if "messages" in item:
                try:
                    prompts.append(render_chat(item["messages"], llm.tokenizer))
                except ValueError as exc:
                    ap.error(f"prompt {n}: {exc}")
            else:
                prompts.append({k: item[k] for k in ("prompt", "prompt_token_ids") if k in item})
        try:
            outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
        except ValueError as exc:
            ap.error(str(exc))
    finally:
        llm.shutdown()
    out = sys.stdout if args.output == "-" else open(args.output, "w")
    try:
        for item, o in zip(items, outputs):
            out.write(json.dumps({
                "id": item.get("id", o.request_id),
                "prompt": o.prompt,
                "outputs": [
                    {"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                     "stop_reason": c.stop_reason, "cumulative_logprob": c.cumulative_logprob}
                    for c in o.outputs
                ],
                "num_prompt_tokens": len(o.prompt_token_ids),
                "time_to_first_token_s": o.metrics.time_to_first_token,
            }) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    return 0


def _read_jsonl(ap: argparse.ArgumentParser, path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        ap.error(f"input file {path} does not exist")
    items = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            ap.error(f"{path}:{n}: not JSON ({exc.msg})")
        if not isinstance(item, dict) or not ({"prompt", "prompt_token_ids", "messages"} & set(item)):
            ap.error(f"{path}:{n}: expected an object with 'prompt', 'prompt_token_ids' or 'messages'")
        items.append(item)
    return items


def _llm(cls: Any, ap: argparse.ArgumentParser, args: argparse.Namespace) -> Any:
    kwargs = engine_kwargs(args)
    if kwargs.get("address") is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local Ray
    model = kwargs.pop("model", None)
    try:
        return cls(model, **kwargs)
    except (ValueError, TypeError) as exc:  # EngineConfig refused a value
        ap.error(f"engine configuration: {exc}")


# -- serve ----------------------------------------------------------------------------


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    """``raydecode serve``: the endpoint, tools and structured outputs, the engine replicas, engine flags."""
    srv = sub.add_parser("serve", help="run the OpenAI-compatible endpoint (Ray Serve) until interrupted")
    srv.add_argument("model_tag", nargs="?", default=None, help="the model, as vLLM's `vllm serve MODEL` (or --model)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--direct-ingress", action=argparse.BooleanOptionalAction, default=True,
                     help="the Serve replica answers HTTP on --port itself (Ray Serve's direct ingress): no hop "
                          "through Serve's proxy for every streamed chunk. Only where serve starts its own Ray "
                          "(no --address); a joined cluster keeps the proxies it was started with")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    srv.add_argument("--served-model-name", default=None)
    srv.add_argument("--chat-template", type=Path, default=None, help="a Jinja chat template file")
    srv.add_argument("--request-timeline", type=Path, default=None, metavar="PATH",
                     help="append one JSON line per request and stage (ingress, engine) to PATH: where its time to "
                          "first token went (send an X-Request-Id to join the stages), and one per engine step; "
                          "off by default")
    t = srv.add_argument_group("tools and structured outputs (vLLM's flags)")
    t.add_argument("--tool-call-parser", choices=_tool_parser_names(), default=None,
                   help="the model's tool call format, parsed for tool_choice \"auto\": hermes (Hermes 2 Pro / 3, "
                        "Qwen 2.5 / 3, <tool_call>{json}</tool_call>), llama3_json (Llama 3.1-3.3 JSON calls), "
                        "pythonic / llama4_pythonic (Llama 3.2 / 4: [f(a=1)]), mistral ([TOOL_CALLS]), "
                        "qwen3_xml / qwen3_coder (Qwen3-Coder's <function=...> XML), deepseek_v3, granite, "
                        "internlm, openai (gpt-oss harmony)")
    t.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="allow tool_choice \"auto\" (the default when a request has tools); needs --tool-call-parser")
    t.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="tool_choice \"none\": leave the tools out of the prompt")
    t.add_argument("--max-tools", type=int, default=None, help="tools one request may carry (default: 128)")
    t.add_argument("--structured-outputs-config", type=json_of(dict), default=None, metavar="JSON",
                   help='defaults for JSON constraints: {"disable_any_whitespace": true, '
                        '"disable_additional_properties": true}')
    t.add_argument("--enable-responses-store", action="store_true",
                   help="keep Responses API responses (previous_response_id, GET /v1/responses/{id}) in the "
                        "ingress's memory; off by default, as vLLM's VLLM_ENABLE_RESPONSES_API_STORE")
    t.add_argument("--responses-store-max-entries", type=int, default=None,
                   help="responses the store keeps, the oldest dropped first (default 10000)")
    t.add_argument("--responses-store-max-age-s", type=float, default=None,
                   help="seconds a stored response is kept (default 3600)")
    lo = srv.add_argument_group("LoRA adapters (vLLM's flags; with --enable-lora)")
    lo.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                    help="adapters served from the start, each a model of its own: name=path, or JSON "
                         '\'{"name": ..., "path": ..., "base_model_name": ...}\'')
    lo.add_argument("--allow-runtime-lora-updating", action="store_true",
                    help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also on with "
                         "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)")
    r = srv.add_argument_group("engine replicas: how many, how they scale, how they drain (Serve's settings)")
    r.add_argument("--num-replicas", type=int, default=None, help="fixed engine replicas (default 1)")
    r.add_argument("--min-replicas", type=int, default=None,
                   help="autoscale the engine replicas between --min-replicas and --max-replicas")
    r.add_argument("--max-replicas", type=int, default=None)
    r.add_argument("--target-ongoing-requests", type=float, default=None,
                   help="requests in flight per replica the autoscaler aims for (Serve's default: 2)")
    r.add_argument("--autoscaling-config", type=json_of(dict), default=None, metavar="JSON",
                   help="Serve's whole autoscaling_config, e.g. '{\"min_replicas\": 1, \"max_replicas\": 4, "
                        "\"upscale_delay_s\": 5}' (the flags above override its keys)")
    r.add_argument("--graceful-shutdown-timeout-s", type=float, default=None,
                   help="a replica leaving finishes its in-flight requests for up to this long (default 60)")
    r.add_argument("--max-ongoing-requests", type=int, default=None, help="per replica, in the engine at once")
    r.add_argument("--max-queued-requests", type=int, default=None, help="waiting for a replica; beyond: 503")
    r.add_argument("--request-router", choices=("prefix_aware", "power_of_two"), default=None,
                   help="how the ingress picks a replica: prefix_aware (to the one that cached the prompt's prefix, "
                        "within a load-imbalance guard) or power_of_two (Serve's); default: prefix_aware when the "
                        "engine caches prefixes")
    r.add_argument("--request-router-kwargs", type=json_of(dict), default=None, metavar="JSON",
                   help='the prefix-aware router\'s settings, e.g. \'{"imbalanced_threshold": 16}\' (requests a '
                        "replica may have in flight beyond the least busy one and still get its prefixes; default 8)")
    r.add_argument("--colocate", action=argparse.BooleanOptionalAction, default=None,
                   help="the HTTP ingress and the engine in one replica: no router, no gRPC hop and one process "
                        "fewer; on by default with one engine replica and no --request-router*, refused with more. "
                        "While that replica is replaced (it crashed) nothing answers HTTP; with --no-colocate the "
                        "ingress answers 503")
    add_engine_flags(srv)


def _serve(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Runs the Serve app in the foreground until interrupted (Ctrl-C, SIGTERM)."""
    if args.chat_template is not None and not args.chat_template.is_file():
        ap.error(f"chat template {args.chat_template} does not exist")
    engine = engine_kwargs(args)
    address = engine.pop("address", None)  # the replica runs inside that cluster already
    if args.model_tag is not None:
        if engine.get("model") not in (None, args.model_tag):
            ap.error(f"two models given: {args.model_tag} and --model {engine['model']}")
        engine["model"] = args.model_tag
    try:
        from cluster.config import EngineConfig

        EngineConfig(**engine)  # refuse bad values here, not in a replica
    except (ValueError, TypeError) as exc:
        ap.error(f"engine configuration: {exc}")
    proxy_port = args.port
    # Serve reads these when it is imported (its handles take their transport from
    # them: gRPC in the throughput-optimized mode) and its processes when Ray starts:
    # so before anything below imports Serve.
    with _environment_restored_on_refusal():
        if address is None:
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            _check_port(ap, args.host, args.port)
            for key, value in (quiet_serve_env() | throughput_serve_env(args.direct_ingress)
                               | serving_priority_env()).items():
                os.environ.setdefault(key, value)  # read by Serve's processes: before Ray starts
            if args.direct_ingress:
                # Read by Serve's controller and replica processes, which inherit the
                # environment of the Ray this process starts.
                os.environ.update(direct_ingress_env(args.port))
                proxy_port = _free_port(args.host)  # the head proxy Serve keeps as a fallback
        api = _api_args(ap, args) | _replica_args(ap, args)  # these import Serve: after its variables
    from ray import serve

    from cluster.ray_session import RaySession
    from deploy.serve import build_app

    app = build_app({
        "model": engine.pop("model", None), "num_workers": engine.pop("num_workers", 1),
        "served_model_name": args.served_model_name, "api_key": args.api_key, "engine": engine,
        "chat_template": args.chat_template.read_text() if args.chat_template else None, **api,
        "request_timeline": str(args.request_timeline.resolve()) if args.request_timeline else None,
    })
    session = RaySession.connect(address)
    # SIGTERM (a service manager, a container stop) ends the server like Ctrl-C does.
    # Set after Ray starts: Ray's core installs its own SIGTERM handler, which aborts.
    signal.signal(signal.SIGTERM, _interrupt)
    # Ctrl-C (SIGINT) stops it too, even when it was started with SIGINT ignored (a
    # non-interactive shell's background job inherits that, and Python then keeps it).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from ray.serve.context import _get_global_client

    started_serve = _get_global_client(raise_if_no_controller_running=False) is None
    try:  # Ctrl-C at any point (even while starting) shuts Serve down cleanly
        serve.start(http_options={"host": args.host, "port": proxy_port})
        serve.run(app, name="raydecode", route_prefix="/")
        print(f"raydecode: serving the OpenAI API at http://{args.host}:{args.port}/v1 (Ctrl-C stops)", flush=True)
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            # What we started goes, nothing else: Serve itself if it was not running
            # before, else only our application; the session then stops Ray (and reaps
            # every process it started) only if it started Ray.
            if started_serve:
                serve.shutdown()
            else:
                serve.delete("raydecode")
        except Exception:
            pass
        session.close()
    return 0


def _tool_parser_names() -> list[str]:
    from deploy.openai.tool_parser_names import TOOL_PARSERS

    return sorted(TOOL_PARSERS)


def _api_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """The tools and structured-outputs part of ``ServerArgs`` (bad values exit 2)."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        ap.error("--enable-auto-tool-choice requires --tool-call-parser")
    if args.max_tools is not None and args.max_tools < 1:
        ap.error(f"--max-tools must be at least 1, got {args.max_tools}")
    out: dict[str, Any] = {"tool_call_parser": args.tool_call_parser,
                           "enable_auto_tool_choice": args.enable_auto_tool_choice,
                           "exclude_tools_when_tool_choice_none": args.exclude_tools_when_tool_choice_none}
    if args.max_tools is not None:
        out["max_tools"] = args.max_tools
    out["enable_responses_store"] = args.enable_responses_store
    for name in ("responses_store_max_entries", "responses_store_max_age_s"):
        value = getattr(args, name)
        if value is not None:
            if value <= 0:
                ap.error(f"--{name.replace('_', '-')} must be above 0, got {value}")
            out[name] = value
    if args.lora_modules:
        from deploy.lora_adapters import parse_lora_module

        try:
            out["lora_modules"] = [parse_lora_module(m) for m in args.lora_modules]
        except ValueError as exc:
            ap.error(f"--lora-modules: {exc}")
    out["allow_runtime_lora_updating"] = args.allow_runtime_lora_updating
    if args.structured_outputs_config is not None:
        from pydantic import ValidationError

        from deploy.server_args import StructuredOutputsConfig

        try:
            StructuredOutputsConfig.model_validate(args.structured_outputs_config)
        except ValidationError as exc:
            ap.error(f"--structured-outputs-config: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}")
        out["structured_outputs_config"] = args.structured_outputs_config
    return out


def _replica_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """The replica part of ``ServerArgs`` (bad values exit 2, naming the flag)."""
    out: dict[str, Any] = {}
    scaling = dict(args.autoscaling_config or {})
    for flag in ("min_replicas", "max_replicas", "target_ongoing_requests"):
        if getattr(args, flag) is not None:
            scaling[flag] = getattr(args, flag)
    if scaling:
        if args.num_replicas is not None:
            ap.error("--num-replicas fixes the replicas; --min-replicas/--max-replicas/--autoscaling-config scale "
                     "them: give one or the other")
        out["autoscaling_config"] = scaling
    elif args.num_replicas is not None:
        out["num_replicas"] = args.num_replicas
    for flag in ("graceful_shutdown_timeout_s", "max_ongoing_requests", "max_queued_requests", "request_router",
                 "request_router_kwargs"):
        if getattr(args, flag) is not None:
            out[flag] = getattr(args, flag)
    # By default, one engine replica with no router asked for shares the ingress's replica.
    out["colocate"] = args.colocate if args.colocate is not None else (
        "autoscaling_config" not in out and out.get("num_replicas", 1) == 1
        and "request_router" not in out and "request_router_kwargs" not in out)
    from pydantic import ValidationError

    from deploy.server_args import ServerArgs

    try:
        ServerArgs.model_validate(out)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = "--" + str(first["loc"][0]).replace("_", "-") if first["loc"] else "replica flags"
        ap.error(f"{where}: {str(first['msg']).removeprefix('Value error, ')}")
    return out


@contextlib.contextmanager
def _environment_restored_on_refusal() -> Iterator[None]:
    """``raydecode serve`` sets Serve's variables in its own environment before Ray
    starts; a command refused before then (exit 2) leaves the environment as it found
    it, so that a caller in the same process (a test, an embedding program) does not
    start its own Ray later with, say, direct ingress on a port of a command that
    never ran. (Serve's own constants, if a refusal came after this process imported
    Serve, keep what they read then; the Ray processes started later read the
    restored environment.)"""
    saved = dict(os.environ)
    try:
        yield
    except BaseException:
        os.environ.clear()
        os.environ.update(saved)
        raise


def _check_port(ap: argparse.ArgumentParser, host: str, port: int) -> None:
    """Exits 2 naming --port when it is out of range or already taken."""
    if not 1 <= port <= 65535:
        ap.error(f"--port must be between 1 and 65535, got {port}")
    try:
        family = _family(host)
    except OSError as exc:
        ap.error(f"--host {host}: {exc}")
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's own bind
        try:
            s.bind((host, port))
        except OSError as exc:
            ap.error(f"--port {port} on {host} cannot be used: {exc.strerror or exc}")


def _family(host: str) -> int:
    """The address family ``host`` binds with (IPv6 for "::1", "::")."""
    return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]


def _free_port(host: str) -> int:
    with socket.socket(_family(host)) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


# -- bench ----------------------------------------------------------------------------


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    """``raydecode bench``: which scripts, from which folder, results where."""
    bench = sub.add_parser("bench", help="run the benchmark scripts of a source checkout (its tests/bench)",
                           description=BENCH_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("names", nargs="*", help="scripts to run (default: all), e.g. e2e worker_step")
    bench.add_argument("--scripts", type=Path, default=None, metavar="DIR",
                       help=f"the benchmark folder (a checkout's tests/bench; default: ${BENCH_SCRIPTS_ENV}, "
                            "else the checkout this raydecode runs from)")
    bench.add_argument("--quick", action="store_true", help="pass --quick to each script")
    bench.add_argument("--out", type=Path, default=Path("bench-results"),
                       help="folder for the scripts' results, results.md and throughput.png "
                            "(default: %(default)s); running some scripts keeps the others' results")


def bench_folder(ap: argparse.ArgumentParser, given: Path | None) -> Path:
    """The benchmark scripts' folder: ``--scripts``, else ``$RAYDECODE_BENCH_SCRIPTS``,
    else ``tests/bench`` of the checkout this package runs from. An installed package
    has none (exits 2 saying so); a folder without ``_report.py`` is not ours (a
    ``tests`` folder some other package left in site-packages, a wrong path)."""
    if given is None and os.environ.get(BENCH_SCRIPTS_ENV):
        given, source = Path(os.environ[BENCH_SCRIPTS_ENV]), f"${BENCH_SCRIPTS_ENV}"
    else:
        source = "--scripts"
    if given is not None:
        folder = given.expanduser().resolve()
        if not (folder / "_report.py").is_file():
            ap.error(f"{source} {given}: not raydecode's benchmark folder (a source checkout's tests/bench, "
                     "with _report.py)")
        return folder
    folder = Path(__file__).resolve().parent.parent / "tests" / "bench"
    if not (folder / "_report.py").is_file():
        ap.error("the benchmark scripts are not part of the installed package: they live in a source checkout, "
                 f"in tests/bench. Run `raydecode bench --scripts CHECKOUT/tests/bench` (or set "
                 f"{BENCH_SCRIPTS_ENV}), or `make bench` in the checkout")
    return folder


def _bench(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Runs the benchmark scripts, then builds the results table (1 when any failed)."""
    folder = bench_folder(ap, args.scripts)
    scripts = sorted(p for p in folder.glob("*.py") if not p.name.startswith("_"))
    if args.names:
        known = {p.stem: p for p in scripts}
        unknown = [n for n in args.names if n not in known]
        if unknown:
            ap.error(f"unknown benchmark(s) {unknown}; choose from {sorted(known)}")
        scripts = [known[n] for n in args.names]
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if not args.names:  # a full run starts the table afresh
        for stale in out.glob("*.json"):
            stale.unlink()
    # The load before the first script: later ones would see the earlier ones' load.
    env = {**os.environ, "RAYDECODE_BENCH_OUT": str(out), "RAYDECODE_BENCH_LOAD": f"{os.getloadavg()[0]:.2f}"}
    failed = 0
    for script in scripts:
        print(f"== {script.stem}", flush=True)
        cmd = [sys.executable, str(script)] + (["--quick"] if args.quick else [])
        failed += subprocess.run(cmd, cwd=folder.parent.parent, env=env).returncode != 0
    print("== results", flush=True)
    failed += subprocess.run([sys.executable, str(folder / "_report.py"), str(out)]).returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
