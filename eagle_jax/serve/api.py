"""The OpenAI-compatible HTTP API (FastAPI) in front of the scheduler.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both streaming as server-sent events with a
final `data: [DONE]`, or one JSON body), GET /v1/models, GET /health, GET /metrics (Prometheus text),
GET /harness (the speculation policy's state as JSON).
Bad requests get an OpenAI-style error body {"error": {"message", "type", "param", "code"}} naming the
field; a full queue gets 503 with Retry-After. Requests are validated completely before they reach the
scheduler, so a bad request never touches the running batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import secrets
import time
import uuid
from typing import Optional, Union

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from eagle_jax.serve.metrics import Metrics
from eagle_jax.serve.scheduler import QueueFull, Request as GenRequest, Scheduler, ShuttingDown
from eagle_jax.serve.text import TextStream

log = logging.getLogger("eagle_jax.serve")

MAX_STOP = 4
ROLES = ("system", "developer", "user", "assistant", "tool")


class ClientGone(Exception):
    """The client of a non-streaming request disconnected."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type, self.headers = (
            status, message, param, code, type_, headers)


def error_response(status, message, param=None, code=None, type_="invalid_request_error", headers=None):
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status, headers=headers)


# --- request bodies ----------------------------------------------------------------------------------

class _Strict(BaseModel):
    # Strict: "5" is not an int and 1.0 is not an int, as in the OpenAI API. Unknown fields are ignored.
    model_config = ConfigDict(extra="allow", strict=True, protected_namespaces=())


class StreamOptions(_Strict):
    include_usage: Optional[bool] = None


class _Common(_Strict):
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    n: Optional[int] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    ignore_eos: Optional[bool] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict] = None
    user: Optional[str] = None


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = None
    echo: Optional[bool] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ContentPart(_Strict):
    type: str
    text: Optional[str] = None


class ChatMessage(_Strict):
    role: str
    content: Union[str, list[ContentPart], None] = None


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None


_FIELD_NAMES = set()
for _m in (CompletionRequest, ChatRequest, ChatMessage, ContentPart, StreamOptions):
    _FIELD_NAMES |= set(_m.model_fields)


def _param(loc) -> str:
    out = str(loc[0]) if loc else ""
    for part in loc[1:]:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _FIELD_NAMES:
            out += f".{part}"
    return out


def _validate(model, body):
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = _param(err.get("loc", ()))
        if err.get("type") == "missing":
            raise ApiError(400, f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
        got = repr(err.get("input"))
        got = got if len(got) <= 60 else got[:57] + "..."
        raise ApiError(400, f"Invalid type for '{param}': {err.get('msg')} (got {got}).", param, "invalid_type")


# --- the app -------------------------------------------------------------------------------------------

class Api:
    def __init__(self, scheduler: Scheduler, model_name: str, max_model_len: int, metrics: Metrics,
                 api_key: str | None = None):
        self.scheduler, self.model_name, self.max_model_len = scheduler, model_name, max_model_len
        self.metrics, self.api_key = metrics, api_key
        self.tokenizer = scheduler.target.tokenizer
        self.vocab = scheduler.target.cfg.vocab_size
        self.created = int(time.time())

    # --- validation ---------------------------------------------------------------------------------
    def check_model(self, name):
        if name is not None and name != self.model_name:
            raise ApiError(404, f"The model '{name}' does not exist; this server serves '{self.model_name}'.",
                           "model", "model_not_found")

    def check_prompt_len(self, n: int, param: str):
        if n >= self.max_model_len:
            raise ApiError(400, f"The prompt is {n} tokens long; this server's maximum context length is "
                                f"{self.max_model_len} tokens (prompt + completion), so the prompt must be shorter "
                                f"than that.", param, "context_length_exceeded")

    def sampling(self, req, n_prompt: int, default_max: int | None, max_tokens_param: str = "max_tokens") -> dict:
        unsupported = [
            ("n", req.n not in (None, 1), "only n=1 is supported"),
            ("presence_penalty", bool(req.presence_penalty), "presence_penalty is not supported (use 0)"),
            ("frequency_penalty", bool(req.frequency_penalty), "frequency_penalty is not supported (use 0)"),
            ("logit_bias", bool(req.logit_bias), "logit_bias is not supported"),
            ("logprobs", bool(req.logprobs), "logprobs are not supported"),
            ("echo", bool(getattr(req, "echo", None)), "echo is not supported"),
            ("best_of", getattr(req, "best_of", None) not in (None, 1), "best_of is not supported"),
            ("suffix", bool(getattr(req, "suffix", None)), "suffix is not supported"),
        ]
        for param, bad, message in unsupported:
            if bad:
                raise ApiError(400, message + ".", param, "unsupported_parameter")
        t = 1.0 if req.temperature is None else req.temperature
        if not math.isfinite(t) or t < 0 or t > 2:
            raise ApiError(400, f"temperature must be a number in [0, 2], got {req.temperature}.", "temperature",
                           "invalid_value")
        top_p = 1.0 if req.top_p is None else req.top_p
        if not math.isfinite(top_p) or not 0 < top_p <= 1:
            raise ApiError(400, f"top_p must be in (0, 1], got {req.top_p}.", "top_p", "invalid_value")
        top_k = req.top_k or 0
        if top_k < -1:
            raise ApiError(400, f"top_k must be >= 0 (0 or -1 disables it), got {top_k}.", "top_k", "invalid_value")
        if top_k >= self.vocab:
            top_k = 0  # keeps the whole vocabulary anyway
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > MAX_STOP:
            raise ApiError(400, f"stop takes at most {MAX_STOP} strings, got {len(stop)}.", "stop", "invalid_value")
        room = self.max_model_len - n_prompt
        max_tokens = getattr(req, "max_completion_tokens", None)
        if max_tokens is None:
            max_tokens = req.max_tokens
        else:
            max_tokens_param = "max_completion_tokens"
        if max_tokens is None:
            max_tokens = room if default_max is None else min(default_max, room)
        elif max_tokens < 1:
            raise ApiError(400, f"{max_tokens_param} must be at least 1, got {max_tokens}.", max_tokens_param,
                           "invalid_value")
        elif max_tokens > room:
            raise ApiError(400, f"This server's maximum context length is {self.max_model_len} tokens. However, you "
                                f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for "
                                f"the completion). Reduce the prompt or {max_tokens_param}.", max_tokens_param,
                           "context_length_exceeded")
        seed = secrets.randbits(32) if req.seed is None else req.seed
        return {"max_tokens": int(max_tokens), "temperature": float(t), "top_p": float(top_p),
                "top_k": max(int(top_k), 0), "seed": int(seed), "ignore_eos": bool(req.ignore_eos), "stop": stop}

    def completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, f"Only one prompt per request is supported, got {len(prompt)}.", "prompt",
                               "invalid_value")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "prompt must not be empty.", "prompt", "invalid_value")
            if self.tokenizer is None:
                raise ApiError(400, "This model has no tokenizer: send the prompt as a list of token ids.", "prompt",
                               "invalid_value")
            ids = list(self.tokenizer(prompt)["input_ids"])
        else:
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab]
            if bad:
                raise ApiError(400, f"prompt token ids must be in [0, {self.vocab}), got {bad[0]}.", "prompt",
                               "invalid_value")
        if not ids:
            raise ApiError(400, "prompt must not be empty.", "prompt", "invalid_value")
        self.check_prompt_len(len(ids), "prompt")
        return ids

    def chat_prompt(self, messages: list[ChatMessage]) -> list[int]:
        if not messages:
            raise ApiError(400, "messages must be a non-empty list.", "messages", "invalid_value")
        msgs = []
        for i, m in enumerate(messages):
            if m.role not in ROLES:
                raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}; got {m.role!r}.",
                               f"messages[{i}].role", "invalid_value")
            content = m.content
            if isinstance(content, list):
                parts = []
                for j, p in enumerate(content):
                    if p.type != "text" or p.text is None:
                        raise ApiError(400, f"Only text content parts are supported; messages[{i}].content[{j}] has "
                                            f"type {p.type!r}.", f"messages[{i}].content[{j}].type", "invalid_value")
                    parts.append(p.text)
                content = "".join(parts)
            msgs.append({"role": m.role, "content": content or ""})
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ApiError(400, "This model has no chat template; use /v1/completions.", "messages", "invalid_value")
        try:
            enc = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        except Exception as e:
            raise ApiError(400, f"The chat template rejected these messages: {e}", "messages", "invalid_value")
        ids = list(enc["input_ids"] if not isinstance(enc, list) else enc)
        self.check_prompt_len(len(ids), "messages")
        return ids

    # --- generation -----------------------------------------------------------------------------------
    async def generate(self, http: Request, chat: bool, prompt_ids: list[int], sp: dict, stream: bool,
                       include_usage: bool):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        try:
            req = GenRequest(prompt_ids, sp["max_tokens"], temperature=sp["temperature"], top_p=sp["top_p"],
                             top_k=sp["top_k"], seed=sp["seed"], ignore_eos=sp["ignore_eos"],
                             sink=lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev))
            self.scheduler.submit(req)
        except ValueError as e:  # the checks above should have caught it; the scheduler double-checks
            raise ApiError(400, str(e), None, "invalid_value")
        except QueueFull as e:
            raise ApiError(503, f"The server is at capacity ({e}); retry shortly.", None, "queue_full", "server_error",
                           {"Retry-After": "1"})
        except ShuttingDown as e:
            raise ApiError(503, str(e), None, "shutting_down", "server_error", {"Retry-After": "5"})
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        text = TextStream(self.tokenizer, sp["stop"])
        usage = lambda: {"prompt_tokens": len(prompt_ids), "completion_tokens": text.tokens,
                         "total_tokens": len(prompt_ids) + text.tokens}

        async def events(poll_disconnect: bool):
            """(delta text, finish reason or None, error message or None) until the request ends."""
            getter, checked = None, loop.time()
            try:
                while True:
                    if poll_disconnect:  # one pending get() at a time, so a timeout never loses an event
                        getter = getter or asyncio.ensure_future(queue.get())
                        done, _ = await asyncio.wait({getter}, timeout=0.5)
                        if loop.time() - checked >= 0.5:  # also while tokens keep coming
                            checked = loop.time()
                            if await http.is_disconnected():
                                raise ClientGone()
                        if not done:
                            continue
                        ev, getter = getter.result(), None
                    else:
                        ev = await queue.get()
                    for item in handle(ev):
                        yield item
                        if item[1] is not None or item[2] is not None:
                            return
            finally:
                if getter is not None:
                    getter.cancel()

        def handle(ev):
            """An engine event -> [(delta text, finish reason or None, error message or None)]."""
            if ev.kind == "tokens":
                delta = text.add(ev.tokens)
                if text.stopped:
                    self.scheduler.cancel(req, reason="stop")
                    return [(delta, "stop", None)]
                return [(delta, None, None)] if delta else []
            if ev.kind == "done":
                return [(text.finish(), "length" if ev.reason == "length" else "stop", None)]
            return [("", None, ev.message or "engine error")]

        if not stream:
            outcome = "cancelled"
            try:
                pieces, finish, error = [], None, None
                try:
                    async for delta, fin, err in events(poll_disconnect=True):
                        pieces.append(delta)
                        finish, error = fin or finish, err
                except ClientGone:
                    return JSONResponse({}, status_code=499)  # nobody is listening
                outcome = "error" if error else "completed"
            finally:
                if outcome == "cancelled":
                    self.scheduler.cancel(req)
                self.metrics.inc("eagle_requests_total", outcome=outcome)
            if error:
                return error_response(500, error, None, "engine_error", "server_error")
            body = {"id": rid, "created": created, "model": self.model_name, "usage": usage()}
            content = "".join(pieces)
            if chat:
                body.update(object="chat.completion", choices=[{
                    "index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None,
                    "finish_reason": finish}])
            else:
                body.update(object="text_completion", choices=[{
                    "index": 0, "text": content, "logprobs": None, "finish_reason": finish}])
            return JSONResponse(body)

        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish=None, role=False) -> str:
            if chat:
                d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
                choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": self.model_name,
                                          "choices": [choice]}) + "\n\n"

        async def sse():
            outcome = "cancelled"  # unless we reach the end: the client went away (or the server stopped)
            try:
                if chat:
                    yield chunk(None, role=True)
                async for delta, fin, err in events(poll_disconnect=False):
                    if err:
                        yield "data: " + json.dumps({"error": {"message": err, "type": "server_error", "param": None,
                                                               "code": "engine_error"}}) + "\n\n"
                        outcome = "error"
                        break
                    if delta:
                        yield chunk(delta)
                    if fin:
                        yield chunk(None, finish=fin)
                        outcome = "completed"
                if include_usage and outcome == "completed":
                    yield "data: " + json.dumps({"id": rid, "object": obj, "created": created,
                                                 "model": self.model_name, "choices": [], "usage": usage()}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                if outcome == "cancelled":
                    self.scheduler.cancel(req)
                self.metrics.inc("eagle_requests_total", outcome=outcome)

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # --- metrics --------------------------------------------------------------------------------------
    def render_metrics(self) -> str:
        c = self.scheduler.counts()
        gauges = [("eagle_requests_running", {}, c["running"]), ("eagle_requests_waiting", {}, c["waiting"]),
                  ("eagle_batch_size", {}, c["batch"]), ("eagle_batch_bucket", {}, c["bucket"]),
                  ("eagle_slots_free", {}, c["free"])]
        policy = self.scheduler.policy
        snap = policy.snapshot()
        last = getattr(policy, "last_choice", None)
        for sampling, part in (("greedy", snap), ("sampled", snap.get("sampled", {}))):
            if part.get("tau_ema") is not None:
                gauges.append(("eagle_tau", {"sampling": sampling}, part["tau_ema"]))
            for name, value in part.get("expected_tokens_per_row", {}).items():
                gauges.append(("eagle_harness_expected_tokens", {"config": name, "sampling": sampling}, value))
        for name in snap.get("expected_tokens_per_row", {}):
            chosen = (last.name == name) if last is not None else (snap["mode"] == "fixed")
            gauges.append(("eagle_harness_choice", {"config": name}, 1.0 if chosen else 0.0))
        return self.metrics.render(gauges)


def build_app(api: Api) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        api.scheduler.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, api.scheduler.shutdown)

    app = FastAPI(title="eagle-jax", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.api = api

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

    async def check_key(request: Request):
        if api.api_key is None:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {api.api_key}".encode()):
            raise ApiError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.", None,
                           "invalid_api_key", "authentication_error", {"WWW-Authenticate": "Bearer"})

    async def body_of(request: Request):
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"Invalid JSON body: {e}", None, "invalid_json")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": api.model_name, "object": "model", "created": api.created,
                                            "owned_by": "eagle-jax", "max_model_len": api.max_model_len}]}

    @v1.post("/completions")
    async def completions(request: Request):
        req = _validate(CompletionRequest, await body_of(request))
        api.check_model(req.model)
        ids = api.completion_prompt(req.prompt)
        sp = api.sampling(req, len(ids), default_max=16)  # the OpenAI default for completions
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await api.generate(request, False, ids, sp, bool(req.stream), include_usage)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        req = _validate(ChatRequest, await body_of(request))
        api.check_model(req.model)
        ids = api.chat_prompt(req.messages)
        sp = api.sampling(req, len(ids), default_max=None)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return await api.generate(request, True, ids, sp, bool(req.stream), include_usage)

    app.include_router(v1)

    @app.get("/health")
    async def health():
        if api.scheduler.alive:
            return {"status": "ok", "model": api.model_name}
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/harness")
    async def harness_state():
        """The speculation policy's state: mode, estimates, choices so far, the cost profile (JSON)."""
        return api.scheduler.policy.snapshot()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(api.render_metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def release_free_memory() -> None:
    """Hands the C heap's free pages back to the OS. Profiling and warm-up allocate and free gigabytes
    of step buffers, which glibc keeps (a plain SmolLM2 server measured 10.9 GB resident after start-up,
    2.3 GB after this); trimming once before serving costs nothing per step (trimming on every free
    halves the throughput). Does nothing where the C library has no malloc_trim."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def create_app(target, head=None, config=None, *, profile=None, metrics: Metrics | None = None) -> FastAPI:
    """The server for a loaded target (and optional draft head) with `config` (a ServeConfig).

    Builds the speculation policy (the harness for speculation='auto': measures or loads the cost profile,
    unless `profile` is given), the scheduler (compiling its steps when config.warmup) and the FastAPI app.
    The scheduler thread starts with the app (its lifespan) and stops with it; `app.state.api` holds it all.
    """
    from eagle_jax import harness, profiles, steps
    from eagle_jax.serve.config import ConfigError, ServeConfig
    from eagle_jax.serve.scheduler import SchedulerConfig, cache_length

    config = config or ServeConfig()
    metrics = metrics or Metrics()
    max_model_len = config.model_len(target.cfg.max_position)
    sched_cfg = SchedulerConfig(max_batch=config.max_batch, max_model_len=max_model_len,
                                batch_buckets=tuple(config.batch_buckets), prefill_batches=tuple(config.prefill_batches),
                                prefill_tokens=config.prefill_tokens, max_queue=config.max_queue)
    mode, tree = config.speculation_mode()
    if mode == "fixed" and head is None:
        raise ConfigError(f"speculation {config.speculation!r} needs a draft head (--draft)")
    if mode == "auto" and head is None:
        log.warning("no draft head: serving with plain decoding (speculation off)")
    if mode == "off" or head is None:
        head, policy = None, harness.FixedPolicy(None)
    elif mode == "fixed":
        policy = harness.FixedPolicy(tree)
    else:
        trees = [t for t in config.candidate_trees() if t is not None]
        candidates = [None] + trees
        if profile is None:
            cache_len = cache_length(max_model_len, candidates)
            profile = profiles.load_or_measure(
                target, head, sched_cfg.buckets(), candidates, cache_len, cache_len + steps.draft_extra(candidates),
                cache_dir=config.profile_dir, reprofile=config.reprofile, reps=config.profile_reps)
        policy = harness.Harness(trees, profile)
    scheduler = Scheduler(target, head, policy, sched_cfg, metrics)
    if config.warmup:
        scheduler.warmup(config.warmup_prompt_len)
    release_free_memory()
    api = Api(scheduler, config.served_model_name or target.name, max_model_len, metrics, config.api_key)
    return build_app(api)
