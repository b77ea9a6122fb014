"""Answering training prompts with continuous batching: the server's engine loop, in process.

Static batches (`eagle_jax.generate` over a batch of prompts) run until their longest answer ends, so rows
whose answers ended early idle, and a conversation's later turns can only start once the whole batch of
earlier turns is done (small batches at long contexts). Here every turn is a request of the server's
scheduler (`eagle_jax.serve.scheduler`, plain decoding): a finished row takes the next waiting request at
once, and a conversation's next turn is queued as soon as its previous answer ends, so the batch stays full
of whatever is ready. Each request is answered by the same jitted steps as `generate`; greedy answers do
not depend on their batch neighbours (up to float rounding, as with another batch size), and sampled
ones use the same per-prompt seeds.

`ContinuousAnswerer` is the loop's client: `submit` a turn (token ids, a seed and a key), `next_done`
returns finished turns in the order they end.
"""

from __future__ import annotations

import queue

from eagle_jax.harness import FixedPolicy
from eagle_jax.serve.prepare import OnDemand
from eagle_jax.serve.requests import Request, SchedulerConfig
from eagle_jax.serve.scheduler import Scheduler

MAX_MODEL_LEN = 1536  # prompt + answer per request (the campaign's second turns reach ~850 + 512 tokens)


class AnswerFailed(RuntimeError):
    """The engine loop failed a request (its message says why)."""


class GreedyWhereAllAre(OnDemand):
    """Compiles on first use, as `OnDemand`, but a step whose rows are all greedy runs the all-greedy
    program (no sampling path; `Engine.run_step(sampling=False)`): the data pipeline's usual batch."""

    def step_sampling(self, tree, sampled: bool) -> bool:
        return sampled


class ContinuousAnswerer:
    """The scheduler with `batch_size` rows of `max_model_len` slots, plain decoding; use as a context
    manager (the loop's thread stops on exit)."""

    def __init__(self, target, *, batch_size: int, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 max_model_len: int = MAX_MODEL_LEN):
        if max_new_tokens >= max_model_len:
            raise ValueError(f"max_new_tokens ({max_new_tokens}) must be below max_model_len ({max_model_len})")
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.max_model_len = max_model_len
        # One batch bucket (rows never move), prefills of up to 16 prompts, long prompts in 512-token chunks.
        config = SchedulerConfig(max_batch=batch_size, batch_buckets=(batch_size,), max_model_len=max_model_len,
                                 prefill_batches=(1, 4, 16), prefill_tokens=4096, prefill_chunk=512,
                                 max_queue=1 << 20, shrink_patience=1 << 30)
        self.scheduler = Scheduler(target, None, FixedPolicy(None), config)
        self.scheduler.ready = GreedyWhereAllAre()
        self.finished: queue.Queue = queue.Queue()
        self.in_flight = 0

    def __enter__(self) -> "ContinuousAnswerer":
        self.scheduler.start()
        return self

    def __exit__(self, *exc) -> None:
        self.scheduler.shutdown()

    def fits(self, prompt_ids) -> bool:
        """Whether a turn with this prompt fits a row (prompt + max_new_tokens <= max_model_len)."""
        return len(prompt_ids) + self.max_new_tokens <= self.max_model_len

    def submit(self, key, prompt_ids, seed: int) -> None:
        """Queues one turn; `next_done` returns (key, answer token ids, finish reason) once it ends."""
        tokens: list[int] = []

        def sink(event) -> None:  # on the loop's thread
            if event.kind == "tokens":
                tokens.extend(event.tokens)
            elif event.kind == "done":
                self.finished.put((key, list(tokens), event.reason, None))
            elif event.kind == "error":
                self.finished.put((key, None, None, event.message))

        self.scheduler.submit(Request(prompt_ids, self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                                      seed=seed, sink=sink))
        self.in_flight += 1

    def next_done(self, timeout: float = 5.0):
        """(key, answer token ids, finish reason) of the next turn to end; AnswerFailed if the loop failed it
        or died."""
        while True:
            try:
                key, tokens, reason, error = self.finished.get(timeout=timeout)
                break
            except queue.Empty:
                if not self.scheduler.alive:
                    raise AnswerFailed(f"the engine loop stopped: {self.scheduler.failure}") from None
        self.in_flight -= 1
        if error is not None:
            raise AnswerFailed(f"turn {key}: {error}")
        return key, tokens, reason
