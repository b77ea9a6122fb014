"""A real uvicorn server in a background thread, and the character-level tokenizer the server tests use
(so text compares exactly with `eagle_jax.generate`)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

from eagle_jax.serve.metrics import parse as parse_metrics

CHARS = ["\n"] + [chr(c) for c in range(32, 127) if chr(c) not in "`~"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2; <|im_end|> is EOS
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def char_tokenizer():
    """A 97-token character-level tokenizer with a chat template (fits the tiny test models' vocabulary)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIALS + CHARS)}, unk_token=SPECIALS[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIALS[2], bos_token=SPECIALS[0],
                                   unk_token=SPECIALS[0], chat_template=CHAT_TEMPLATE)


class ServerThread:
    """A real uvicorn server for `app` on a free localhost port, in a background thread."""

    def __init__(self, app):
        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def scheduler(self):
        return self.app.state.api.scheduler

    def request(self, method, path, body=None, headers=None, raw=None):
        """(status, headers, parsed JSON or text) of one plain HTTP request."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        text = resp.read().decode()
        conn.close()
        try:
            return resp.status, dict(resp.getheaders()), json.loads(text)
        except json.JSONDecodeError:
            return resp.status, dict(resp.getheaders()), text

    def metrics(self):
        return parse_metrics(self.request("GET", "/metrics")[2])
