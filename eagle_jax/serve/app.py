"""The FastAPI app: routes, authentication, error bodies and the scheduler's lifetime.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both streaming as server-sent events with a
final `data: [DONE]`, or one JSON body), GET /v1/models, GET /health, GET /metrics (Prometheus text),
GET /ready (whether requests can be served yet, and what the background preparation has left), GET
/harness (the speculation policy's state as JSON).
Bad requests get an OpenAI-style error body {"error": {"message", "type", "param", "code"}} naming the
field; a full queue gets 503 with Retry-After. The /v1 routes need 'Authorization: Bearer KEY' when the
server has an API key. `create_app` builds it all for a loaded model.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import os

import jax
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from eagle_jax import harness, profiles, sharding
from eagle_jax.serve.api import Api
from eagle_jax.serve.config import ConfigError, ServeConfig
from eagle_jax.serve.metrics import CompileCounter, Metrics
from eagle_jax.serve.replica import Channel
from eagle_jax.serve.requests import SchedulerConfig, bucket_lengths, cache_length
from eagle_jax.serve.scheduler import Scheduler
from eagle_jax.tree import tree_name
from eagle_jax.serve.schemas import ApiError, ChatRequest, CompletionRequest, decode_json, error_response, parse_body

log = logging.getLogger("eagle_jax.serve")


def build_app(api: Api) -> FastAPI:
    """The app serving `api`; the scheduler thread starts and stops with it (its lifespan)."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        api.scheduler.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, api.scheduler.shutdown)

    app = FastAPI(title="eagle-jax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.api = api
    add_error_handlers(app, api)
    app.add_middleware(InternalErrors, metrics=api.metrics)
    app.include_router(v1_router(api))
    add_service_routes(app, api)
    return app


def add_error_handlers(app: FastAPI, api: Api) -> None:
    """ApiErrors (counted in eagle_requests_total) and Starlette's own errors (404, 405) as OpenAI-style bodies."""

    @app.exception_handler(ApiError)
    async def on_api_error(request, e: ApiError):
        if e.status == 503:
            api.metrics.inc("eagle_requests_total", outcome="rejected")
        elif e.status == 401:
            api.metrics.inc("eagle_requests_total", outcome="unauthorized")
        elif 400 <= e.status < 500:
            api.metrics.inc("eagle_requests_total", outcome="invalid")
        return error_response(e.status, e.message, e.param, e.code, e.type, e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request, e):
        return error_response(e.status_code, str(e.detail), None, None,
                              "invalid_request_error" if e.status_code < 500 else "server_error",
                              getattr(e, "headers", None))


class InternalErrors:
    """ASGI middleware for what no handler expected: a request that raises is logged, counted
    (eagle_requests_total{outcome="error"}) and answered 500 with an OpenAI-style body and
    `Connection: close`, so a client never reads a reset on its next request. A stream that fails after
    its first chunk cannot be answered any more; its connection is closed."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_and_note(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        except Exception:
            log.exception("internal error answering %s %s", scope.get("method"), scope.get("path"))
            self.metrics.inc("eagle_requests_total", outcome="error")
            if started:
                raise
            await error_response(500, "The server failed while answering this request; it has been logged.", None,
                                 "internal_error", "server_error", {"Connection": "close"})(scope, receive, send)


def v1_router(api: Api) -> APIRouter:
    """The OpenAI routes under /v1, behind the API key if there is one."""

    async def check_key(request: Request):
        if api.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api.api_key.encode()):
            raise ApiError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.", None,
                           "invalid_api_key", "authentication_error", {"WWW-Authenticate": "Bearer"})

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @v1.get("/models")
    async def models():
        return api.models()

    @v1.post("/completions")
    async def completions(request: Request):
        req = parse_body(CompletionRequest, decode_json(await request.body()))
        return await api.completions(request, req)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        req = parse_body(ChatRequest, decode_json(await request.body()))
        return await api.chat_completions(request, req)

    return v1


def add_service_routes(app: FastAPI, api: Api) -> None:
    """/health (alive), /ready, /harness and /metrics (no API key: for load balancers and monitoring)."""

    @app.get("/health")
    async def health():
        if api.scheduler.alive:
            return {"status": "ok", "model": api.model_name}
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/ready")
    async def ready():
        """200 once requests can be served (plain decoding of the first batch bucket is compiled), with what
        is still being prepared ("complete" turns true when nothing is left); 503 before that."""
        prep = api.scheduler.ready.snapshot()
        ok = api.scheduler.alive and prep["servable"]
        status = ("ready" if prep["complete"] else "preparing") if ok else "starting"
        longest = {str(b): n for b, (n, _) in api.scheduler.lengths.items()}  # the KV budget's effect
        return JSONResponse({"status": status, "model": api.model_name, "preparation": prep,
                             "longest_request_by_batch_bucket": longest}, status_code=200 if ok else 503)

    @app.get("/harness")
    async def harness_state():
        """The speculation policy's state: mode, estimates, choices so far, the cost profile, and the
        background preparation's progress (JSON)."""
        return {**api.scheduler.policy.snapshot(), "preparation": api.scheduler.ready.snapshot()}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(api.render_metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")


def create_app(target, head=None, config=None, *, profile=None, metrics: Metrics | None = None) -> FastAPI:
    """The server for a loaded target (and optional draft head) with `config` (a ServeConfig).

    Builds the speculation policy (the harness for speculation='auto': measures or loads the cost profile,
    unless `profile` is given), the scheduler (compiling its steps when config.warmup) and the FastAPI app.
    The scheduler thread starts with the app (its lifespan) and stops with it; `app.state.api` holds it all.
    """
    config = config or ServeConfig()
    metrics = metrics or Metrics()
    if jax.process_count() > 1:  # (joined through the environment rather than --distributed)
        config = dataclasses.replace(config, distributed=True)  # validated again: see ServeConfig.mesh_problem
    max_model_len = config.model_len(target.cfg.max_position)
    buckets, prefill_batches = tuple(config.batch_buckets), tuple(config.prefill_batches)
    dp = sharding.mesh_shape(target.model.mesh)["data"]
    if dp > 1:  # every batch (and prefill batch) splits evenly over the data axis
        every = buckets or SchedulerConfig(max_batch=config.max_batch, max_model_len=max_model_len).buckets()
        buckets = tuple(b for b in every if b % dp == 0)
        prefill_batches = tuple(sorted({-(-p // dp) * dp for p in prefill_batches}))
    sched_cfg = SchedulerConfig(max_batch=config.max_batch, max_model_len=max_model_len,
                                batch_buckets=buckets, prefill_batches=prefill_batches,
                                prefill_tokens=config.prefill_tokens, prefill_chunk=config.prefill_chunk,
                                max_queue=config.max_queue, kv_cache_tokens=kv_cache_tokens(config, max_model_len),
                                resident_tree_buckets=config.resident_tree_buckets, block_size=config.block_size)
    CompileCounter.watch()
    head, policy = speculation_policy(target, head, config, sched_cfg, profile)
    scheduler = Scheduler(target, head, policy, sched_cfg, metrics, profile_dir=config.profile_dir,
                          profile_reps=config.profile_reps)
    if scheduler.blocks is not None:
        log.info("KV cache: %d blocks of %d slots shared, handed to requests by need", *scheduler.pages)
    else:
        log.info("KV cache: %d slots shared; longest request (prompt + max_tokens) a row holds, by batch bucket: %s",
                 sched_cfg.kv_cache_tokens, ", ".join(f"{b}: {n}" for b, (n, _) in scheduler.lengths.items()))
    if jax.process_count() > 1:  # one loop per process, in step (no background preparation: see serve.replica)
        scheduler.replica = Channel()
    elif config.warmup:  # compiled in the background once the app starts; served meanwhile
        if config.compile_cache:  # a restart loads the prepared programs without tracing them
            scheduler.engine.use_store(os.path.join(config.compile_cache, "programs"))
        scheduler.prepare_in_background(config.warmup_prompt_len)
    api = Api(scheduler, config.served_model_name or target.name, max_model_len, metrics, config.api_key)
    return build_app(api)


def kv_cache_tokens(config: ServeConfig, max_model_len: int) -> int:
    """`config.kv_cache_tokens`, or by default room for 8 rows of max_model_len (with the tree slack)."""
    if config.kv_cache_tokens is not None:
        return config.kv_cache_tokens
    mode, tree = config.speculation_mode()
    trees = {"off": [], "fixed": [tree]}.get(mode, config.candidate_trees())
    return 8 * cache_length(max_model_len, trees)


def speculation_policy(target, head, config: ServeConfig, sched_cfg: SchedulerConfig, profile=None):
    """(head, policy) for config.speculation: no head and plain decoding for 'off' (or without a head),
    a fixed tree, or the harness choosing among config.candidates with a cost profile (`profile`, else
    loaded from config.profile_dir or measured now)."""
    mode, tree = config.speculation_mode()
    if mode == "fixed" and head is None:
        raise ConfigError(f"speculation {config.speculation!r} needs a draft head (--draft)")
    if mode == "auto" and head is None:
        log.warning("no draft head: serving with plain decoding (speculation off)")
    if mode == "off" or head is None:
        return None, harness.FixedPolicy(None)
    if mode == "fixed":
        return head, harness.FixedPolicy(tree)
    trees = [t for t in config.candidate_trees() if t is not None]
    candidates = [None] + trees
    if profile is None:  # the cached one, else measured on real steps as the server serves
        cache_len = cache_length(sched_cfg.max_model_len, candidates)
        pages = None
        if sched_cfg.block_size:  # paged caches: every bucket's attention walks what its rows hold
            pages = (sched_cfg.block_size, sched_cfg.kv_cache_tokens)
        elif sched_cfg.kv_cache_tokens:  # batch buckets with shorter caches: steps of other costs
            cache_len = [c for _, c in bucket_lengths(sched_cfg, candidates).values()]
        key = profiles.profile_key(target, head, sched_cfg.buckets(), [tree_name(t) for t in candidates], cache_len,
                                   pages=pages)
        profile = None if config.reprofile else profiles.load_cached(key, config.profile_dir)
        if profile is None:
            profile = profiles.Profile(key, {}, {"device": profiles.device_kind(), "model": target.name,
                                                  "cache_len": cache_len, "candidates": [tree_name(t) for t in candidates],
                                                  "method": "online"}, source="online")
        else:
            log.info("harness: cost profile from %s", profiles.profile_file(key, config.profile_dir))
    return head, harness.Harness(trees, profile)
