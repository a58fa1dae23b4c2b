"""raydecode's deployment surface: the OpenAI HTTP API on Ray Serve and the command.

Modules:
  serve            the Ray Serve application: the FastAPI ingress, its routes, build_app
  openai/protocol  the OpenAI request bodies (validated at the edge) and response builders
  cli              the ``raydecode`` command (generate, serve, bench)

Beside them: ``serve.yaml`` (a Serve config of the app), ``cluster.yaml`` and
``cluster-local.yaml`` (``ray up`` clusters), and ``README.md`` (how to deploy).
Dependency direction: deploy -> cluster -> worker -> sampler; HTTP lives only here.
"""
