"""Two Ray nodes on this machine (``ray.cluster_utils.Cluster``): the node that hosts a
worker is removed mid-batch (every request still finishes with the output of an
undisturbed run, and a replacement worker joins once a new node offers room); and a
Serve app whose configuration pins the worker to the node with a custom resource."""

from __future__ import annotations

import contextlib
import time

import pytest
import ray

from cluster import LLM, RequestOutput
from conftest import own_ray
from helpers import free_port, prompts
from sampler.params import SamplingParams


@contextlib.contextmanager
def local_cluster(head: dict, second: dict):
    """A head and a second node on this machine, this process connected to them; the
    shared local Ray comes back afterwards."""
    from ray import serve
    from ray.cluster_utils import Cluster

    with own_ray():
        cluster = Cluster(initialize_head=True, head_node_args=head)
        node = cluster.add_node(**second)
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            yield cluster, node
        finally:
            serve.shutdown()
            ray.shutdown()
            cluster.shutdown()


@pytest.fixture
def two_nodes():
    # Notice a lost node in about a second rather than the default ~15 s.
    health = {"health_check_period_ms": 300, "health_check_failure_threshold": 3}
    with local_cluster({"num_cpus": 1, "_system_config": health}, {"num_cpus": 1}) as nodes:
        yield nodes


@pytest.mark.multinode
def test_removing_the_node_of_a_worker_loses_no_request(two_nodes, tiny_model_path):
    cluster, second = two_nodes
    ps = prompts(400, [6 + 5 * i for i in range(32)], seed=21)
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) if i % 2
        else SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True)
        for i in range(32)
    ]
    llm = LLM(tiny_model_path, num_workers=2, worker_num_cpus=1, max_num_seqs=16, max_model_len=512,
              max_num_batched_tokens=64, worker_start_timeout_s=120)
    engine = llm.engine
    try:
        undisturbed = [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]
        nodes = {w.index: ray.get(w.actor.health.remote())["node_id"] for w in engine.workers}
        on_second = [w for w in engine.workers if nodes[w.index] == second.node_id]
        assert len(on_second) == 1, "one worker per node"

        for i, (p, sp) in enumerate(zip(ps, params)):
            engine.add_request(f"r{i}", p, sp)
        finals: dict[str, RequestOutput] = {}
        removed = False
        deadline = time.monotonic() + 120
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "requests did not finish after the node was lost"
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
            held = on_second[0].scheduler.running if on_second[0].live else []
            if not removed and sum(len(s.output_token_ids) > 0 for s in held) >= 4:
                cluster.remove_node(second)
                removed = True
        assert removed and engine.num_worker_failures == 1
        assert [finals[f"r{i}"].outputs[0].token_ids for i in range(32)] == undisturbed

        # The replacement waits for room; a new node provides it.
        cluster.add_node(num_cpus=1)
        deadline = time.monotonic() + 90
        while sum(w.live for w in engine.workers) < 2:
            assert time.monotonic() < deadline, "the replacement worker never started"
            engine.step(timeout=0.5)
            time.sleep(0.2)
        again = llm.generate(ps[:8], params[:8], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == undisturbed[:8]
    finally:
        llm.shutdown()


@pytest.fixture
def resource_cluster():
    with local_cluster({"num_cpus": 2}, {"num_cpus": 1, "resources": {"raydecode_worker": 1}}) as nodes:
        yield nodes


@pytest.mark.multinode
def test_serve_places_the_worker_on_the_node_with_the_resource(resource_cluster, tiny_model_path):
    import httpx
    from ray import serve

    from deploy.serve import build_app

    cluster, node = resource_cluster
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({
        "model": tiny_model_path,
        "engine": {"max_model_len": 256, "worker_num_cpus": 1, "worker_resources": {"raydecode_worker": 1}},
    }), name="placed", route_prefix="/")
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                   json={"prompt": "the quick brown fox", "max_tokens": 8, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    from ray.util.state import list_actors

    live = list_actors(filters=[("class_name", "=", "Worker"), ("state", "=", "ALIVE")])
    assert len(live) == 1 and live[0].node_id == node.node_id


@pytest.mark.multinode
def test_a_tensor_parallel_group_across_two_nodes_answers_as_one_node(two_nodes, tiny_model_path):
    """TP=2 spread over the two nodes (gloo over TCP between them, no shared memory)
    gives what one whole worker gives."""
    cluster, second = two_nodes
    ps = prompts(400, [4, 19, 33, 8], seed=23)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    settings = dict(max_num_seqs=4, max_model_len=256, worker_start_timeout_s=120)
    one = LLM(tiny_model_path, **settings)
    try:
        ref = one.generate(ps, params, use_tqdm=False)
    finally:
        one.shutdown()
    llm = LLM(tiny_model_path, tensor_parallel_size=2, placement_group_strategy="STRICT_SPREAD", **settings)
    try:
        (group,) = llm.engine.workers
        assert len({r.node_id for r in group.ranks}) == 2, "one rank per node"
        got = llm.generate(ps, params, use_tqdm=False)
    finally:
        llm.shutdown()
    for r, g in zip(ref, got):
        assert r.outputs[0].token_ids == g.outputs[0].token_ids
        for a, b, t in zip(r.outputs[0].logprobs, g.outputs[0].logprobs, r.outputs[0].token_ids):
            assert abs(a[t].logprob - b[t].logprob) < 1e-4
