"""Tool calls in a chat: reading them out of a reply, streaming-safe, and the tool results that go back.

The call format is the one Qwen3.5's published chat template writes (its tools branch; the tiny preset's template
has the same one, deltaship/models/data/qwen3.5-tiny/chat_template.jinja; where the text came from: docs/agents.md):

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

A string parameter's VALUE is its text; any other is JSON. The Qwen3 JSON-in-tags form is not this template's, so
it is not read. `ToolCallStream` shows a reply's text as it comes while holding back whatever may be the start of
a call, so a streamed reply never prints half a `<tool_call>`.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

from deltaship.constrain.tools import OPEN, Tools
from deltaship.errors import DeltashipError

CLOSE = "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>\n?(.*?)</function>\s*</tool_call>", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
MAX_RESULT_CHARS = 1 << 20  # a tool result beyond 1 MiB of text is refused: it would not fit a context anyway


def split_reply(text: str, tools: Tools | None) -> tuple[str, list[dict[str, Any]]]:
    """(the reply's text before its first call, stripped; the complete calls as {"name", "arguments"}). A call
    cut off by the token budget is not a call; a name that is not declared, or arguments that do not validate
    (possible only without the constraint), are left out too."""
    think = text.rfind("</think>")  # a call is in the answer, not in the reasoning before it
    at = text.find(OPEN, think + 1 if think >= 0 else 0)
    if at < 0 or tools is None:
        return text.strip(), []
    calls = []
    for m in _CALL.finditer(text, at):
        name = m.group(1).strip()
        tool = tools.get(name)
        if tool is None:
            continue
        args = {}
        for p in _PARAM.finditer(m.group(2)):
            key, raw = p.group(1).strip(), p.group(2)
            args[key] = raw if tool.is_string(key) else _json_or_text(raw)
        try:
            jsonschema.validate(args, tool.parameters)
        except jsonschema.ValidationError:
            continue
        calls.append({"name": name, "arguments": args})
    return text[:at].strip(), calls


def _json_or_text(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:  # the template writes Python's True/False/None for booleans and null through `| string`
        return {"True": True, "False": False, "None": None}.get(raw.strip(), raw)


def message_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls as an assistant message's `tool_calls` (OpenAI's shape, which the template reads)."""
    return [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]


def tool_messages(results: Any, calls: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The `tool` messages for results of the last reply's calls: each result {"name", "content"} names a call that
    reply made (one result per call at most); content is text, or JSON written as compact text."""
    fix = 'pass [{"name": NAME, "content": TEXT}, ...], one per call of the last reply (Reply.tool_calls)'
    if isinstance(results, dict):
        results = [results]
    if not isinstance(results, list) or not results:
        raise DeltashipError("tool results are a non-empty list of {name, content}", fix)
    if not calls:
        raise DeltashipError("tool results, but the last reply made no tool call", "send a message instead")
    left = [c["name"] for c in calls]
    out = []
    for i, r in enumerate(results):
        if not isinstance(r, dict) or not isinstance(r.get("name"), str) or "content" not in r:
            raise DeltashipError(f"tool result {i} is not an object with name and content", fix)
        if r["name"] not in left:
            made = ", ".join(c["name"] for c in calls)
            raise DeltashipError(
                f"tool result {i} is for {r['name']!r}, a call the last reply did not make (it called: {made})",
                fix,
            )
        left.remove(r["name"])
        content = r["content"]
        text = content if isinstance(content, str) else json.dumps(content, separators=(",", ":"))
        if len(text) > MAX_RESULT_CHARS:
            raise DeltashipError(f"tool result {i}: {len(text):,} characters", "return a shorter result")
        out.append({"role": "tool", "name": r["name"], "content": text})
    return out


class ToolCallStream:
    """Text deltas in, what may be shown out: everything before a call, holding back a tail that could be the
    start of `<tool_call>`; once a call opens, nothing more is shown (the calls are read whole at the end)."""

    def __init__(self) -> None:
        self.text, self.shown, self.in_call = "", 0, False

    def feed(self, text: str) -> str:
        """The whole text so far (decoded); returns the new part safe to show."""
        self.text = text
        if self.in_call:
            return ""
        at = text.find(OPEN, max(self.shown - len(OPEN), 0))
        if at >= 0:
            self.in_call = True
            end = at
        else:
            end = len(text)
            for k in range(min(len(OPEN) - 1, len(text)), 0, -1):  # a tail that may grow into <tool_call>
                if OPEN.startswith(text[-k:]):
                    end = len(text) - k
                    break
        new = text[self.shown : end] if end > self.shown else ""
        self.shown = max(self.shown, end)
        return new

    def finish(self) -> str:
        """The held-back tail, where no call came."""
        if self.in_call:
            return ""
        new = self.text[self.shown :]
        self.shown = len(self.text)
        return new


def run_tool_loop(chat, text: str, functions: dict[str, Any], max_rounds: int = 4, **sampling: Any):
    """Chat.run_tools: send, then while the reply calls tools (at most max_rounds replies), call each Python
    function with its arguments and send the results back; the last round's reply may not call (tool choice
    none). A function's exception is its result's text (`error: ...`), as an agent would report it."""
    if chat.tools is None:
        raise DeltashipError("run_tools needs tools", "pass tools= to Chat (the OpenAI function list)")
    missing = [n for n in chat.tools.names() if n not in functions]
    if missing:
        raise DeltashipError(f"run_tools: no Python function for {missing}", "pass functions={name: callable}")
    if max_rounds < 1:
        raise DeltashipError(f"max_rounds must be >= 1, got {max_rounds}", "pass max_rounds=1 or more")
    reply = chat.send(text, **sampling, **({"tool_choice": "none"} if max_rounds == 1 else {}))
    rounds = 1
    while reply.tool_calls:
        results = []
        for call in reply.tool_calls:
            try:
                content = functions[call["name"]](**call["arguments"])
            except Exception as e:  # noqa: BLE001  # the tool's failure is the model's to read, not the loop's
                content = f"error: {type(e).__name__}: {e}"
            results.append({"name": call["name"], "content": content})
        rounds += 1
        last = rounds >= max_rounds
        reply = chat.send_tool_results(results, **sampling, **({"tool_choice": "none"} if last else {}))
    return reply
