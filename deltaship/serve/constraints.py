"""The one place where a request's output constraints are read: `response_format` and `tools`.

`response_format` `{"type": "json_object"}` (any JSON object) and `{"type": "json_schema", "json_schema": {"name",
"schema", "strict"}}` become a checked deltaship.constrain Constraint here, before the request is queued: a bad or
unsupported schema is a 400 carrying constrain's message (it names the keyword and its path). The engine starts
the constraint's parser for the reply and masks each token with it (engine.Engine.generate). The schema is bounded
by the request body (api.MAX_BODY_BYTES) and constrain's own limits (size, depth, subschemas, parser fuel).
`strict` is read and not needed: every schema is enforced (a keyword llguidance cannot enforce is refused).

`tools` and `tool_choice` are read here too (`tools_for`): the function list checked by constrain's `read_tools`,
the choice (`auto`, `none`, `required`, or `{"type": "function", "function": {"name"}}`) by its `check_choice`;
`tool_constraint` is constrain's call grammar for the reply (`tool_grammar`), so a call always parses and its
arguments validate. The legacy `functions`/`function_call` are refused.
"""

from __future__ import annotations

from typing import Any

from deltaship.constrain import Constraint, build_constraint
from deltaship.constrain.tools import Tools, check_choice, read_tools, tool_grammar
from deltaship.errors import DeltashipError
from deltaship.serve.errors import ApiError

LEGACY = "is not supported by deltaship serve (the legacy function API): use tools and tool_choice"
ANY_OBJECT = {"type": "object"}  # json_object: any JSON object, as OpenAI's JSON mode
MAX_NAME_CHARS = 64  # OpenAI's bound on json_schema.name


def constraint_for(request: dict[str, Any]) -> Constraint | None:
    """The constraint a chat or completion request asks for (None: free text); a bad one is a 400."""
    for name in ("functions", "function_call"):
        if request.get(name) is not None:
            raise ApiError(400, f"{name} {LEGACY}", name, "unsupported_parameter")
    fmt = request.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _build(ANY_OBJECT, "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise _bad("response_format.json_schema: an object with `name` and `schema`", "response_format.json_schema")
        name = spec.get("name")
        if name is not None and not (isinstance(name, str) and 0 < len(name) <= MAX_NAME_CHARS):
            raise _bad(f"json_schema.name: a string of 1 to {MAX_NAME_CHARS} characters", "response_format.json_schema")
        if spec.get("strict") not in (None, True, False):
            raise _bad("json_schema.strict: true or false", "response_format.json_schema")
        schema = spec.get("schema", ANY_OBJECT)  # OpenAI's default: absent means any JSON (here: any object)
        return _build(schema, "response_format.json_schema.schema")
    raise _bad(
        f"response_format type {kind!r}: use 'text', 'json_object' or 'json_schema'"
        if isinstance(fmt, dict)
        else "response_format: an object with a `type`",
        "response_format",
    )


def _build(schema: Any, param: str) -> Constraint:
    if not isinstance(schema, (dict, bool)):  # never a str: constrain would read a str as a file's path
        raise _bad(f"{param}: a JSON Schema is an object or a boolean, not {type(schema).__name__}", param)
    try:
        constraint = build_constraint(json_schema=schema)
    except DeltashipError as e:  # constrain's message names the problem (keyword, path, limit)
        where = e.message.removeprefix("json_schema=: ").removeprefix("json_schema=")
        raise _bad(f"{param}: {where}; fix: {e.fix}" if e.fix else f"{param}: {where}", param) from None
    assert constraint is not None
    return constraint


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param, "invalid_value")


def tools_for(request: dict[str, Any]) -> tuple[Tools | None, str]:
    """The request's checked function list (None: no tools) and tool choice (auto, none, required or a function's
    name; OpenAI's default: auto with tools, none without); a bad list or choice is a 400 naming it."""
    raw, choice = request.get("tools"), request.get("tool_choice")
    tools = None
    if raw is not None:
        if raw == []:  # OpenAI clients send no tools as an empty list at times: no tools
            raw = None
        else:
            try:
                tools = read_tools(raw, "tools")
            except DeltashipError as e:
                raise _bad(f"{e.message}; fix: {e.fix}" if e.fix else e.message, "tools") from None
    if choice is None:
        return tools, "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise _bad('tool_choice: "auto", "none", "required" or {"type": "function", "function": {"name"}}',
                       "tool_choice")  # fmt: skip
        if tools is None or tools.get(name) is None:
            known = ", ".join(tools.names()) if tools else "no tools given"
            raise _bad(f"tool_choice: function {name!r} is not declared in tools ({known})", "tool_choice")
        return tools, name
    if choice not in ("auto", "none", "required"):
        raise _bad(f'tool_choice {choice!r}: "auto", "none", "required" or a function object', "tool_choice")
    if choice == "required" and tools is None:
        raise _bad("tool_choice 'required' needs tools", "tool_choice")
    check_choice(choice, tools)
    return tools, choice


def tool_constraint(tools: Tools, choice: str, think: bool) -> Constraint:
    """constrain's call grammar of the reply under `choice` (think: the prompt opens a <think> block)."""
    try:
        constraint = tool_grammar(tools, choice, think)
    except DeltashipError as e:
        raise _bad(f"tools: {e.message}", "tools") from None
    assert constraint is not None
    return constraint
