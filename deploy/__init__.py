"""raydecode's deployment surface: the OpenAI HTTP API on Ray Serve and the command.

Modules:
  serve    the Ray Serve application's arguments (ServerArgs) and builders (build_app)
  ingress  the OpenAI HTTP ingress deployment: routes, validation, API key, routing by model
  engine_server  the engine deployment: AsyncLLM behind the OpenAI protocol, called by the ingress
  request_router  the ingress's handle policy: each prompt to the engine replica that cached
           its prefix, within a load-imbalance guard (Serve's request-router API)
  serve_llm/  Ray Serve LLM's config shape (LLMConfig, build_openai_app) over those builders
           (its ``__init__`` lists the modules)
  metrics  ``GET /metrics``: the engine's counters as Prometheus text under vLLM's names,
           for every replica of the app (``ReplicaMetrics``)
  metrics_hub  the hub actor of an app that its replicas push their metrics to
  openai/  the OpenAI (and vLLM-extension) protocol: request models, responses, tools,
           structured outputs (its ``__init__`` lists the modules)
  cli      the ``raydecode`` command (generate, serve, bench)
  engine_flags  ``EngineConfig``'s fields as the command's flags
  serve_env  the environment ``raydecode serve`` gives Ray Serve before Ray starts

Beside them: ``grafana/raydecode.json`` (a Grafana dashboard over ``/metrics``),
``serve.yaml`` (a Serve config of the app), ``cluster.yaml`` and
``cluster-local.yaml`` (``ray up`` clusters), and ``README.md`` (how to deploy).
Dependency direction: deploy -> cluster -> worker -> sampler; HTTP lives only here.
"""
