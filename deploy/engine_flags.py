"""``EngineConfig``'s fields as command-line flags: one flag per field, typed from the
field and helped by its ``#:`` doc comment (vLLM's flag names where vLLM has the
setting), and the fields given on a command line read back from the parsed arguments.
``raydecode serve`` and ``raydecode generate`` both take them (``deploy.cli``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import types
import typing
from typing import Any

import msgspec

#: vLLM's flag names where vLLM has the same setting under another name (the first is
#: shown in --help; the others, our own names among them, are aliases). Every other
#: ``EngineConfig`` field is ``--field-name``, which is vLLM's name where vLLM has it
#: (--max-model-len, --max-num-seqs, --max-num-batched-tokens, --seed, --dtype, ...).
FLAG_NAMES = {
    "num_workers": ["--num-workers", "--data-parallel-size", "-dp"],
    "kv_block_size": ["--block-size", "--kv-block-size"],
    "num_spec_tokens": ["--spec-tokens", "--num-spec-tokens"],
    "tensor_parallel_size": ["--tensor-parallel-size", "-tp"],
    "pipeline_parallel_size": ["--pipeline-parallel-size", "-pp"],
    "quantization": ["--quantization", "-q"],
}


def config_docs(cls: type | None = None) -> dict[str, str]:
    """Each config field's ``#:`` doc comment (the lines right above it), by name, from
    the class and the classes it extends (``EngineConfig`` extends ``WorkerConfig``)."""
    if cls is None:
        from cluster.config import EngineConfig as cls
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.split(".")[0] in ("builtins", "msgspec") or not getattr(klass, "__struct_fields__", None):
            continue
        lines, _ = inspect.getsourcelines(klass)
        pending: list[str] = []
        for line in lines:
            text = line.strip()
            if text.startswith("#:"):
                pending.append(text[2:].strip())
                continue
            match = re.match(r"([A-Za-z_]\w*)\s*:", text)
            if match and pending:
                docs[match.group(1)] = " ".join(pending)
            pending = []
    return docs


def json_of(kind: type) -> Any:
    """An argparse ``type``: the argument as JSON, which must be a ``kind`` (dict, list)."""
    def parse(text: str) -> Any:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not JSON ({exc.msg}): {text!r}") from None
        if not isinstance(value, kind):
            raise argparse.ArgumentTypeError(f"expected a JSON {kind.__name__}, got {text!r}")
        return value

    parse.__name__ = f"JSON {kind.__name__}"
    return parse


class _ListAction(argparse.Action):
    """A list field: several values (``--logits-processors a:A b:B``, vLLM's form) or
    one JSON list."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any = None) -> None:
        if len(values) == 1 and values[0].lstrip().startswith("["):
            try:
                values = json_of(list)(values[0])
            except argparse.ArgumentTypeError as exc:
                parser.error(f"{option}: {exc}")
        setattr(namespace, self.dest, list(values))


def _base_type(hint: Any) -> Any:
    """int, float, str, bool, list or dict for a field's type (``X | None`` -> X)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _base_type(args[0]) if len(args) == 1 else str
    if origin is typing.Literal:
        return type(typing.get_args(hint)[0])
    return origin or hint


ENGINE_DEST = "engine__"


def add_engine_flags(p: argparse.ArgumentParser, taken: set[str] = frozenset()) -> None:
    """One flag per ``EngineConfig`` field, typed from the field and helped by its
    ``#:`` comment. A name the subcommand already uses for something else gets an
    ``--engine-`` prefix (``generate --seed`` is the sampling seed; ``--engine-seed``
    the engine's). Flags not given leave the config's defaults."""
    from cluster.config import EngineConfig

    g = p.add_argument_group("engine (EngineConfig; dict and list fields take JSON)")
    hints = typing.get_type_hints(EngineConfig)
    docs = config_docs(EngineConfig)
    for f in msgspec.structs.fields(EngineConfig):
        names = [n if n not in taken else "--engine-" + n.lstrip("-") for n in
                 FLAG_NAMES.get(f.name, ["--" + f.name.replace("_", "-")])]
        kind = _base_type(hints[f.name])
        default = f.default_factory() if f.default_factory is not msgspec.NODEFAULT else f.default
        doc = docs.get(f.name, "")
        help_ = f"{doc} (default: {json.dumps(default) if kind in (list, dict) else default})".replace("%", "%%")
        kw: dict[str, Any] = {"dest": ENGINE_DEST + f.name, "default": argparse.SUPPRESS, "help": help_.strip(),
                              "metavar": f.name.upper()}
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
            del kw["metavar"]
        elif kind is list:
            kw.update(action=_ListAction, nargs="+", metavar="VALUE")
        elif kind is dict:
            kw.update(type=json_of(dict), metavar="JSON")
        else:
            kw["type"] = kind
            if typing.get_origin(hints[f.name]) is typing.Literal:
                kw["choices"] = typing.get_args(hints[f.name])
        g.add_argument(*names, **kw)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineConfig`` fields given on the command line."""
    return {k[len(ENGINE_DEST):]: v for k, v in vars(args).items() if k.startswith(ENGINE_DEST)}

