"""One completion request in flight: from the scheduler's events to an HTTP response.

The scheduler thread calls the request's sink with each engine event; `Generation` moves the events onto
the event loop (an asyncio queue) and answers with one JSON body or a stream of server-sent events ending in `data: [DONE]`.
Whatever way the request ends, it is counted once in eagle_requests_total (completed, error or
cancelled), and a request that did not run to its end is cancelled in the scheduler.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from eagle_jax.serve.metrics import Metrics
from eagle_jax.serve.requests import QueueFull, Request as GenRequest, ShuttingDown
from eagle_jax.serve.scheduler import Scheduler
from eagle_jax.serve.schemas import ApiError, error_response

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there


class ClientGone(Exception):
    """The client of a non-streaming request disconnected."""


class Generation:
    """One request: `submit` it, then answer with `json_response` or `stream_response`.

    `events` yields (delta text, finish reason or None, error message or None) until the request ends.
    """

    def __init__(self, scheduler: Scheduler, metrics: Metrics, model_name: str, tokenizer, *, chat: bool,
                 prompt_ids: list[int], sampling: dict, include_usage: bool):
        self.scheduler, self.metrics, self.model_name = scheduler, metrics, model_name
        self.chat, self.prompt_ids, self.sampling, self.include_usage = chat, prompt_ids, sampling, include_usage
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.request: GenRequest | None = None
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion.chunk" if chat else "text_completion"  # of a streamed chunk
        self.completion_tokens = 0  # tokens delivered so far (up to the one that ended the request)

    # --- the scheduler side ---------------------------------------------------------------------------
    def submit(self) -> None:
        """Hands the request to the scheduler; a 400 or 503 ApiError if it refuses it."""
        sp = self.sampling
        try:
            self.request = GenRequest(self.prompt_ids, sp["max_tokens"], temperature=sp["temperature"],
                                      top_p=sp["top_p"], top_k=sp["top_k"], seed=sp["seed"],
                                      ignore_eos=sp["ignore_eos"], stop=sp["stop"], sink=self.deliver)
            self.scheduler.submit(self.request)
        except ValueError as e:  # the API's checks should have caught it; the scheduler double-checks
            raise ApiError(400, str(e), None, "invalid_value")
        except QueueFull as e:
            raise ApiError(503, f"The server is at capacity ({e}); retry shortly.", None, "queue_full", "server_error",
                           {"Retry-After": "1"})
        except ShuttingDown as e:
            raise ApiError(503, str(e), None, "shutting_down", "server_error", {"Retry-After": "5"})

    def deliver(self, event) -> None:
        """The request's sink: called on the scheduler thread, queues the event on the event loop."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def end(self, outcome: str) -> None:
        """Counts the request once; one that did not reach its end ('cancelled') leaves the scheduler."""
        if outcome == "cancelled":
            self.scheduler.cancel(self.request)
        self.metrics.inc("eagle_requests_total", outcome=outcome)

    # --- events -> text -------------------------------------------------------------------------------
    async def events(self, http: Request | None = None):
        """(delta text, finish reason or None, error message or None) until the request ends. With `http`,
        checks every DISCONNECT_POLL_S that the client is still there (ClientGone if not)."""
        getter, checked = None, self.loop.time()
        try:
            while True:
                if http is not None:  # one pending get() at a time, so a timeout never loses an event
                    getter = getter or asyncio.ensure_future(self.queue.get())
                    done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
                    if self.loop.time() - checked >= DISCONNECT_POLL_S:  # also while tokens keep coming
                        checked = self.loop.time()
                        if await http.is_disconnected():
                            raise ClientGone()
                    if not done:
                        continue
                    event, getter = getter.result(), None
                else:
                    event = await self.queue.get()
                for item in self.handle(event):
                    yield item
                    if item[1] is not None or item[2] is not None:
                        return
        finally:
            if getter is not None:
                getter.cancel()

    def handle(self, event) -> list[tuple[str, str | None, str | None]]:
        """An engine event -> [(delta text, finish reason or None, error message or None)]."""
        if event.kind == "tokens":  # the scheduler's TokenStream found EOS / stop strings and made the text
            self.completion_tokens += len(event.tokens)
            return [(event.text, None, None)] if event.text else []
        if event.kind == "done":
            return [(event.text, "length" if event.reason == "length" else "stop", None)]
        return [("", None, event.message or "engine error")]

    def usage(self) -> dict:
        n_prompt, n_completion = len(self.prompt_ids), self.completion_tokens
        return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion}

    # --- one JSON body --------------------------------------------------------------------------------
    async def json_response(self, http: Request):
        """Waits for the whole completion: a chat.completion or text_completion body, a 500 on an engine
        error, or an empty 499 if the client went away first."""
        outcome = "cancelled"
        try:
            pieces, finish, error = [], None, None
            try:
                async for delta, fin, err in self.events(http):
                    pieces.append(delta)
                    finish, error = fin or finish, err
            except ClientGone:
                return JSONResponse({}, status_code=499)  # nobody is listening
            outcome = "error" if error else "completed"
        finally:
            self.end(outcome)
        if error:
            return error_response(500, error, None, "engine_error", "server_error")
        return JSONResponse(self.body("".join(pieces), finish))

    def body(self, content: str, finish: str | None) -> dict:
        body = {"id": self.id, "created": self.created, "model": self.model_name, "usage": self.usage()}
        if self.chat:
            body.update(object="chat.completion", choices=[{
                "index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None,
                "finish_reason": finish}])
        else:
            body.update(object="text_completion", choices=[{
                "index": 0, "text": content, "logprobs": None, "finish_reason": finish}])
        return body

    # --- server-sent events ---------------------------------------------------------------------------
    def stream_response(self) -> StreamingResponse:
        return StreamingResponse(self.sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def sse(self):
        """The event stream: (for chat, a first chunk with the role) a chunk per delta, a last chunk with
        the finish reason, the usage chunk if asked for, then [DONE]. An engine error is one error event."""
        outcome = "cancelled"  # unless we reach the end: the client went away (or the server stopped)
        try:
            if self.chat:
                yield self.chunk(None, role=True)
            async for delta, fin, err in self.events():
                if err:
                    yield self.error_event(err)
                    outcome = "error"
                    break
                if delta:
                    yield self.chunk(delta)
                if fin:
                    yield self.chunk(None, finish=fin)
                    outcome = "completed"
            if self.include_usage and outcome == "completed":
                yield self.usage_chunk()
            yield "data: [DONE]\n\n"
        finally:
            self.end(outcome)

    def chunk(self, delta: str | None, finish: str | None = None, role: bool = False) -> str:
        if self.chat:
            d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
        return self.event({"id": self.id, "object": self.object, "created": self.created, "model": self.model_name,
                           "choices": [choice]})

    def usage_chunk(self) -> str:
        return self.event({"id": self.id, "object": self.object, "created": self.created, "model": self.model_name,
                           "choices": [], "usage": self.usage()})

    @staticmethod
    def error_event(message: str) -> str:
        return Generation.event({"error": {"message": message, "type": "server_error", "param": None,
                                           "code": "engine_error"}})

    @staticmethod
    def event(data: dict) -> str:
        return "data: " + json.dumps(data) + "\n\n"
