"""AsyncLLM on the tiny model: streaming in the three output kinds, concurrent streams,
abort (explicit and by a consumer that leaves), bad input raised to the caller."""

from __future__ import annotations

import asyncio

import pytest

from cluster import LLM, AsyncLLM
from sampler.params import RequestOutputKind, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(ray_local, tiny_model_path):
    e = AsyncLLM(tiny_model_path, num_workers=1, max_num_seqs=8, max_model_len=512, worker_num_cpus=1)
    yield e
    e.shutdown()


async def collect(engine, prompt, params, rid):
    return [out async for out in engine.generate(prompt, params, rid)]


def test_output_kinds_agree(engine):
    async def main():
        return await asyncio.gather(
            collect(engine, "the quick brown fox", GREEDY.clone(output_kind=RequestOutputKind.CUMULATIVE, logprobs=1), "cum"),
            collect(engine, "the quick brown fox", GREEDY.clone(output_kind=RequestOutputKind.DELTA, logprobs=1), "delta"),
            collect(engine, "the quick brown fox", GREEDY.clone(output_kind=RequestOutputKind.FINAL_ONLY, logprobs=1), "final"),
        )

    cum, delta, final = asyncio.run(main())
    assert len(final) == 1 and final[0].finished
    full = final[0].outputs[0]
    assert len(cum) > 1 and cum[-1].finished and not any(o.finished for o in cum[:-1])
    assert cum[-1].outputs[0].token_ids == full.token_ids and cum[-1].outputs[0].text == full.text
    lengths = [len(o.outputs[0].token_ids) for o in cum]
    assert lengths == sorted(lengths)  # cumulative outputs only grow
    assert len(delta) > 1 and delta[-1].finished
    assert [t for o in delta for c in o.outputs for t in c.token_ids] == full.token_ids
    assert "".join(c.text for o in delta for c in o.outputs) == full.text
    assert sum(len(c.logprobs) for o in delta for c in o.outputs) == len(full.token_ids)
    assert delta[-1].outputs[0].finish_reason == "length"
    m = final[0].metrics
    assert m.arrival_time <= m.first_token_time <= m.last_token_time


def test_streams_match_the_batch_client(engine, tiny_model_path):
    prompts = ["a stitch in time", "ray schedules actors", "tokens flow", "héllo wörld"]

    async def main():
        return await asyncio.gather(*(collect(engine, p, GREEDY, f"s{i}") for i, p in enumerate(prompts)))

    streamed = [outs[-1].outputs[0].token_ids for outs in asyncio.run(main())]
    llm = LLM(tiny_model_path, num_workers=1, max_num_seqs=2, max_model_len=512, worker_num_cpus=1)
    try:
        assert streamed == [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()


def test_abort_and_a_consumer_that_leaves_free_their_rows(engine):
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def main():
        outs = []
        async for out in engine.generate("abort me", long, "victim"):
            outs.append(out)
            if len(outs) == 2:
                engine.abort("victim")
        # A consumer that stops early (client disconnected) aborts its request too.
        stream = engine.generate("leave me", long, "leaver")
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(200):
            if engine.engine.num_unfinished_requests == 0:
                break
            await asyncio.sleep(0.05)
        after = await collect(engine, "next", GREEDY, "next")
        return outs, after

    outs, after = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 400
    assert engine.engine.num_unfinished_requests == 0
    assert all(w.scheduler.num_running == 0 for w in engine.engine.workers)
    assert after[-1].finished and len(after[-1].outputs[0].token_ids) == 20


def test_bad_input_raises_in_the_caller(engine):
    async def main():
        with pytest.raises(ValueError, match="too long"):
            await collect(engine, [5] * 600, GREEDY, "bad")
        with pytest.raises(ValueError, match="empty"):
            await collect(engine, "", GREEDY, "bad2")

        async def hold():
            last = None
            async for out in engine.generate("dup", GREEDY.clone(max_tokens=50), "dup"):
                last = out
                await asyncio.sleep(0.01)
            return last

        first = asyncio.ensure_future(hold())
        await asyncio.sleep(0.05)
        with pytest.raises(ValueError, match="already running"):
            await collect(engine, "dup", GREEDY, "dup")
        return await first

    out = asyncio.run(main())
    assert out.finished and len(out.outputs[0].token_ids) == 50


def test_a_consumer_that_falls_behind_gets_the_deltas_joined(engine):
    """A delta stream read slowly gets fewer outputs, and together they hold exactly
    what a stream read at once holds (n=2: both samples, text, tokens, logprobs)."""
    params = GREEDY.clone(output_kind=RequestOutputKind.DELTA, logprobs=2, max_tokens=24, n=2, temperature=0.8,
                          seed=7)

    async def slow(rid):
        outs = []
        async for out in engine.generate("a stitch in time", params, rid):
            outs.append(out)
            await asyncio.sleep(0.3)  # several engine steps pile up meanwhile
        return outs

    async def main():
        return await asyncio.gather(collect(engine, "a stitch in time", params, "fast"), slow("slow"))

    fast, slow_outs = asyncio.run(main())
    assert len(slow_outs) < len(fast) and slow_outs[-1].finished and fast[-1].finished

    def joined(outs):
        per = {}
        for o in outs:
            for c in o.outputs:
                text, tokens, lps = per.get(c.index, ("", [], []))
                per[c.index] = (text + c.text, tokens + c.token_ids, lps + [dict(p) for p in c.logprobs])
        return per

    a, b = joined(fast), joined(slow_outs)
    assert set(a) == {0, 1} and a.keys() == b.keys()
    for i in a:
        assert a[i][0] == b[i][0] and a[i][1] == b[i][1] and len(a[i][1]) == 24
        assert [{t: lp.logprob for t, lp in p.items()} for p in a[i][2]] == \
            [{t: lp.logprob for t, lp in p.items()} for p in b[i][2]]
    last = {c.index: c.finish_reason for o in slow_outs for c in o.outputs}
    assert last == {0: "length", 1: "length"}


def test_a_request_that_arrives_during_a_step_joins_the_next_one(engine, tiny_model_path):
    """What arrives while a step runs is handed to the engine (``intake``) right before
    it schedules, also when it dispatches the next step the moment a reply lands: the
    request is in that step, not the one after it (a whole step of extra TTFT, and
    served TTFT is measured against vLLM's, whose engine loop takes its input queue in
    before every schedule)."""
    from cluster.config import EngineConfig
    from cluster.engine import LLMEngine

    assert engine.engine.intake == engine._apply_commands  # AsyncLLM's queue feeds the hook
    core = LLMEngine(EngineConfig(model=tiny_model_path, num_workers=1, max_num_seqs=4, max_model_len=256,
                                  worker_num_cpus=1))
    try:
        core.add_request("a", "the quick brown fox", GREEDY)
        core.step()  # a's prefill went and came back; its first decode is in flight now
        slot = core.workers[0]
        assert slot.inflight is not None
        arrived = core.make_request("b", "ray schedules actors", GREEDY)
        handed: list[object] = []

        def intake() -> None:
            if not handed:
                handed.append(core.enqueue(arrived))

        core.intake = intake
        last_sent = slot.pending[-1].step.message.step_id
        core.step()  # the reply lands and the next step goes at once
        assert handed, "the engine did not take its input in before scheduling"
        # The first step sent after the intake has it (under async scheduling a decode
        # step may already wait behind the running one: that one cannot).
        for _ in range(3):
            after = [p.step for p in slot.pending if p.step.message.step_id > last_sent]
            if after:
                break
            core.step()
        assert after and any(seq.request is arrived for seq in after[0].rows)
        assert arrived.metrics.first_scheduled_time is not None
    finally:
        core.shutdown()
