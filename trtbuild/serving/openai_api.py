"""OpenAI's API as trtbuild serves it: the request bodies, their checks, the error object and the shapes of
responses and streamed chunks. No HTTP here (server.py); pydantic is imported on first use."""

from __future__ import annotations

import functools
import json
import time
from typing import Any, Literal


# The rejection reason a status means where the error does not name one (serve.py counts every rejection).
REJECTED = {400: "invalid", 404: "not_found", 405: "method_not_allowed", 413: "too_large", 429: "queue_full",
            500: "server_error", 503: "unavailable"}


class ApiError(Exception):
    """An HTTP error with OpenAI's error object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}
        # the label of trtbuild_requests_rejected_total: said where the status alone does not tell it
        self.reason = reason or REJECTED.get(status, "invalid")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@functools.cache
def request_models() -> tuple[type, type]:
    """The pydantic models of the two bodies (built on first use: pydantic is the server's dependency)."""
    from pydantic import BaseModel, ConfigDict, Field

    class Common(BaseModel):
        # strict: "5" is not a number and 1 is not a bool, as OpenAI's API answers; unknown fields pass
        model_config = ConfigDict(extra="allow", strict=True)
        model: str | None = None
        max_tokens: int | None = Field(None, ge=1)
        temperature: float = Field(1.0, ge=0.0, le=2.0)
        top_p: float = Field(1.0, gt=0.0, le=1.0)
        top_k: int = Field(0, ge=-1)  # vLLM's extension; -1 or 0 = off
        n: int = Field(1, ge=1, le=128)
        seed: int | None = Field(None, ge=0, lt=2**63)
        stop: str | list[str] | None = None
        stop_token_ids: list[int] | None = None
        stream: bool = False
        stream_options: dict[str, Any] | None = None
        presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
        frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
        repetition_penalty: float = Field(1.0, gt=0.0)
        user: str | None = None
        # vLLM's extensions, for clients that count tokens (benchmarks) and models without a tokenizer
        ignore_eos: bool = False
        return_token_ids: bool = False

    class Completion(Common):
        prompt: str | list[str] | list[int] | list[list[int]]

    class Message(BaseModel):
        model_config = ConfigDict(extra="allow", strict=True)
        role: Literal["system", "user", "assistant", "tool", "developer"]
        content: str | list[dict[str, Any]] | None = None

    class Chat(Common):
        messages: list[Message] = Field(min_length=1)
        max_completion_tokens: int | None = Field(None, ge=1)

    return Completion, Chat


UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "best_of", "suffix", "logit_bias", "tools", "functions",
                "response_format")


def parse(raw: bytes, model: type) -> Any:
    """A request body as `model`, or ApiError 400 naming the first field that is wrong."""
    from pydantic import ValidationError

    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    try:
        params = model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ApiError(400, f"{where}: {first['msg']}{more}", param=where) from None
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False, 0, [], {}):
            raise ApiError(400, f"{name}: not supported by this server", param=name)
    if params.frequency_penalty != 0.0:
        raise ApiError(400, "frequency_penalty: not supported (presence_penalty and repetition_penalty are)",
                       param="frequency_penalty")
    return params


def flat_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message whose content is a list of parts ({"type": "text", "text": ...}), as one string: the form chat
    templates are written for. Parts other than text are refused."""
    content = message.get("content")
    if isinstance(content, list):
        if any(not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str)
               for p in content):
            raise ApiError(400, "messages: only text content parts are supported", param="messages")
        message = message | {"content": "".join(p["text"] for p in content)}
    return message


def finish_reason(finish: str | None) -> str | None:
    """OpenAI's finish_reason for a scheduler finish (a cancelled request is only ever seen by its own stream)."""
    return None if finish is None else "stop" if finish in ("stop", "cancelled") else finish


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def chunk(rid: str, model: str, chat: bool, index: int, text: str | None, finish: str | None, role: bool = False,
          token_ids: list[int] | None = None) -> dict[str, Any]:
    """One streamed chunk of one choice: a text delta, the assistant role (chat's first chunk), or the end."""
    if chat:
        delta: dict[str, Any] = ({"role": "assistant", "content": ""} if role else
                                 {} if text is None else {"content": text})
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}


def _usage(usage: dict[str, int], generated: int) -> dict[str, int]:
    return usage | {"completion_tokens": generated, "total_tokens": usage["prompt_tokens"] + generated}


def usage_chunk(rid: str, model: str, chat: bool, usage: dict[str, int], generated: int) -> dict[str, Any]:
    """The last chunk of a stream that asked for `stream_options.include_usage`."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [], "usage": _usage(usage, generated)}


def response(rid: str, model: str, chat: bool, texts: list[str], finishes: list[str | None],
             tokens: list[list[int]] | None, usage: dict[str, int], generated: int) -> dict[str, Any]:
    """A whole (not streamed) completion or chat completion; `tokens`: each choice's token ids, where asked for."""
    if chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None,
                    "finish_reason": finish_reason(f)} for i, (t, f) in enumerate(zip(texts, finishes))]
    else:
        choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": finish_reason(f)}
                   for i, (t, f) in enumerate(zip(texts, finishes))]
    for choice, row in zip(choices, tokens or []):
        choice["token_ids"] = row
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": _usage(usage, generated)}
