"""A rank's ModelRunner: one rank of a model-parallel group.

It loads only its shard of the model (``sharded_loader``), joins the group's collectives
(``group``) and runs the same steps as every other rank of its group, in step: after the
first pipeline stage its hidden states come from the previous stage, before the last
they go to the next one, and on the last stage tensor rank 0 gathers the vocabulary
slices into the logits. Only the group's leader samples and replies; it sends what each
row emitted to the other ranks, which append those tokens when a later step needs them
(the step message's ``needs_tokens_of``), so an earlier stage goes on to the next step
while the leader still samples.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from sampler.logits_processor.interface import LogitsProcessorError
from worker.config import WorkerConfig
from worker.parallel.group import ParallelGroup, install_tensor_parallel_hooks
from worker.parallel.layout import RankLayout
from worker.parallel.sharded_loader import load_model_shard, lora_sharding
from worker.protocol import GroupRank, RowError, StepReply, StepRequest, StepTimings
from worker.runner.attention import plan_in_effect, register_paged_attention
from worker.runner.attention_plan import AttentionPlan
from worker.runner.backend import ChooseBackend, reference_backend
from worker.runner.lora import LoRAManager
from worker.runner.model_loader import LoadedModel
from worker.runner.model_runner import ModelRunner


class ShardedModelRunner(ModelRunner):
    group: ParallelGroup

    def __init__(self, config: WorkerConfig, group_rank: GroupRank, store: object | None = None,
                 choose_backend: ChooseBackend = reference_backend) -> None:
        """``group_rank``: this rank's place in its group (``config.group_size`` ranks);
        rank 0 joins through the rendezvous ``store`` it opened."""
        self.group_rank, self._store = group_rank, store
        self.layout: RankLayout | None = None
        self._token_sends: list[object] = []  # the leader's, of its last step
        #: another rank's receives of the leader's tokens: (step id, handle, table, requests), oldest first
        self._token_receives: list[tuple[int, object, torch.Tensor, list]] = []
        super().__init__(config, choose_backend)
        #: samples and replies (False: a follower rank, which takes the leader's tokens)
        self.samples = self.layout.is_leader
        if self.backend.decoder is None:
            install_tensor_parallel_hooks(self.model, self.group)  # after the load's probe: it runs alone

    def _load_model(self, config: WorkerConfig) -> LoadedModel:
        register_paged_attention()
        loaded, self.layout = load_model_shard(
            config.model, tensor_parallel_size=config.tensor_parallel_size,
            pipeline_parallel_size=config.pipeline_parallel_size, rank=self.group_rank.rank,
            pipeline_layer_partition=config.pipeline_layer_partition,
            enable_expert_parallel=config.enable_expert_parallel, **self._load_options(config),
        )
        return self._checked(loaded)

    def _lora_manager(self, config: WorkerConfig) -> LoRAManager:
        """A rank's adapters: checked against the whole model's linears, each rank
        loading its cut of its own layers' weights (``lora_sharding``)."""
        assert self.layout is not None
        targets, localize = lora_sharding(config.model, self.layout, config.trust_remote_code, config.quantization)
        return LoRAManager(self.model, config.max_lora_rank, config.max_cpu_loras or config.max_loras,
                           self.loaded.dtype, self.device, targets=targets, localize=localize)

    def _join_group(self) -> None:
        """The group's collectives (after the load: a rank that fails to load leaves
        the others waiting here at most ``timeout_s``)."""
        self.group = ParallelGroup(self.group_rank, self.layout, self.device, self._store)

    # -- one step -----------------------------------------------------------------------

    def _before_step(self, step: StepRequest) -> None:
        if self._token_receives:
            self._collect_tokens(step.needs_tokens_of)

    def _run(self, step_id: int, scheduled: np.ndarray, t0: float) -> StepReply:
        if self.samples:
            return super()._run(step_id, scheduled, t0)
        # A rank that does not sample: the leader's tokens follow.
        work = self._forward_step(scheduled)
        if work is None:
            return self._empty_reply(step_id)
        if len(work.s_rows):
            self._expect_tokens(step_id, work.s_rows, work.s_width)
        self.batch.num_computed[work.rows] = work.computed + work.count - work.num_drafts
        t3 = time.perf_counter()
        self.timings = StepTimings(prepare=work.t1 - t0, forward=work.t2 - work.t1, sample=t3 - work.t2,
                                   collective=self.group.take_seconds())
        return self._empty_reply(step_id, self.timings)

    def _collective_seconds(self) -> float:
        return self.group.take_seconds()

    def _run_layers(self, input_ids: torch.Tensor, plan: AttentionPlan, keep: torch.Tensor) -> torch.Tensor | None:
        return self._forward_shard(input_ids, plan, keep)

    def _sample(
        self, logits: torch.Tensor, s_rows: np.ndarray, num_drafts: np.ndarray, width: np.ndarray
    ) -> tuple[list[list[int]], tuple[np.ndarray, np.ndarray, np.ndarray] | None, list[RowError]]:
        """The leader's sampling, and what each row emitted sent to the other ranks
        (that the sampling raised, when it did)."""
        try:
            emitted, lp, failed = super()._sample(logits, s_rows, num_drafts, width)
        except LogitsProcessorError:
            if len(s_rows):
                self._send_tokens(None, set(), s_rows, width)
            raise
        if len(s_rows):
            self._send_tokens(emitted, {f.row for f in failed}, s_rows, width)
        return emitted, lp, failed

    def reset(self) -> None:
        super().reset()
        self._token_receives = []

    # -- the group's parts --------------------------------------------------------------

    def _forward_shard(self, input_ids: torch.Tensor, plan: AttentionPlan, keep: torch.Tensor) -> torch.Tensor | None:
        """A rank's part of the forward: after the first stage the hidden states come
        from the previous stage; before the last they go to the next one; on the last,
        tensor rank 0 gathers the vocabulary slices into the logits."""
        group, layout = self.group, self.layout
        hidden = None
        if not layout.first_stage:
            hidden = group.recv_hidden(len(input_ids), self.model.config.hidden_size, self.loaded.dtype)
        if self.backend.decoder is not None:
            out = self.backend.decoder.forward(input_ids, plan.token_positions, plan, keep, hidden=hidden)
        else:
            with plan_in_effect(plan):
                out = self.model.model(
                    input_ids=input_ids.unsqueeze(0) if hidden is None else None,
                    inputs_embeds=None if hidden is None else hidden.unsqueeze(0),
                    position_ids=plan.token_positions.unsqueeze(0), use_cache=False, attention_plan=plan,
                ).last_hidden_state[0]
            if layout.last_stage:
                out = group.gather_logits(self.model.lm_head(out.index_select(0, keep)), self.loaded.vocab_size)
                cap = getattr(self.model.config, "final_logit_softcapping", None)
                if out is not None and cap:  # what the causal LM's forward does after its head (Gemma 2)
                    out = torch.tanh(out / cap) * cap
        if not layout.last_stage:
            group.send_hidden(out)
            return None
        return out

    def _send_tokens(self, emitted: list[list[int]] | None, failed: set[int], s_rows: np.ndarray,
                     width: np.ndarray) -> None:
        """The leader: what each sampling row emitted, to the group's other ranks (a
        ``[rows, 1 + width]`` table: a count, -1 for a failed row, -2 when the sampling
        raised, then the tokens). The previous step's sends are complete first."""
        for work in self._token_sends:
            self.group.wait(work)
        rows, cols = len(s_rows), 1 + (int(width.max()) if len(width) else 0)
        grid = torch.full((rows, cols), -2, dtype=torch.int32)
        if emitted is not None:
            grid.zero_()
            for i, (row, tokens) in enumerate(zip(s_rows.tolist(), emitted)):
                grid[i, 0] = -1 if row in failed else len(tokens)
                grid[i, 1 : 1 + len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
        self._token_sends = self.group.send_tokens(grid)

    def _expect_tokens(self, step_id: int, s_rows: np.ndarray, width: np.ndarray) -> None:
        """Another rank: posts the receive of the leader's tokens for this step's
        sampling rows; they are appended when a later step needs them (``_collect_tokens``),
        so an earlier pipeline stage goes on to another step meanwhile."""
        cols = 1 + (int(width.max()) if len(width) else 0)
        work, grid = self.group.receive_tokens(len(s_rows), cols)
        requests = [self.batch.requests[r] for r in s_rows.tolist()]
        self._token_receives.append((step_id, work, grid, requests))

    def _collect_tokens(self, through: int) -> None:
        """Another rank: appends the leader's tokens of the steps up to ``through``
        (the step message's ``needs_tokens_of``) to their rows, found by request (later
        steps may have moved them; a row removed since is skipped)."""
        batch = self.batch
        while self._token_receives and self._token_receives[0][0] <= through:
            _, work, grid, requests = self._token_receives.pop(0)
            self.group.wait(work)
            where = {id(r): i for i, r in enumerate(batch.requests[: batch.batch_size]) if r is not None}
            table = grid.cpu().numpy()
            for req, entry in zip(requests, table):
                row, count = where.get(id(req)), int(entry[0])
                if row is None or count < 0:
                    continue
                batch.append_tokens(row, entry[1 : 1 + count].tolist())
                batch.num_computed[row] += count - 1  # accepted drafts (with no drafts: 0)
            if batch.thinking_budget is not None:
                batch.thinking_budget.update_state([r.output_token_ids for r in batch.requests[: batch.batch_size]])
