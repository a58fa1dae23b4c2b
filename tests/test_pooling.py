"""Pooling models in process (no Ray): the worker's pooling runner driven by the
driver's own scheduler and reply merging (``pooling_driver.py``), against independent
references -- sentence-transformers' ``encode`` on the same folders, transformers'
encoders, cross-encoders and decoders run one prompt at a time -- never against our
own output."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.pooling import PoolingParams, cosine, finish_vector
from pooling_driver import pool_through_scheduler, raw_vectors
from sampler.params import SamplingParams
from tiny_encoder import build_sentence_transformer, build_tiny_encoder
from tiny_model import build_tiny_model
from worker.build import build_runner
from worker.config import WorkerConfig
from worker.pooling import PoolerSpec, PoolingModelError, pooler_spec
from worker.protocol import PROTOCOL_VERSION, AddedRequest, Int32Array, ProtocolError, StepRequest
from worker.runner.pooling_runner import PoolingModelRunner

TEXTS = ["the quick brown fox", "ray schedules actors and tasks across a cluster of nodes", "héllo wörld",
         "a stitch in time saves nine and the early bird catches the worm " * 3, "", "tokens"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    bert = build_tiny_encoder(root / "bert")
    return {
        "bert": bert,
        "bert-st-mean": build_sentence_transformer(root / "bert-st-mean", bert, pooling="mean", dense=32),
        "bert-st-cls": build_sentence_transformer(root / "bert-st-cls", bert, pooling="cls", normalize=False),
        "roberta": build_tiny_encoder(root / "roberta", arch="roberta"),  # (before the folders around it)
        "xlm-roberta": build_tiny_encoder(root / "xlmr", arch="xlm-roberta", seed=3),
        "cross": build_tiny_encoder(root / "cross", task="classify", num_labels=1, seed=1),
        "classes": build_tiny_encoder(root / "classes", task="classify", num_labels=3, seed=2),
        "roberta-cross": build_tiny_encoder(root / "rcross", arch="roberta", task="classify", num_labels=1, seed=4),
        "roberta-st-lower": build_sentence_transformer(root / "roberta-st-lower", root / "roberta", pooling="mean",
                                                       dense=16, lowercase=True),
        "llama": build_tiny_model(root / "llama"),
    }


def runner_for(folder, fast: bool = True, **kw):
    config = WorkerConfig(model=str(folder), max_num_seqs=8, **kw)
    return build_runner(config) if fast else PoolingModelRunner(config)


def tokens(folder, texts):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    return tok, [tok(t)["input_ids"] for t in texts]


def check_close(ours: np.ndarray, ref: np.ndarray, cos_min: float = 0.9999, atol: float = 1e-4) -> None:
    for a, b in zip(ours, ref):
        assert cosine(a, b) >= cos_min
        np.testing.assert_allclose(a, b, atol=atol, rtol=1e-3)


@pytest.mark.parametrize("fast", [True, False], ids=["cpu-backend", "torch-paths"])
def test_bert_cls_embeddings_equal_transformers(folders, fast):
    from transformers import AutoModel

    runner = runner_for(folders["bert"], fast)
    assert runner.info.pooler.pooling_type == "CLS" and runner.info.pooler.bidirectional
    _, ids = tokens(folders["bert"], TEXTS)
    outs, _ = pool_through_scheduler(runner, ids, params=PoolingParams(use_activation=False))
    model = AutoModel.from_pretrained(folders["bert"]).eval()
    with torch.no_grad():
        ref = np.stack([model(torch.tensor([p])).last_hidden_state[0, 0].numpy() for p in ids])
    check_close(raw_vectors(outs), ref)


@pytest.mark.parametrize("name", ["bert-st-mean", "bert-st-cls"])
def test_sentence_transformers_folders_equal_its_encode(folders, name):
    from sentence_transformers import SentenceTransformer

    runner = runner_for(folders[name])
    _, ids = tokens(folders[name], TEXTS)
    outs, _ = pool_through_scheduler(runner, ids)
    ref = SentenceTransformer(str(folders[name]), device="cpu").encode(TEXTS, convert_to_numpy=True)
    check_close(raw_vectors(outs), ref)
    spec = runner.info.pooler
    assert spec.width == ref.shape[1] and spec.use_activation == (name == "bert-st-mean")


@pytest.mark.parametrize("name", ["roberta", "xlm-roberta"])
def test_roberta_family_positions_start_past_the_padding_index(folders, name):
    from transformers import AutoModel

    runner = runner_for(folders[name], pooler_config={"pooling_type": "MEAN"})
    _, ids = tokens(folders[name], TEXTS)
    outs, _ = pool_through_scheduler(runner, ids, params=PoolingParams(use_activation=False))
    model = AutoModel.from_pretrained(folders[name]).eval()
    with torch.no_grad():
        ref = np.stack([model(torch.tensor([p])).last_hidden_state[0].mean(0).numpy() for p in ids])
    check_close(raw_vectors(outs), ref)
    assert runner.info.max_model_len == 128  # 130 positions less the padding index + 1


@pytest.mark.parametrize("name", ["cross", "roberta-cross"])
def test_cross_encoder_scores_pairs_as_transformers_head(folders, name):
    from transformers import AutoModelForSequenceClassification

    runner = runner_for(folders[name])
    tok, _ = tokens(folders[name], [])
    pairs = [("what is ray", "ray schedules actors"), ("the fox", "the quick brown fox jumps over the lazy dog"),
             ("a", "b")]
    enc = [tok(a, b) for a, b in pairs]
    types = [e.get("token_type_ids") for e in enc]
    outs, _ = pool_through_scheduler(runner, [e["input_ids"] for e in enc],
                                     token_types=types if name == "cross" else None,
                                     params=PoolingParams(use_activation=False))
    model = AutoModelForSequenceClassification.from_pretrained(folders[name]).eval()
    with torch.no_grad():
        ref = np.stack([model(**{k: torch.tensor([v]) for k, v in e.items()}).logits[0].numpy() for e in enc])
    if name == "cross":
        assert any(any(t) for t in types)  # the pairs' second texts are type 1
    np.testing.assert_allclose(raw_vectors(outs), ref, atol=1e-5)
    spec = runner.info.pooler
    assert spec.task == "classify" and spec.supported_tasks == ["classify", "score"]
    scored = finish_vector(ref[0], PoolingParams(), spec)
    assert scored[0] == pytest.approx(1 / (1 + np.exp(-ref[0][0])))


def test_classifier_probabilities_and_labels(folders):
    from transformers import AutoModelForSequenceClassification

    runner = runner_for(folders["classes"])
    spec = runner.info.pooler
    assert spec.labels == ["label_0", "label_1", "label_2"] and spec.supported_tasks == ["classify"]
    _, ids = tokens(folders["classes"], TEXTS)
    outs, _ = pool_through_scheduler(runner, ids)
    model = AutoModelForSequenceClassification.from_pretrained(folders["classes"]).eval()
    with torch.no_grad():
        ref = np.stack([torch.softmax(model(torch.tensor([p])).logits[0], -1).numpy() for p in ids])
    np.testing.assert_allclose(raw_vectors(outs), ref, atol=1e-5)


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("fast", [True, False], ids=["fused-decoder", "torch-paths"])
def test_decoder_pooled_over_prefill_chunks_equals_transformers(folders, kind, fast):
    """A decoder embedder pools its prompt across chunks of 7 tokens, rows joining and
    leaving: every kind of pooling equals transformers' base model on each prompt
    alone (normalised, as the embed task's default)."""
    from transformers import AutoModel

    runner = runner_for(folders["llama"], fast, runner="pooling", pooler_config={"pooling_type": kind})
    if fast:
        assert runner.backend.decoder is not None  # the fused decoder's hidden states
    _, ids = tokens(folders["llama"], [t for t in TEXTS if t])
    outs, steps = pool_through_scheduler(runner, ids, budget=7, rows=3)
    assert steps > len(ids)  # prompts ran in chunks
    model = AutoModel.from_pretrained(folders["llama"]).eval()
    with torch.no_grad():
        hidden = [model(torch.tensor([p])).last_hidden_state[0] for p in ids]
    pick = {"LAST": lambda h: h[-1], "MEAN": lambda h: h.mean(0), "CLS": lambda h: h[0]}[kind]
    ref = np.stack([(lambda v: v / v.norm())(pick(h)).numpy() for h in hidden])
    check_close(raw_vectors(outs), ref)
    assert not runner.partial  # nothing left behind


def test_decoder_last_token_pooling_with_the_prefix_cache(folders):
    from transformers import AutoModel

    runner = runner_for(folders["llama"], runner="pooling")
    _, ids = tokens(folders["llama"], ["the quick brown fox jumps over the lazy dog and the quick brown fox"])
    prompts = [ids[0], ids[0] + ids[0][:5], ids[0]]  # shared prefixes, one repeated
    outs, _ = pool_through_scheduler(runner, prompts, budget=64, rows=1, prefix_caching=True)
    assert outs[2].num_cached_tokens > 0
    model = AutoModel.from_pretrained(folders["llama"]).eval()
    with torch.no_grad():
        ref = np.stack([(lambda v: v / v.norm())(model(torch.tensor([p])).last_hidden_state[0, -1]).numpy()
                        for p in prompts])
    check_close(raw_vectors(outs), ref)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6), seed=st.integers(0, 10_000))
def test_packed_encoder_steps_of_any_lengths(folders, lengths, seed):
    """Prompts of any lengths (one length or several) packed into steps: each equals
    the encoder run on it alone."""
    from transformers import AutoModel

    runner = _cached_runner(folders["bert"])
    rng = np.random.default_rng(seed)
    prompts = [[2, *rng.integers(5, runner.info.vocab_size, n - 1).tolist()] if n > 1 else [2] for n in lengths]
    outs, _ = pool_through_scheduler(runner, prompts, params=PoolingParams(use_activation=False))
    model = _cached_reference(folders["bert"], AutoModel)
    with torch.no_grad():
        ref = np.stack([model(torch.tensor([p])).last_hidden_state[0, 0].numpy() for p in prompts])
    check_close(raw_vectors(outs), ref)


_CACHE: dict = {}


def _cached_runner(folder):
    key = ("runner", str(folder))
    if key not in _CACHE:
        _CACHE[key] = runner_for(folder)
    return _CACHE[key]


def _cached_reference(folder, cls):
    key = ("ref", str(folder))
    if key not in _CACHE:
        _CACHE[key] = cls.from_pretrained(folder).eval()
    return _CACHE[key]


def _step(rows, prompts, scheduled, token_types=None):
    blocks = [-(-len(p) // 16) for p in prompts]
    return StepRequest(
        version=PROTOCOL_VERSION, step_id=0, batch_size=len(rows),
        added=[AddedRequest(row=r, request_id=f"q{r}", params=SamplingParams(),
                            prompt_token_ids=Int32Array.of(p),
                            token_type_ids=None if token_types is None else Int32Array.of(token_types[i]))
               for i, (r, p) in enumerate(zip(rows, prompts))],
        num_scheduled_tokens=Int32Array.of(scheduled), num_new_blocks=Int32Array.of(blocks),
        new_block_ids=Int32Array.of(list(range(sum(blocks)))))


def test_an_encoder_step_must_run_whole_prompts_and_valid_token_types(folders):
    runner = runner_for(folders["cross"])
    with pytest.raises(ProtocolError, match="whole prompt"):
        runner.execute(_step([0], [[2, 5, 6, 3]], [2]))
    with pytest.raises(ProtocolError, match="token_type_ids"):
        runner.execute(_step([0], [[2, 5, 6, 3]], [4], token_types=[[0, 0, 1]]))
    with pytest.raises(ProtocolError, match="token_type_ids"):
        runner.execute(_step([0], [[2, 5, 6, 3]], [4], token_types=[[0, 0, 1, 7]]))
    assert runner.batch.batch_size == 0  # refused before anything changed
    reply = runner.execute(_step([0], [[2, 5, 6, 3]], [4], token_types=[[0, 0, 1, 1]]))
    assert reply.pooled_rows.numpy().tolist() == [0] and reply.pooled_width == 1


def test_pooler_spec_from_sentence_transformers_files(folders, tmp_path):
    import json
    import shutil

    from transformers import AutoConfig

    folder = tmp_path / "st"
    shutil.copytree(folders["bert-st-mean"], folder)
    config = AutoConfig.from_pretrained(folder)
    spec = pooler_spec(str(folder), config)
    assert (spec.pooling_type, spec.width, spec.use_activation, spec.task) == ("MEAN", 32, True, "embed")
    assert pooler_spec(str(folder), config, {"pooling_type": "cls", "use_activation": False}).pooling_type == "CLS"
    modules = json.loads((folder / "modules.json").read_text())
    (folder / "modules.json").write_text(json.dumps(modules + [{"idx": 9, "name": "9", "path": "x",
                                                                "type": "sentence_transformers.models.WeightedLayerPooling"}]))
    with pytest.raises(PoolingModelError, match="WeightedLayerPooling is not supported"):
        pooler_spec(str(folder), config)
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "max"}))
    with pytest.raises(PoolingModelError, match="pooling_mode 'max' is not supported"):
        pooler_spec(str(folder), config)
    (folder / "modules.json").write_text("{not json")
    with pytest.raises(PoolingModelError, match="modules.json"):
        pooler_spec(str(folder), config)


def test_which_architectures_pool():
    """A base model pools (its family's base class, by transformers' table); a model
    with a head whose class name also ends in "Model" does not."""
    from transformers import AutoConfig

    from worker.pooling import pooling_task

    cases = [("gpt2", "GPT2LMHeadModel", None), ("gpt2", "GPT2Model", "embed"), ("qwen2", "Qwen2Model", "embed"),
             ("qwen2", "Qwen2ForCausalLM", None), ("bert", "BertForMaskedLM", "embed"),
             ("bert", "BertForSequenceClassification", "classify"), ("llama", None, None)]
    for kind, arch, want in cases:
        config = AutoConfig.for_model(kind)
        config.architectures = [arch] if arch else None
        assert pooling_task(config) == want, (kind, arch)


def test_runner_choice_and_refusals(folders):
    from worker.runner.model_loader import ModelLoadError
    from worker.runner.pooling_runner import serves_pooling

    assert serves_pooling(WorkerConfig(model=str(folders["bert"])))
    assert serves_pooling(WorkerConfig(model=str(folders["llama"]), runner="pooling"))
    assert not serves_pooling(WorkerConfig(model=str(folders["llama"])))
    with pytest.raises(ModelLoadError, match="not a generative model"):
        serves_pooling(WorkerConfig(model=str(folders["bert"]), runner="generate"))
    with pytest.raises(ValueError, match="runner must be one of"):
        WorkerConfig(runner="embed")
    with pytest.raises(ValueError, match="pooler_config"):
        WorkerConfig(pooler_config={"pooling_type": "MAX"})
    with pytest.raises(ValueError, match="speculative decoding"):
        WorkerConfig(runner="pooling", num_spec_tokens=2)
    with pytest.raises(ModelLoadError, match="quantization"):
        runner_for(folders["bert"], quantization="int8")
    with pytest.raises(ModelLoadError, match="enable_lora"):
        runner_for(folders["bert"], enable_lora=True)


def test_per_request_finishing_of_vectors():
    spec = PoolerSpec(task="embed", pooling_type="LAST", width=4, is_matryoshka=True)
    v = np.array([3.0, 4.0, 0.0, 12.0], dtype=np.float32)
    np.testing.assert_allclose(finish_vector(v, PoolingParams(), spec), v / 13)
    np.testing.assert_allclose(finish_vector(v, PoolingParams(dimensions=2), spec), [0.6, 0.8])
    np.testing.assert_allclose(finish_vector(v, PoolingParams(use_activation=False), spec), v)
    cls = PoolerSpec(task="classify", pooling_type="CLS", width=2, labels=["a", "b"])
    np.testing.assert_allclose(finish_vector(np.array([0.0, np.log(3)]), PoolingParams(), cls), [0.25, 0.75],
                               rtol=1e-6)
    with pytest.raises(ValueError, match="dimensions"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=-2)
    with pytest.raises(ValueError, match="only supports dimensions in range"):
        PoolingParams(dimensions=8).verify(spec)
    with pytest.raises(ValueError, match=r"only supports Matryoshka dimensions \[2, 4\]"):
        PoolingParams(dimensions=3).verify(PoolerSpec(task="embed", pooling_type="CLS", width=4,
                                                      matryoshka_dimensions=[2, 4]))
    with pytest.raises(ValueError, match="does not support Matryoshka"):
        PoolingParams(dimensions=2).verify(PoolerSpec(task="embed", pooling_type="CLS", width=4))
    with pytest.raises(ValueError, match="task 'classify' is not supported"):
        PoolingParams(task="classify").verify(spec)
    with pytest.raises(ValueError, match="task 'score' is not supported"):
        PoolingParams(task="score").verify(PoolerSpec(task="classify", pooling_type="CLS", width=3))


def test_lowercasing_folders_and_bfloat16_mean_pooling_through_dense_layers(folders):
    """A folder whose Transformer module lowercases (``do_lower_case``, a case-sensitive
    BPE tokenizer) embeds as sentence-transformers does; mean pooling in bfloat16 (sums
    kept in float32) feeds the bfloat16 Dense layer."""
    from sentence_transformers import SentenceTransformer

    from cluster.pooling import PoolingParams as Params

    folder = folders["roberta-st-lower"]
    texts = ["The Quick BROWN fox", "Ray schedules ACTORS"]
    ref = SentenceTransformer(str(folder), device="cpu").encode(texts)
    runner = runner_for(folder)
    assert runner.info.pooler.lowercase
    tok, _ = tokens(folder, [])
    outs, _ = pool_through_scheduler(runner, [tok(t.lower())["input_ids"] for t in texts])
    check_close(raw_vectors(outs), ref)
    runner16 = runner_for(folder, dtype="bfloat16")
    outs, _ = pool_through_scheduler(runner16, [tok(t.lower())["input_ids"] for t in texts], params=Params())
    for a, b in zip(raw_vectors(outs), ref):
        assert cosine(a, b) >= 0.99


def test_a_pooling_row_arrives_with_its_prompt_only(folders):
    runner = runner_for(folders["llama"], runner="pooling", pooler_config={"pooling_type": "MEAN"})
    bad = [
        AddedRequest(row=0, request_id="q0", params=SamplingParams(), prompt_token_ids=Int32Array.of([5, 6, 7, 8]),
                     output_token_ids=Int32Array.of([9])),
        AddedRequest(row=0, request_id="q0", params=SamplingParams(), prompt_token_ids=Int32Array.of(list(range(5, 25))),
                     num_computed_tokens=16),
    ]
    for added, says in zip(bad, ("no output tokens", "cannot start from cached ones")):
        step = StepRequest(version=PROTOCOL_VERSION, step_id=0, batch_size=1, added=[added],
                           num_scheduled_tokens=Int32Array.of([1]), num_new_blocks=Int32Array.of([2]),
                           new_block_ids=Int32Array.of([0, 1]))
        with pytest.raises(ProtocolError, match=says):
            runner.execute(step)
        assert runner.batch.batch_size == 0 and not runner.partial


def test_a_classifiers_activation_follows_its_config():
    from transformers import AutoConfig

    from worker.pooling import classifier_activation

    def config(**kw):
        c = AutoConfig.for_model("bert", num_labels=2)
        for k, v in kw.items():
            setattr(c, k, v)
        return c

    assert classifier_activation(config()) == "classify"
    assert classifier_activation(config(problem_type="regression")) == "identity"
    assert classifier_activation(config(problem_type="multi_label_classification")) == "sigmoid"
    assert classifier_activation(config(sentence_transformers={"activation_fn": "torch.nn.modules.linear.Identity"})) \
        == "identity"
    assert classifier_activation(config(sbert_ce_default_activation_function="torch.nn.modules.activation.Sigmoid")) \
        == "classify"
    with pytest.raises(PoolingModelError, match="activation_fn"):
        classifier_activation(config(sentence_transformers={"activation_fn": "os.system"}))
    logits = np.array([1.0, -2.0], dtype=np.float32)
    spec = PoolerSpec(task="classify", pooling_type="CLS", width=2, activation="identity")
    np.testing.assert_allclose(finish_vector(logits, PoolingParams(), spec), logits)
    spec = PoolerSpec(task="classify", pooling_type="CLS", width=2, activation="sigmoid")
    np.testing.assert_allclose(finish_vector(logits, PoolingParams(), spec), 1 / (1 + np.exp(-logits)), rtol=1e-6)
