"""``raydecode run-batch``: an OpenAI batch file (``deploy/batch_file.py``) through engine
replicas on Ray Data, as ``vllm run-batch`` runs one through a single engine.

The driver first streams the input once: it writes the error line of every line that
cannot run, drops a repeated ``custom_id`` (the first line with it runs; the rest are
reported), skips what a resumed output already holds, and marks the lines to run. Ray
Data then reads those lines (``BatchLines``, a read task streaming the file), answers
them on ``--concurrency`` replicas (``deploy/data/batch_stage.py``: each one the HTTP
endpoint's engine side) and the driver appends each answer to the output as it comes,
one whole line per write, flushed: a run that dies leaves complete lines (and at most
one torn last line), and ``--resume`` truncates the torn line and runs only what is
missing. The driver never holds the file: its memory grows only with the set of
``custom_id``s it has seen.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from deploy.batch_file import OutputScan, output_id, parse_line, scan_output
from deploy.engine_flags import add_engine_flags, engine_kwargs

#: Bytes read from the input at a time
CHUNK = 1 << 20
#: CPUs Ray reserves for the read task (it only splits lines)
READ_CPUS = 0.25

HELP = """Reads the OpenAI batch input format (one JSON object per line: custom_id, method POST,
url /v1/chat/completions or /v1/completions, body as that endpoint takes it, its model
optional) and writes the batch output format (one line per custom_id: response with
status_code and body, or error), in the order answers finish. Input and output are local
paths or any URI pyarrow opens (s3://, gs://, hdfs://). Lines that cannot run become
error lines naming the line; the rest run. --resume keeps what an earlier run of the same
input wrote and runs only the rest."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run-batch", help="run an OpenAI batch file (vllm run-batch's format) on Ray Data",
                       description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-i", "--input-file", required=True, help="the batch input file (path or URI)")
    p.add_argument("-o", "--output-file", required=True, help="the batch output file (path or URI)")
    p.add_argument("--resume", action="store_true",
                   help="keep the output's complete lines and run only the lines it lacks (a torn last line, "
                        "from a run that died mid-write, is cut and redone)")
    p.add_argument("--concurrency", type=int, default=1, help="engine replicas (each with its own workers)")
    p.add_argument("--batch-size", type=int, default=64, help="lines per Ray Data batch")
    p.add_argument("--max-concurrent-batches", type=int, default=8, help="batches in flight per replica")
    p.add_argument("--served-model-name", default=None, help="the model name lines may give (default: the model's)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_engine_flags(p)


def _filesystem(uri: str) -> tuple[Any, str]:
    import pyarrow.fs

    if "://" not in uri:
        return pyarrow.fs.LocalFileSystem(), os.path.abspath(uri)
    return pyarrow.fs.FileSystem.from_uri(uri)


def iter_lines(stream: Any) -> Iterator[bytes]:
    """A byte stream's lines, each with its newline (the last one may lack it)."""
    rest = b""
    while True:
        chunk = stream.read(CHUNK)
        if not chunk:
            break
        rest += chunk
        *lines, rest = rest.split(b"\n")
        for line in lines:
            yield line + b"\n"
    if rest:
        yield rest


def input_lines(uri: str) -> Iterator[tuple[int, str]]:
    """The input's non-blank lines: (1-based line number, text)."""
    fs, path = _filesystem(uri)
    with fs.open_input_stream(path) as stream:
        for n, raw in enumerate(iter_lines(stream), start=1):
            text = raw.decode("utf-8", errors="replace").strip()
            if text:
                yield n, text


class Prepass:
    """The driver's one pass over the input: error lines, repeats, what is done."""

    def __init__(self, done: OutputScan | None) -> None:
        self.done = done
        self.seen: dict[str, int] = {}
        self.run = bytearray()
        self.to_run = self.errors = self.skipped = 0
        self.repeats: list[tuple[int, str, int]] = []

    def scan(self, uri: str, write: Any) -> None:
        for n, text in input_lines(uri):
            request, key, error = parse_line(text, n)
            if request is not None:
                first = self.seen.setdefault(request.custom_id, n)
                if first != n:
                    self.repeats.append((n, request.custom_id, first))
                    continue
            if self.done is not None and output_id(key) in self.done.keys:
                self.skipped += 1
                continue
            if error is not None:
                write(json.dumps(error, ensure_ascii=False))
                self.errors += 1
                continue
            while len(self.run) <= n >> 3:
                self.run.append(0)
            self.run[n >> 3] |= 1 << (n & 7)
            self.to_run += 1


class Output:
    """The output file, appended one whole line per write and flushed."""

    def __init__(self, uri: str, resume: bool) -> None:
        self.fs, self.path = _filesystem(uri)
        self.scan: OutputScan | None = None
        import pyarrow.fs

        exists = self.fs.get_file_info(self.path).type == pyarrow.fs.FileType.File
        if resume and exists:
            with self.fs.open_input_stream(self.path) as stream:
                self.scan = scan_output(iter_lines(stream))
            if isinstance(self.fs, pyarrow.fs.LocalFileSystem):
                os.truncate(self.path, self.scan.good_bytes)  # the torn last line goes
                self.stream: Any = open(self.path, "ab")
            else:
                try:
                    self.stream = self.fs.open_append_stream(self.path)
                except Exception as exc:
                    raise ValueError(f"--resume: {uri} cannot be appended to ({exc}); resume to a local file") from None
                if self.scan.torn:
                    raise ValueError(f"--resume: {uri} ends in a torn line, which only a local file can be cut")
        else:
            self.scan = OutputScan(set(), 0, 0, False) if resume else None
            if isinstance(self.fs, pyarrow.fs.LocalFileSystem):
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                self.stream = open(self.path, "wb")
            else:
                self.stream = self.fs.open_output_stream(self.path)
        self.written = 0

    def write(self, line: str) -> None:
        self.stream.write(line.encode("utf-8") + b"\n")
        self.stream.flush()
        self.written += 1

    def close(self) -> None:
        self.stream.close()


def _server_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    engine = engine_kwargs(args)
    engine.pop("address", None)
    template = None
    if args.chat_template is not None:
        if not os.path.isfile(args.chat_template):
            ap.error(f"chat template {args.chat_template} does not exist")
        with open(args.chat_template, encoding="utf-8") as f:
            template = f.read()
    try:
        from cluster.config import EngineConfig
        from deploy.server_args import ServerArgs

        EngineConfig(**engine)
        server = {"model": engine.pop("model", None), "num_workers": engine.pop("num_workers", 1),
                  "served_model_name": args.served_model_name, "chat_template": template, "engine": engine}
        ServerArgs.model_validate(server)
    except (ValueError, TypeError) as exc:
        ap.error(f"engine configuration: {exc}")
    return server


def run(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    for flag in ("concurrency", "batch_size", "max_concurrent_batches"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    server = _server_args(ap, args)
    address = engine_kwargs(args).get("address")
    try:
        output = Output(args.output_file, args.resume)
    except (OSError, ValueError) as exc:
        ap.error(f"output file: {exc}")
    try:
        prepass = Prepass(output.scan)
        try:
            prepass.scan(args.input_file, output.write)
        except (OSError, ValueError) as exc:
            ap.error(f"input file: {exc}")
        for line, custom_id, first in prepass.repeats:
            print(f"run-batch: line {line}: custom_id {custom_id!r} repeats line {first}'s; not run", file=sys.stderr)
        if prepass.to_run:
            _run_lines(args, server, address, prepass, output)
    finally:
        output.close()
    resumed = f", {prepass.skipped} already in the output" if args.resume else ""
    print(f"run-batch: {output.written} lines written ({prepass.errors} could not run{resumed}, "
          f"{len(prepass.repeats)} repeated custom_ids dropped) to {args.output_file}", file=sys.stderr)
    return 0


def _run_lines(args: argparse.Namespace, server: dict[str, Any], address: str | None, prepass: Prepass,
               output: Output) -> None:
    import ray
    from tqdm.auto import tqdm

    from cluster.config import EngineConfig
    from cluster.ray_session import RaySession
    from deploy.data.batch_source import BatchLines
    from deploy.data.batch_stage import BatchLineStage
    from deploy.data.config import pool_size
    from deploy.data.processor import exclude_replica_workers, replica_reservation

    engine = EngineConfig(model=server["model"], num_workers=server["num_workers"], **server["engine"])
    held = replica_reservation(engine)
    init: dict[str, Any] = {}
    if address is None:
        from deploy.serve_env import serving_priority_env

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        for key, value in serving_priority_env().items():  # the replicas' engines ahead of their workers
            os.environ.setdefault(key, value)
        # A local Ray: the workers' CPUs are tokens (one per worker), so the light
        # stages always have room beside them.
        init["num_cpus"] = max(os.cpu_count() or 1, int(held.get("CPU", 1) * args.concurrency) + 1)
    session = RaySession.connect(address, init)
    try:
        from ray.data import ActorPoolStrategy, DataContext

        context = DataContext.get_current()
        context.enable_progress_bars = False
        context.print_on_execution_start = False
        exclude_replica_workers(context, held, args.concurrency)
        pending = 2 * engine.max_num_seqs * engine.num_workers
        ds = ray.data.read_datasource(BatchLines(args.input_file, bytes(prepass.run), prepass.to_run, input_lines),
                                      num_cpus=READ_CPUS)
        ds = ds.map_batches(BatchLineStage, fn_constructor_kwargs={"server_args": server, "pending_limit": pending},
                            compute=ActorPoolStrategy(**pool_size((args.concurrency, args.concurrency)),
                                                      max_concurrent_calls_per_actor=args.max_concurrent_batches),
                            batch_size=args.batch_size, batch_format="pyarrow", num_cpus=0)
        bar = tqdm(total=prepass.to_run, desc="run-batch", unit="line", disable=args.no_progress,
                   dynamic_ncols=True)
        started, tokens = time.monotonic(), 0
        try:
            for row in ds.iter_rows():
                output.write(row["output"])
                tokens += int(row["completion_tokens"] or 0)
                elapsed = max(time.monotonic() - started, 1e-9)
                bar.set_postfix_str(f"{tokens / elapsed:.0f} output tok/s", refresh=False)
                bar.update(1)
        finally:
            bar.close()
    finally:
        session.close()
