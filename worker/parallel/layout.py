"""Model-parallel layout: which part of the model each rank of a group holds.

A replica of the model can be a *group* of ``tp x pp`` ranks (Ray actors):

- pipeline parallel: the decoder layers are split into ``pp`` contiguous runs
  (*stages*), evenly, the leftovers to the earlier stages (vLLM's rule; an explicit
  partition, vLLM's ``VLLM_PP_LAYER_PARTITION``, overrides it). The first stage also
  holds the embedding, the last the final norm and the LM head; a stage hands the next
  the hidden states of the step's tokens.
- tensor parallel: within a stage each of the ``tp`` ranks holds a slice of every
  layer: its query heads (``heads / tp``), its key/value heads (split when
  ``kv_heads >= tp``, then ``kv_heads % tp == 0``; else each rank holds one KV head,
  replicated ``tp / kv_heads`` times, which needs ``tp % kv_heads == 0``), its columns of
  the MLP (``intermediate / tp``), and a slice of the vocabulary for the LM head. The
  attention output and MLP projections are row-parallel: their partial sums are
  all-reduced (two all-reduces per layer). A mixture of experts shards each expert the
  same way (its columns ``expert_intermediate / tp`` on every rank, every rank holding
  every expert and the router whole): the experts' weighted sum is one partial sum,
  all-reduced like a dense MLP's. With expert parallelism each rank holds
  ``experts / tp`` whole experts instead; every rank has every token (the hidden
  states are the same on all ranks after the attention's all-reduce), computes the
  pairs routed to its experts, and the same all-reduce adds the ranks' shares.

Global rank numbering: ``rank = pp_rank * tp + tp_rank``. The *leader*, the rank that
samples and answers the driver, is tensor rank 0 of the last stage (it gathers the
full logits).

Everything here is arithmetic on a model's config: the driver runs the same checks
before it starts any actor (``check_parallel_sizes``), so a size that cannot work is
refused at once, with the sizes that would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from worker.config import parse_partition


class ParallelSizeError(ValueError):
    """The model cannot be split this way (the message says which sizes work)."""


@dataclass(frozen=True)
class ModelShape:
    """What the layout depends on, read from a transformers config."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    #: an expert's MLP width in a mixture of experts (0: no experts)
    expert_intermediate_size: int = 0
    #: experts a mixture-of-experts layer holds (0: none)
    num_experts: int = 0

    @classmethod
    def of(cls, config: Any) -> ModelShape:
        text = getattr(config, "text_config", None) or config
        heads = int(text.num_attention_heads)
        kv = int(getattr(text, "num_key_value_heads", None) or heads)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        intermediate = int(getattr(text, "intermediate_size", 0) or 0)
        experts = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None) or 0
        expert_width = int(getattr(text, "moe_intermediate_size", None) or intermediate) if experts else 0
        if experts and not getattr(text, "moe_intermediate_size", None):
            intermediate = 0  # the experts are intermediate_size wide (Mixtral, gpt-oss): no dense MLP
        return cls(
            num_layers=int(text.num_hidden_layers), num_heads=heads, num_kv_heads=kv, head_dim=int(head_dim),
            hidden_size=int(text.hidden_size), intermediate_size=intermediate,
            vocab_size=int(text.vocab_size), expert_intermediate_size=expert_width, num_experts=int(experts),
        )


def tp_sizes_that_work(shape: ModelShape, limit: int = 64, expert_parallel: bool = False) -> list[int]:
    """Tensor-parallel sizes up to ``limit`` this model splits into."""
    return [tp for tp in range(1, limit + 1) if _tp_problem(shape, tp, expert_parallel) is None]


def _tp_problem(shape: ModelShape, tp: int, expert_parallel: bool = False) -> str | None:
    if shape.num_heads % tp:
        return f"its {shape.num_heads} attention heads do not divide by {tp}"
    kv = shape.num_kv_heads
    if kv >= tp and kv % tp:
        return f"its {kv} key/value heads do not divide by {tp}"
    if kv < tp and tp % kv:
        return f"{tp} is not a multiple of its {kv} key/value heads (to replicate them)"
    if shape.intermediate_size % tp:
        return f"its MLP width {shape.intermediate_size} does not divide by {tp}"
    if expert_parallel:
        if shape.num_experts % tp:
            return f"its {shape.num_experts} experts do not divide by {tp} (expert parallelism)"
    elif shape.expert_intermediate_size % tp:
        return f"its experts' width {shape.expert_intermediate_size} does not divide by {tp}"
    return None


def layer_partition(num_layers: int, pp: int, override: list[int] | None = None) -> list[int]:
    """Layers per stage: even, the leftovers one each to the earliest stages (vLLM's
    ``get_pp_indices``), or ``override`` when given (it must name ``pp`` stages and sum
    to ``num_layers``)."""
    if pp > num_layers:
        raise ParallelSizeError(f"pipeline_parallel_size {pp} exceeds the model's {num_layers} layers")
    if override is not None:
        if len(override) != pp or sum(override) != num_layers:
            raise ParallelSizeError(
                f"pipeline_layer_partition {','.join(map(str, override))} must give {pp} stages "
                f"summing to the model's {num_layers} layers"
            )
        return list(override)
    base, extra = divmod(num_layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def check_parallel_sizes(config: Any, tp: int, pp: int, partition: str | None = None,
                         expert_parallel: bool = False) -> ModelShape:
    """Refuses (``ParallelSizeError``, naming the reason and the sizes that work) a
    ``tp x pp`` split this model cannot take (with ``expert_parallel``: its experts
    split whole over the tensor ranks); returns its shape otherwise."""
    shape = ModelShape.of(config)
    if expert_parallel and not shape.num_experts:
        raise ParallelSizeError("enable_expert_parallel: the model has no mixture-of-experts layers")
    if tp > 1:
        problem = _tp_problem(shape, tp, expert_parallel)
        if problem is not None:
            works = tp_sizes_that_work(shape, expert_parallel=expert_parallel)
            raise ParallelSizeError(
                f"tensor_parallel_size {tp} does not fit this model: {problem} "
                f"(sizes that work: {', '.join(map(str, works))})"
            )
    layer_partition(shape.num_layers, pp, parse_partition(partition))
    return shape


@dataclass(frozen=True)
class RankLayout:
    """One rank's share of the model."""

    tp_size: int
    pp_size: int
    tp_rank: int
    pp_rank: int
    first_layer: int  # the global index of this stage's first layer
    num_layers: int  # layers this stage holds
    q_heads: tuple[int, int]  # [start, end) of the global query heads this rank holds
    kv_heads: tuple[int, int]  # [start, end) of the global key/value heads
    intermediate: tuple[int, int]  # [start, end) of the MLP's columns
    expert_intermediate: tuple[int, int]  # [start, end) of every expert's columns ((0, 0): no experts)
    vocab: tuple[int, int]  # [start, end) of the vocabulary its LM-head slice computes
    vocab_shard: int  # rows of every rank's LM-head slice (the last one padded to it)
    #: [start, end) of the experts this rank holds: all of them, or its share of them
    #: whole under expert parallelism
    experts: tuple[int, int] = (0, 0)
    expert_parallel: bool = False

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_leader(self) -> bool:
        return self.last_stage and self.tp_rank == 0

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.first_layer + self.num_layers)

    def stage_ranks(self, pp_rank: int | None = None) -> list[int]:
        """The global ranks of a stage's tensor-parallel ranks (this rank's stage by default)."""
        s = self.pp_rank if pp_rank is None else pp_rank
        return [s * self.tp_size + t for t in range(self.tp_size)]


def leader_rank(tp: int, pp: int) -> int:
    """The global rank that samples and replies: tensor rank 0 of the last stage."""
    return (pp - 1) * tp


def rank_layout(shape: ModelShape, tp: int, pp: int, rank: int, partition: list[int] | None = None,
                expert_parallel: bool = False) -> RankLayout:
    """The layout of global ``rank`` of a ``tp x pp`` group (sizes checked)."""
    if not 0 <= rank < tp * pp:
        raise ValueError(f"rank {rank} outside a group of {tp} x {pp}")
    pp_rank, tp_rank = divmod(rank, tp)
    stages = layer_partition(shape.num_layers, pp, partition)
    if tp > 1 and _tp_problem(shape, tp, expert_parallel) is not None:
        raise ParallelSizeError(f"tensor_parallel_size {tp}: {_tp_problem(shape, tp, expert_parallel)}")
    q = shape.num_heads // tp
    kv = shape.num_kv_heads
    if kv >= tp:
        kv_range = (tp_rank * kv // tp, (tp_rank + 1) * kv // tp)
    else:  # fewer KV heads than ranks: each rank holds the one its query heads read
        head = tp_rank * kv // tp
        kv_range = (head, head + 1)
    inter = shape.intermediate_size // tp
    expert = shape.expert_intermediate_size // (1 if expert_parallel else tp)
    held = shape.num_experts // tp if expert_parallel else shape.num_experts
    first_expert = tp_rank * held if expert_parallel else 0
    shard = -(-shape.vocab_size // tp)
    return RankLayout(
        tp_size=tp, pp_size=pp, tp_rank=tp_rank, pp_rank=pp_rank,
        first_layer=sum(stages[:pp_rank]), num_layers=stages[pp_rank],
        q_heads=(tp_rank * q, (tp_rank + 1) * q), kv_heads=kv_range,
        intermediate=(tp_rank * inter, (tp_rank + 1) * inter),
        expert_intermediate=(0, expert) if expert_parallel else (tp_rank * expert, (tp_rank + 1) * expert),
        experts=(first_expert, first_expert + held), expert_parallel=expert_parallel,
        vocab=(min(tp_rank * shard, shape.vocab_size), min((tp_rank + 1) * shard, shape.vocab_size)),
        vocab_shard=shard,
    )
