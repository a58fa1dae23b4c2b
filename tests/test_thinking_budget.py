"""Thinking budget: ReasoningConfig and ThinkingBudgetStateHolder.

The steps run as the worker and the sampler run them (``update_state`` with the
confirmed outputs, then ``apply_at_positions`` on the step's logits rows); one test
drives ``apply_to_logits``, vLLM's entry point. Every expectation here is worked out by
hand from these rules:

* a block opens with the think-start sequence; the tokens after it count (the start
  tokens themselves do not);
* a prompt whose last start sequence comes after its last end sequence opens a block,
  and the prompt tokens after that start count;
* once the count reaches the budget the end sequence is forced one token per step
  (end[0], end[1], ...); a budget of 0 forces the end right after the start;
* after the end sequence (forced or emitted by the model) the row is free again, and a
  new start opens a new block with a fresh budget;
* rows without ``thinking_token_budget`` are never touched;
* a forced row has every logit -inf except the forced token; other rows are unchanged;
* speculative decoding: with ``remaining = budget - count`` and ``k`` drafts, the forced
  position is 0 if remaining <= 0, ``remaining`` if remaining < k, else the bonus (k).
"""

from __future__ import annotations

import pytest
import torch

from sampler.logits_processor import BatchUpdate, MoveDirectionality
from sampler.params import SamplingParams
from sampler.positions import Positions
from sampler.thinking_budget import ReasoningConfig, ThinkingBudgetStateHolder

V = 32
S = 20  # single-token start
E = 22  # single-token end
S1, S2 = 20, 21  # two-token start
E1, E2, E3 = 22, 23, 24  # three-token end
UNI = MoveDirectionality.UNIDIRECTIONAL
SWAP = MoveDirectionality.SWAP


# -- helpers ------------------------------------------------------------------------


def make_holder(start, end, num_spec_tokens=0, max_num_seqs=8):
    cfg = ReasoningConfig(reasoning_start_token_ids=list(start), reasoning_end_token_ids=list(end))
    return ThinkingBudgetStateHolder(cfg, max_num_seqs, num_spec_tokens, torch.device("cpu"), False)


def params(budget):
    return SamplingParams(thinking_token_budget=budget, max_tokens=None)


def added(index, budget, prompt=(), output=None):
    return (index, params(budget), list(prompt), output if output is not None else [])


def update(batch_size, removed=(), added=(), moved=()):
    return BatchUpdate(
        batch_size=batch_size, removed=list(removed), added=list(added), moved=list(moved)
    )


_GEN = torch.Generator().manual_seed(1234)


def decode(before: torch.Tensor, after: torch.Tensor) -> list:
    """Per logits row: None if unchanged, else the single token left finite.

    Anything else (a partially edited row, NaN, more than one finite logit) fails."""
    assert after.shape == before.shape
    result = []
    for i in range(before.shape[0]):
        if torch.equal(after[i], before[i]):
            result.append(None)
            continue
        finite = torch.isfinite(after[i]).nonzero().flatten().tolist()
        assert len(finite) == 1, f"row {i}: expected exactly one finite logit, got {finite}"
        others = torch.ones(after.shape[1], dtype=torch.bool)
        others[finite[0]] = False
        assert torch.all(after[i][others] == float("-inf")), f"row {i} not masked with -inf"
        result.append(finite[0])
    return result


def forced(holder, outputs, drafts=None, bonus=False):
    """One step as the worker and the sampler run it: ``update_state`` with the
    confirmed ``outputs``, then ``apply_at_positions`` on the step's logits rows: one per
    batch row without ``drafts``; with them, one per draft position (row after row), or
    with ``bonus`` one per batch row after all of its drafts. Returns the per-logits-row
    decoding."""
    holder.update_state(outputs)
    if drafts is None:
        row_index, prefixes = range(len(outputs)), None
    else:
        at = Positions.bonus(drafts, len(outputs)) if bonus else Positions.drafts(drafts)
        row_index, prefixes = at.row_index.tolist(), at.prefixes
    logits = torch.randn(len(row_index), V, generator=_GEN) * 3
    out = holder.apply_at_positions(logits.clone(), row_index, prefixes)
    return decode(logits, out)


def run_single(holder, output, tokens):
    """Appends ``tokens`` one by one to ``output`` (row 0 of a one-row batch) and
    returns the forced token seen before each append plus the one after the last."""
    seen = [forced(holder, [output])[0]]
    for tok in tokens:
        output.append(tok)
        seen.append(forced(holder, [output])[0])
    return seen


# -- ReasoningConfig ------------------------------------------------------------------


def test_reasoning_config_keeps_ids():
    cfg = ReasoningConfig(reasoning_start_token_ids=[3, 4], reasoning_end_token_ids=[5])
    assert cfg.reasoning_start_token_ids == [3, 4]
    assert cfg.reasoning_end_token_ids == [5]


@pytest.mark.parametrize(
    "start, end", [([], [5]), ([3], []), ([], [])], ids=["empty-start", "empty-end", "both"]
)
def test_reasoning_config_rejects_empty_lists(start, end):
    with pytest.raises(ValueError):
        ReasoningConfig(reasoning_start_token_ids=start, reasoning_end_token_ids=end)


class TinyTokenizer:
    """Character-level tokenizer; prepends BOS (0) when add_special_tokens is true."""

    VOCAB = {"<": 1, "t": 2, "h": 3, "i": 4, "n": 5, "k": 6, ">": 7, "/": 8}

    def encode(self, text, add_special_tokens=True):
        ids = [self.VOCAB[c] for c in text]
        return ([0] if add_special_tokens else []) + ids


def test_reasoning_config_from_strings():
    cfg = ReasoningConfig.from_strings("<think>", "</think>", TinyTokenizer())
    assert cfg.reasoning_start_token_ids == [1, 2, 3, 4, 5, 6, 7]
    assert cfg.reasoning_end_token_ids == [1, 8, 2, 3, 4, 5, 6, 7]


def test_reasoning_config_from_strings_rejects_marker_without_tokens():
    with pytest.raises(ValueError):
        ReasoningConfig.from_strings("", "</think>", TinyTokenizer())


def test_from_strings_config_drives_the_holder():
    cfg = ReasoningConfig.from_strings("<think>", "</think>", TinyTokenizer())
    holder = ThinkingBudgetStateHolder(cfg, 4, 0, torch.device("cpu"), False)
    out = []
    holder.sync_batch(update(1, added=[added(0, 1, [9], out)]))
    start = cfg.reasoning_start_token_ids
    end = cfg.reasoning_end_token_ids
    seen = run_single(holder, out, start + [9])
    # free while the start is being written and at count 0; forced once 1 token counted
    assert seen[:-1] == [None] * (len(start) + 1)
    assert seen[-1] == end[0]
    seen = run_single(holder, out, end)
    assert seen[1:] == end[1:] + [None]


# -- single-token markers -------------------------------------------------------------


def test_budget_counts_tokens_after_start():
    holder = make_holder([S], [E])
    out = []
    holder.sync_batch(update(1, added=[added(0, 3, [1, 2], out)]))
    # before S: free; after S count 0,1,2 free; after 3rd thinking token: forced
    seen = run_single(holder, out, [5, S, 6, 7, 8])
    assert seen == [None, None, None, None, None, E]
    # the model obeys; the row is free again afterwards
    seen = run_single(holder, out, [E, 9, 10, 11, 12])
    assert seen == [E, None, None, None, None, None]


def test_new_block_after_forced_end_gets_fresh_budget():
    holder = make_holder([S], [E])
    out = []
    holder.sync_batch(update(1, added=[added(0, 2, [], out)]))
    assert run_single(holder, out, [S, 1, 2]) == [None, None, None, E]
    assert run_single(holder, out, [E, 3, 4, S]) == [E, None, None, None, None]
    # the new block counts from 0 again
    assert run_single(holder, out, [5, 6, E]) == [None, None, E, None]


def test_unbudgeted_requests_are_never_touched():
    holder = make_holder([S], [E])
    free, tracked = [], []
    holder.sync_batch(
        update(2, added=[added(0, None, [S], free), added(1, 1, [S], tracked)])
    )
    # prompt opened a block for both; only row 1 has a budget (1)
    assert forced(holder, [free, tracked]) == [None, None]
    free.append(1)
    tracked.append(1)
    assert forced(holder, [free, tracked]) == [None, E]
    for tok in [2, 3, S, 4, 5, 6, 7]:
        free.append(tok)
        assert forced(holder, [free, tracked])[0] is None


def test_model_emitting_end_closes_block():
    holder = make_holder([S], [E])
    out = []
    holder.sync_batch(update(1, added=[added(0, 3, [], out)]))
    assert run_single(holder, out, [S, 1, E]) == [None, None, None, None]
    # closed: no counting, however long it runs
    assert run_single(holder, out, list(range(1, 10))) == [None] * 10
    # an end outside a block changes nothing; a new start opens a fresh block
    assert run_single(holder, out, [E, S, 1, 2, 3]) == [None, None, None, None, None, E]


def test_budget_zero_forces_end_right_after_start():
    holder = make_holder([S], [E])
    out = []
    holder.sync_batch(update(1, added=[added(0, 0, [], out)]))
    assert run_single(holder, out, [1, 2, S]) == [None, None, None, E]
    assert run_single(holder, out, [E, 3]) == [E, None, None]


# -- multi-token markers ----------------------------------------------------------------


def test_multi_token_start_and_three_token_end():
    holder = make_holder([S1, S2], [E1, E2, E3])
    out = []
    holder.sync_batch(update(1, added=[added(0, 2, [1], out)]))
    # S1 alone opens nothing; S1 S2 opens; 2 thinking tokens reach the budget
    assert run_single(holder, out, [S1, S2, 5, 6]) == [None, None, None, None, E1]
    # the end is forced one token per step
    assert run_single(holder, out, [E1, E2, E3]) == [E1, E2, E3, None]
    assert run_single(holder, out, [7, 8, 9]) == [None, None, None, None]
    # a new block, fresh budget
    assert run_single(holder, out, [S1, S2, 10, 11, E1]) == [None, None, None, None, E1, E2]


def test_split_start_sequence_does_not_open():
    holder = make_holder([S1, S2], [E1, E2, E3])
    out = []
    holder.sync_batch(update(1, added=[added(0, 0, [], out)]))
    # S1 x S2 and S2 S1 are not the start sequence
    assert run_single(holder, out, [S1, 3, S2, S2, S1]) == [None] * 6
    # S1 S2 is; budget 0 forces right after it
    assert run_single(holder, out, [S2]) == [None, E1]


def test_budget_zero_multi_token_start():
    holder = make_holder([S1, S2], [E1, E2, E3])
    out = []
    holder.sync_batch(update(1, added=[added(0, 0, [], out)]))
    assert run_single(holder, out, [S1, S2, E1, E2, E3, 4]) == [None, None, E1, E2, E3, None, None]


def test_model_emitting_multi_token_end_closes_block():
    holder = make_holder([S1, S2], [E1, E2, E3])
    out = []
    holder.sync_batch(update(1, added=[added(0, 6, [], out)]))
    assert run_single(holder, out, [S1, S2, 1, E1, E2, E3]) == [None] * 7
    assert run_single(holder, out, list(range(1, 10))) == [None] * 10


def test_partial_end_sequence_counts_as_thinking():
    holder = make_holder([S], [E1, E2, E3])
    out = []
    holder.sync_batch(update(1, added=[added(0, 4, [], out)]))
    # E1 E2 followed by something else does not close; all 4 tokens count
    assert run_single(holder, out, [S, E1, E2, 5, 6]) == [None, None, None, None, None, E1]


# -- prompts that opened a block --------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, budget, outputs",
    [
        # prompt count 2 (tokens 2, 3); budget 3: one more token reaches it
        ([1, S, 2, 3], 3, [None, E]),
        # block already closed in the prompt: never forced by itself
        ([S, 2, E, 3], 1, [None, None, None, None]),
        # last start after last end: count 1
        ([S, 2, E, S, 3], 2, [None, E]),
        # end before start: the start still opens a block (count 1)
        ([E, S, 2], 2, [None, E]),
        # no markers at all
        ([1, 2, 3], 0, [None, None, None]),
        # the prompt alone exceeds the budget: forced at once
        ([S, 1, 2, 3, 4], 2, [E]),
        # the prompt alone reaches the budget exactly
        ([S, 1, 2], 2, [E]),
        # prompt ends with the start sequence: count 0
        ([4, S], 1, [None, E]),
    ],
)
def test_prompt_opened_block(prompt, budget, outputs):
    holder = make_holder([S], [E])
    out = []
    holder.sync_batch(update(1, added=[added(0, budget, prompt, out)]))
    fill = [5, 6, 7, 8]
    assert run_single(holder, out, fill[: len(outputs) - 1]) == outputs


def test_prompt_opened_block_multi_token_markers():
    holder = make_holder([S1, S2], [E1, E2, E3])
    out = []
    # the last start (at 5..6) comes after the last end (at 1..3): count 2 (tokens 7, 8)
    prompt = [9, E1, E2, E3, 1, S1, S2, 7, 8]
    holder.sync_batch(update(1, added=[added(0, 3, prompt, out)]))
    assert run_single(holder, out, [4, E1, E2, E3, 5]) == [None, E1, E2, E3, None, None]


def test_prompt_ending_with_multi_token_start_and_budget_zero():
    holder = make_holder([S1, S2], [E1, E2, E3])
    out = []
    holder.sync_batch(update(1, added=[added(0, 0, [1, S1, S2], out)]))
    assert run_single(holder, out, [E1, E2, E3]) == [E1, E2, E3, None]


def test_prompt_closes_block_with_multi_token_end():
    holder = make_holder([S1, S2], [E1, E2, E3])
    out = []
    holder.sync_batch(update(1, added=[added(0, 0, [S1, S2, 5, E1, E2, E3, 6], out)]))
    assert run_single(holder, out, [7, 8]) == [None, None, None]


def test_resumed_request_arrives_with_output_so_far():
    """An added request carries its output so far; it is read from the prompt on."""
    holder = make_holder([S], [E])
    out = [1, S, 2]  # count 1
    holder.sync_batch(update(1, added=[added(0, 2, [3], out)]))
    assert run_single(holder, out, [4]) == [None, E]


# -- following the persistent batch ----------------------------------------------------


def test_state_follows_adds_removes_moves_and_swaps():
    holder = make_holder([S], [E])
    r0, r1, r2, r3 = [S, 1], [S, 1], [S, 1, 2, 3], [S]
    # budgets: r0 2 (count 1), r1 1 (count 1 -> forced), r2 none, r3 5 (count 0)
    holder.sync_batch(
        update(
            4,
            added=[added(0, 2, [], r0), added(1, 1, [], r1), added(2, None, [], r2),
                   added(3, 5, [], r3)],
        )
    )
    assert forced(holder, [r0, r1, r2, r3]) == [None, E, None, None]

    # swap 0 <-> 1: the forced request is now in row 0
    holder.sync_batch(update(4, moved=[(0, 1, SWAP)]))
    assert forced(holder, [r1, r0, r2, r3]) == [E, None, None, None]

    # r1 finishes (row 0); condense: 3 -> 0 unidirectional; r1's state is gone
    holder.sync_batch(update(3, removed=[0], moved=[(3, 0, UNI)]))
    rows = [r3, r0, r2]
    assert forced(holder, rows) == [None, None, None]
    r0.append(4)  # r0 reaches its budget of 2
    assert forced(holder, rows) == [None, E, None]

    # a unidirectional move onto an occupied row discards what was there (no remove)
    holder.sync_batch(update(2, moved=[(2, 1, UNI)]))
    rows = [r3, r2]
    assert forced(holder, rows) == [None, None]
    r2.append(5)
    assert forced(holder, rows) == [None, None]

    # a new request replaces row 0 without a remove: r3's state is discarded
    r4 = [S, 1, 2]
    holder.sync_batch(update(2, added=[added(0, None, [], r4)]))
    rows = [r4, r2]
    r4.extend([3, 4, 5])
    assert forced(holder, rows) == [None, None]

    # added at 2 (extending), then swapped 2 <-> 0: the add index is before moves
    r5 = [S, 7]
    holder.sync_batch(update(3, added=[added(2, 1, [], r5)], moved=[(2, 0, SWAP)]))
    assert forced(holder, [r5, r2, r4]) == [E, None, None]


def test_vacated_row_is_empty_after_unidirectional_move():
    holder = make_holder([S], [E])
    a, b = [S, 1], [S]
    # a: budget 1, count 1 -> forced; b: budget 2, count 0
    holder.sync_batch(update(2, added=[added(0, 1, [], a), added(1, 2, [], b)]))
    assert forced(holder, [a, b]) == [E, None]
    # condense 1 -> 0: a is discarded, b lands in row 0, row 1 is empty
    holder.sync_batch(update(1, moved=[(1, 0, UNI)]))
    assert forced(holder, [b]) == [None]
    # a request without a budget at row 1: nothing may leak into it
    c = [S, 1, 2, 3]
    holder.sync_batch(update(2, added=[added(1, None, [], c)]))
    assert forced(holder, [b, c]) == [None, None]
    b.extend([5, 6])
    assert forced(holder, [b, c]) == [E, None]


def test_removed_row_state_is_discarded():
    holder = make_holder([S], [E])
    a = [S, 1]
    holder.sync_batch(update(1, added=[added(0, 1, [], a)]))
    assert forced(holder, [a]) == [E]
    assert holder.has_tracked_requests()
    holder.sync_batch(update(0, removed=[0]))
    assert not holder.has_tracked_requests()
    assert forced(holder, []) == []
    # a later request at row 0 without a budget: untouched
    b = [S, 1, 2]
    holder.sync_batch(update(1, added=[added(0, None, [], b)]))
    assert not holder.has_tracked_requests()
    assert forced(holder, [b]) == [None]


def test_none_update_keeps_state_and_reads_new_tokens():
    holder = make_holder([S], [E])
    a = []
    holder.sync_batch(update(1, added=[added(0, 1, [], a)]))
    for tok in [S, 1]:
        holder.sync_batch(None)
        a.append(tok)
    holder.sync_batch(None)
    assert forced(holder, [a]) == [E]


# -- speculative decoding -----------------------------------------------------------------


def spec_case(budget, prompt, confirmed, start=(S,), end=(E,), num_spec=4):
    holder = make_holder(start, end, num_spec_tokens=num_spec)
    out = list(confirmed)
    holder.sync_batch(update(1, added=[added(0, budget, prompt, out)]))
    return holder, out


FILL = [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    "budget, prompt, confirmed, k, position",
    [
        # remaining = 3 - 3 = 0 -> position 0
        (3, [], [S, 7, 8, 9], 3, 0),
        # remaining = 3 - 5 = -2 (the prompt alone exceeds) -> position 0
        (3, [S, 7, 8, 9, 10, 11], [], 3, 0),
        # remaining = 3 - 1 = 2 < 4 -> position 2
        (3, [], [S, 7], 4, 2),
        # remaining = 1 < 3 -> position 1
        (2, [S], [7], 3, 1),
        # remaining = 4 - 1 = 3 == k -> bonus (position 3)
        (4, [], [S, 7], 3, 3),
        # remaining = 1 == k = 1 -> bonus
        (1, [S], [], 1, 1),
        # remaining = 0 with k = 0 -> bonus (the only position)
        (1, [S, 7], [], 0, 0),
        # remaining = 6 > 3 -> nothing forced
        (6, [], [S], 3, None),
        # budget 0 right after the start: remaining 0 -> position 0
        (0, [], [S], 2, 0),
    ],
)
def test_spec_forced_position(budget, prompt, confirmed, k, position):
    drafts = FILL[:k]
    holder, out = spec_case(budget, prompt, confirmed)
    rows = forced(holder, [out], [drafts])
    if position is None:
        assert rows == [None] * k
    else:
        # no forcing before the position, the end token at it (later ones: don't care,
        # the draft there is not the end token, so it is rejected)
        assert rows[:position] == [None] * min(position, k)
        if position < k:
            assert rows[position] == E
    bonus = forced(holder, [out], [drafts], bonus=True)
    if position is None:
        assert bonus == [None]
    elif position == k:
        assert bonus == [E]


def test_spec_draft_rows_layout_over_several_requests():
    holder = make_holder([S], [E], num_spec_tokens=3)
    r0, r1, r2, r3 = [S, 1, 2, 3], [S], [S, 1], [S]
    holder.sync_batch(
        update(
            4,
            added=[added(0, None, [], r0), added(1, 2, [], r1), added(2, 1, [], r2),
                   added(3, 3, [], r3)],
        )
    )
    drafts = [[4, 5], [6, 7, 8], [], [9, 10]]
    outputs = [r0, r1, r2, r3]
    # r0: no budget. r1: count 0, budget 2, k 3 -> position 2 (flat row 2 + 2 = 4).
    # r2: count 1 = budget, k 0 -> only the bonus. r3: remaining 3 > 2 -> nothing.
    rows = forced(holder, outputs, drafts)
    assert rows == [None, None, None, None, E, None, None]
    bonus = forced(holder, outputs, drafts, bonus=True)
    assert bonus[0] is None
    assert bonus[2] == E
    assert bonus[3] is None


def test_apply_to_logits_takes_vllms_layout():
    """vLLM's entry point: each output list ends with its row's drafts
    (``spec_token_ids``), and the logits rows are the draft positions row after row, or
    with ``predict_bonus_token`` one bonus row per batch row. It forces what the
    sampler's positions force, and the drafts never count as confirmed."""
    holder = make_holder([S], [E], num_spec_tokens=3)
    confirmed = [[S, 1, 2, 3], [S], [S, 1], [S]]
    holder.sync_batch(
        update(
            4,
            added=[added(0, None, [], confirmed[0]), added(1, 2, [], confirmed[1]),
                   added(2, 1, [], confirmed[2]), added(3, 3, [], confirmed[3])],
        )
    )
    drafts = [[4, 5], [6, 7, 8], [], [9, 10]]
    with_drafts = [c + d for c, d in zip(confirmed, drafts)]

    def apply_to_logits(spec, predict_bonus_token, n_rows):
        holder.update_state(with_drafts if spec else confirmed, spec)
        logits = torch.randn(n_rows, V, generator=_GEN) * 3
        return decode(logits, holder.apply_to_logits(logits.clone(), predict_bonus_token, spec))

    for _ in range(2):  # read twice: the same answer, so the drafts were not confirmed
        assert apply_to_logits(drafts, False, 7) == [None, None, None, None, E, None, None]
        bonus = apply_to_logits(drafts, True, 4)
        assert bonus[0] is None and bonus[2] == E and bonus[3] is None
        assert bonus == forced(holder, confirmed, drafts, bonus=True)
    # without drafts: one row per batch row; r2 is at its budget
    assert apply_to_logits(None, False, 4) == [None, None, E, None]


def test_spec_drafts_following_the_end_sequence():
    holder, out = spec_case(2, [], [S, 7], end=(E1, E2, E3))
    drafts = [8, E1, E2]  # count 1 -> 8 reaches 2; then the drafts write the end
    rows = forced(holder, [out], [drafts])
    assert rows == [None, E1, E2]
    bonus = forced(holder, [out], [drafts], bonus=True)
    assert bonus == [E3]


def test_spec_single_end_accepted_frees_later_positions():
    holder, out = spec_case(1, [], [S])
    drafts = [7, E, 8]
    rows = forced(holder, [out], [drafts])
    assert rows == [None, E, None]
    bonus = forced(holder, [out], [drafts], bonus=True)
    assert bonus == [None]


def test_spec_model_end_in_drafts_closes_block():
    holder, out = spec_case(5, [], [S, 1])
    drafts = [E, 2, 3]
    rows = forced(holder, [out], [drafts])
    assert rows == [None, None, None]
    bonus = forced(holder, [out], [drafts], bonus=True)
    assert bonus == [None]


def test_spec_drafts_are_not_counted_as_confirmed_across_steps():
    holder, out = spec_case(4, [], [S])
    drafts = [1, 2, 3]
    # count 0, remaining 4 > 3: nothing (counting the drafts as confirmed would give 1)
    rows = forced(holder, [out], [drafts])
    assert rows == [None, None, None]
    assert forced(holder, [out], [drafts], bonus=True) == [None]

    # next step: 1 accepted, then a recovered token: confirmed count 2
    out.extend([1, 9])
    drafts = [4, 5, 6]  # remaining 2 < 3 -> position 2
    rows = forced(holder, [out], [drafts])
    assert rows[:3] == [None, None, E]

    # next step: 4, 5 accepted, then the forced E at position 2: block closed
    out.extend([4, 5, E])
    drafts = [6, 7]
    rows = forced(holder, [out], [drafts])
    assert rows == [None, None]
    assert forced(holder, [out], [drafts], bonus=True) == [None]


def test_spec_mid_end_sequence_across_steps():
    holder, out = spec_case(3, [], [S, 1], end=(E1, E2, E3))
    drafts = [2, 3]  # remaining 2 == k: bonus forced E1
    rows = forced(holder, [out], [drafts])
    assert rows == [None, None]
    assert forced(holder, [out], [drafts], bonus=True) == [E1]
    out.extend([2, 3, E1])  # both accepted, bonus E1
    drafts = [E2, E3]
    rows = forced(holder, [out], [drafts])
    assert rows == [E2, E3]
    assert forced(holder, [out], [drafts], bonus=True) == [None]


def test_spec_unbudgeted_rows_untouched():
    holder = make_holder([S], [E], num_spec_tokens=2)
    a = [S, 1, 2, 3]
    holder.sync_batch(update(1, added=[added(0, None, [S], a)]))
    drafts = [4, 5]
    assert forced(holder, [a], [drafts]) == [None, None]
    assert forced(holder, [a], [drafts], bonus=True) == [None]
