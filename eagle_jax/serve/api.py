"""The OpenAI-compatible API's request handling, between the HTTP routes (`eagle_jax.serve.app`) and the
scheduler.

`Api` checks a parsed request's values (the model name, the prompt, the sampling parameters), builds the
prompt's token ids (a chat through the tokenizer's chat template) and starts a `Generation`, which answers
with one JSON body or a server-sent event stream. Requests are validated completely before they reach the
scheduler, so a bad request never touches the running batch. `render_metrics` is GET /metrics.
"""

from __future__ import annotations

import math
import secrets
import time

from fastapi import Request

from eagle_jax.serve.generation import Generation
from eagle_jax.serve.metrics import CompileCounter, Metrics, process_memory
from eagle_jax.serve.scheduler import Scheduler
from eagle_jax.serve.schemas import ApiError, ChatMessage, ChatRequest, CommonRequest, CompletionRequest, check_text

MAX_STOP = 4
ROLES = ("system", "developer", "user", "assistant", "tool")


class Api:
    """The server's state (scheduler, model name, context length, metrics, API key) and its endpoints' logic."""

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

    def sampling(self, req: CommonRequest, n_prompt: int, default_max: int | None,
                 max_tokens_param: str = "max_tokens") -> dict:
        """The scheduler's sampling parameters for `req` (a 400 ApiError for an unsupported or invalid one)."""
        self.reject_unsupported(req)
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
        for i, text in enumerate(stop):
            check_text(text, "stop" if isinstance(req.stop, str) else f"stop[{i}]")
        max_tokens = self.max_tokens(req, n_prompt, default_max, max_tokens_param)
        seed = secrets.randbits(32) if req.seed is None else req.seed
        return {"max_tokens": int(max_tokens), "temperature": float(t), "top_p": float(top_p),
                "top_k": max(int(top_k), 0), "seed": int(seed), "ignore_eos": bool(req.ignore_eos), "stop": stop}

    @staticmethod
    def reject_unsupported(req: CommonRequest) -> None:
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

    def max_tokens(self, req: CommonRequest, n_prompt: int, default_max: int | None, param: str) -> int:
        """The completion's token budget: max_completion_tokens (chat) or max_tokens, else `default_max`,
        within the room the prompt leaves in max_model_len."""
        room = self.max_model_len - n_prompt
        max_tokens = getattr(req, "max_completion_tokens", None)
        if max_tokens is None:
            max_tokens = req.max_tokens
        else:
            param = "max_completion_tokens"
        if max_tokens is None:
            return room if default_max is None else min(default_max, room)
        if max_tokens < 1:
            raise ApiError(400, f"{param} must be at least 1, got {max_tokens}.", param, "invalid_value")
        if max_tokens > room:
            raise ApiError(400, f"This server's maximum context length is {self.max_model_len} tokens. However, you "
                                f"requested {n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for "
                                f"the completion). Reduce the prompt or {param}.", param, "context_length_exceeded")
        return max_tokens

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
            ids = list(self.tokenizer(check_text(prompt, "prompt"))["input_ids"])
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
            check_text(content or "", f"messages[{i}].content")
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

    # --- the endpoints ---------------------------------------------------------------------------------
    async def completions(self, http: Request, req: CompletionRequest):
        """POST /v1/completions."""
        self.check_model(req.model)
        ids = self.completion_prompt(req.prompt)
        sp = self.sampling(req, len(ids), default_max=16)  # the OpenAI default for completions
        return await self.generate(http, False, ids, sp, bool(req.stream), req.wants_usage())

    async def chat_completions(self, http: Request, req: ChatRequest):
        """POST /v1/chat/completions."""
        self.check_model(req.model)
        ids = self.chat_prompt(req.messages)
        sp = self.sampling(req, len(ids), default_max=None)
        return await self.generate(http, True, ids, sp, bool(req.stream), req.wants_usage())

    def models(self) -> dict:
        """GET /v1/models."""
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "eagle-jax", "max_model_len": self.max_model_len}]}

    async def generate(self, http: Request, chat: bool, prompt_ids: list[int], sp: dict, stream: bool,
                       include_usage: bool):
        """Submits the request (sampling parameters `sp` from `sampling`) and answers it: a
        StreamingResponse of server-sent events if `stream`, else one JSON body once it is done."""
        gen = Generation(self.scheduler, self.metrics, self.model_name, self.tokenizer, chat=chat,
                         prompt_ids=prompt_ids, sampling=sp, include_usage=include_usage)
        gen.submit()
        return gen.stream_response() if stream else await gen.json_response(http)

    # --- metrics --------------------------------------------------------------------------------------
    def render_metrics(self) -> str:
        c = self.scheduler.counts()
        gauges = [("eagle_requests_running", {}, c["running"]), ("eagle_requests_waiting", {}, c["waiting"]),
                  ("eagle_batch_size", {}, c["batch"]), ("eagle_batch_bucket", {}, c["bucket"]),
                  ("eagle_slots_free", {}, c["free"])]
        if "kv_blocks_used" in c:  # a paged KV cache (`serve.blocks`)
            gauges += [("eagle_kv_blocks_used", {}, c["kv_blocks_used"]), ("eagle_kv_blocks_free", {}, c["kv_blocks_free"])]
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
        for source, n in CompileCounter.counts().items():
            gauges.append(("eagle_xla_programs_total", {"source": source}, float(n)))
        mem = process_memory()
        for key, name in (("VmRSS", "eagle_process_resident_bytes"), ("VmHWM", "eagle_process_peak_resident_bytes")):
            if key in mem:
                gauges.append((name, {}, mem[key]))
        prep = self.scheduler.ready.snapshot()
        if "programs_total" in prep:
            gauges += [("eagle_preparation_programs_done", {}, prep["programs_done"]),
                       ("eagle_preparation_programs_total", {}, prep["programs_total"])]
        return self.metrics.render(gauges)
