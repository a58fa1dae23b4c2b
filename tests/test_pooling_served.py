"""A pooling model's HTTP endpoints, one Serve app holding three models (a
sentence-transformers BERT embedder, a BERT cross-encoder and the tiny generative
Llama): ``/v1/embeddings`` through the ``openai`` client (its base64 default and
floats) and ``langchain-openai``, ``/pooling``, ``/score``, ``/rerank``, ``/classify``
as vLLM 0.32 answers them (``docs/usage.md``), every vector against
sentence-transformers or transformers; wrong routes and hostile bodies are 4xx and the
server stays whole."""

from __future__ import annotations

import base64
import concurrent.futures

import httpx
import numpy as np
import openai
import pytest
import torch

from helpers import TEMPLATE, free_port
from tiny_encoder import build_sentence_transformer, build_tiny_encoder

TEXTS = ["the quick brown fox", "ray schedules actors and tasks across a cluster", "héllo wörld", ""]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("served-encoders")
    bert = build_tiny_encoder(root / "bert")
    return {"embed": build_sentence_transformer(root / "embed", bert, pooling="mean"),
            "cross": build_tiny_encoder(root / "cross", task="classify", num_labels=1, seed=1)}


@pytest.fixture(scope="module")
def server(ray_local, folders, tiny_model_path):
    from ray import serve

    from deploy.serve import engine_deployment, ingress_deployment
    from deploy.server_args import ServerArgs

    engine = {"max_num_seqs": 16, "worker_num_cpus": 1}
    apps = {}
    for name, model, extra in (("embed", folders["embed"], {"chat_template": TEMPLATE}), ("cross", folders["cross"], {}),
                               ("tiny", tiny_model_path, {})):
        args = ServerArgs.model_validate({"model": str(model), "served_model_name": name, "engine": engine, **extra})
        apps[name] = engine_deployment(args, name=f"Engine-{name}")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(ingress_deployment(apps), name="pooling", route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


@pytest.fixture(scope="module")
def reference(folders):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folders["embed"]), device="cpu")


def post(server, path, body, model="embed"):
    return httpx.post(f"{server}{path}", json={"model": model, **body}, timeout=120)


def test_embeddings_through_the_openai_client_equal_sentence_transformers(server, reference):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0)
    ref = reference.encode(TEXTS)
    for fmt in (openai.NOT_GIVEN, "float"):  # the client asks base64 unless told (and decodes it)
        r = client.embeddings.create(model="embed", input=TEXTS, encoding_format=fmt)
        assert r.model == "embed" and r.object == "list" and [d.index for d in r.data] == [0, 1, 2, 3]
        ours = np.array([d.embedding for d in r.data])
        assert ours.shape == ref.shape
        np.testing.assert_allclose(ours, ref, atol=1e-5)
        assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(reference.tokenize([t])["input_ids"][0])
                                                                      for t in TEXTS)
    assert r.id.startswith("embd-")
    one = client.embeddings.create(model="embed", input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, ref[0], atol=1e-5)


def test_langchain_openai_embeddings(server, reference):
    from langchain_openai import OpenAIEmbeddings

    # (tiktoken's token ids are not this model's: the text goes as text)
    emb = OpenAIEmbeddings(model="embed", base_url=f"{server}/v1", api_key="none", check_embedding_ctx_length=False)
    np.testing.assert_allclose(emb.embed_documents(TEXTS[:3]), reference.encode(TEXTS[:3]), atol=1e-5)
    np.testing.assert_allclose(emb.embed_query(TEXTS[1]), reference.encode(TEXTS[1]), atol=1e-5)


def test_encodings_token_ids_and_truncation(server, reference):
    ref = reference.encode(TEXTS[0])
    r = post(server, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64", "embed_dtype": "float16",
                                         "endianness": "big"})
    v = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype=">f2").astype(np.float32)
    np.testing.assert_allclose(v, ref, atol=2e-3)
    ids = reference.tokenize([TEXTS[1]])["input_ids"][0].tolist()
    r = post(server, "/v1/embeddings", {"input": [ids, ids[:4]]})
    data = r.json()["data"]
    np.testing.assert_allclose(data[0]["embedding"], reference.encode(TEXTS[1]), atol=1e-5)
    # truncate_prompt_tokens: the tokenizer truncates and keeps [CLS] ... [SEP] (vLLM's way)
    r = post(server, "/v1/embeddings", {"input": TEXTS[1], "truncate_prompt_tokens": 4})
    assert r.json()["usage"]["prompt_tokens"] == 4
    kept = post(server, "/v1/embeddings", {"input": [ids[0], ids[1], ids[2], ids[-1]]})  # [CLS] two tokens [SEP]
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], kept.json()["data"][0]["embedding"], atol=1e-6)
    # a side given: the token list is sliced (the last 3)
    r = post(server, "/v1/embeddings", {"input": TEXTS[1], "truncate_prompt_tokens": 3, "truncation_side": "left"})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 3
    long = "the quick brown fox " * 200
    assert post(server, "/v1/embeddings", {"input": long}).status_code == 400
    r = post(server, "/v1/embeddings", {"input": long, "truncate_prompt_tokens": -1})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 128
    # chat messages through the server's template
    r = post(server, "/v1/embeddings", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and len(r.json()["data"]) == 1


def test_pooling_score_and_rerank(server, reference, folders):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    r = post(server, "/pooling", {"input": TEXTS[:2]})
    body = r.json()
    assert body["id"].startswith("pooling-") and body["data"][0]["object"] == "pooling"
    np.testing.assert_allclose([d["data"] for d in body["data"]], reference.encode(TEXTS[:2]), atol=1e-5)
    ref = reference.encode(TEXTS[:3])
    r = post(server, "/v1/score", {"queries": TEXTS[0], "documents": TEXTS[:3]})
    scores = [d["score"] for d in r.json()["data"]]
    np.testing.assert_allclose(scores, ref @ ref[0], atol=1e-5)
    r = post(server, "/score", {"text_1": TEXTS[:2], "text_2": TEXTS[1:3]})
    np.testing.assert_allclose([d["score"] for d in r.json()["data"]], [ref[0] @ ref[1], ref[1] @ ref[2]], atol=1e-5)
    assert post(server, "/score", {"data_1": TEXTS[:2], "data_2": TEXTS[0]}).status_code == 400  # N:1

    tok = AutoTokenizer.from_pretrained(folders["cross"])
    model = AutoModelForSequenceClassification.from_pretrained(folders["cross"]).eval()
    query, docs = "what does ray schedule", ["actors and tasks", "the lazy dog", "a stitch in time"]
    with torch.no_grad():
        logits = [float(model(**tok(query, d, return_tensors="pt")).logits[0, 0]) for d in docs]
    want = 1 / (1 + np.exp(-np.array(logits)))
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = post(server, path, {"query": query, "documents": docs, "top_n": 2}, model="cross")
        body = r.json()
        assert body["id"].startswith("score-") and len(body["results"]) == 2
        order = np.argsort(-want)[:2].tolist()
        assert [x["index"] for x in body["results"]] == order
        np.testing.assert_allclose([x["relevance_score"] for x in body["results"]], want[order], atol=1e-5)
        assert body["results"][0]["document"] == {"text": docs[order[0]], "multi_modal": None}
    r = post(server, "/classify", {"input": ["actors and tasks"]}, model="cross")
    assert r.json()["data"][0]["num_classes"] == 1 and r.json()["data"][0]["label"] == "label_0"
    r = post(server, "/v1/score", {"queries": query, "documents": docs, "use_activation": False}, model="cross")
    np.testing.assert_allclose([d["score"] for d in r.json()["data"]], logits, atol=1e-5)


@pytest.mark.parametrize("path, body, model, status, says", [
    ("/v1/completions", {"prompt": "hi"}, "embed", 404, "does not support /v1/completions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "embed", 404, "pooling model"),
    ("/v1/embeddings", {"input": "hi"}, "tiny", 404, "generative model"),
    ("/v1/embeddings", {"input": "hi"}, "cross", 404, "/classify"),
    ("/classify", {"input": "hi"}, "embed", 404, "does not support /classify"),
    ("/v1/embeddings", {"input": "hi"}, "nope", 404, "does not exist"),
    ("/v1/embeddings", {"input": "hi", "normalize": True}, "embed", 400, "use_activation"),
    ("/v1/embeddings", {"input": "hi", "dimensions": 16}, "embed", 400, "Matryoshka"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "bytes"}, "embed", 400, "encoding_format"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "hex"}, "embed", 400, "encoding_format"),
    ("/v1/embeddings", {"input": []}, "embed", 400, "at least one prompt"),
    ("/v1/embeddings", {"input": [99999]}, "embed", 400, "outside the vocabulary"),
    ("/v1/embeddings", {"input": "hi", "truncate_prompt_tokens": 1000}, "embed", 400, "truncate_prompt_tokens"),
    ("/v1/embeddings", {"input": "hi", "truncate_prompt_tokens": -2}, "embed", 400, "truncate_prompt_tokens"),
    ("/v1/embeddings", {"input": ["x"] * 1025}, "embed", 400, "max_sequences_per_request"),
    ("/v1/embeddings", '{"input": "\\ud800"}', "embed", 400, "input"),  # a lone surrogate, as JSON carries it
    ("/v1/embeddings", {}, "embed", 400, "input"),
    ("/pooling", {"input": "hi", "task": "classify"}, "embed", 400, "Unsupported task"),
    ("/rerank", {"query": "q", "documents": [], "top_n": 1}, "cross", 400, "documents"),
    ("/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "cross", 400, "top_n"),
    ("/score", {"queries": [[1, 2]], "documents": ["d"]}, "cross", 400, "queries"),
    ("/score", {"queries": "q", "documents": ["d"], "truncate_prompt_tokens": 4, "truncation_side": "left"}, "cross",
     400, "truncation_side"),
    ("/rerank", {"query": "q", "documents": ["d"] * 1025}, "cross", 400, "max_sequences_per_request"),
])
def test_wrong_routes_and_hostile_bodies(server, path, body, model, status, says):
    if isinstance(body, str):  # raw JSON text
        r = httpx.post(f"{server}{path}", content=(f'{{"model": "{model}", ' + body[1:]).encode(), timeout=60,
                       headers={"content-type": "application/json"})
    else:
        r = post(server, path, body, model=model)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert says.lower() in error["message"].lower(), error
    assert error["code"] == status


def test_many_concurrent_requests_with_odd_bytes_leave_the_server_whole(server, reference):
    bad = [b"{", b"\xff\xfe", b'{"model": "embed", "input": 5}', b'{"model": "embed", "input": "' + b"x" * 10 + b'"']
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        good = [pool.submit(post, server, "/v1/embeddings", {"input": [f"request {i} of many"] * 8}) for i in range(24)]
        raw = [pool.submit(httpx.post, f"{server}/v1/embeddings", content=b, timeout=60,
                           headers={"content-type": "application/json"}) for b in bad * 3]
        assert all(f.result().status_code == 200 for f in good)
        assert all(400 <= f.result().status_code < 500 or f.result().status_code == 200 for f in raw)
    r = post(server, "/v1/embeddings", {"input": TEXTS[0]})
    np.testing.assert_allclose(r.json()["data"][0]["embedding"], reference.encode(TEXTS[0]), atol=1e-5)
