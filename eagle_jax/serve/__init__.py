"""OpenAI-compatible serving with continuous batching and the load-aware speculation harness.

    python -m eagle_jax.serve [--preset serve/smollm2-135m-instruct.toml] [--speculation auto|off|fixed:D,K,N]

Modules: `scheduler` (the engine loop), `app` (the FastAPI app and its routes, `create_app`), `api` (request
checks, prompts and sampling parameters), `generation` (one request from scheduler events to a JSON body or
an event stream), `schemas` (request bodies, `ApiError`), `config` (settings and presets), `text`
(incremental detokenisation and stop strings), `metrics` (Prometheus text); the harness itself is
`eagle_jax.harness`. See serve/README.md.
"""

from eagle_jax.serve.config import ConfigError, ServeConfig, load_preset


def create_app(target, head=None, config=None, **kwargs):
    from eagle_jax.serve import app

    return app.create_app(target, head, config, **kwargs)


__all__ = ["ConfigError", "ServeConfig", "create_app", "load_preset"]
