"""Prefix-aware routing across engine replicas, on Serve's request-router API.

Each engine replica keeps its own prefix cache, so a request whose prompt begins the way
an earlier one did is cheapest on the replica that ran the earlier one. The ingress
calls the engines through a deployment handle; this router is that handle's policy
(``request_router_config`` of the engine deployment, set from ``ServerArgs.request_router``
by ``deploy.serve.engine_deployment``). Per generation request it:

1. takes a routing key from the parsed body: a chat's tools and messages (role and text
   of each, content parts joined, tool calls included), a completion's prompt text, or
   its token ids (one character per id, so token prompts match token prompts); a
   batched prompt routes on its first prompt and records all of them;
2. leaves out the replicas with more than ``imbalanced_threshold`` requests in flight
   beyond the least busy one (the load-imbalance guard) and full ones. In flight: the
   larger of the count Serve keeps for the replica (what it last reported, so it
   includes other ingress replicas' requests) and the generation requests this router
   sent it that have not finished (exact while a burst is on its way, which Serve's
   count lags);
3. finds, in a prefix tree of the keys each replica was sent (Ray Serve LLM's
   ``PrefixTree``), how much of the key each of the others holds, and sends the request
   to the least busy of those holding the longest prefix (within ``min_match_chars``:
   a few characters more fill no cache block). A flooded replica's prefix thus goes to
   the least busy one, which, its key recorded, holds it too from then on;
4. a key of which no replica holds ``match_rate_threshold`` of its length, and at least
   ``min_match_chars``, is a new prefix: it goes to the replica given the fewest new
   prefixes lately (a count that halves every ``placement_half_life_s``; ties: the least
   busy). Prefixes spread evenly as they come, a burst of new ones included, and the
   traffic they bring, which no one knows yet, is the guard's to even out.

Calls without a prompt (``card``, ``health``, ``tokenize``, ``detokenize``; only the
``completions`` and ``chat`` methods use the cache) get Serve's power-of-two choice.

Why not Ray Serve LLM's ``PrefixCacheAffinityRouter`` itself (read, and tried on fake
replicas, in Ray 2.60):

- it raises ``ValueError`` in ``choose_replicas`` for a call whose arguments carry no
  prompt (``detokenize``, a ``tokenize`` of a prompt), and Serve's routing task retries
  it forever: the call never reaches a replica;
- it reads messages as dicts: our pydantic messages, like token-id prompts, give an empty
  text, which divides by zero (``ZeroDivisionError``: no chat request is routed);
- it blocks the router's event loop on two ``ray.get`` round trips to a detached tree
  actor per request;
- it records a prefix once the replica has accepted the request, so a burst with a new
  prefix spreads before the first of it is recorded;
- it places a new prefix on the replica with the fewest characters in its tree (without
  eviction, its default: ever; a replica busy an hour ago is passed over now);
- it prefers the replicas at the deepest tree node, so a match one character longer (two
  user turns that both start with "W") outweighs any load below the guard;
- its load is Serve's cached count per replica, which trails a burst: each replica's
  count as it accepted a request, without those still on their way (in a trial of this
  router before it counted its own, 19 of a 24-request flood reached one replica before
  the guard, threshold 8, moved any);
- its detached tree actor outlives ``serve.delete`` of the app (it goes on
  ``serve.shutdown`` only), and a router that finds replicas it never saw in the tree
  may pick them (``KeyError``).

A subclass fixing these would override every method but ``initialize_state``; this
router is its own, on the same API, reusing Ray's ``PrefixTree`` (in process) and
accepting Ray's keyword arguments. The tree lives in the router, one per ingress replica:
no round trip per request; with several ingress replicas each keeps its own view, so a
prefix may be computed once per ingress replica rather than once.
"""

from __future__ import annotations

import inspect
import json
import logging
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree
from ray.serve._private.common import ReplicaID
from ray.serve._private.replica_result import ReplicaResult
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve._private.request_router.request_router import LocalityMixin, MultiplexMixin, RequestRouter
from ray.serve.config import RequestRouterConfig

logger = logging.getLogger("ray.serve")

#: the engine deployment's methods whose requests fill the prefix cache
ROUTED_METHODS = frozenset({"completions", "chat"})
#: where Serve finds the router (a string: a Serve config or YAML can name it too)
ROUTER_PATH = "deploy.request_router:PrefixAwareRouter"

# Key separators: control characters no role name contains.
_MESSAGE = "\x1e"
_FIELD = "\x1f"
_TOKENS = "\x00"  # a token-id prompt's key starts with it; a text prompt's never does
_TOOLS = "\x02"

_PROMPT_ATTR = "_raydecode_prefix_keys"


def _plain(value: Any) -> Any:
    """``value`` with pydantic models as dicts (for a JSON fingerprint)."""
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_none=True)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _field(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


def _content_text(content: Any) -> str:
    """A message's content as text: a string, or its parts' text joined by newlines
    (as the engine renders them); a non-text part by its JSON, so two different
    images do not look alike."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        parts = []
        for part in content:
            text = _field(part, "text")
            parts.append(text if isinstance(text, str) else json.dumps(_plain(part), sort_keys=True, default=str))
        return "\n".join(parts)
    return json.dumps(_plain(content), sort_keys=True, default=str)


def _message_key(message: Any) -> str:
    role = _field(message, "role")
    role = "system" if role == "developer" else str(role)  # rendered alike
    key = role + _FIELD + _content_text(_field(message, "content"))
    extra = {k: _plain(v) for k in ("name", "tool_calls", "tool_call_id") if (v := _field(message, k)) is not None}
    if extra:
        key += _FIELD + json.dumps(extra, sort_keys=True, default=str)
    return _MESSAGE + key


def _token_key(ids: list[int]) -> str:
    return _TOKENS + "".join(chr(t) if isinstance(t, int) and 0 <= t < 0x110000 else "\ufffd" for t in ids)


def _prompt_keys(prompt: Any) -> list[str]:
    if isinstance(prompt, str):
        return [prompt] if prompt else []
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return []
    if all(isinstance(t, int) for t in prompt):  # one prompt of token ids
        return [_token_key(list(prompt))]
    keys = []
    for item in prompt:  # a batch: strings or lists of token ids
        if isinstance(item, str) and item:
            keys.append(item)
        elif isinstance(item, (list, tuple)) and item:
            keys.append(_token_key(list(item)))
    return keys


def routing_keys(body: Any, max_chars: int | None = None) -> list[str]:
    """The prefix keys of an engine call's body: one for a chat or a single prompt,
    one per prompt of a batch, none for anything else (a body without ``messages`` or
    ``prompt``, an empty prompt). Each is cut to ``max_chars``."""
    messages = _field(body, "messages")
    keys: list[str]
    if isinstance(messages, (list, tuple)) and messages:
        tools = _field(body, "tools")
        head = _TOOLS + json.dumps(_plain(tools), sort_keys=True, default=str) if tools else ""
        keys = [head + "".join(_message_key(m) for m in messages)]
    else:
        keys = _prompt_keys(_field(body, "prompt"))
    return [k[:max_chars] for k in keys] if max_chars else keys


def _common_prefix_len(a: str, b: str) -> int:
    """Characters ``a`` and ``b`` share at their start: equal slices compared in C,
    bisected (Ray's tree compares character by character in Python)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo]; a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


#: a request chosen for a replica but not accepted by any within this long was cancelled
#: (its client left while it was routed): it no longer counts as load
UNROUTED_TTL_S = 30.0


@dataclass
class _Assignment:
    replica: ReplicaID
    at: float
    routed: bool = False


class _Tree(PrefixTree):
    """Ray Serve LLM's multi-tenant prefix tree (tenants: replica ids), with a fast
    shared-prefix count and every tenant's match at once."""

    @staticmethod
    def _shared_prefix_count(a: str, b: str) -> int:
        return _common_prefix_len(a, b)

    def match_lengths(self, text: str) -> dict[str, int]:
        """For each tenant holding a prefix of ``text``: the length of its longest. The
        text fixes one path from the root; a tenant's match ends at the deepest node of
        that path it was inserted through (every node of its strings is whole: nodes
        split where strings part)."""
        out: dict[str, int] = {}
        with self.lock:
            node, i = self.root, 0
            while i < len(text):
                child = node.edge_label_to_child.get(text[i])
                if child is None:
                    break
                n = _common_prefix_len(child.text, text[i:i + len(child.text)])
                i += n
                for tenant in child.tenant_to_last_access_time:
                    out[tenant] = i
                if n < len(child.text):
                    break
                node = child
        return out


class PrefixAwareRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Sends a generation request to the engine replica that cached the longest prefix
    of its prompt, within a load-imbalance guard; everything else by power of two
    choices. See the module's docstring; the keyword arguments are ``initialize_state``'s."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tree = _Tree()
        self._clock = 0.0  # the tree's LRU time: one tick per insert (ties evict together)
        self._placed: dict[ReplicaID, float] = {}  # new prefixes given lately, decayed
        self._placed_at = time.monotonic()
        # Generation requests this router sent each replica that have not finished: the
        # load the guard compares (with what Serve's cache says), exact while a burst is
        # still on its way (Serve's cache takes each replica's count as it accepts one
        # request, which leaves out the requests behind it).
        self._inflight: dict[ReplicaID, int] = {}
        self._assigned: dict[str, _Assignment] = {}  # internal request id ->
        self._swept_at = time.monotonic()
        self.initialize_state()

    def initialize_state(self, imbalanced_threshold: float = 8, match_rate_threshold: float = 0.1,
                         do_eviction: bool = True, eviction_threshold_chars: int = 2_000_000,
                         eviction_target_chars: int | None = None, eviction_interval_secs: float | None = None,
                         max_key_chars: int = 32_768, min_match_chars: int = 64,
                         placement_half_life_s: float = 60.0) -> None:
        """``imbalanced_threshold``: requests in flight a replica may have beyond the
        least busy one and still get the requests whose prefix it holds (the
        load-imbalance guard; ``inf``: never overridden). ``match_rate_threshold``: the
        share of a key that must match for it to count as cached somewhere, and
        ``min_match_chars`` the least length of that match (a few characters, say
        "You are a helpful assistant.", fill no cache block: such a key is new, else
        every chat opening that way would pile onto one replica up to the guard).
        ``eviction_threshold_chars``: characters of keys remembered per
        replica; beyond, its least recently sent ones are forgotten down to
        ``eviction_target_chars`` (default 90%) unless ``do_eviction`` is false (the
        tree then grows without bound). ``max_key_chars``: the length of a prompt's
        head that decides. ``placement_half_life_s``: how fast the count of new prefixes
        given to each replica (which places the next new one) forgets.
        ``eviction_interval_secs`` is accepted for Ray Serve LLM's configurations and
        does nothing: eviction happens as keys are inserted."""
        check_router_kwargs(dict(imbalanced_threshold=imbalanced_threshold, match_rate_threshold=match_rate_threshold,
                                 eviction_threshold_chars=eviction_threshold_chars,
                                 eviction_target_chars=eviction_target_chars, max_key_chars=max_key_chars,
                                 min_match_chars=min_match_chars,
                                 placement_half_life_s=placement_half_life_s))
        self._imbalanced_threshold = float(imbalanced_threshold)
        self._match_rate_threshold = float(match_rate_threshold)
        self._do_eviction = bool(do_eviction)
        self._eviction_threshold_chars = int(eviction_threshold_chars)
        self._eviction_target_chars = int(eviction_target_chars if eviction_target_chars is not None
                                          else 0.9 * eviction_threshold_chars)
        self._max_key_chars = int(max_key_chars)
        self._min_match_chars = int(min_match_chars)
        self._placement_half_life_s = float(placement_half_life_s)

    # -- keys and the tree ----------------------------------------------------------------

    def _keys(self, pending_request: PendingRequest) -> list[str]:
        """The request's prefix keys (computed once, kept on the request)."""
        keys = getattr(pending_request, _PROMPT_ATTR, None)
        if keys is None:
            keys = []
            if pending_request.metadata.call_method in ROUTED_METHODS and pending_request.args:
                keys = routing_keys(pending_request.args[0], self._max_key_chars)
                adapter = pending_request.metadata.multiplexed_model_id
                if adapter:  # a LoRA adapter's KV is its own: its prefixes are apart from the base model's
                    keys = [f"{adapter}\x00{key}" for key in keys]
            setattr(pending_request, _PROMPT_ATTR, keys)
        return keys

    @staticmethod
    def _tenant(replica_id: ReplicaID) -> str:
        return replica_id.to_full_id_str()

    def _record(self, keys: list[str], replica_id: ReplicaID) -> None:
        """``replica_id`` was sent ``keys``: they go into its part of the tree."""
        tenant = self._tenant(replica_id)
        if tenant not in self._tree.tenant_to_char_count:
            return  # a replica that has left
        for key in keys:
            self._clock += 1.0
            self._tree.insert(key, tenant, self._clock)
        if self._do_eviction and self._tree.tenant_to_char_count[tenant] > self._eviction_threshold_chars:
            excess = self._tree.tenant_to_char_count[tenant] - self._eviction_target_chars
            self._tree.evict_tenant_by_lru(tenant, excess)

    def tree_chars(self) -> dict[str, int]:
        """Characters of keys remembered per replica (its full id)."""
        return dict(self._tree.tenant_to_char_count)

    # -- load: generation requests in flight per replica ---------------------------------

    def _count(self, replica_id: ReplicaID, delta: int) -> None:
        n = self._inflight.get(replica_id, 0) + delta
        if n > 0:
            self._inflight[replica_id] = n
        else:
            self._inflight.pop(replica_id, None)

    def _assign(self, pending_request: PendingRequest, replica_id: ReplicaID) -> None:
        """``pending_request`` is about to go to ``replica_id`` (chosen again, say after a
        rejection: its earlier choice no longer counts)."""
        key = pending_request.metadata.internal_request_id
        old = self._assigned.get(key)
        if old is not None:
            self._count(old.replica, -1)
        self._assigned[key] = _Assignment(replica_id, time.monotonic())
        self._count(replica_id, +1)
        now = time.monotonic()
        if now - self._swept_at > 1.0:
            self._swept_at = now
            for k, a in list(self._assigned.items()):
                if not a.routed and now - a.at > UNROUTED_TTL_S:
                    del self._assigned[k]
                    self._count(a.replica, -1)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        a = self._assigned.pop(internal_request_id, None)
        if a is not None:
            self._count(a.replica, -1)

    def inflight(self) -> dict[str, int]:
        """Generation requests in flight per replica (its full id), as this router counts."""
        return {self._tenant(rid): n for rid, n in self._inflight.items()}

    # -- the policy ---------------------------------------------------------------------

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Requests in flight per replica: the cache Serve keeps, else probed (a
        replica that does not answer is left out)."""
        lens: dict[ReplicaID, int] = {}
        unknown = []
        for r in replicas:
            q = self._replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if q is None:
                unknown.append(r)
            else:
                lens[r.replica_id] = q
        if unknown:
            for r, q in await self._probe_queue_lens(unknown, 0):
                if q is not None:
                    lens[r.replica_id] = q
        return lens

    def _pick(self, key: str, replicas: list[RunningReplica],
              lens: dict[ReplicaID, int]) -> tuple[RunningReplica | None, bool]:
        """The replica for ``key`` among ``replicas`` (those with a known queue length
        that is not full), by the policy in the module's docstring, and whether the key
        is a new prefix."""
        open_ = [r for r in replicas if r.replica_id in lens and lens[r.replica_id] < r.max_ongoing_requests]
        if not open_:
            return None, False
        least = min(lens[r.replica_id] for r in open_)
        # The guard: a replica busier than the least busy by more than the threshold is
        # not considered, however much of the prompt it holds.
        within = [r for r in open_ if lens[r.replica_id] - least <= self._imbalanced_threshold]
        matched = self._tree.match_lengths(key)
        best = max((matched.get(self._tenant(r.replica_id), 0) for r in within), default=0)
        if best >= max(self._match_rate_threshold * len(key), self._min_match_chars, 1):
            # Holders of (about) the longest prefix: a few characters more (less than
            # min_match_chars, under a cache block) is no reason to pass a less busy one.
            holders = [r for r in within if matched.get(self._tenant(r.replica_id), 0) >= best - self._min_match_chars]
            return min(holders, key=lambda r: (lens[r.replica_id], random.random())), False
        placed = self._placed_counts()
        return min(within, key=lambda r: (placed.get(r.replica_id, 0.0), lens[r.replica_id], random.random())), True

    def _placed_counts(self) -> dict[ReplicaID, float]:
        """New prefixes given to each replica lately: each counts 1, halving every
        ``placement_half_life_s``."""
        now = time.monotonic()
        factor = 0.5 ** ((now - self._placed_at) / self._placement_half_life_s)
        self._placed_at = now
        for rid in self._placed:
            self._placed[rid] *= factor
        return self._placed

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Ranks of replicas to try: the prefix's replica first (then Serve's power of
        two choices, should it be full); power of two choices alone for a call without
        a prompt."""
        fallback = await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        if pending_request is None or not fallback:
            return fallback
        keys = self._keys(pending_request)
        if not keys:
            return fallback
        reported = await self._queue_lens(candidate_replicas)
        lens = {rid: max(q, self._inflight.get(rid, 0)) for rid, q in reported.items()}
        chosen, new = self._pick(keys[0], candidate_replicas, lens)
        if chosen is None:
            return fallback
        adapter = pending_request.metadata.multiplexed_model_id
        if new and adapter:
            # A new prefix of a LoRA adapter: the least busy replica that has the adapter
            # loaded; none has it: Serve's choice (it prefers replicas with fewer adapters).
            holders = [r for r in candidate_replicas if adapter in r.multiplexed_model_ids and r.replica_id in lens
                       and lens[r.replica_id] < r.max_ongoing_requests]
            if not holders:
                return fallback
            chosen = min(holders, key=lambda r: (lens[r.replica_id], random.random()))
        # Recorded now, not once the replica accepts: the requests of a burst that share
        # a new prefix follow this one instead of spreading before it is recorded.
        self._record(keys, chosen.replica_id)
        self._assign(pending_request, chosen.replica_id)
        if new:
            placed = self._placed_counts()
            placed[chosen.replica_id] = placed.get(chosen.replica_id, 0.0) + 1.0
        return [[chosen], *fallback]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        """A replica accepted the request. If it is not the one chosen for it (that one
        was full), its keys and its load go to the one that has it."""
        keys = self._keys(pending_request)
        if not keys:
            return
        a = self._assigned.get(pending_request.metadata.internal_request_id)
        if a is None or a.replica != replica_id:
            self._record(keys, replica_id)
            self._assign(pending_request, replica_id)
            a = self._assigned[pending_request.metadata.internal_request_id]
        a.routed = True

    # -- replicas coming and going ------------------------------------------------------

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        ids = {r.replica_id for r in replicas}
        self._placed = {rid: n for rid, n in self._placed.items() if rid in ids}
        self._inflight = {rid: n for rid, n in self._inflight.items() if rid in ids}
        live = {self._tenant(r.replica_id) for r in replicas}
        known = set(self._tree.tenant_to_char_count)
        if known - live:
            self._tree.remove_tenants(sorted(known - live))
        if live - known:
            self._tree.add_tenants(sorted(live - known), self._clock)
        if live != known:
            logger.info("prefix-aware routing over %d replicas of %s (imbalanced_threshold %s)", len(live),
                        self._deployment_id, self._imbalanced_threshold)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._placed.pop(replica_id, None)
        self._inflight.pop(replica_id, None)
        self._tree.remove_tenants([self._tenant(replica_id)])


# -- configuration ------------------------------------------------------------------------

_KWARGS = frozenset(inspect.signature(PrefixAwareRouter.initialize_state).parameters) - {"self"}


def check_router_kwargs(kwargs: dict[str, Any]) -> None:
    """``ValueError`` naming the first bad keyword argument of the prefix-aware router."""
    unknown = sorted(set(kwargs) - _KWARGS)
    if unknown:
        raise ValueError(f"request_router_kwargs.{unknown[0]}: not a setting of the prefix-aware router "
                         f"(it takes {', '.join(sorted(_KWARGS))})")

    def number(name: str, low: float, high: float | None = None, integer: bool = False) -> None:
        value = kwargs.get(name)
        if value is None:
            return
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= low
        ok = ok and (high is None or value <= high) and (not integer or float(value).is_integer())
        if not ok:
            what = f"{'an integer' if integer else 'a number'} >= {low}"
            what += f" and <= {high}" if high is not None else ""
            raise ValueError(f"request_router_kwargs.{name}: must be {what}, got {value!r}")

    number("imbalanced_threshold", 0)
    number("match_rate_threshold", 0, 1)
    number("eviction_threshold_chars", 1, integer=True)
    number("eviction_target_chars", 0, integer=True)
    number("max_key_chars", 1, integer=True)
    number("min_match_chars", 0, integer=True)
    number("placement_half_life_s", 1e-3)
    target, threshold = kwargs.get("eviction_target_chars"), kwargs.get("eviction_threshold_chars")
    if target is not None and threshold is not None and target > threshold:
        raise ValueError(f"request_router_kwargs.eviction_target_chars: must be <= eviction_threshold_chars "
                         f"({threshold}), got {target}")


def router_options(router: str | None, kwargs: dict[str, Any], prefix_caching: bool) -> dict[str, Any]:
    """The engine deployment's Serve options for ``ServerArgs.request_router``:
    ``request_router_config`` for the prefix-aware router, nothing for Serve's power of
    two choices. ``None`` picks prefix-aware when the engine caches prefixes."""
    if router is None:
        router = "prefix_aware" if prefix_caching else "power_of_two"
    if router == "power_of_two":
        return {}
    return {"request_router_config": RequestRouterConfig(request_router_class=ROUTER_PATH,
                                                         request_router_kwargs=dict(kwargs))}


#: Ray Serve LLM's prefix-aware router, under any of its import paths.
_RAY_PREFIX_ROUTER = "PrefixCacheAffinityRouter"
_RAY_KV_ROUTER = "KVAwareRouter"


def _class_path(cls: Any) -> str:
    if isinstance(cls, str):
        return cls.replace(":", ".")
    return f"{getattr(cls, '__module__', '')}.{getattr(cls, '__qualname__', repr(cls))}"


def from_ray_serve_llm(config: Any) -> Any:
    """A Ray Serve LLM ``deployment_config.request_router_config`` for raydecode's
    engine deployment: Ray's ``PrefixCacheAffinityRouter`` (which cannot read our
    requests) becomes this module's router with the same keyword arguments (checked)
    and the other fields kept; Ray's ``KVAwareRouter`` is refused (it needs vLLM's KV
    events); any other router passes as given."""
    as_dict = config.model_dump() if isinstance(config, RequestRouterConfig) else config
    if not isinstance(as_dict, Mapping):
        return config
    path = _class_path(as_dict.get("request_router_class", ""))
    if not path.startswith("ray."):
        return config
    name = path.rsplit(".", 1)[-1]
    if name == _RAY_KV_ROUTER:
        raise ValueError("deployment_config.request_router_config: KVAwareRouter is not supported: it routes on "
                         "vLLM's KV-cache events; raydecode routes on prompt prefixes (PrefixCacheAffinityRouter, "
                         "or leave request_router_config out: prefix-aware is the default)")
    if name != _RAY_PREFIX_ROUTER:
        return config
    kwargs = dict(as_dict.get("request_router_kwargs") or {})
    kwargs.pop("tree_actor", None)  # Ray's test hook: our tree lives in the router
    check_router_kwargs(kwargs)
    fields = {k: v for k, v in as_dict.items()
              if k not in ("request_router_class", "request_router_kwargs") and v is not None}
    return RequestRouterConfig(**fields, request_router_class=ROUTER_PATH, request_router_kwargs=kwargs)
