"""The environment ``raydecode serve`` gives Ray Serve before Ray starts: a quieter
controller, Ray's workers at niceness 0, Serve's throughput-optimized mode (the
replicas call each other over gRPC) and direct ingress on the served port. Serve and
its processes read these variables when they start, so they are set first; a cluster
started by ``ray start`` gets the same from them in its environment
(``deploy/cluster.yaml``).
"""

from __future__ import annotations


def quiet_serve_env() -> dict[str, str]:
    """Serve's own background work, slowed where one replica that never autoscales
    does not need its pace: the controller's loop every 1 s instead of 0.1 s and the
    replica's autoscaling metrics every 1 s instead of 0.1 s. On a small machine the
    controller's loop took a visible share of a core beside the worker, and much less
    after; a decode step shares the cores with it, so one stream's inter-token latency
    and many streams' throughput both gained a little (measured: docs/performance.md,
    'The numbers behind the code's choices'). Variables already set win."""
    return {
        "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1",
        "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    }


def serving_priority_env() -> dict[str, str]:
    """Ray's workers at niceness 0 instead of Ray's 15. The serving processes (the
    engine and ingress replicas, Serve's controller and proxy) then get a core at once
    when a request or a token arrives, instead of waiting behind the model worker's
    threads at the same niceness; a CPU model worker raises its own threads back to
    ``cpu_worker_niceness`` (15) when it loads, so it loses no more CPU than they use.
    On a small machine under many streams that gave more tokens/s, a shorter TTFT tail
    and more goodput (measured: docs/performance.md, 'The numbers behind the code's
    choices'). The variable already set wins."""
    return {"RAY_worker_niceness": "0"}


def throughput_serve_env(direct_ingress: bool) -> dict[str, str]:
    """Ray Serve's throughput-optimized mode (``RAY_SERVE_THROUGHPUT_OPTIMIZED``): the
    ingress calls the engine replicas over gRPC instead of Ray actor calls, so a
    streamed item is no longer an object in Ray's store, and each replica runs our
    code and its handle's router on its main event loop instead of threads of their
    own. On two cores the worker gets back what the two replicas stop using: the main
    loops took the replicas' share of a core down, and gRPC the ingress's, each for
    more tokens/s (measured: docs/performance.md, 'The numbers behind the code's
    choices'). A handle takes its transport from the Serve of the process that makes
    it, when Serve is imported: set these first (``raydecode serve`` does, in
    ``deploy.cli``; the ingress also follows its own process's mode,
    ``deploy.ingress.over_cluster_transport``). Three of the mode's other defaults are
    undone: replica logs still go to the replicas' stderr (a driver that prints its
    workers' output, such as ``serve run``, shows them; ``raydecode serve`` starts Ray
    with ``log_to_driver`` off, so they stay in Ray's session logs), each request's
    access-log line is written when it ends, not a thousand at a time (neither
    measured a cost; measured: docs/performance.md, 'The numbers behind the code's
    choices'), and direct ingress stays whatever ``--direct-ingress`` says. gRPC's
    4 MiB cap on what a replica receives is raised to gRPC's own limit, so a body the
    ingress accepts reaches the engine, which refuses an oversized prompt with a 400
    naming it, as it does over Ray calls. A cluster started by ``ray start`` gets the
    same from these variables in its environment (``deploy/cluster.yaml``)."""
    return {
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_LOG_TO_STDERR": "1",
        "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1",
        "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(2**31 - 1),
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1" if direct_ingress else "0",
    }


def direct_ingress_env(port: int) -> dict[str, str]:
    """The environment that makes Ray Serve's ingress replica serve HTTP on ``port``
    itself (direct ingress). Serve deals replicas ports from a range; a range of this
    one port gives it to the one replica. A replacement replica may take it back at
    once (no quarantine: nothing else competes for it), and a stopping replica does
    not hold requests open for a load balancer to notice it is going (there is none)."""
    return {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1),  # a half-open range
        "RAY_SERVE_PORT_QUARANTINE_S": "0",
        "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0",
    }
