"""The logits-processor framework: BatchUpdate, BatchUpdateBuilder, LogitsProcessors,
process_dict_updates, build_logitsprocs / loading (classes, "module:Qualname" strings,
entry points), validate_request_params, and AdapterLogitsProcessor."""

from __future__ import annotations

import dataclasses
import re
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import torch

from sampler.config import SamplerConfig
from sampler.logits_processor import (
    AdapterLogitsProcessor,
    BatchUpdate,
    BatchUpdateBuilder,
    LogitBiasLogitsProcessor,
    LogitsProcessor,
    LogitsProcessors,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
    MoveDirectionality,
    build_logitsprocs,
    process_dict_updates,
)
from sampler.logits_processor import loading as loading_mod
from sampler.logits_processor.loading import validate_request_params
from sampler.params import SamplingParams

# The helper module lives beside this file; make it importable by its plain name whatever
# pytest's rootdir/import mode, so "procs_for_tests:Cls" strings resolve to it.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
import procs_for_tests as pft  # noqa: E402

MOD = pft.__name__
GROUP = "raydecode.logits_processors"
UNI = MoveDirectionality.UNIDIRECTIONAL
SWAP = MoveDirectionality.SWAP
BUILTINS = {MinPLogitsProcessor, LogitBiasLogitsProcessor, MinTokensLogitsProcessor}
VOCAB = 16


def _config(**kw) -> SamplerConfig:
    return SamplerConfig(vocab_size=VOCAB, max_num_seqs=8, **kw)


@pytest.fixture
def no_entry_points(monkeypatch):
    """Isolate from whatever the environment has installed in the group."""
    monkeypatch.setattr(loading_mod, "entry_points", lambda *a, **kw: [])


def _fake_entry_points(monkeypatch, eps):
    calls = []

    def fake(*args, group=None, **kw):
        calls.append(group)
        return [ep for ep in eps if ep.group == group]

    monkeypatch.setattr(loading_mod, "entry_points", fake)
    return calls


def _update(batch_size, removed=(), added=(), moved=()):
    return BatchUpdate(batch_size=batch_size, removed=list(removed), added=list(added),
                       moved=list(moved))


# -- BatchUpdate -------------------------------------------------------------------------


def test_batch_update_is_frozen():
    bu = _update(2, removed=[1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        bu.batch_size = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        bu.removed = []
    assert bu.batch_size == 2 and list(bu.removed) == [1]


def test_move_directionality_members():
    assert {m.name for m in MoveDirectionality} == {"UNIDIRECTIONAL", "SWAP"}


# -- BatchUpdateBuilder --------------------------------------------------------------------


def test_builder_removed_descending_and_pop_lowest_first():
    b = BatchUpdateBuilder()
    for i in (3, 1, 5, 0, 4):
        b.removed_append(i)
    assert b.has_removed()
    assert list(b.removed) == [5, 4, 3, 1, 0]
    assert b.peek_removed() == 0
    assert b.peek_removed() == 0  # peek does not consume
    assert [b.pop_removed() for _ in range(5)] == [0, 1, 3, 4, 5]
    assert b.pop_removed() is None
    assert b.peek_removed() is None
    assert not b.has_removed()


def test_builder_pop_without_reading_first():
    b = BatchUpdateBuilder()
    for i in (7, 2, 9):
        b.removed_append(i)
    assert b.peek_removed() == 2
    assert b.pop_removed() == 2
    assert b.pop_removed() == 7
    assert list(b.removed) == [9]


@pytest.mark.parametrize("read", ["removed", "peek", "pop"])
def test_builder_removed_append_after_read_raises(read):
    b = BatchUpdateBuilder()
    b.removed_append(2)
    b.removed_append(6)
    b.removed_append(4)  # appending before any read is fine
    if read == "removed":
        _ = b.removed
    elif read == "peek":
        assert b.peek_removed() == 2
    else:
        assert b.pop_removed() == 2
    with pytest.raises(RuntimeError):
        b.removed_append(1)


def test_builder_get_and_reset_none_when_unchanged():
    b = BatchUpdateBuilder()
    assert b.get_and_reset(4) is None
    assert b.get_and_reset(0) is None


def test_builder_get_and_reset_returns_update_then_starts_empty():
    params = SamplingParams()
    prompt, out = [1, 2], []
    b = BatchUpdateBuilder()
    b.removed_append(3)
    b.removed_append(1)
    assert b.pop_removed() == 1  # the lowest hole is filled by the add below
    b.added.append((1, params, prompt, out))
    b.moved.append((4, 3, UNI))
    bu = b.get_and_reset(4)
    assert isinstance(bu, BatchUpdate)
    assert bu.batch_size == 4
    assert list(bu.removed) == [3]
    assert len(bu.added) == 1
    idx, p, pr, o = bu.added[0]
    assert idx == 1 and p is params and pr is prompt and o is out
    assert list(bu.moved) == [(4, 3, UNI)]
    # the builder starts afresh
    assert list(b.removed) == [] and list(b.added) == [] and list(b.moved) == []
    assert b.get_and_reset(4) is None
    # ...and later use of the builder does not touch the returned update
    b.removed_append(0)  # the removed-read lock was reset: appending is allowed again
    b.added.append((2, params, [9], []))
    b.moved.append((0, 1, SWAP))
    assert list(bu.removed) == [3]
    assert len(bu.added) == 1 and bu.added[0][0] == 1
    assert list(bu.moved) == [(4, 3, UNI)]
    bu2 = b.get_and_reset(3)
    assert list(bu2.removed) == [0]
    assert [a[0] for a in bu2.added] == [2]
    assert list(bu2.moved) == [(0, 1, SWAP)]
    assert list(bu.removed) == [3]  # still untouched


def test_builder_get_and_reset_none_still_unlocks_removed():
    b = BatchUpdateBuilder()
    b.removed_append(1)
    assert b.pop_removed() == 1  # read (and emptied) the removed rows
    assert b.get_and_reset(3) is None
    b.removed_append(2)  # a new step: registering removals works again
    assert list(b.removed) == [2]


def test_builder_get_and_reset_only_moves():
    b = BatchUpdateBuilder()
    b.moved.append((0, 1, SWAP))
    bu = b.get_and_reset(2)
    assert bu is not None and list(bu.moved) == [(0, 1, SWAP)]
    assert list(bu.removed) == [] and list(bu.added) == []


def test_builder_reset_reports_change():
    b = BatchUpdateBuilder()
    assert b.reset() is False
    b.removed_append(2)
    assert b.reset() is True
    assert list(b.removed) == []
    assert b.reset() is False
    b.batch_changed = True  # e.g. a change not listed in removed/added/moved
    assert b.reset() is True
    assert b.reset() is False
    # reset also clears collected adds and moves, and the removed-read lock
    b.added.append((0, SamplingParams(), [], []))
    b.moved.append((1, 0, UNI))
    b.removed_append(5)
    _ = b.removed
    b.reset()
    assert list(b.added) == [] and list(b.moved) == []
    b.removed_append(1)  # allowed again after reset
    assert list(b.removed) == [1]


# -- LogitsProcessors container ------------------------------------------------------


def test_logits_processors_split_by_argmax_invariance():
    cfg = _config()
    inv1 = pft.InvariantProc(cfg, torch.device("cpu"), False)
    inv2 = pft.InvariantProc(cfg, torch.device("cpu"), False)
    rec = pft.RecordingProc(cfg, torch.device("cpu"), False)
    procs = LogitsProcessors([rec, inv1, inv2])
    assert list(procs.argmax_invariant) == [inv1, inv2]
    assert list(procs.non_argmax_invariant) == [rec]
    all_ = list(procs.all)
    assert len(all_) == 3 and {id(p) for p in all_} == {id(rec), id(inv1), id(inv2)}
    assert len(list(procs.all)) == 3  # .all can be iterated again
    empty = LogitsProcessors()
    assert list(empty.all) == [] and list(empty.argmax_invariant) == []
    assert list(LogitsProcessors(None).non_argmax_invariant) == []


# -- process_dict_updates ---------------------------------------------------------------


def _p(tag):
    """Params whose state (by the new_state below) is ``tag``, or None when tag is None."""
    return SamplingParams(extra_args=None if tag is None else {"tag": tag})


def _new_state(params, prompt_ids, output_ids):
    return (params.extra_args or {}).get("tag")


def _add(row, tag):
    return (row, _p(tag), [100 + row], [])


def test_pdu_none_update_is_noop():
    entries = {0: "A"}
    assert process_dict_updates(entries, None, _new_state) is False
    assert entries == {0: "A"}


def test_pdu_add_passes_fields_to_new_state():
    seen = []
    params = _p("X")
    prompt, out = [1, 2, 3], [4]

    def new_state(p, pr, o):
        seen.append((p, pr, o))
        return "X"

    entries = {}
    assert process_dict_updates(entries, _update(1, added=[(0, params, prompt, out)]),
                                new_state) is True
    assert entries == {0: "X"}
    assert len(seen) == 1 and seen[0][0] is params and seen[0][1] is prompt
    assert seen[0][2] is out


def test_pdu_adds():
    entries = {}
    bu = _update(3, added=[_add(0, "A"), _add(1, None), _add(2, "C")])
    assert process_dict_updates(entries, bu, _new_state) is True
    assert entries == {0: "A", 2: "C"}


def test_pdu_add_replaces_and_add_none_clears():
    entries = {0: "A", 1: "B"}
    bu = _update(2, added=[_add(0, "D"), _add(1, None)])
    assert process_dict_updates(entries, bu, _new_state) is True
    assert entries == {0: "D"}


def test_pdu_add_none_on_empty_row_reports_no_change():
    entries = {0: "A"}
    assert process_dict_updates(entries, _update(2, added=[_add(1, None)]), _new_state) is False
    assert entries == {0: "A"}


def test_pdu_remove():
    entries = {0: "A", 1: "B", 2: "C"}
    assert process_dict_updates(entries, _update(2, removed=[1]), _new_state) is True
    assert entries == {0: "A", 2: "C"}
    # removing a row this processor has no state for changes nothing
    assert process_dict_updates(entries, _update(2, removed=[1]), _new_state) is False
    assert entries == {0: "A", 2: "C"}


def test_pdu_unidirectional_move_discards_destination():
    entries = {0: "A", 1: "B", 3: "D"}
    assert process_dict_updates(entries, _update(3, moved=[(3, 1, UNI)]), _new_state) is True
    assert entries == {0: "A", 1: "D"}


def test_pdu_unidirectional_move_from_stateless_row_clears_destination():
    # Row 3 holds a request without state here; it moves onto row 1, whose request is
    # discarded (seed: "If another request already resided at index d, it is replaced").
    entries = {0: "A", 1: "B"}
    assert process_dict_updates(entries, _update(2, moved=[(3, 1, UNI)]), _new_state) is True
    assert entries == {0: "A"}


def test_pdu_unidirectional_move_into_empty_row():
    entries = {3: "D"}
    assert process_dict_updates(entries, _update(2, moved=[(3, 1, UNI)]), _new_state) is True
    assert entries == {1: "D"}


def test_pdu_swap():
    entries = {0: "A", 1: "B", 3: "D"}
    assert process_dict_updates(entries, _update(4, moved=[(3, 1, SWAP)]), _new_state) is True
    assert entries == {0: "A", 1: "D", 3: "B"}


def test_pdu_swap_with_stateless_row():
    entries = {1: "B"}
    assert process_dict_updates(entries, _update(4, moved=[(1, 3, SWAP)]), _new_state) is True
    assert entries == {3: "B"}
    entries = {1: "B"}
    assert process_dict_updates(entries, _update(4, moved=[(3, 1, SWAP)]), _new_state) is True
    assert entries == {3: "B"}


def test_pdu_moves_among_stateless_rows_report_no_change():
    entries = {0: "A"}
    bu = _update(4, moved=[(2, 3, SWAP), (3, 1, UNI)])
    assert process_dict_updates(entries, bu, _new_state) is False
    assert entries == {0: "A"}


def test_pdu_fewer_new_than_finished():
    # [A,B,C,D]; add E at 0, remove 2, move 3->2, swap 0<->1 -> [B,E,D]
    entries = {0: "A", 1: "B", 2: "C", 3: "D"}
    bu = _update(3, removed=[2], added=[_add(0, "E")], moved=[(3, 2, UNI), (0, 1, SWAP)])
    assert process_dict_updates(entries, bu, _new_state) is True
    assert entries == {0: "B", 1: "E", 2: "D"}


def test_pdu_more_new_than_finished():
    # [A,B,C,D]; add E at 2, F at 4, swap 0<->1 -> [B,A,E,D,F]
    entries = {0: "A", 1: "B", 2: "C", 3: "D"}
    bu = _update(5, added=[_add(2, "E"), _add(4, "F")], moved=[(0, 1, SWAP)])
    assert process_dict_updates(entries, bu, _new_state) is True
    assert entries == {0: "B", 1: "A", 2: "E", 3: "D", 4: "F"}


def test_pdu_order_removes_then_adds_then_moves():
    # add index refers to the row before moves: E added at 2, then 2 swaps with 0
    entries = {0: "A", 1: "B", 2: "C"}
    bu = _update(3, removed=[2], added=[_add(2, "E")], moved=[(2, 0, SWAP)])
    assert process_dict_updates(entries, bu, _new_state) is True
    assert entries == {0: "E", 1: "B", 2: "A"}


# -- build_logitsprocs and loading ------------------------------------------------------


def _types(procs: LogitsProcessors) -> list[type]:
    return [type(p) for p in procs.all]


def test_build_loads_the_three_builtins(no_entry_points):
    procs = build_logitsprocs(_config(), "cpu", False, [])
    assert isinstance(procs, LogitsProcessors)
    types = _types(procs)
    assert sorted(t.__name__ for t in types) == sorted(t.__name__ for t in BUILTINS)
    assert set(types) == BUILTINS
    assert [type(p) for p in procs.argmax_invariant] == [MinPLogitsProcessor]
    assert {type(p) for p in procs.non_argmax_invariant} == {
        LogitBiasLogitsProcessor, MinTokensLogitsProcessor}


def test_build_with_custom_class_objects(no_entry_points):
    cfg = _config()
    procs = build_logitsprocs(cfg, "cpu", False, [pft.RecordingProc, pft.InvariantProc])
    types = _types(procs)
    assert set(types) == BUILTINS | {pft.RecordingProc, pft.InvariantProc}
    assert types.count(pft.RecordingProc) == 1
    rec = next(p for p in procs.all if type(p) is pft.RecordingProc)
    assert rec in list(procs.non_argmax_invariant)
    assert any(type(p) is pft.InvariantProc for p in procs.argmax_invariant)
    # built as Cls(config, device, is_pin_memory)
    assert rec.config is cfg
    assert torch.device(rec.device) == torch.device("cpu")
    assert rec.is_pin_memory is False


def test_build_with_fqcn_strings(no_entry_points):
    procs = build_logitsprocs(
        _config(), "cpu", False, [f"{MOD}:RecordingProc", f"{MOD}:Outer.Inner"]
    )
    types = _types(procs)
    assert pft.RecordingProc in types
    assert pft.Outer.Inner in types
    assert set(types) == BUILTINS | {pft.RecordingProc, pft.Outer.Inner}


def test_build_uses_config_logits_processors_by_default(no_entry_points):
    cfg = _config(logits_processors=[f"{MOD}:RecordingProc"])
    procs = build_logitsprocs(cfg, "cpu", False)
    assert pft.RecordingProc in _types(procs)


def test_built_processors_receive_update_state(no_entry_points):
    procs = build_logitsprocs(_config(), "cpu", False, [pft.RecordingProc])
    rec = next(p for p in procs.all if type(p) is pft.RecordingProc)
    bu = _update(1, added=[(0, SamplingParams(), [1], [])])
    procs.update_state(bu)
    procs.update_state(None)
    assert rec.updates == [bu, None]


BAD_SPECS = [
    # (entry, reason pattern)
    (f"{MOD}.RecordingProc", r"':'|colon|module:|Qualname|format"),
    (f"{MOD}:RecordingProc:extra", r"':'|colon|module:|Qualname|format"),
    ("a:b:c", r"':'|colon|module:|Qualname|format"),
    (":RecordingProc", r"empty|module"),
    (f"{MOD}:", r"empty|name|class"),
    (f"{MOD}:NoSuchClass", r"attribute|has no|not found|NoSuchClass"),
    (f"{MOD}:Outer.Missing", r"attribute|has no|not found|Missing"),
    (f"{MOD}:NOT_A_CLASS", r"not a class|class"),
    (f"{MOD}:not_a_class_function", r"not a class|class"),
    (f"{MOD}:NotAProcessor", r"LogitsProcessor"),
    ("raydecode_no_such_module_xyz:Thing", r"import|module"),
]


@pytest.mark.parametrize(("entry", "why"), BAD_SPECS, ids=[e for e, _ in BAD_SPECS])
def test_bad_fqcn_entries_raise_naming_entry_and_reason(no_entry_points, entry, why):
    with pytest.raises((ValueError, RuntimeError)) as excinfo:
        build_logitsprocs(_config(), "cpu", False, [entry])
    msg = str(excinfo.value)
    assert entry in msg, msg
    assert re.search(why, msg, re.IGNORECASE), msg


def test_bad_class_object_entry_rejected(no_entry_points):
    with pytest.raises((ValueError, RuntimeError)) as excinfo:
        build_logitsprocs(_config(), "cpu", False, [pft.NotAProcessor])
    assert "NotAProcessor" in str(excinfo.value)
    assert "LogitsProcessor" in str(excinfo.value)


def test_module_raising_on_import(no_entry_points, tmp_path, monkeypatch):
    name = "raydecode_broken_procs_mod_for_tests"
    (tmp_path / f"{name}.py").write_text("raise ImportError('boom from broken module')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    entry = f"{name}:Proc"
    with pytest.raises((ValueError, RuntimeError)) as excinfo:
        build_logitsprocs(_config(), "cpu", False, [entry])
    msg = str(excinfo.value)
    assert entry in msg and re.search(r"import", msg, re.IGNORECASE), msg
    assert "boom from broken module" in msg or "boom from broken module" in repr(
        excinfo.value.__cause__)


def test_entry_point_class_is_loaded(monkeypatch):
    calls = _fake_entry_points(
        monkeypatch,
        [
            EntryPoint(name="recording", value=f"{MOD}:RecordingProc", group=GROUP),
            EntryPoint(name="other-group", value=f"{MOD}:InvariantProc", group="other.group"),
        ],
    )
    procs = build_logitsprocs(_config(), "cpu", False, [])
    types = _types(procs)
    assert GROUP in calls
    assert pft.RecordingProc in types
    assert pft.InvariantProc not in types  # registered under another group
    assert set(types) == BUILTINS | {pft.RecordingProc}


def test_entry_point_and_fqcn_together(monkeypatch):
    _fake_entry_points(
        monkeypatch, [EntryPoint(name="inv", value=f"{MOD}:InvariantProc", group=GROUP)]
    )
    procs = build_logitsprocs(_config(), "cpu", False, [f"{MOD}:RecordingProc"])
    assert set(_types(procs)) == BUILTINS | {pft.RecordingProc, pft.InvariantProc}


@pytest.mark.parametrize(
    "value",
    ["raydecode_no_such_module_xyz:Thing", f"{MOD}:NoSuchClass"],
    ids=["missing-module", "missing-attr"],
)
def test_failing_entry_point_raises_naming_it(monkeypatch, value):
    _fake_entry_points(monkeypatch, [EntryPoint(name="broken-proc", value=value, group=GROUP)])
    with pytest.raises(RuntimeError) as excinfo:
        build_logitsprocs(_config(), "cpu", False, [])
    assert "broken-proc" in str(excinfo.value)


def test_entry_point_to_non_processor_rejected(monkeypatch):
    _fake_entry_points(
        monkeypatch, [EntryPoint(name="not-a-proc", value=f"{MOD}:NotAProcessor", group=GROUP)]
    )
    with pytest.raises((ValueError, RuntimeError)) as excinfo:
        build_logitsprocs(_config(), "cpu", False, [])
    assert "not-a-proc" in str(excinfo.value)


# -- validate_request_params -----------------------------------------------------------


def test_validate_request_params_calls_each_class(no_entry_points):
    procs = build_logitsprocs(_config(), "cpu", False, [pft.RecordingProc, pft.InvariantProc])
    pft.VALIDATE_CALLS.clear()
    ok = SamplingParams()
    validate_request_params(procs, ok)
    called = sorted(name for name, _ in pft.VALIDATE_CALLS)
    assert called == ["InvariantProc", "RecordingProc"]
    assert all(p is ok for _, p in pft.VALIDATE_CALLS)
    bad = SamplingParams(extra_args={"reject_me": True})
    with pytest.raises(ValueError, match="reject_me"):
        validate_request_params(procs, bad)


def test_validate_request_params_builtins_only_accepts(no_entry_points):
    procs = build_logitsprocs(_config(), "cpu", False, [])
    validate_request_params(procs, SamplingParams(min_p=0.2, logit_bias={1: 1.0},
                                                  min_tokens=2))


# -- AdapterLogitsProcessor ---------------------------------------------------------------


def _ban_params():
    return SamplingParams(extra_args={"ban_last": True})


def _prompt_params():
    return SamplingParams(extra_args={"prompt_aware": True})


def _logits(rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g)


def _expect_banned(row_before, banned):
    exp = row_before.clone()
    for t in banned:
        exp[t] = float("-inf")
    return exp


def test_adapter_is_a_logits_processor():
    proc = pft.BanLastTokenAdapter(_config(), torch.device("cpu"), False)
    assert isinstance(proc, AdapterLogitsProcessor) and isinstance(proc, LogitsProcessor)
    assert proc.is_argmax_invariant() is False


def test_adapter_sees_live_output_list_and_skips_none_rows():
    proc = pft.BanLastTokenAdapter(_config(), torch.device("cpu"), False)
    out0, out1 = [], []
    proc.update_state(_update(2, added=[(0, _ban_params(), [1], out0),
                                        (1, SamplingParams(), [2], out1)]))
    logits = _logits(2)
    before = logits.clone()
    res = proc.apply(logits)
    assert torch.equal(res, before)  # no output yet: nothing to ban

    out0.append(3)  # the worker appends after update_state
    out1.append(4)
    proc.update_state(None)
    logits = _logits(2, seed=1)
    before = logits.clone()
    res = proc.apply(logits)
    assert torch.equal(res[0], _expect_banned(before[0], [3]))
    assert torch.equal(res[1], before[1])  # None processor: row untouched

    out0.append(5)  # no update_state call at all: still the live list
    logits = _logits(2, seed=2)
    before = logits.clone()
    res = proc.apply(logits)
    assert torch.equal(res[0], _expect_banned(before[0], [5]))
    assert torch.equal(res[1], before[1])


def test_adapter_three_arg_callable_gets_prompt_and_new_tensor_written_back():
    proc = pft.PromptAwareAdapter(_config(), torch.device("cpu"), False)
    prompt, out = [7, 1], [2, 2]
    proc.update_state(_update(2, added=[(1, _prompt_params(), prompt, out),
                                        (0, SamplingParams(), [9], [])]))
    logits = _logits(2)
    before = logits.clone()
    res = proc.apply(logits)
    exp1 = before[1].clone()
    exp1[7] = 102.0  # 100 + len(output)
    assert torch.equal(res[1], exp1)
    assert torch.equal(res[0], before[0])
    out.append(3)
    res = proc.apply(_logits(2))
    assert res[1][7].item() == 103.0


def test_adapter_readd_with_none_clears_row():
    proc = pft.BanLastTokenAdapter(_config(), torch.device("cpu"), False)
    out = [2]
    proc.update_state(_update(1, added=[(0, _ban_params(), [1], out)]))
    res = proc.apply(_logits(1))
    assert res[0][2].item() == float("-inf")
    # a new request without the processor replaces row 0
    proc.update_state(_update(1, added=[(0, SamplingParams(), [1], [2])]))
    logits = _logits(1)
    before = logits.clone()
    assert torch.equal(proc.apply(logits), before)


def test_adapter_state_follows_swaps_and_moves():
    proc = pft.BanLastTokenAdapter(_config(), torch.device("cpu"), False)
    out_a, out_c = [3], [7]
    proc.update_state(_update(3, added=[(0, _ban_params(), [1], out_a),
                                        (1, SamplingParams(), [1], [9]),
                                        (2, _ban_params(), [1], out_c)]))
    logits = _logits(3)
    before = logits.clone()
    res = proc.apply(logits)
    assert torch.equal(res[0], _expect_banned(before[0], [3]))
    assert torch.equal(res[1], before[1])
    assert torch.equal(res[2], _expect_banned(before[2], [7]))

    # swap rows 0 and 1: A's processor now on row 1, row 0 untouched
    proc.update_state(_update(3, moved=[(0, 1, SWAP)]))
    logits = _logits(3, seed=1)
    before = logits.clone()
    res = proc.apply(logits)
    assert torch.equal(res[0], before[0])
    assert torch.equal(res[1], _expect_banned(before[1], [3]))
    assert torch.equal(res[2], _expect_banned(before[2], [7]))

    # A (row 1) finishes; condense C from row 2 into row 1
    proc.update_state(_update(2, removed=[1], moved=[(2, 1, UNI)]))
    out_c.append(11)
    logits = _logits(2, seed=2)
    before = logits.clone()
    res = proc.apply(logits)
    assert res.shape == (2, VOCAB)
    assert torch.equal(res[0], before[0])
    assert torch.equal(res[1], _expect_banned(before[1], [11]))


def test_adapter_unidirectional_move_discards_destination_state():
    proc = pft.BanLastTokenAdapter(_config(), torch.device("cpu"), False)
    proc.update_state(_update(3, added=[(0, _ban_params(), [1], [4]),
                                        (1, _ban_params(), [1], [5]),
                                        (2, SamplingParams(), [1], [6])]))
    # row 2 (no processor) moves onto row 0: row 0's state is gone
    proc.update_state(_update(2, moved=[(2, 0, UNI)]))
    logits = _logits(2)
    before = logits.clone()
    res = proc.apply(logits)
    assert torch.equal(res[0], before[0])
    assert torch.equal(res[1], _expect_banned(before[1], [5]))


def test_adapter_in_logits_processors_container(no_entry_points):
    procs = build_logitsprocs(_config(), "cpu", False,
                              [f"{MOD}:BanLastTokenAdapter", pft.PromptAwareAdapter])
    types = _types(procs)
    assert pft.BanLastTokenAdapter in types and pft.PromptAwareAdapter in types
    nai = {type(p) for p in procs.non_argmax_invariant}
    assert {pft.BanLastTokenAdapter, pft.PromptAwareAdapter} <= nai
