"""The HTTP face: a Starlette app over one Engine and its Scheduler (docs/serve.md).

Routes: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions. A bad request is a 4xx with an
OpenAI-style error object; anything unexpected is a 500 with a one-line message (logged), never a traceback.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from deltaship.chat.tools import ToolCallStream
from deltaship.constrain.tools import Tools
from deltaship.errors import DeltashipError
from deltaship.serve import api
from deltaship.serve.constraints import constraint_for, tool_constraint, tools_for
from deltaship.serve.engine import Busy, Engine, Job, Result, Sampling, Scheduler
from deltaship.serve.errors import ApiError

log = logging.getLogger("deltaship.serve")
RETRY_AFTER_S = 2


class Served:
    """What the app serves: the engine, its scheduler, the model's name, the API key (None: no key asked)."""

    def __init__(self, engine: Engine, scheduler: Scheduler, model: str, api_key: str | None):
        self.engine, self.scheduler, self.model, self.api_key = engine, scheduler, model, api_key
        self.counts = {"requests": 0, "cancelled": 0, "completion_tokens": 0, "cached_tokens": 0, "prompt_tokens": 0}

    def record(self, result: Result) -> None:
        self.counts["requests"] += 1
        self.counts["cancelled"] += result.finish_reason == "cancelled"
        self.counts["completion_tokens"] += len(result.ids)
        self.counts["cached_tokens"] += result.cached_tokens
        self.counts["prompt_tokens"] += result.prompt_tokens


def build_app(served: Served) -> Starlette:
    async def health(request: Request) -> Response:
        held = served.engine.held
        return JSONResponse(
            {
                "status": "ok",
                "pending": served.scheduler.pending,
                "held_conversations": len(held),
                "held_bytes": held.nbytes,
                **served.counts,
            }
        )

    async def models(request: Request) -> Response:
        _authorize(served, request)
        return JSONResponse(
            {"object": "list", "data": [{"id": served.model, "object": "model", "created": 0, "owned_by": "deltaship"}]}
        )

    async def chat_completions(request: Request) -> Response:
        _authorize(served, request)
        req = api.parse(api.ChatRequest, await _read_json(request))
        body = req.model_dump()
        constraint = await run_in_threadpool(constraint_for, body)  # a schema compiles off the loop
        tools, choice = tools_for(body)
        if constraint is not None and tools is not None and choice != "none":
            raise ApiError(
                400,
                f"response_format and tools (tool_choice {choice!r}) cannot be combined: a reply takes one "
                "constraint, and the tools' is the call grammar (pass tool_choice 'none', or drop one)",
                "response_format",
                "unsupported_parameter",
            )
        messages = api.messages_for_template(req)
        kwargs = dict(req.chat_template_kwargs or {})
        if tools is not None:  # rendered by the template's tools branch, as Chat renders them
            kwargs["tools"] = list(tools.entries)
        if constraint is not None:
            # the reply is the structure from its first token: rendered without thinking (Qwen's template then
            # closes an empty think block in the generation prompt); the content has no think block to strip
            if kwargs.get("enable_thinking"):
                raise ApiError(
                    400,
                    "response_format with chat_template_kwargs.enable_thinking true is not supported: the "
                    "constraint applies from the reply's first token (drop enable_thinking)",
                    "chat_template_kwargs",
                    "unsupported_parameter",
                )
            kwargs["enable_thinking"] = False
        try:
            prompt, marks = await run_in_threadpool(served.engine.render, messages, kwargs)  # off the event loop
            if constraint is None and tools is not None:  # the call grammar, opening inside <think> where it does
                think = await run_in_threadpool(served.engine.opens_think, messages, kwargs)
                constraint = await run_in_threadpool(tool_constraint, tools, choice, think)
        except DeltashipError as e:
            raise ApiError(400, e.message, "messages", "invalid_value") from None
        return await _complete(served, request, req, prompt, constraint, chat=True, marks=marks, tools=tools)

    async def completions(request: Request) -> Response:
        _authorize(served, request)
        req = api.parse(api.CompletionRequest, await _read_json(request))
        for name in ("tools", "tool_choice"):  # a completion has no template to render them, nor calls to return
            if getattr(req, name) is not None:
                raise ApiError(400, f"{name}: use /v1/chat/completions", name, "unsupported_parameter")
        constraint = await run_in_threadpool(constraint_for, req.model_dump())
        p = req.prompt
        if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
            prompt = list(p)
            bad = [t for t in prompt if not 0 <= t < served.engine.session.vocab_size]
            if bad:
                raise ApiError(400, f"prompt: token ids {bad[:4]} are outside the vocabulary", "prompt")
        else:
            if isinstance(p, list) and len(p) != 1:
                raise ApiError(400, "prompt: one prompt per request (n = 1)", "prompt", "unsupported_parameter")
            prompt = await run_in_threadpool(served.engine.tokenizer.encode, p[0] if isinstance(p, list) else p)
        return await _complete(served, request, req, prompt, constraint, chat=False)

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def unexpected(request: Request, exc: Exception) -> Response:
        log.error("deltaship serve: %s on %s: %s", type(exc).__name__, request.url.path, exc)
        return JSONResponse(ApiError(500, "internal error (logged by the server)").body(), status_code=500)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 404)
        return JSONResponse(
            ApiError(status, f"{request.method} {request.url.path}: no such route").body(), status_code=status
        )

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    handlers = {ApiError: api_error, 404: not_found, 405: not_found, Exception: unexpected}
    return Starlette(routes=routes, exception_handlers=handlers)


def _authorize(served: Served, request: Request) -> None:
    if served.api_key is None:
        return
    got = request.headers.get("authorization", "")
    if not hmac.compare_digest(got.encode(), f"Bearer {served.api_key}".encode()):
        raise ApiError(401, "missing or wrong API key (send Authorization: Bearer KEY)", None, "invalid_api_key")


async def _read_json(request: Request) -> Any:
    """The body as JSON, read up to api.MAX_BODY_BYTES (a longer one is refused before it is all read)."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > api.MAX_BODY_BYTES):
        raise ApiError(413, f"the request body is over {api.MAX_BODY_BYTES} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > api.MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is over {api.MAX_BODY_BYTES} bytes")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not JSON ({e})") from None
    except RecursionError:  # e.g. a schema nested thousands deep: refused here, not a 500
        raise ApiError(400, "the request body is nested too deeply") from None


async def _complete(
    served: Served,
    request: Request,
    req,
    prompt: list[int],
    constraint,
    chat: bool,
    marks: list[int] = (),
    tools: Tools | None = None,
) -> Response:
    engine = served.engine
    ctx = engine.session.max_context
    if not prompt:
        raise ApiError(400, "the prompt is empty", "prompt")
    if len(prompt) >= ctx:
        raise ApiError(
            400,
            f"the prompt has {len(prompt)} tokens; the model's context is {ctx}",
            "messages",
            "context_length_exceeded",
        )
    sampling = Sampling(api.max_tokens(req, len(prompt), ctx), req.temperature, req.top_p, req.seed, api.stops(req))
    guide = None
    if constraint is not None:  # built here, so that a constraint the tokenizer cannot drive is a 400 before a stream
        try:
            guide = await run_in_threadpool(engine.guide, constraint)
        except DeltashipError as e:
            param = "response_format" if tools is None else "tools"
            raise ApiError(400, f"{param}: {e.message}", param, "invalid_value") from None
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def put(item) -> None:  # from the engine's thread
        try:
            loop.call_soon_threadsafe(events.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is stopping
            pass

    def done(result, error) -> None:
        if isinstance(result, Result):
            served.record(result)
        put(("error", error) if error is not None else ("done", result))

    job = Job(lambda: None, done)
    on_text = (lambda text: put(("text", text))) if req.stream else None
    job.run = lambda: engine.generate(prompt, sampling, job.cancelled, on_text, guide, marks)
    try:
        served.scheduler.submit(job)
    except Busy as e:
        raise ApiError(
            503, f"the server is busy: {e.message}", None, "server_busy", {"Retry-After": str(RETRY_AFTER_S)}
        ) from None
    rid = api.new_id("chatcmpl" if chat else "cmpl")
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(
            _stream(served, job, events, rid, chat, include_usage, tools),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    result = await _wait(job, events, request)
    if result is None:  # the client went away; nobody reads this
        return Response(status_code=499)
    if chat:
        return JSONResponse(api.chat_response(rid, served.model, result, tools))
    return JSONResponse(api.completion_response(rid, served.model, result))


async def _wait(job: Job, events: asyncio.Queue, request: Request) -> Result | None:
    """The result of a non-streaming request; None if its client disconnected first (its job is cancelled)."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while True:
            got = asyncio.ensure_future(events.get())
            finished, _ = await asyncio.wait({got, gone}, return_when=asyncio.FIRST_COMPLETED)
            if got not in finished:
                got.cancel()
                job.cancelled.set()
                return None
            kind, value = got.result()
            if kind == "error":
                raise _as_api_error(value)
            if kind == "done":
                return value
    finally:
        gone.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(
    served: Served,
    job: Job,
    events: asyncio.Queue,
    rid: str,
    chat: bool,
    include_usage: bool,
    tools: Tools | None = None,
):
    """SSE chunks: (chat) the role, the text as it becomes final, the finish reason, optionally the usage; then
    [DONE]. With tools, the text is shown through deltaship.chat's ToolCallStream (never a part of a call) and the
    calls come whole at the end, one `delta.tool_calls` chunk, before the finish reason `tool_calls`. A client that
    disconnects closes this generator: its job is cancelled (dropped if queued, stopped at the next token if
    decoding)."""
    model = served.model
    held = ToolCallStream() if tools is not None else None
    so_far = ""

    def sse(obj: dict) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    try:
        if chat:
            yield sse(api.chat_chunk(rid, model, {"role": "assistant", "content": ""}))
        while True:
            kind, value = await events.get()
            if kind == "text" and held is not None:
                so_far += value
                if shown := held.feed(so_far):
                    yield sse(api.chat_chunk(rid, model, {"content": shown}))
            elif kind == "text":
                yield sse(
                    api.chat_chunk(rid, model, {"content": value}) if chat else api.completion_chunk(rid, model, value)
                )
            elif kind == "error":
                yield sse(_as_api_error(value).body())
                break
            else:
                reason = api.finish(value)
                if held is not None:
                    if tail := held.finish():
                        yield sse(api.chat_chunk(rid, model, {"content": tail}))
                    _, calls = api.reply_calls(value.text, tools)
                    if calls:
                        indexed = [{"index": i, **c} for i, c in enumerate(calls)]
                        yield sse(api.chat_chunk(rid, model, {"tool_calls": indexed}))
                        reason = "tool_calls"
                yield sse(
                    api.chat_chunk(rid, model, {}, reason) if chat else api.completion_chunk(rid, model, "", reason)
                )
                if include_usage:
                    use = api.usage(value)
                    yield sse(
                        api.chat_chunk(rid, model, None, use=use)
                        if chat
                        else api.completion_chunk(rid, model, None, use=use)
                    )
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()  # a no-op once it finished


def _as_api_error(error: BaseException) -> ApiError:
    if isinstance(error, ApiError):
        return error
    if isinstance(error, DeltashipError):
        return ApiError(400, error.message)
    log.error("deltaship serve: %s while generating: %s", type(error).__name__, error)
    return ApiError(500, "internal error while generating (logged by the server)")
