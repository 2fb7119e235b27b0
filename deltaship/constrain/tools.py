"""Tools an assistant may call: the OpenAI function list, checked, and the grammar of a reply that calls them.

`read_tools(FILE or list)` checks a function list (`[{"type": "function", "function": {"name", "description",
"parameters"}}]`) before any bundle is opened: every problem is a DeltashipError naming the entry and the field.
`tool_grammar(tools, choice)` is the constraint of an assistant reply in the call format of Qwen3.5's published
chat template (docs/agents.md, "Tool calls"):

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

A string parameter's VALUE is the text itself; any other VALUE is JSON (the template writes mappings and lists
with `tojson`). From `<tool_call>` on, the name is one of the declared functions and the parameters are that
function's (required ones always, in the order its `properties` declares them), each VALUE valid against its
schema: compact JSON through llguidance's `%json`, a string as one line without `<` (within its `minLength`,
`maxLength`, `enum`/`const` and `pattern`, read as anchored).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltaship.constrain.constraint import (
    JSON_OPTIONS,
    MAX_FILE_BYTES,
    Constraint,
    _check_depth,
    _check_schema,
    _validate,
)
from deltaship.errors import DeltashipError
from deltaship.files import read_bounded_text

CHOICES = ("auto", "required", "none")  # or a function's name
MAX_TOOLS = 128
MAX_CALLS = 4  # calls in one reply (the template separates them by a newline)
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}")  # function and parameter names (OpenAI's, plus a dot)
OPEN = "<tool_call>"
FIX = 'pass a JSON list of {"type": "function", "function": {"name", "description", "parameters"}} (docs/agents.md)'


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any] = field(hash=False, compare=False)

    def properties(self) -> dict[str, Any]:
        return self.parameters.get("properties") or {}

    def is_string(self, key: str) -> bool:
        """Whether the template writes this parameter's value as its text (a string schema), not as JSON."""
        schema = self.properties().get(key)
        return isinstance(schema, dict) and schema.get("type") == "string"


@dataclass(frozen=True)
class Tools:
    """A checked function list: `entries` as the template renders them (the file's own objects), `by_name`."""

    entries: tuple[dict[str, Any], ...] = field(hash=False, compare=False)
    tools: tuple[Tool, ...]
    where: str

    def names(self) -> list[str]:
        return [t.name for t in self.tools]

    def get(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)


def read_tools(value: str | Path | list[Any], where: str | None = None) -> Tools:
    """A function list from a JSON file or a list; every problem raised here, naming the entry and field."""
    if isinstance(value, (str, Path)):
        where = where or f"--tools {value}"
        text = read_bounded_text(value, "tools file", FIX, MAX_FILE_BYTES)
        try:
            doc = json.loads(text)
        except RecursionError:
            raise DeltashipError(f"{where}: nested too deep", FIX) from None
        except ValueError as e:
            raise DeltashipError(f"{where}: not JSON ({e})", FIX) from None
    else:
        where, doc = where or "tools=", value
    if isinstance(doc, dict) and isinstance(doc.get("tools"), list):  # {"tools": [...]} as in a request body
        doc = doc["tools"]
    if not isinstance(doc, list):
        raise DeltashipError(f"{where}: a function list is a JSON array, not {type(doc).__name__}", FIX)
    if not doc:
        raise DeltashipError(f"{where}: the function list is empty", FIX)
    if len(doc) > MAX_TOOLS:
        raise DeltashipError(f"{where}: {len(doc)} functions, more than {MAX_TOOLS}", "declare fewer functions")
    _check_depth(doc, where)
    tools, seen = [], set()
    for i, entry in enumerate(doc):
        at = f"{where}: entry {i}"
        fn = entry.get("function") if isinstance(entry, dict) else None
        if not isinstance(fn, dict) or entry.get("type") != "function":
            raise DeltashipError(f'{at} is not {{"type": "function", "function": {{...}}}}', FIX)
        extra = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if extra:
            raise DeltashipError(f"{at}: unknown field(s) {extra} in function", FIX)
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise DeltashipError(
                f"{at}: function name {name!r} is not 1-64 of [A-Za-z0-9_.-], a letter or _ first", FIX
            )
        if name in seen:
            raise DeltashipError(f"{at}: function {name!r} is declared twice", "give each function its own name")
        seen.add(name)
        desc = fn.get("description", "")
        if not isinstance(desc, str):
            raise DeltashipError(f"{at} ({name}): description is {type(desc).__name__}, not a string", FIX)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        _check_parameters(params, f"{at} ({name}): parameters")
        tools.append(Tool(name, desc, params))
    return Tools(tuple(doc), tuple(tools), where)


def _check_parameters(params: Any, at: str) -> None:
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise DeltashipError(f"{at} is not a JSON Schema of an object", 'e.g. {"type": "object", "properties": {...}}')
    _check_schema(params, at)
    props = params.get("properties", {})
    if not isinstance(props, dict):
        raise DeltashipError(f"{at}: properties is not an object", "map each parameter name to its schema")
    for key, schema in props.items():
        if not NAME.fullmatch(key):
            raise DeltashipError(f"{at}: parameter name {key!r} is not 1-64 of [A-Za-z0-9_.-]", "rename it")
        if isinstance(schema, dict) and schema.get("type") == "string" and "format" in schema:
            raise DeltashipError(
                f"{at}/properties/{key}: `format` on a string parameter cannot be enforced in a tool call (its value "
                "is written as plain text)",
                "drop `format`, or give a `pattern` instead",
            )
    missing = [k for k in params.get("required", []) if k not in props]
    if missing:
        raise DeltashipError(f"{at}: required parameter(s) {missing} are not in properties", "declare them")


# ---- the grammar of a reply -----------------------------------------------------------------------------------------
def tool_grammar(tools: Tools, choice: str = "auto", think: bool = False) -> Constraint | None:
    """The constraint of one assistant reply under `choice`: auto (text, or text then calls), required (calls
    only), none (text without a call), or a function's name (calls of it only). think: the reply opens inside the
    template's <think> block (closed by `</think>` and a blank line before the answer). None: auto without tools."""
    check_choice(choice, tools)
    lines = [_start(tools, choice, think)]
    if think:
        lines.append(r"think[lazy]: /(?s:.*)<\/think>\n\n/")
    lines.append(r"TEXT: /(?s:.*)/ & ~/(?s:.*<tool_call>.*)/")
    if choice != "none":
        lines.append(r"prose[lazy]: /(?s:.*)<tool_call>/")
        lines.append(f'calls: body ("\\n" {json.dumps(OPEN)} body){{0,{MAX_CALLS - 1}}}')
        chosen = [t for t in tools.tools if choice in ("auto", "required") or t.name == choice]
        lines.append("body: " + " | ".join(f"fn_{i}" for i in range(len(chosen))))
        for i, t in enumerate(chosen):
            lines.extend(_function_rules(t, i))
    where = f"--tools {tools.where.removeprefix('--tools ')} --tool-choice {choice}"
    g = json.dumps({"grammars": [{"lark_grammar": "\n".join(lines) + "\n"}]})
    _validate(g, where)
    return Constraint("tools", where, g)


def _start(tools: Tools, choice: str, think: bool) -> str:
    head = "start: think " if think else "start: "
    if choice == "none":
        return head + "TEXT"
    if choice == "auto":
        return head + "(TEXT | prose calls)"
    return head + json.dumps(OPEN) + " calls"


def check_choice(choice: str, tools: Tools | None) -> None:
    if choice in CHOICES:
        return
    if tools is None or tools.get(choice) is None:
        known = ", ".join(tools.names()) if tools else "no --tools given"
        raise DeltashipError(
            f"--tool-choice {choice!r} is not auto, required, none or a declared function ({known})",
            "pass auto, required, none or one of the functions' names",
        )


def _function_rules(tool: Tool, i: int) -> list[str]:
    """fn_i: the call after its `<tool_call>`: `\\n<function=NAME>\\n`, the parameters, `</function>\\n</tool_call>`."""
    props, required = tool.properties(), set(tool.parameters.get("required", []))
    defs = {k: tool.parameters[k] for k in ("$defs", "definitions") if k in tool.parameters}
    parts, rules = [], []
    for j, (key, schema) in enumerate(props.items()):
        rule = f"p_{i}_{j}"
        head = json.dumps(f"<parameter={key}>\n")
        rules.append(f'{rule}: {head} {_value(schema, defs, f"{rule}_v", rules)} "\\n</parameter>\\n"')
        parts.append(rule if key in required else f"{rule}?")
    opening = json.dumps(f"\n<function={tool.name}>\n")
    body = " ".join([opening, *parts, json.dumps("</function>\n</tool_call>")])
    return [f"fn_{i}: {body}", *rules]


def _value(schema: Any, defs: dict[str, Any], name: str, rules: list[str]) -> str:
    """The grammar of one parameter's VALUE: a string schema's text, else compact JSON valid against it."""
    if isinstance(schema, dict) and schema.get("type") == "string":
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else list(schema["enum"])
            values = [v for v in values if isinstance(v, str)]
            if not values:
                raise DeltashipError(f"parameter schema {schema}: enum has no string value", "fix the tools file")
            return "(" + " | ".join(json.dumps(v) for v in values) + ")"
        lo, hi = int(schema.get("minLength", 0)), schema.get("maxLength")
        reps = f"{{{lo},{int(hi)}}}" if hi is not None else (f"{{{lo},}}" if lo else "*")
        line = f"/[^<\\n]{reps}/"
        if "pattern" in schema:
            pat = str(schema["pattern"]).removeprefix("^").removesuffix("$").replace("/", "\\/")
            line = f"/{pat}/ & {line}"
        token = name.upper()
        rules.append(f"{token}: {line}")
        return token
    doc = dict(schema) if isinstance(schema, dict) else {} if schema is True else {"not": {}}
    doc.update(defs)
    doc["x-guidance"] = JSON_OPTIONS
    return f"%json {json.dumps(doc)}"


def after_think(constraint: Constraint) -> Constraint:
    """`constraint` after a <think> block the reply opens inside (closed by `</think>` and a blank line): the
    reasoning is free, the answer is held to the constraint."""
    inner = json.loads(constraint.grammar)
    grammars = [dict(g, name="answer") if i == 0 else g for i, g in enumerate(inner["grammars"])]
    head = {"lark_grammar": "start: think @answer\n" + r"think[lazy]: /(?s:.*)<\/think>\n\n/" + "\n"}
    g = json.dumps({**inner, "grammars": [head, *grammars]})
    _validate(g, constraint.where)
    return Constraint(constraint.kind, constraint.where, g)
