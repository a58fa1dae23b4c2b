"""Pooling models through the engine on Ray (``LLM.embed``, ``score``, ``classify``,
``encode``; ``AsyncLLM.encode``), against sentence-transformers and transformers; a
worker SIGKILLed mid-batch loses no request and changes no vector."""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest
import torch

from cluster import LLM, AsyncLLM, PoolingParams
from tiny_encoder import build_sentence_transformer, build_tiny_encoder

TEXTS = [f"{t} {i}" for i, t in enumerate(["the quick brown fox", "ray schedules actors and tasks", "héllo wörld",
                                              "tokens flow through the sampler one step at a time"] * 6)]

LONG = [" ".join([t] * 3) for t in TEXTS[:12]]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("llm-encoders")
    bert = build_tiny_encoder(root / "bert")
    return {"embed": build_sentence_transformer(root / "embed", bert, pooling="mean"),
            "cross": build_tiny_encoder(root / "cross", task="classify", num_labels=1, seed=1),
            "classes": build_tiny_encoder(root / "classes", task="classify", num_labels=3, seed=2)}


def test_embed_score_and_their_refusals(ray_local, folders, tiny_model_path):
    from sentence_transformers import SentenceTransformer

    ref = SentenceTransformer(str(folders["embed"]), device="cpu").encode(TEXTS)
    llm = LLM(str(folders["embed"]), worker_num_cpus=1, max_num_batched_tokens=64)
    try:
        outs = llm.embed(TEXTS, use_tqdm=False)
        np.testing.assert_allclose([o.outputs.embedding for o in outs], ref, atol=1e-5)
        assert llm.encode(TEXTS[0], use_tqdm=False)[0].outputs.data.shape == (ref.shape[1],)
        scores = llm.score(TEXTS[0], TEXTS[:4], use_tqdm=False)
        np.testing.assert_allclose([s.outputs.score for s in scores], ref[:4] @ ref[0], atol=1e-5)
        pairs = llm.score(TEXTS[:3], TEXTS[3:6], use_tqdm=False)
        np.testing.assert_allclose([s.outputs.score for s in pairs], (ref[:3] * ref[3:6]).sum(1), atol=1e-5)
        raw = llm.embed(TEXTS[:2], pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        assert abs(np.linalg.norm(raw[0].outputs.embedding) - 1) > 1e-3  # not normalised
        with pytest.raises(ValueError, match="pooling model"):
            llm.generate(["hi"])
        with pytest.raises(ValueError, match="classify"):
            llm.classify(["hi"], use_tqdm=False)
        with pytest.raises(ValueError, match="1:1, 1:N or N:N|one length"):
            llm.score(TEXTS[:2], TEXTS[:3], use_tqdm=False)
        with pytest.raises(ValueError, match="prompt 1: .*too long"):
            llm.embed(["ok", "the quick brown fox " * 100], use_tqdm=False)
        assert len(llm.embed(["the quick brown fox " * 100], truncate_prompt_tokens=-1,
                             use_tqdm=False)[0].prompt_token_ids) == 128
    finally:
        llm.shutdown()
    gen = LLM(tiny_model_path, worker_num_cpus=1)
    try:
        with pytest.raises(ValueError, match="generative model"):
            gen.embed(["hi"], use_tqdm=False)
    finally:
        gen.shutdown()


def test_cross_encoder_and_classifier(ray_local, folders):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    query, docs = "what does ray schedule", ["actors and tasks", "the lazy dog", "a stitch in time"]
    tok = AutoTokenizer.from_pretrained(folders["cross"])
    model = AutoModelForSequenceClassification.from_pretrained(folders["cross"]).eval()
    with torch.no_grad():
        logits = np.array([float(model(**tok(query, d, return_tensors="pt")).logits[0, 0]) for d in docs])
    llm = LLM(str(folders["cross"]), worker_num_cpus=1)
    try:
        scores = llm.score(query, docs, use_tqdm=False)
        np.testing.assert_allclose([s.outputs.score for s in scores], 1 / (1 + np.exp(-logits)), atol=1e-5)
    finally:
        llm.shutdown()
    llm = LLM(str(folders["classes"]), worker_num_cpus=1)
    model = AutoModelForSequenceClassification.from_pretrained(folders["classes"]).eval()
    tok = AutoTokenizer.from_pretrained(folders["classes"])  # (trained apart: not the cross-encoder's vocabulary)
    try:
        outs = llm.classify(docs, use_tqdm=False)
        with torch.no_grad():
            want = [torch.softmax(model(**tok(d, return_tensors="pt")).logits[0], -1).numpy() for d in docs]
        np.testing.assert_allclose([o.outputs.probs for o in outs], want, atol=1e-5)
        with pytest.raises(ValueError, match="score"):
            llm.score(query, docs, use_tqdm=False)
    finally:
        llm.shutdown()


def test_async_encode_and_a_worker_killed_mid_batch(ray_local, folders, tiny_model_path):
    """A decoder embedder on two workers, prompts of 30-60 tokens in chunks of 8; one worker
    SIGKILLed while it holds half-pooled rows: every request finishes on the other,
    with the vector it has without the kill."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModel.from_pretrained(tiny_model_path).eval()
    with torch.no_grad():
        ref = []
        for t in LONG:
            h = model(torch.tensor([tok(t)["input_ids"]])).last_hidden_state[0].mean(0)
            ref.append((h / h.norm()).numpy())
    llm = LLM(tiny_model_path, runner="pooling", pooler_config={"pooling_type": "MEAN"}, num_workers=2,
              max_num_batched_tokens=8, max_num_seqs=4, worker_num_cpus=1)
    try:
        engine = llm.engine
        for i, t in enumerate(LONG):
            engine.enqueue(engine.make_pooling_request(f"k{i}", t, PoolingParams(task="embed")))
        finals, killed = {}, []
        while engine.has_unfinished_requests():
            for out in engine.step(timeout=0.2):
                finals[out.request_id] = out
            if not killed:
                for slot in engine.workers:
                    half = [s for s in (slot.scheduler.running if slot.scheduler else [])
                            if 0 < s.num_computed_tokens < s.num_tokens]
                    if slot.live and slot.pid is not None and half:
                        killed.append(slot)
                        os.kill(slot.pid, signal.SIGKILL)
                        break
        assert killed and engine.num_worker_failures >= 1
        for i in range(len(LONG)):
            assert finals[f"k{i}"].error is None
            np.testing.assert_allclose(finals[f"k{i}"].outputs.data.numpy(), ref[i], atol=1e-5)
    finally:
        llm.shutdown()

    async def encode_all() -> list:
        alm = AsyncLLM(str(folders["embed"]), worker_num_cpus=1)
        try:
            async def one(i: int):
                async for out in alm.encode(TEXTS[i], PoolingParams(task="embed"), f"a{i}"):
                    last = out
                return last

            return await asyncio.gather(*(one(i) for i in range(6)))
        finally:
            alm.shutdown()

    from sentence_transformers import SentenceTransformer

    outs = asyncio.run(encode_all())
    want = SentenceTransformer(str(folders["embed"]), device="cpu").encode(TEXTS[:6])
    np.testing.assert_allclose([o.outputs.data.numpy() for o in outs], want, atol=1e-5)
