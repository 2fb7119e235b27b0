"""The OpenAI request shapes deltaship serve reads, checked once (pydantic), and the responses it writes.

Every bound is here: body size (app.py reads at most MAX_BODY_BYTES), message count, text length, stop strings,
max_tokens (at most what the context leaves). Unknown fields are ignored, as OpenAI-compatible servers do; known
ones that would change the answer and are not supported (n > 1, logprobs, penalties) are refused, not ignored.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deltaship.serve.errors import ApiError

MAX_BODY_BYTES = 4 << 20
MAX_MESSAGES = 1024
MAX_TEXT_CHARS = 1 << 20
MAX_STOP = 4
DEFAULT_MAX_TOKENS = 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Strict):
    type: Literal["text"]
    text: str = Field(max_length=MAX_TEXT_CHARS)


class OtherPart(_Strict):
    type: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | OtherPart] | None = Field(default=None, max_length=MAX_TEXT_CHARS)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str | None = Field(default=None, max_length=256)
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, lt=1 << 63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=1)
    presence_penalty: float = Field(default=0, ge=0, le=0)
    frequency_penalty: float = Field(default=0, ge=0, le=0)
    response_format: Any = None  # constraints.py reads these
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: Literal[False] | None = None
    chat_template_kwargs: dict[Literal["enable_thinking"], bool] | None = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] = Field(max_length=MAX_TEXT_CHARS)
    logprobs: None = None
    echo: Literal[False] = False
    suffix: None = None
    best_of: int = Field(default=1, ge=1, le=1)


def parse(kind: type[_Common], data: Any) -> Any:
    """A request body checked into its model; a breach is a 400 naming the field."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        where = ".".join(str(x) for x in first["loc"]) or None
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise ApiError(400, f"{where}: {first['msg']}{more}", where, "invalid_value") from None


def stops(req: _Common) -> tuple[str, ...]:
    out = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(out) > MAX_STOP or any(not 0 < len(s) <= 256 for s in out):
        raise ApiError(400, f"stop: at most {MAX_STOP} strings of 1 to 256 characters", "stop", "invalid_value")
    return tuple(out)


def messages_for_template(req: ChatRequest) -> list[dict[str, str]]:
    """The messages as the chat template takes them: text content only (images are not supported yet)."""
    out = []
    for i, m in enumerate(req.messages):
        if m.role == "tool":
            raise ApiError(
                400,
                "messages with role 'tool' are not supported yet (tools need constrained decoding)",
                f"messages.{i}.role",
                "unsupported_parameter",
            )
        if isinstance(m.content, list):
            other = next((p for p in m.content if not isinstance(p, TextPart)), None)
            if other is not None:
                raise ApiError(
                    400,
                    f"message content of type {other.type!r} is not supported (text only)",
                    f"messages.{i}.content",
                    "unsupported_parameter",
                )
            text = "".join(p.text for p in m.content)
        else:
            text = m.content or ""
        out.append({"role": "system" if m.role == "developer" else m.role, "content": text})
    return out


def max_tokens(req: _Common, prompt_tokens: int, max_context: int) -> int:
    """What the request may generate: its max_tokens (or max_completion_tokens), at most what the context leaves."""
    left = max_context - prompt_tokens
    asked = getattr(req, "max_completion_tokens", None)
    asked = req.max_tokens if asked is None else asked
    if asked is None:
        return min(DEFAULT_MAX_TOKENS, left)
    if asked > left:
        raise ApiError(
            400,
            f"max_tokens {asked}: the prompt has {prompt_tokens} tokens and the context is "
            f"{max_context}, so at most {left} can be generated",
            "max_tokens",
            "context_length_exceeded",
        )
    return asked


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(result) -> dict[str, Any]:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": len(result.ids),
        "total_tokens": result.prompt_tokens + len(result.ids),
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
    }


def finish(result) -> str:
    return "length" if result.finish_reason == "cancelled" else result.finish_reason


def chat_response(rid: str, model: str, result) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": result.text},
                "finish_reason": finish(result),
                "logprobs": None,
            }
        ],
        "usage": usage(result),
    }


def chat_chunk(rid: str, model: str, delta: dict | None, reason: str | None = None, use=None) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}]
    out = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if use is not None:
        out["usage"] = use
    return out


def completion_response(rid: str, model: str, result) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": result.text, "finish_reason": finish(result), "logprobs": None}],
        "usage": usage(result),
    }


def completion_chunk(rid: str, model: str, text: str | None, reason: str | None = None, use=None) -> dict[str, Any]:
    choices = [] if text is None else [{"index": 0, "text": text, "finish_reason": reason, "logprobs": None}]
    out = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": choices}
    if use is not None:
        out["usage"] = use
    return out
