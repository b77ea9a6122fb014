"""Request bodies of the OpenAI-compatible API and the errors that answer bad ones.

The pydantic models check the shape and types of a body (strictly, as the OpenAI API does: "5" is not an
int and 1.0 is not an int); the values themselves (ranges, lengths, the model name) are checked by
`eagle_jax.serve.api.Api`. Every problem is an `ApiError`, answered with an OpenAI-style error body
{"error": {"message", "type", "param", "code"}} that names the field.
"""

from __future__ import annotations

import json
from typing import Optional, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError


class ApiError(Exception):
    """An error answered with `error_response` (the app's exception handler turns it into one)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type, self.headers = (
            status, message, param, code, type_, headers)


def error_response(status, message, param=None, code=None, type_="invalid_request_error", headers=None):
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status, headers=headers)


# --- request bodies ----------------------------------------------------------------------------------

class StrictModel(BaseModel):
    # Strict: "5" is not an int and 1.0 is not an int, as in the OpenAI API. Unknown fields are ignored.
    model_config = ConfigDict(extra="allow", strict=True, protected_namespaces=())


class StreamOptions(StrictModel):
    include_usage: Optional[bool] = None


class CommonRequest(StrictModel):
    """The fields /v1/completions and /v1/chat/completions share."""

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

    def wants_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (stream_options.include_usage)."""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(CommonRequest):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: Optional[int] = None
    echo: Optional[bool] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ContentPart(StrictModel):
    type: str
    text: Optional[str] = None


class ChatMessage(StrictModel):
    role: str
    content: Union[str, list[ContentPart], None] = None


class ChatRequest(CommonRequest):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None


# --- parsing -----------------------------------------------------------------------------------------

FIELD_NAMES = frozenset().union(*(m.model_fields for m in (CompletionRequest, ChatRequest, ChatMessage,
                                                             ContentPart, StreamOptions)))


def error_param(loc) -> str:
    """A pydantic error location as the OpenAI API names a parameter: messages[0].content[1].type
    (dropping the names pydantic adds for the branches of a union)."""
    out = str(loc[0]) if loc else ""
    for part in loc[1:]:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in FIELD_NAMES:
            out += f".{part}"
    return out


MAX_DEPTH = 32  # nesting levels a request body may have (the deepest valid one has 5)
MAX_DIGITS = 64  # digits an integer in a request body may have


class HugeInteger:
    """An integer literal too long to be any parameter's value, kept as its length: pydantic refuses it
    as "not a valid integer" and names the field (converting it could take long, or fail past Python's
    4300-digit limit)."""

    def __init__(self, digits: str):
        self.n = len(digits.lstrip("-"))

    def __repr__(self) -> str:
        return f"<an integer of {self.n} digits>"


def _parse_int(digits: str):
    return int(digits) if len(digits) <= MAX_DIGITS + 1 else HugeInteger(digits)


def decode_json(raw: bytes):
    """The JSON value of a request body; a 400 ApiError if it is not JSON, or is nested too deeply."""
    try:
        body = json.loads(raw, parse_int=_parse_int)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise ApiError(400, f"Invalid JSON body: {e}", None, "invalid_json")
    except RecursionError:
        raise ApiError(400, f"Invalid JSON body: nested more than {MAX_DEPTH} levels deep.", None, "invalid_json")
    if json_depth(body) > MAX_DEPTH:
        raise ApiError(400, f"Invalid JSON body: nested more than {MAX_DEPTH} levels deep.", None, "invalid_json")
    return body


def json_depth(value) -> int:
    """How deeply lists and objects nest in a decoded JSON value (without recursion)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (list, dict)):
            deepest = max(deepest, d)
            if deepest > MAX_DEPTH:
                break
            todo.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def check_text(text: str, param: str) -> str:
    """`text` if it is valid Unicode (no lone surrogates, which no tokenizer can encode); else a 400."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{param} is not valid Unicode text: a lone surrogate {text[e.start]!r} at character "
                            f"{e.start}.", param, "invalid_value")
    return text


def parse_body(model: type[StrictModel], body):
    """`body` (decoded JSON) as a `model`; a 400 ApiError naming the first missing or mistyped field."""
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = error_param(err.get("loc", ()))
        if err.get("type") == "missing":
            raise ApiError(400, f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
        got = repr(err.get("input"))
        got = got if len(got) <= 60 else got[:57] + "..."
        raise ApiError(400, f"Invalid type for '{param}': {err.get('msg')} (got {got}).", param, "invalid_type")
