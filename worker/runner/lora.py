"""LoRA adapters on a worker: the loaded ones, and each step's products over its rows.

A step's packed tokens belong to rows, each row to one adapter or to the base model. An
adapted linear adds ``B (A x)`` (B scaled at load) to the base layer's output: the
shrink ``x A^T`` over the projections that read the same input at once (A of q, k and
v stacked), then one expand per projection into its columns of the output (S-LoRA's /
Punica's shrink and expand, as torch ops; with several adapters in a step, batched
over them: ``StepLoRA``), never per row. The base weights
stay as they are: packed, merged, quantized; adapters stay in float beside them.

Two paths run it: the fused CPU decoder calls ``StepLoRA.add`` after its projections
(``worker/cpu/fused_decoder.py``); the transformers forward gets a forward hook on each
adaptable linear. Loaded adapters are kept by id, the least recently used dropped past
``max_cpu_loras`` (never one a row still uses); the driver keeps a batch's distinct
adapters within ``max_loras``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from worker.lora_adapter import ATTACHABLE, LoRAAdapter, LoRAAdapterError, read_adapter
from worker.lora_fetch import adapter_folder

logger = logging.getLogger("raydecode")

#: sets of a step's adapters whose stacked weights are kept (steady batches reuse them)
MAX_STACKED_SETS = 4
#: a rank's part of a whole-model module's adapter: (name, A, B) -> (its own name, its
#: cut of A, of B), or None where another rank holds the module
Localize = Callable[[str, torch.Tensor, torch.Tensor], "tuple[str, torch.Tensor, torch.Tensor] | None"]
#: a group of projections that read one input: (module name, output index, first
#: column, width) per projection, ``output index`` into the outputs the caller passes
Parts = tuple[tuple[str, int, int, int], ...]


def adaptable_linears(model: nn.Module) -> dict[str, list[int]]:
    """module name -> [in, out] of every linear an adapter may attach to (a decoder
    layer's projections; not experts of a mixture-of-experts block)."""
    out = {}
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if last in ATTACHABLE and ".experts." not in f".{name}." and hasattr(module, "in_features"):
            out[name] = [int(module.in_features), int(module.out_features)]
    return out


class LoadedAdapter:
    """One adapter's weights, and its projections stacked per group of ``Parts``."""

    def __init__(self, spec: LoRAAdapter, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.spec = spec
        self.weights = weights
        self._groups: dict[Parts, Any] = {}

    def group(self, parts: Parts) -> tuple[torch.Tensor, list[tuple[int, int, int, int, int, torch.Tensor]]] | None:
        """For the projections ``parts``: A of those it adapts stacked ``[R, in]``, and
        per adapted projection (output index, first column, width, its rows of R, B);
        None when it adapts none of them."""
        if parts in self._groups:
            return self._groups[parts]
        a_list, expands, r = [], [], 0
        for name, out_index, first, width in parts:
            pair = self.weights.get(name)
            if pair is None:
                continue
            a, b = pair
            expands.append((out_index, first, width, r, r + a.shape[0], b))
            a_list.append(a)
            r += a.shape[0]
        found = (torch.cat(a_list).contiguous(), expands) if a_list else None
        self._groups[parts] = found
        return found


class StepLoRA:
    """One step's adapters: each with the packed tokens of its rows (None: all).

    With several adapters in the step their tokens run together: gathered into one
    padded block per adapter (``[adapters, most tokens of one, in]``), each group of
    projections as one batched shrink and one batched expand per projection over the
    adapters' stacked weights (ranks padded with zeros), the products added back into
    the tokens' rows: a handful of calls per layer however many adapters there are."""

    def __init__(self, groups: list[tuple[LoadedAdapter, torch.Tensor | None]],
                 stacked: dict[Parts, Any] | None = None) -> None:
        """``stacked``: the stacked weights of earlier steps with the same adapters in
        the same order (kept by ``LoRAManager``), filled as the layers ask."""
        self.groups = groups
        self._stacked: dict[Parts, Any] = {} if stacked is None else stacked
        if len(groups) > 1:
            counts = [len(idx) for _, idx in groups]
            width = max(counts)
            # padded slot (adapter a, position j) -> the token it holds (pads repeat one)
            gather = torch.zeros(len(groups) * width, dtype=torch.long)
            valid = []
            for a, (_, idx) in enumerate(groups):
                gather[a * width : a * width + len(idx)] = idx.cpu()
                valid.append(torch.arange(a * width, a * width + len(idx)))
            self.width = width
            self.gather = gather.to(groups[0][1].device)
            self.valid = torch.cat(valid).to(self.gather.device)
            self.tokens = torch.cat([idx for _, idx in groups])

    def add(self, parts: Parts, x: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
        """Adds each adapter's products to ``outs`` (the base projections' outputs of
        ``x`` ``[T, in]``, each ``[T, width]``), in place."""
        if len(self.groups) > 1:
            self._add_batched(parts, x, outs)
            return
        adapter, idx = self.groups[0]
        group = adapter.group(parts)
        if group is None:
            return
        a, expands = group
        xs = x if idx is None else x.index_select(0, idx)
        shrunk = torch.mm(xs, a.t())
        for out_index, first, width, r0, r1, b in expands:
            delta = torch.mm(shrunk[:, r0:r1], b.t())
            dst = outs[out_index][:, first : first + width]
            if idx is None:
                dst.add_(delta)
            else:
                dst.index_add_(0, idx, delta)

    def _stack(self, parts: Parts, like: torch.Tensor) -> Any:
        """The step's adapters' weights for ``parts``, stacked: A ``[adapters, in, R]``
        (each part's rows at its offset, padded to the part's largest rank) and per part
        (output index, first column, width, its rows of R, B ``[adapters, r, width]``);
        None when no adapter adapts any of them."""
        if parts in self._stacked:
            return self._stacked[parts]
        per_part = []
        for name, out_index, first, width in parts:
            pairs = [adapter.weights.get(name) for adapter, _ in self.groups]
            rank = max((p[0].shape[0] for p in pairs if p is not None), default=0)
            if rank:
                per_part.append((out_index, first, width, rank, pairs))
        if not per_part:
            self._stacked[parts] = None
            return None
        n, d_in = len(self.groups), like.shape[-1]
        total = sum(rank for *_, rank, _ in per_part)
        a_all = like.new_zeros(n, d_in, total)
        expands, r0 = [], 0
        for out_index, first, width, rank, pairs in per_part:
            b_all = like.new_zeros(n, rank, width)
            for i, pair in enumerate(pairs):
                if pair is not None:
                    a, b = pair
                    a_all[i, :, r0 : r0 + a.shape[0]] = a.t()
                    b_all[i, : a.shape[0]] = b.t()
            expands.append((out_index, first, width, r0, r0 + rank, b_all))
            r0 += rank
        self._stacked[parts] = (a_all, expands)
        return self._stacked[parts]

    def _add_batched(self, parts: Parts, x: torch.Tensor, outs: Sequence[torch.Tensor]) -> None:
        stacked = self._stack(parts, x)
        if stacked is None:
            return
        a_all, expands = stacked
        n = len(self.groups)
        xs = x.index_select(0, self.gather).view(n, self.width, -1)
        shrunk = torch.bmm(xs, a_all)  # [adapters, width, R]
        for out_index, first, width, r0, r1, b_all in expands:
            delta = torch.bmm(shrunk[:, :, r0:r1], b_all).view(n * self.width, width).index_select(0, self.valid)
            outs[out_index][:, first : first + width].index_add_(0, self.tokens, delta)


class LoRAManager:
    """The worker's adapters: loaded on a row's first use, kept by id (LRU past
    ``max_cpu_loras``), and the current step's ``StepLoRA`` (``active``)."""

    def __init__(self, model: nn.Module, max_rank: int, max_loaded: int, dtype: torch.dtype, device: torch.device,
                 targets: dict[str, list[int]] | None = None, localize: Localize | None = None) -> None:
        """``targets``: the whole model's adaptable linears, what adapters are checked
        against (default: ``model``'s own); ``localize``: a rank of a model-parallel
        group's part of a whole-model module's (A, B): its own name for the module and
        the cut of A or B it holds, or None for a module of another stage."""
        #: the linears this worker's model holds, by its own names (the hooks' places)
        self.local_targets = adaptable_linears(model)
        self.targets = targets if targets is not None else self.local_targets
        self.localize = localize
        self.max_rank = max_rank
        self.max_loaded = max_loaded
        self.dtype, self.device = dtype, device
        self.loaded: OrderedDict[int, LoadedAdapter] = OrderedDict()
        #: stacked weights per ordered set of adapters in a step (the last few sets)
        self._stacks: OrderedDict[tuple[int, ...], dict[Parts, Any]] = OrderedDict()
        #: the step running now (None: no row of it has an adapter)
        self.active: StepLoRA | None = None
        self.num_loads = 0

    def attach(self, model: nn.Module, decoder: Any) -> None:
        """Both paths read ``active``: the transformers forward through a hook on each
        adaptable linear (adding the step's products to its output), a backend's own
        decoder (``decoder.lora``) where it runs the layers itself."""
        for name, module in model.named_modules():
            if name in self.local_targets:
                module.register_forward_hook(self._hook(name, self.local_targets[name][1]))
        if decoder is not None:
            if not hasattr(decoder, "lora"):
                raise LoRAAdapterError(f"enable_lora: the {type(decoder).__name__} path runs no adapters")
            decoder.lora = self

    def _hook(self, name: str, width: int) -> Any:
        parts: Parts = ((name, 0, 0, width),)

        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            step = self.active
            if step is not None:
                x = args[0]
                step.add(parts, x.reshape(-1, x.shape[-1]), (out.view(-1, width),))
        return hook

    def adapter(self, spec: LoRAAdapter, in_use: set[int]) -> LoadedAdapter:
        """``spec``'s weights, loaded now if they are not (``in_use``: ids a row holds,
        never dropped to make room)."""
        have = self.loaded.get(spec.id)
        if have is not None and have.spec == spec:
            self.loaded.move_to_end(spec.id)
            return have
        try:
            weights = read_adapter(adapter_folder(spec.path, spec.id), self.max_rank, self.targets, self.dtype, self.device)
        except (LoRAAdapterError, OSError) as exc:
            raise RuntimeError(f"LoRA adapter {spec.name!r} (id {spec.id}) failed to load: {exc}") from None
        if self.localize is not None:  # a rank of a group: its layers' weights, its cut, by its names
            weights = self._localized(weights)
        self.num_loads += 1
        loaded = LoadedAdapter(spec, weights)
        self.loaded[spec.id] = loaded
        self.loaded.move_to_end(spec.id)
        for old in [k for k in self.loaded if k not in in_use and k != spec.id][: max(0, len(self.loaded) - self.max_loaded)]:
            del self.loaded[old]
        self._stacks = OrderedDict((k, v) for k, v in self._stacks.items() if spec.id not in k)
        logger.info("LoRA adapter %r (id %d) loaded from %s", spec.name, spec.id, spec.path)
        return loaded

    def _localized(self, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
                   ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        assert self.localize is not None
        out = {}
        for name, (a, b) in weights.items():
            part = self.localize(name, a, b)
            if part is None:
                continue
            local, a, b = part
            want = self.local_targets.get(local)
            if want is None or [a.shape[1], b.shape[0]] != want:
                raise LoRAAdapterError(f"{name}: its cut {list(a.shape)} / {list(b.shape)} does not fit this rank's "
                                       f"{local} ({want})")
            out[local] = (a.contiguous(), b.contiguous())
        return out

    def begin(self, specs: list[LoRAAdapter | None], token_rows: np.ndarray) -> StepLoRA | None:
        """Sets ``active`` for a step whose packed tokens belong to ``token_rows`` (rows of
        the batch, whose adapters are ``specs``); None when no token has one. With
        several adapters the step's groups are those of every row the batch holds (some
        may run no token this step), so the stacked weights stay the same from step to
        step until an adapter joins or leaves the batch."""
        ids = np.array([0 if s is None else s.id for s in specs], dtype=np.int64)
        per_token = ids[token_rows]
        present = np.unique(per_token)
        present = present[present != 0]
        if len(present) == 0:
            self.active = None
            return None
        held = np.unique(ids)
        held = held[held != 0]
        in_use = set(held.tolist())
        by_id = {s.id: s for s in specs if s is not None}
        if len(present) == 1 and (per_token == present[0]).all():  # one adapter, every token
            self.active = StepLoRA([(self.adapter(by_id[int(present[0])], in_use), None)])
            return self.active
        ids_in_step = held if len(held) > 1 else present
        groups = [(self.adapter(by_id[i], in_use),
                   torch.from_numpy(np.flatnonzero(per_token == i)).to(self.device)) for i in ids_in_step.tolist()]
        key = tuple(int(i) for i in ids_in_step)
        stacked = self._stacks.setdefault(key, {}) if len(groups) > 1 else None
        if stacked is not None:
            self._stacks.move_to_end(key)
            while len(self._stacks) > MAX_STACKED_SETS:
                self._stacks.popitem(last=False)
        self.active = StepLoRA(groups, stacked)
        return self.active

    def end(self) -> None:
        self.active = None
