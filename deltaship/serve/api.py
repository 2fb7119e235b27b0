"""The OpenAI request shapes deltaship serve reads, checked once (pydantic), and the responses it writes.

Every bound is here: body size (app.py reads at most MAX_BODY_BYTES), message count, text length, stop strings,
max_tokens (at most what the context leaves). Unknown fields are ignored, as OpenAI-compatible servers do; known
ones that would change the answer and are not supported (n > 1, logprobs, penalties) are refused, not ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deltaship.chat.tools import split_reply
from deltaship.constrain.tools import Tools
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


class FunctionCall(_Strict):
    name: str = Field(max_length=64)
    arguments: str | dict[str, Any] = "{}"  # OpenAI's: a JSON string; a mapping is taken too


class ToolCall(_Strict):
    id: str | None = Field(default=None, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | OtherPart] | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=64)
    tool_call_id: str | None = Field(default=None, max_length=256)


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


def messages_for_template(req: ChatRequest) -> list[dict[str, Any]]:
    """The messages as the chat template takes them, as `Chat` keeps them: text content (images are not supported
    yet); an assistant's `tool_calls` with their arguments as mappings (deltaship.chat.tools.message_calls's shape);
    a `tool` message as {"role": "tool", "name", "content"}, its `tool_call_id` one of the calls of the assistant
    message before it (each answered once)."""
    out: list[dict[str, Any]] = []
    open_calls: dict[str, str] = {}  # the last assistant message's calls not yet answered: id -> name
    for i, m in enumerate(req.messages):
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
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": text}
        if m.role == "assistant":
            open_calls = {}
            if m.tool_calls:
                msg["tool_calls"] = []
                for j, call in enumerate(m.tool_calls):
                    args = _arguments(call.function.arguments, f"messages.{i}.tool_calls.{j}.function.arguments")
                    msg["tool_calls"].append({"type": "function", "function": {"name": call.function.name,
                                                                               "arguments": args}})  # fmt: skip
                    open_calls[call.id or f"#{j}"] = call.function.name
        elif m.role == "tool":
            name = open_calls.pop(m.tool_call_id, None) if m.tool_call_id is not None else None
            if name is None:
                raise ApiError(
                    400,
                    f"messages.{i}: a tool message for tool_call_id {m.tool_call_id!r}, which is not a call of the "
                    "assistant message before it (or was answered already)",
                    f"messages.{i}.tool_call_id",
                    "invalid_value",
                )
            msg["name"] = name
        else:
            open_calls = {}
        out.append(msg)
    return out


def _arguments(raw: str | dict[str, Any], where: str) -> dict[str, Any]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw) if raw.strip() else {}
        except (ValueError, RecursionError):
            raise ApiError(400, f"{where}: not JSON", where, "invalid_value") from None
    if not isinstance(raw, dict):
        raise ApiError(400, f"{where}: a JSON object of the call's arguments", where, "invalid_value")
    return raw


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


def reply_calls(text: str, tools: Tools | None) -> tuple[str | None, list[dict[str, Any]]]:
    """A reply's content and its calls in OpenAI's shape (`id`, `type`, `function: {name, arguments}` with the
    arguments a JSON string), read by deltaship.chat.tools.split_reply; content None when the reply only calls."""
    if tools is None:
        return text, []
    content, calls = split_reply(text, tools)
    if not calls:
        return text, []
    out = [
        {"id": new_id("call"), "type": "function",
         "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
        for c in calls
    ]  # fmt: skip
    return content or None, out


def chat_response(rid: str, model: str, result, tools: Tools | None = None) -> dict[str, Any]:
    content, calls = reply_calls(result.text, tools)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": "tool_calls" if calls else finish(result),
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
