"""Prefix-aware routing across engine replicas (``deploy/request_router.py``).

The router's policy is checked on fake replicas (no Ray): the routing key of each body
the ingress sends, affinity, new prefixes spread, a burst following its first request,
the load-imbalance guard, calls without a prompt, replicas leaving, the tree's bound.
Then the configuration (``ServerArgs``, the engine deployment, the CLI flag, Ray Serve
LLM's ``request_router_config``). Then one served app on the tiny model: 2 engine
replicas behind the router reach at least 90% of the prefix-cache hit rate of one
replica alone with the same KV memory (4 long system prompts, 96 interleaved chats), and
a replica flooded with one prefix's requests passes the rest of them to the other.
"""

from __future__ import annotations

import asyncio
import functools
import math
import threading
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import httpx
import pytest

from deploy.openai.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from deploy.request_router import ROUTER_PATH, PrefixAwareRouter, check_router_kwargs, routing_keys

# -- fakes ----------------------------------------------------------------------------------


class FakeReplica:
    """What the router reads of a running replica; ``queue_len`` is what it reports."""

    def __init__(self, name: str, max_ongoing_requests: int = 256) -> None:
        from ray.serve._private.common import DeploymentID, ReplicaID

        self.replica_id = ReplicaID(unique_id=name, deployment_id=DeploymentID(name="LLMEngine", app_name="app"))
        self.max_ongoing_requests = max_ongoing_requests
        self.queue_len = 0
        self.node_id = ""
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len

    def __repr__(self) -> str:
        return self.replica_id.unique_id


def make_router(replicas: list[FakeReplica], use_cache: bool = False, **kwargs: Any) -> PrefixAwareRouter:
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    router = PrefixAwareRouter(deployment_id=DeploymentID(name="LLMEngine", app_name="app"),
                               handle_source=DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=use_cache)
    router.initialize_state(**kwargs)
    router.update_replicas(replicas)
    return router


def pending(body: Any, method: str = "chat", adapter: str = "") -> Any:
    from ray.serve._private.common import RequestMetadata
    from ray.serve._private.request_router.common import PendingRequest

    args = [] if body is None else [body, None]
    return PendingRequest(args=args, kwargs={}, metadata=RequestMetadata(
        request_id="r", internal_request_id=uuid.uuid4().hex, call_method=method, multiplexed_model_id=adapter))


def chat(system: str, user: str) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "system", "content": system}, {"role": "user", "content": user}])


def system_text(i: int) -> str:
    return f"system prompt number {i}: " + " ".join(f"rule{i}-{j}" for j in range(60))


async def choose(router: PrefixAwareRouter, replicas: list[FakeReplica], body: Any, method: str = "chat",
                 send: bool = False) -> list[list[FakeReplica]]:
    """The router's ranks for one request; ``send``: then what Serve does when it sends
    the request to the first choice (its queue length in the router's cache, +1)."""
    ranks = await router.choose_replicas(replicas, pending(body, method))
    if send:
        router.on_send_request(ranks[0][0].replica_id)
    return ranks


def in_loop(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Runs an async test in an event loop of its own (the router's tasks need one)."""
    @functools.wraps(test)
    def sync(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))
    return sync


# -- routing keys -----------------------------------------------------------------------------


def test_routing_key_of_a_chat_reads_pydantic_messages_parts_roles_and_tools():
    as_models = routing_keys(ChatCompletionRequest(messages=[
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}, {"type": "text", "text": "be kind"}]},
        {"role": "user", "content": "hi"}]))
    as_dicts = routing_keys({"messages": [{"role": "system", "content": "be brief\nbe kind"},
                                          {"role": "user", "content": "hi"}]})
    assert as_models == as_dicts and len(as_models) == 1  # parts joined as rendered; developer is system
    assert "be brief\nbe kind" in as_models[0] and "hi" in as_models[0]
    other_role = routing_keys({"messages": [{"role": "user", "content": "be brief\nbe kind"},
                                            {"role": "user", "content": "hi"}]})
    assert other_role != as_dicts
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with_tools = routing_keys(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=[tool]))
    without = routing_keys(ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}]))
    assert with_tools != without and with_tools[0].endswith(without[0])  # tools first, as templates render them
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    assert routing_keys({"messages": [{"role": "assistant", "content": None, "tool_calls": calls}]}) != \
        routing_keys({"messages": [{"role": "assistant", "content": None}]})


def test_routing_key_of_a_completion_text_token_ids_and_batches():
    assert routing_keys(CompletionRequest(prompt="hello world")) == ["hello world"]
    ids = routing_keys(CompletionRequest(prompt=[5, 6, 7]))
    assert len(ids) == 1 and len(ids[0]) == 4 and ids[0] != "\x05\x06\x07"  # one char per id, marked
    assert routing_keys(CompletionRequest(prompt=[5, 6, 7, 8]))[0].startswith(ids[0])  # token prefixes nest
    assert routing_keys(CompletionRequest(prompt=["ab", "cd"])) == ["ab", "cd"]
    assert [len(k) for k in routing_keys(CompletionRequest(prompt=[[1, 2], [3, 4, 5]]))] == [3, 4]
    assert routing_keys(CompletionRequest(prompt="")) == []
    assert routing_keys(DetokenizeRequest(tokens=[1, 2])) == []
    assert routing_keys(CompletionRequest(prompt="x" * 100), max_chars=10) == ["x" * 10]


# -- the policy, on fake replicas -----------------------------------------------------------------


@in_loop
async def test_a_prefix_stays_on_its_replica_and_new_prefixes_spread():
    replicas = [FakeReplica("a"), FakeReplica("b")]
    router = make_router(replicas)
    homes: dict[int, set[str]] = {i: set() for i in range(4)}
    for turn in range(8):
        for i in range(4):
            ranks = await choose(router, replicas, chat(system_text(i), f"question {turn}"))
            assert len(ranks[0]) == 1  # one replica first, then power of two as the fallback
            homes[i].add(repr(ranks[0][0]))
    assert all(len(h) == 1 for h in homes.values()), homes
    assert sorted(sum((list(h) for h in homes.values()), [])) == ["a", "a", "b", "b"], homes


@in_loop
async def test_new_prefixes_spread_evenly_whatever_follows_them():
    """A new prefix goes to the replica given the fewest new prefixes lately, not the one
    sent the fewest requests: the follow-ups of an early prefix do not push the later
    ones all onto the other replica."""
    replicas = [FakeReplica("a"), FakeReplica("b")]
    router = make_router(replicas)
    order = [0, 0, 0, 0, 1, 2, 3]  # prefix 0's follow-ups come before the others' first requests
    homes: dict[int, str] = {}
    for j, i in enumerate(order):
        homes[i] = repr((await choose(router, replicas, chat(system_text(i), f"q{j}")))[0][0])
    assert sorted(homes.values()) == ["a", "a", "b", "b"], homes


@in_loop
async def test_a_burst_with_a_new_prefix_follows_its_first_request():
    """Recorded when chosen, not once the replica accepts: requests routed before the
    first one is sent still find its prefix."""
    replicas = [FakeReplica("a"), FakeReplica("b"), FakeReplica("c")]
    router = make_router(replicas)
    chosen = await asyncio.gather(*(choose(router, replicas, chat(system_text(7), f"q{j}")) for j in range(6)))
    assert len({repr(ranks[0][0]) for ranks in chosen}) == 1


@in_loop
async def test_the_guard_sends_a_flooded_replicas_prefix_elsewhere():
    replicas = [FakeReplica("a"), FakeReplica("b")]
    router = make_router(replicas, imbalanced_threshold=4)
    home = (await choose(router, replicas, chat(system_text(1), "first")))[0][0]
    other = next(r for r in replicas if r is not home)
    home.queue_len = 4  # at the threshold: still home
    assert (await choose(router, replicas, chat(system_text(1), "second")))[0][0] is home
    home.queue_len = 5  # beyond it: the least busy replica takes it ...
    assert (await choose(router, replicas, chat(system_text(1), "third")))[0][0] is other
    other.queue_len = 2  # ... and from then on holds the prefix too: the least busy holder gets it
    assert (await choose(router, replicas, chat(system_text(1), "fourth")))[0][0] is other
    home.queue_len, other.queue_len = 0, 3
    assert (await choose(router, replicas, chat(system_text(1), "fifth")))[0][0] is home


@in_loop
async def test_without_the_guard_a_flooded_replica_keeps_its_prefix():
    replicas = [FakeReplica("a"), FakeReplica("b")]
    router = make_router(replicas, imbalanced_threshold=math.inf)
    home = (await choose(router, replicas, chat(system_text(1), "first")))[0][0]
    home.queue_len = 200
    assert (await choose(router, replicas, chat(system_text(1), "second")))[0][0] is home
    home.queue_len = home.max_ongoing_requests  # full: never chosen, guard or not
    assert (await choose(router, replicas, chat(system_text(1), "third")))[0][0] is not home


@in_loop
async def test_a_flood_spreads_once_the_home_is_busier_by_the_threshold():
    """Counted as the router sends them: the replicas (whose counts Serve's cache holds)
    have not seen a burst's requests yet when the next ones are routed."""
    replicas = [FakeReplica("a"), FakeReplica("b")]
    router = make_router(replicas, use_cache=True)  # the default threshold: 8; the replicas report 0
    flood = [pending(chat(system_text(3), f"q{j}")) for j in range(30)]
    sent = [(await router.choose_replicas(replicas, pr))[0][0] for pr in flood]
    names = [repr(r) for r in sent]
    home = names[0]
    assert names[:9] == [home] * 9, names  # 9 in flight on its home, 0 elsewhere: 9 - 0 > 8
    assert names[9] != home, names
    assert abs(names.count("a") - names.count("b")) <= 1, names  # then both homes share it
    assert router.inflight() == {r.replica_id.to_full_id_str(): names.count(repr(r)) for r in replicas}
    for pr, r in zip(flood, sent):  # all finish: home again
        router.on_request_completed(r.replica_id, pr.metadata.internal_request_id)
    assert router.inflight() == {}
    assert repr((await choose(router, replicas, chat(system_text(3), "after")))[0][0]) in {"a", "b"}


@in_loop
async def test_a_request_accepted_elsewhere_moves_its_keys_and_load():
    replicas = [FakeReplica("a"), FakeReplica("b")]
    router = make_router(replicas)
    pr = pending(chat(system_text(4), "q"))
    chosen = (await router.choose_replicas(replicas, pr))[0][0]
    other = next(r for r in replicas if r is not chosen)
    router.on_request_routed(pr, other.replica_id, None)  # the chosen one was full
    assert router.inflight() == {other.replica_id.to_full_id_str(): 1}
    assert router._tree.match_lengths(routing_keys(pr.args[0])[0]).keys() == {
        chosen.replica_id.to_full_id_str(), other.replica_id.to_full_id_str()}


@in_loop
async def test_calls_without_a_prompt_use_power_of_two_choices():
    replicas = [FakeReplica("a"), FakeReplica("b"), FakeReplica("c")]
    router = make_router(replicas)
    calls = [(None, "card"), (None, "health"), (TokenizeRequest(prompt="hello"), "tokenize"),
             (TokenizeRequest(messages=[{"role": "user", "content": "hi"}]), "tokenize"),
             (DetokenizeRequest(tokens=[1, 2]), "detokenize"), (CompletionRequest(prompt=""), "completions")]
    for body, method in calls:
        ranks = await choose(router, replicas, body, method)
        assert len(ranks) == 1 and len(ranks[0]) == 2, (method, ranks)  # two random replicas
    assert set(router.tree_chars().values()) == {0}  # a tokenize warms no cache: nothing recorded


@in_loop
async def test_token_ids_and_batches_route_by_prefix():
    replicas = [FakeReplica("a"), FakeReplica("b")]
    router = make_router(replicas)
    shared = list(range(1, 200))
    first = (await choose(router, replicas, CompletionRequest(prompt=shared + [7]), "completions"))[0][0]
    for tail in ([8], [9, 10]):
        assert (await choose(router, replicas, CompletionRequest(prompt=shared + tail), "completions"))[0][0] is first
    text, second = "a long shared document. " * 20, "another document entirely. " * 12
    home = (await choose(router, replicas, CompletionRequest(prompt=[text + "q1", second]), "completions"))[0][0]
    # routed on its first prompt, every prompt of the batch recorded where it went
    for prompt in (text, second):
        matched, tenants = router._tree.prefix_match(prompt)
        assert matched == prompt and tenants == [home.replica_id.to_full_id_str()]


@in_loop
async def test_a_lora_adapters_requests_go_to_a_replica_that_has_it_and_keep_their_own_prefixes():
    """A new prefix of an adapter goes to the least busy replica that reports the
    adapter loaded (Serve's multiplexed model ids), not to the one new prefixes would
    spread to; its prefixes are apart from the base model's (another KV)."""
    a, b, c = FakeReplica("a"), FakeReplica("b"), FakeReplica("c")
    b.multiplexed_model_ids = {"m:sql"}
    c.multiplexed_model_ids = {"m:sql"}
    c.queue_len = 50  # far busier: b stays the choice while its own requests pile up
    router = make_router([a, b, c])
    for i in range(6):
        ranks = await router.choose_replicas([a, b, c], pending(chat(system_text(i), "q"), adapter="m:sql"))
        assert ranks[0] == [b]
    base = [(await router.choose_replicas([a, b, c], pending(chat(system_text(i), "q"))))[0][0] for i in range(6)]
    assert a in base  # the base model's same prompts are new prefixes, spread as any
    nobody = await router.choose_replicas([a, b, c], pending(chat(system_text(50), "q"), adapter="m:other"))
    assert len(nobody[0]) != 1 or nobody[0][0] in (a, b, c)  # Serve's own choice (power of two)


@in_loop
async def test_a_replica_that_leaves_leaves_the_tree():
    a, b, c = FakeReplica("a"), FakeReplica("b"), FakeReplica("c")
    router = make_router([a, b])
    home = (await choose(router, [a, b], chat(system_text(5), "q")))[0][0]
    rest = [r for r in (a, b) if r is not home]
    router.update_replicas([*rest, c])
    assert home.replica_id.to_full_id_str() not in router.tree_chars()
    assert (await choose(router, [*rest, c], chat(system_text(5), "q2")))[0][0] in (*rest, c)


@in_loop
async def test_the_tree_stays_within_its_bound():
    replicas = [FakeReplica("a"), FakeReplica("b")]
    router = make_router(replicas, eviction_threshold_chars=5_000, eviction_target_chars=4_000)
    for i in range(60):
        await choose(router, replicas, chat(system_text(100 + i), "q"))
    chars = router.tree_chars()
    assert sum(chars.values()) > 0 and max(chars.values()) <= 5_000, chars


# -- configuration --------------------------------------------------------------------------------


def test_router_kwargs_are_checked():
    check_router_kwargs({"imbalanced_threshold": 4, "match_rate_threshold": 0.2, "do_eviction": True,
                         "eviction_interval_secs": 10})  # Ray Serve LLM's names are accepted
    for bad, match in [({"imbalanced": 4}, "request_router_kwargs.imbalanced: not a setting"),
                       ({"imbalanced_threshold": -1}, "imbalanced_threshold: must be a number >= 0"),
                       ({"match_rate_threshold": 2}, "match_rate_threshold"),
                       ({"eviction_threshold_chars": 10, "eviction_target_chars": 20}, "eviction_target_chars")]:
        with pytest.raises(ValueError, match=match):
            check_router_kwargs(bad)


def test_server_args_pick_the_router_of_the_engine_deployment():
    from deploy.serve import ServerArgs, engine_deployment

    def router_config(**args: Any) -> Any:
        app = engine_deployment(ServerArgs.model_validate({"model": "m", **args}))
        return app._bound_deployment._deployment_config.request_router_config

    default = router_config()
    assert default.request_router_class == ROUTER_PATH and default.request_router_kwargs == {}
    tuned = router_config(request_router_kwargs={"imbalanced_threshold": 3})
    assert tuned.request_router_kwargs == {"imbalanced_threshold": 3}
    serve_default = ROUTER_PATH != router_config(request_router="power_of_two").request_router_class
    assert serve_default  # Serve's own (power of two choices)
    assert router_config(engine={"enable_prefix_caching": False}).request_router_class != ROUTER_PATH
    assert router_config(request_router="prefix_aware",
                         engine={"enable_prefix_caching": False}).request_router_class == ROUTER_PATH
    with pytest.raises(ValueError, match="request_router_kwargs.imbalanced: not a setting"):
        ServerArgs(request_router_kwargs={"imbalanced": 3})
    with pytest.raises(ValueError, match="request_router is power_of_two"):
        ServerArgs(request_router="power_of_two", request_router_kwargs={"imbalanced_threshold": 3})
    with pytest.raises(ValueError):
        ServerArgs(request_router="round_robin")


def test_cli_request_router_flag():
    from deploy.cli import _parser, _replica_args

    ap = _parser()
    args = ap.parse_args(["serve", "--request-router", "power_of_two"])
    assert _replica_args(ap, args)["request_router"] == "power_of_two"
    args = ap.parse_args(["serve", "--request-router-kwargs", '{"imbalanced_threshold": 2}'])
    assert _replica_args(ap, args)["request_router_kwargs"] == {"imbalanced_threshold": 2}
    assert "request_router" not in _replica_args(ap, ap.parse_args(["serve"]))
    with pytest.raises(SystemExit):
        ap.parse_args(["serve", "--request-router", "random"])
    with pytest.raises(SystemExit):
        _replica_args(ap, ap.parse_args(["serve", "--request-router-kwargs", '{"nope": 1}']))


def test_ray_serve_llm_prefix_router_runs_as_ours():
    from deploy.serve_llm import map_deployment_config

    for path in ("ray.serve.llm.request_router:PrefixCacheAffinityRouter",
                 "ray.serve.llm.request_router.PrefixCacheAffinityRouter",
                 "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter"):
        _, _, serve_options = map_deployment_config({"request_router_config": {
            "request_router_class": path, "request_router_kwargs": {"imbalanced_threshold": 5},
            "initial_backoff_s": 0.05}})
        config = serve_options["request_router_config"]
        assert config.request_router_class == ROUTER_PATH
        assert config.request_router_kwargs == {"imbalanced_threshold": 5} and config.initial_backoff_s == 0.05
    other = {"request_router_class": "ray.serve.experimental.round_robin_router:RoundRobinRouter"}
    assert map_deployment_config({"request_router_config": other})[2]["request_router_config"] == other
    with pytest.raises(ValueError, match="KVAwareRouter is not supported"):
        map_deployment_config({"request_router_config": {
            "request_router_class": "ray.serve.llm.request_router:KVAwareRouter"}})
    with pytest.raises(ValueError, match="request_router_kwargs.bogus"):
        map_deployment_config({"request_router_config": {
            "request_router_class": "ray.serve.llm.request_router:PrefixCacheAffinityRouter",
            "request_router_kwargs": {"bogus": 1}}})


# -- served: 2 replicas behind the router against one replica alone ---------------------------------


KV_TOKENS = 1024  # each routed replica's KV pool
PER_PROMPT = 24  # chats per system prompt


@pytest.fixture
def app_url(ray_local, tiny_model_path):
    from ray import serve

    from helpers import free_port
    from prefix_workload import engine_args, multi_engine_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # The same KV memory on both sides: each routed replica holds about 2 of the 4 system
    # prompts (about 330 tokens each), the single one all 4. Power of two choices here
    # reaches about 0.4 of the single replica's hit rate (tests/bench/prefix_routing.py).
    serve.run(multi_engine_app({
        "routed": engine_args(tiny_model_path, "routed", 2, "prefix_aware", kv_cache_tokens=KV_TOKENS),
        "single": engine_args(tiny_model_path, "single", 1, "prefix_aware", kv_cache_tokens=2 * KV_TOKENS)}),
        name="prefix-routing", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def test_two_routed_replicas_reach_the_hit_rate_of_one_and_a_flood_spreads(app_url):
    from prefix_workload import chat_requests, measure, settled, system_prompts

    url = app_url
    chats = 4 * PER_PROMPT
    single = measure(url, "single", chat_requests(1, system_prompts(1), PER_PROMPT), 8, 0)
    routed = measure(url, "routed", chat_requests(2, system_prompts(2), PER_PROMPT), 8, 0)
    print(f"\nprefix hit rate, {chats} chats on 4 system prompts: one replica {single.hit_rate:.3f}; two replicas "
          f"behind the prefix-aware router {routed.hit_rate:.3f} ({routed.hit_rate / single.hit_rate:.2f}x); tokens "
          f"looked up per replica {sorted(round(q) for q in routed.per_replica_queries.values())}")
    assert single.hit_rate > 0.5  # the workload does share its prefixes
    assert routed.hit_rate >= 0.9 * single.hit_rate
    assert len(routed.per_replica_queries) == 2 and min(routed.per_replica_queries.values()) > 0  # both serve

    # The guard: one prefix's requests stay on one replica until it has more than 8
    # (the default imbalanced_threshold) in flight beyond the other, then spread.
    sent = chats
    flood_prefix = system_prompts(3, 1)[0]

    def completion(tail: str, max_tokens: int) -> dict[str, Any]:
        return {"model": "routed", "prompt": flood_prefix + tail, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}

    before = settled(url, "routed", sent)
    for j in range(4):  # one after another: all on the prefix's first replica
        assert httpx.post(f"{url}/v1/completions", json=completion(f" q{j}", 2), timeout=120).status_code == 200
    sent += 4
    quiet = settled(url, "routed", sent).minus(before).finished
    assert sorted(quiet.values()) == [0, 4], quiet
    home = max(quiet, key=quiet.get)

    flood, codes = 24, []
    barrier = threading.Barrier(flood)

    def client(j: int) -> None:
        barrier.wait()
        codes.append(httpx.post(f"{url}/v1/completions", json=completion(f" flood {j}", 32), timeout=300).status_code)

    threads = [threading.Thread(target=client, args=(j,)) for j in range(flood)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sent += flood
    assert codes == [200] * flood
    spread = settled(url, "routed", sent).minus(before).finished
    away = sum(n for engine, n in spread.items() if engine != home)
    print(f"flood of {flood} requests sharing a prefix: {spread[home] - 4:.0f} on its replica, {away:.0f} on the other")
    assert away >= 3, spread
