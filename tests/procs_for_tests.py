"""Logits processors (and non-processors) used by tests/test_logits_processor_framework.py.

Loaded by "module:Qualname" strings and fake entry points, so it has to be an importable
module of its own (not a test file).
"""

from __future__ import annotations

import time

import torch

from sampler.logits_processor import AdapterLogitsProcessor, LogitsProcessor

#: (class name, params) of every validate_params call, in order.
VALIDATE_CALLS: list[tuple[str, object]] = []


class RecordingProc(LogitsProcessor):
    """Non-argmax-invariant; remembers how it was built and every update it got."""

    def __init__(self, config, device, is_pin_memory):
        self.config = config
        self.device = device
        self.is_pin_memory = is_pin_memory
        self.updates: list = []

    @classmethod
    def validate_params(cls, sampling_params):
        VALIDATE_CALLS.append((cls.__name__, sampling_params))
        extra = sampling_params.extra_args or {}
        if extra.get("reject_me"):
            raise ValueError("RecordingProc: reject_me is set")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update) -> None:
        self.updates.append(batch_update)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


class InvariantProc(LogitsProcessor):
    """Argmax-invariant no-op."""

    def __init__(self, config, device, is_pin_memory):
        pass

    @classmethod
    def validate_params(cls, sampling_params):
        VALIDATE_CALLS.append((cls.__name__, sampling_params))

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


class Outer:
    """Holds a nested processor class, to load through a dotted qualname."""

    class Inner(InvariantProc):
        pass


class NotAProcessor:
    """A class, but not a LogitsProcessor subclass."""

    def __init__(self, *args):
        pass


NOT_A_CLASS = 42


def not_a_class_function(*args):
    return None


class BanLastTokenAdapter(AdapterLogitsProcessor):
    """Per-request: (output_ids, logits_row) -> bans the last output token in place.

    Used for requests whose extra_args has "ban_last"; others get None (untouched).
    """

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        if not (params.extra_args or {}).get("ban_last"):
            return None

        def ban_last(output_ids, logits_row):
            if output_ids:
                logits_row[output_ids[-1]] = float("-inf")
            return logits_row

        return ban_last


class PromptAwareAdapter(AdapterLogitsProcessor):
    """Per-request: (prompt_ids, output_ids, logits_row) -> a NEW row where the first
    prompt token's logit is set to 100 + len(output_ids)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        if not (params.extra_args or {}).get("prompt_aware"):
            return None

        def mark(prompt_ids, output_ids, logits_row):
            out = logits_row.clone()
            out[prompt_ids[0]] = 100.0 + len(output_ids)
            return out

        return mark


class ExplodingProc(LogitsProcessor):
    """Raises inside ``apply`` while any row's request has extra_args {"explode": True}."""

    def __init__(self, config, device, is_pin_memory):
        self.rows: set[int] = set()

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update) -> None:
        if not batch_update:
            return
        for row in batch_update.removed:
            self.rows.discard(row)
        for row, params, _, _ in batch_update.added:
            self.rows.discard(row)
            if (params.extra_args or {}).get("explode"):
                self.rows.add(row)
        for a, b, direction in batch_update.moved:
            had_a, had_b = a in self.rows, b in self.rows
            self.rows.discard(a)
            self.rows.discard(b)
            if had_a:
                self.rows.add(b)
            if had_b and direction.name == "SWAP":
                self.rows.add(a)

    def apply(self, logits):
        if self.rows:
            raise RuntimeError(f"boom in rows {sorted(self.rows)}")
        return logits


def _in_ray_worker() -> bool:
    """True inside a Ray worker process (never the test process itself)."""
    try:
        import ray

        return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE
    except Exception:
        return False


class FlaggedRowsProc(LogitsProcessor):
    """Tracks the rows whose request has ``extra_args[FLAG]`` set through every
    BatchUpdate (removed, then added at their pre-move indices, then moved in order; a
    unidirectional move takes the row's state from a to b, a swap exchanges them) and
    calls ``strike`` in ``apply`` while any such row is in the batch."""

    FLAG = ""

    def __init__(self, config, device, is_pin_memory):
        self.rows: set[int] = set()

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update) -> None:
        if not batch_update:
            return
        for row in batch_update.removed:
            self.rows.discard(row)
        for row, params, _, _ in batch_update.added:
            self.rows.discard(row)
            if (params.extra_args or {}).get(self.FLAG):
                self.rows.add(row)
        for a, b, direction in batch_update.moved:
            had_a, had_b = a in self.rows, b in self.rows
            self.rows.discard(a)
            self.rows.discard(b)
            if had_a:
                self.rows.add(b)
            if had_b and direction.name == "SWAP":
                self.rows.add(a)
        self.rows = {r for r in self.rows if r < batch_update.batch_size}

    def apply(self, logits):
        if self.rows:
            if not _in_ray_worker():  # never take the test process down with it
                raise RuntimeError(f"{type(self).__name__}: flagged rows {sorted(self.rows)} outside a Ray worker")
            self.strike()
        return logits

    def strike(self) -> None:
        raise NotImplementedError


class PoisonProc(FlaggedRowsProc):
    """SIGKILLs its own worker process whenever a row with extra_args {"poison": True}
    is in a batch that samples (a request that crashes every worker it runs on)."""

    FLAG = "poison"

    def strike(self) -> None:
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


class HangProc(FlaggedRowsProc):
    """Sleeps for an hour whenever a row with extra_args {"hang": True} is in a batch
    that samples (a request that hangs every worker it runs on)."""

    FLAG = "hang"

    def strike(self) -> None:
        import time

        time.sleep(3600)


class SlowStepAdapter(AdapterLogitsProcessor):
    """Per-request: sleeps ``step_sleep_ms`` (a request's ``vllm_xargs``) at each of its
    steps and changes nothing, so a stream lasts as long as a test needs whatever the
    machine's speed (draining, scaling and fault tests). Argmax-invariant: the output is
    the model's own."""

    def is_argmax_invariant(self) -> bool:
        return False  # it must run for the rows that ask, greedy or not

    def new_req_logits_processor(self, params):
        sleep_ms = (params.extra_args or {}).get("step_sleep_ms")
        if not sleep_ms:
            return None

        def slow(output_ids, logits_row):
            time.sleep(float(sleep_ms) / 1000)
            return logits_row

        return slow
