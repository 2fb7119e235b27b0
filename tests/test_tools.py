"""Tool calls and constraints in a chat (deltaship/constrain/tools.py, deltaship/chat/tools.py): on random weights
the call grammar, not the model, makes every call parse and validate against its function; the tiny's template
renders tools as Qwen3.5's published template does; tool results go back only for calls that were made; a
constraint holds on /retry."""

from __future__ import annotations

import io
import json
import random

import jsonschema
import pytest

from deltaship.chat import Chat
from deltaship.chat.tools import ToolCallStream, split_reply
from deltaship.commands.chat import chat as chat_command
from deltaship.constrain import token_table
from deltaship.constrain.tools import MAX_CALLS, read_tools, tool_grammar
from deltaship.errors import DeltashipError
from deltaship.models.presets import TINY_SPECIAL_TOKENS, write_tiny_tokenizer

EOS, IM_END = TINY_SPECIAL_TOKENS["<|endoftext|>"], TINY_SPECIAL_TOKENS["<|im_end|>"]
NO_THINK = {"enable_thinking": False}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now", "description": "The time."}}


@pytest.fixture(scope="module")
def random_chat_bundle(tmp_path_factory):
    """Random weights with the presets' byte-level tokenizer and the tiny's template: its logits are noise, so only
    the constraint can make a call parse. Context for the tools block (1,300 bytes of instructions, up to ~1,000
    of functions) and 4 calls."""
    from helpers import write_checkpoint

    from deltaship.compile import export

    root = tmp_path_factory.mktemp("tools-random")
    ckpt = write_checkpoint("base", root / "ckpt", seed=11, vocab_size=272, eos_token_id=EOS)
    write_tiny_tokenizer(ckpt)
    out = root / "bundle"
    export(str(ckpt), out, target="onnx", precision="fp32", max_context=4096, prefill_chunk=64, verify=False,
           progress=False)  # fmt: skip
    return out


# ---- generated tool lists, each call's longest form known ------------------------------------------------------
def _param(rng: random.Random) -> tuple[dict, int]:
    """(a parameter schema, the most bytes its VALUE takes): every value is bounded."""
    kind = rng.choice(["string", "enum", "integer", "boolean", "array", "object"])
    if kind == "string":
        n = rng.randint(0, 12)
        return {"type": "string", "maxLength": n}, 4 * n  # a character is at most 4 bytes
    if kind == "enum":
        values = rng.sample(["red", "green", "blue", "a b", "x-1"], rng.randint(1, 3))
        return {"type": "string", "enum": values}, max(len(v) for v in values)
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}, 4
    if kind == "boolean":
        return {"type": "boolean"}, 5
    if kind == "array":
        return {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}, 2 + 3 * 6
    return {
        "type": "object",
        "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["k"],
        "additionalProperties": False,
    }, 7


def _tools(rng: random.Random) -> tuple[list[dict], int]:
    """(a function list of 1-3 functions, the most bytes one call of any of them takes)."""
    tools, longest = [], 0
    for i in range(rng.randint(1, 3)):
        props, size = {}, len("<tool_call>\n<function=f_0_x>\n</function>\n</tool_call>\n")
        for j in range(rng.randint(0, 3)):
            schema, most = _param(rng)
            props[f"p{j}"] = schema
            size += len(f"<parameter=p{j}>\n\n</parameter>\n") + most
        required = [k for k in props if rng.random() < 0.6]
        name = f"f_{i}_{rng.choice('abcxyz')}"
        params = {"type": "object", "properties": props, "required": required}
        tools.append({"type": "function", "function": {"name": name, "description": f"tool {i}", "parameters": params}})
        longest = max(longest, size)
    return tools, longest


LISTS = [_tools(random.Random(seed)) for seed in range(24)]


def _check_calls(reply, tools: list[dict], only: str | None = None) -> None:
    """Every call of the reply parses and validates against its function; the reply is calls only."""
    by_name = {t["function"]["name"]: t["function"].get("parameters", {}) for t in tools}
    assert reply.text.startswith("<tool_call>\n<function="), reply.text[:80]
    assert reply.constraint == {"kind": "tools", "complete": True} and reply.stopped == "eos", reply.text[-80:]
    assert len(reply.tool_calls) == reply.text.count("</tool_call>") >= 1  # no call left out as unparsable
    for call in reply.tool_calls:
        assert call["name"] in by_name and (only is None or call["name"] == only)
        jsonschema.validate(call["arguments"], by_name[call["name"]])
        assert set(by_name[call["name"]].get("required", [])) <= set(call["arguments"])


def test_required_calls_always_parse_and_validate(random_chat_bundle):
    """A few dozen tool lists, greedy and sampled (a retry of the same turn): budgets above MAX_CALLS of each
    list's longest call, so every reply completes."""
    for i, (tools, longest) in enumerate(LISTS):
        c = Chat(random_chat_bundle, template_kwargs=NO_THINK, tools=tools, tool_choice="required")
        budget = MAX_CALLS * (longest + 1) + 2
        _check_calls(c.send("go", max_new_tokens=budget), tools)
        _check_calls(c.retry(max_new_tokens=budget, temperature=1.0, seed=i), tools)


def test_tool_choice_name_forces_that_function_and_none_gives_no_call(random_chat_bundle):
    tools = [WEATHER, NOW]
    c = Chat(random_chat_bundle, template_kwargs=NO_THINK, tools=tools, tool_choice="now")
    for seed in range(3):
        r = c.send("time?", max_new_tokens=4 * 52 + 8, temperature=1.0, seed=seed)  # 4 calls of `now`
        _check_calls(r, tools, only="now")
        assert c.history[-1]["tool_calls"][0]["function"]["name"] == "now"  # kept for the template
    r = c.send("and?", max_new_tokens=60, temperature=1.0, seed=1, tool_choice="none")
    assert r.tool_calls == [] and "<tool_call>" not in r.text and "tool_calls" not in c.history[-1]
    with pytest.raises(DeltashipError, match="not auto, required, none or a declared function"):
        c.send("x", tool_choice="delete_all")


def test_call_grammar_opens_where_the_choice_says():
    """The grammar itself, byte by byte over the tiny's byte tokens: auto lets prose then calls through, required
    only a call from the first byte, none never completes `<tool_call>`, NAME only that function."""
    import tempfile
    from pathlib import Path

    d = Path(tempfile.mkdtemp())
    write_tiny_tokenizer(d)
    table = token_table((d / "tokenizer.json").read_text(), 272, [EOS, IM_END])
    tools = read_tools([WEATHER, NOW])
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"

    def accepts(choice: str, text: str) -> bool:
        g = tool_grammar(tools, choice).guide(table)
        for b in text.encode():
            if not g.allowed()[b]:
                return False
            g.advance(b)
        return g.complete()

    assert accepts("auto", "hello") and accepts("auto", "Let me look. " + call) and accepts("auto", call)
    assert accepts("required", call) and not accepts("required", "hello") and not accepts("required", "x" + call)
    assert accepts("none", "hello <tool_cal") and not accepts("none", call) and not accepts("none", "a " + call)
    assert accepts("get_weather", call) and not accepts("now", call)
    bad = call.replace("Paris", "P<aris")  # a string value is one line without `<`
    assert not accepts("auto", bad) and not accepts("required", call.replace("city", "town"))
    assert not accepts("required", call.replace("get_weather", "get_wether"))
    assert accepts("auto", call + "\n" + call) and not accepts("auto", call + " trailing")


def test_tools_files_that_are_not_function_lists_are_refused(tmp_path):
    cases = [
        ({"type": "function"}, "a function list is a JSON array"),
        ([], "empty"),
        ([{"name": "x"}], 'entry 0 is not {"type": "function"'),
        ([{"type": "function", "function": {"name": "bad name"}}], "function name 'bad name'"),
        ([NOW, NOW], "declared twice"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "not a JSON Schema"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": ["a"]}}}],
         r"required parameter\(s\) \['a'\]"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "a": {"type": "intger"}}}}}], "invalid schema at /properties/a/type"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "d": {"type": "string", "format": "date"}}}}}], "`format` on a string parameter"),
        ([{"type": "function", "function": {"name": "f", "args": {}}}], r"unknown field\(s\) \['args'\]"),
    ]  # fmt: skip
    for doc, message in cases:
        with pytest.raises(DeltashipError, match=message):
            read_tools(doc)
    path = tmp_path / "tools.json"
    path.write_text("[{not json")
    with pytest.raises(DeltashipError, match=f"--tools {path}: not JSON"):
        read_tools(path)
    assert read_tools({"tools": [NOW]}).names() == ["now"]  # a request body's "tools" is taken as it is


def test_cli_refuses_a_bad_tools_file_with_exit_2(random_chat_bundle, tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "tools.json"
    bad.write_text(json.dumps([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]))
    r = subprocess.run([sys.executable, "-m", "deltaship", "chat", str(random_chat_bundle), "--tools", str(bad)],
                       input="hi\n", capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "entry 0 (f): parameters is not a JSON Schema of an object" in r.stderr, r.stderr
    assert r.stdout == ""  # nothing generated


def test_tool_results_only_for_calls_that_were_made(random_chat_bundle, tmp_path):
    c = Chat(random_chat_bundle, template_kwargs=NO_THINK, tools=[WEATHER, NOW], tool_choice="get_weather")
    with pytest.raises(DeltashipError, match="no reply yet|made no tool call"):
        c.send_tool_results([{"name": "now", "content": "12:00"}])
    r = c.send("weather?", max_new_tokens=120)
    assert [x["name"] for x in r.tool_calls] == ["get_weather"] * len(r.tool_calls)
    held = (c.ids, c.history)
    with pytest.raises(DeltashipError, match="for 'now', a call the last reply did not make"):
        c.send_tool_results([{"name": "now", "content": "12:00"}])
    too_many = [{"name": "get_weather", "content": "sun"}] * (len(r.tool_calls) + 1)
    with pytest.raises(DeltashipError, match="did not make"):
        c.send_tool_results(too_many)
    assert (c.ids, c.history) == held  # refused before anything was fed or kept
    r2 = c.send_tool_results({"name": "get_weather", "content": {"sky": "sun"}}, max_new_tokens=8, tool_choice="none")
    assert c.history[-2] == {"role": "tool", "name": "get_weather", "content": '{"sky":"sun"}'}
    assert r2.tool_calls == []
    text = c.template.render(c.messages, False, **c.template_kwargs)
    assert '<|im_start|>user\n<tool_response>\n{"sky":"sun"}\n</tool_response><|im_end|>\n' in text
    # a saved session keeps the calls, the tool messages and the tools (template settings) as they were
    path = c.save(tmp_path / "tools.dschat")
    loaded = Chat.load(path, random_chat_bundle)
    assert loaded.history == c.history and loaded.ids == c.ids and loaded.tools.names() == ["get_weather", "now"]
    assert loaded.history[1]["tool_calls"] == c.history[1]["tool_calls"]
    # a retry of a loaded tool-results turn keeps all its results (the turn's inputs are the tool messages)
    n = sum(m["role"] == "tool" for m in loaded.history)
    loaded.retry(max_new_tokens=8, tool_choice="none")
    assert [m["role"] for m in loaded.history] == [m["role"] for m in c.history] and n >= 1


def test_a_turn_of_several_tool_results_retries_whole(random_chat_bundle, tmp_path):
    c = Chat(random_chat_bundle, template_kwargs=NO_THINK, tools=[NOW], tool_choice="now")
    r = c.send("times?", max_new_tokens=4 * 52 + 8)
    assert len(r.tool_calls) >= 2  # greedy on these weights: several calls
    c.send_tool_results([{"name": "now", "content": f"{i}:00"} for i in range(len(r.tool_calls))],
                        max_new_tokens=8, tool_choice="none")  # fmt: skip
    roles = [m["role"] for m in c.history]
    loaded = Chat.load(c.save(tmp_path / "t.dschat"), random_chat_bundle)
    for chat in (c, loaded):
        chat.retry(max_new_tokens=8, temperature=1.0, seed=4)
        assert [m["role"] for m in chat.history] == roles


def test_line_protocol_tool_results_and_refusal(random_chat_bundle, tmp_path):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER, NOW]))
    script = 'weather?\n/tool {"name": "get_weather", "content": "rain"}\n'
    out = io.StringIO()
    chat_command(random_chat_bundle, no_thinking=True, json=True, tools=tools, tool_choice="get_weather",
                 max_new_tokens=120, stdin=io.StringIO(script), stdout=out)  # fmt: skip
    first, second = [json.loads(line) for line in out.getvalue().splitlines()]
    assert first["command"] == "send" and first["tool_calls"] and first["tool_calls"][0]["name"] == "get_weather"
    assert set(first["tool_calls"][0]) == {"name", "arguments"}
    assert second["command"] == "tool" and second["tool_calls"][0]["name"] == "get_weather"  # still forced
    with pytest.raises(DeltashipError, match="for 'now', a call the last reply did not make"):
        chat_command(random_chat_bundle, no_thinking=True, json=True, tools=tools, tool_choice="get_weather",
                     max_new_tokens=120, stdin=io.StringIO('go\n/tool {"name": "now", "content": "1"}\n'),
                     stdout=io.StringIO())  # fmt: skip
    plain = io.StringIO()  # without --json: the text before the calls, then one `tool call:` line per call
    chat_command(random_chat_bundle, no_thinking=True, tools=tools, tool_choice="now", max_new_tokens=60,
                 stdin=io.StringIO("time?\n"), stdout=plain)  # fmt: skip
    lines = plain.getvalue().splitlines()
    assert (
        "<tool_call>" not in plain.getvalue()
        and lines[1:]
        and all(json.loads(line.removeprefix("tool call: ")) == {"name": "now", "arguments": {}} for line in lines[1:])
    )
    with pytest.raises(DeltashipError, match="--tool-choice now without --tools"):
        chat_command(random_chat_bundle, tool_choice="now", stdin=io.StringIO(""), stdout=io.StringIO())


# the tools branch of Qwen3.5's published chat template (docs/agents.md names the copy), rendered for WEATHER
PUBLISHED_TOOLS_SYSTEM = (
    "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
    + json.dumps(WEATHER, ensure_ascii=False)
    + "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified "
    "format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in "
    "natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer "
    "the question like normal with your current knowledge and do not tell the user about function calls\n"
    "</IMPORTANT>\n\nBe brief.<|im_end|>\n"
)


def test_tiny_template_renders_tools_as_the_published_template():
    from deltaship.chat.template import ChatTemplate
    from deltaship.models.presets import CHAT_TEMPLATE_FILE

    t = ChatTemplate(CHAT_TEMPLATE_FILE.read_text(encoding="utf-8"))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}},
            {"type": "function", "function": {"name": "now", "arguments": {}}}]},
        {"role": "tool", "name": "get_weather", "content": "sunny"},
        {"role": "tool", "name": "now", "content": "12:00"},
    ]  # fmt: skip
    text = t.render(messages, True, tools=[WEATHER], enable_thinking=False)
    assert text == (
        PUBLISHED_TOOLS_SYSTEM + "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\nLooking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n"
        "</function>\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\n12:00\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert t.render(plain, True) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n" \
        "<|im_start|>assistant\n<think>\n"  # fmt: skip


def test_reply_parsing_and_streaming_hold_back_a_call():
    tools = read_tools([WEATHER, NOW])
    text = (
        "Sure.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Jose\n</parameter>\n<parameter=days>\n"
        "3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>"
    )
    content, calls = split_reply(text, tools)
    thought = "<think>\nmaybe <tool_call>\n</think>\n\n"  # a call is in the answer, not in the reasoning
    assert split_reply(thought + text, tools) == (thought + "Sure.", calls)
    assert content == "Sure." and calls == [
        {"name": "get_weather", "arguments": {"city": "San Jose", "days": 3}},
        {"name": "now", "arguments": {}},
    ]
    assert split_reply(text[:-5], tools)[1] == calls[:1]  # a call cut off by the budget is no call
    assert split_reply(text.replace("=now>", "=rm>"), tools)[1] == calls[:1]  # an undeclared name is no call
    s, shown = ToolCallStream(), ""
    for i in range(1, len(text) + 1):
        part = s.feed(text[:i])
        assert "<" not in part  # never a piece of the call's markup
        shown += part
    assert shown + s.finish() == "Sure.\n\n"
    s = ToolCallStream()
    assert s.feed("a <tool_ca") == "a " and s.feed("a <tool_cab") == "<tool_cab" and s.finish() == ""


def test_tool_loop_calls_the_python_function_and_answers(random_chat_bundle):
    """The worked example of docs/agents.md: the reply calls get_weather (forced here, on random weights), the
    loop runs the Python function with the call's arguments and sends its result back, and the last reply answers
    without a call."""
    seen = []

    def get_weather(city: str, days: int = 1) -> dict:
        seen.append((city, days))
        return {"city": city, "sky": "sunny", "days": days}

    c = Chat(random_chat_bundle, template_kwargs=NO_THINK, tools=[WEATHER], tool_choice="get_weather")
    reply = c.run_tools("Weather in Paris?", {"get_weather": get_weather}, max_rounds=2, max_new_tokens=120)
    assert seen and all(isinstance(city, str) and len(city) <= 12 and 1 <= days <= 7 for city, days in seen)
    roles = [m["role"] for m in c.history]
    assert roles == ["user", "assistant"] + ["tool"] * len(seen) + ["assistant"]
    assert json.loads(c.history[2]["content"])["city"] == seen[0][0]
    assert reply.tool_calls == [] and "tool_calls" not in c.history[-1]
    with pytest.raises(DeltashipError, match="no Python function"):
        c.run_tools("again", {})


# ---- constraints in a chat -----------------------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
          "maximum": 99}}, "required": ["ok", "n"], "additionalProperties": False}  # fmt: skip


def test_constraint_holds_on_retry_undo_and_a_saved_session(random_chat_bundle, tmp_path):
    """The turn keeps its constraint (a reply's constraint starts and ends with it: the turn checkpoint needs no
    parser state, and a saved session stores none; the command passes its constraint to every turn, so a loaded
    session's /retry is held to it again)."""
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    session = tmp_path / "talk.dschat"
    out = io.StringIO()
    chat_command(random_chat_bundle, no_thinking=True, json=True, json_schema=schema, session=session,
                 temperature=1.0, seed=5, max_new_tokens=40, stdin=io.StringIO("hi\n/retry\n/undo\nyo\n"),
                 stdout=out)  # fmt: skip
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    replies = [r for r in records if r["command"] in ("send", "retry")]
    assert [r["command"] for r in replies] == ["send", "retry", "send"]
    for r in replies:
        jsonschema.validate(json.loads(r["reply"]), SCHEMA)
        assert r["constraint"] == {"kind": "json_schema", "complete": True}
    assert [r["seed"] for r in replies] == [5, 6, 5]  # retry k of a turn draws with seed + k
    fresh = Chat(random_chat_bundle, template_kwargs=NO_THINK)  # the retry's draw, under the same mask
    redo = fresh.send("hi", max_new_tokens=40, temperature=1.0, seed=6, json_schema=SCHEMA)
    assert redo.ids == replies[1]["reply_ids"]
    out = io.StringIO()
    chat_command(random_chat_bundle, no_thinking=True, json=True, json_schema=schema, session=session,
                 temperature=1.0, seed=9, max_new_tokens=40, stdin=io.StringIO("/retry\n"), stdout=out)  # fmt: skip
    (again,) = [json.loads(line) for line in out.getvalue().splitlines()]
    jsonschema.validate(json.loads(again["reply"]), SCHEMA)

    c = Chat(random_chat_bundle, template_kwargs=NO_THINK)
    r = c.send("x", max_new_tokens=20, regex="[a-c]{3}")
    assert len(r.text) == 3 and set(r.text) <= set("abc") and r.constraint["complete"]
    r = c.retry(max_new_tokens=20, temperature=1.0, seed=2)  # the turn's regex again
    assert len(r.text) == 3 and set(r.text) <= set("abc")
    c.undo()
    r = c.send("y", max_new_tokens=6, temperature=1.0, seed=2)  # a turn without one is not held to it
    assert r.constraint is None


def test_constraint_after_an_open_think_block(random_chat_bundle):
    """With thinking on, the generation prompt opens <think>: the reasoning is free, the answer after
    `</think>` and a blank line is held to the constraint."""
    from deltaship.constrain import build_constraint
    from deltaship.constrain.tools import after_think

    c = Chat(random_chat_bundle)
    table = token_table(c.tokenizer.json_text, c.session.vocab_size, sorted(c.stop_ids))
    g = after_think(build_constraint(regex="[0-9]{2}")).guide(table)
    for b in "hmm, so</think>\n\n42".encode():
        assert g.allowed()[b]
        g.advance(b)
    assert g.complete() and not g.allowed()[ord("x")]
    with pytest.raises(DeltashipError, match="cannot be combined"):
        Chat(random_chat_bundle, tools=[NOW]).send("x", regex="a")


def test_trained_tiny_chat_constraint_changes_nothing_it_allows(shared_export):
    """Token equality on the trained tiny: a chat reply under a constraint that allows what the model says (any
    text, the budget's length) is the unconstrained reply token for token, and a retry under it again the same."""
    bundle = shared_export("constrain-tiny-onnx", "qwen3.5-tiny", target="onnx", precision="fp32", mtp=True,
                           max_context=256, prefill_chunk=16, verify=False)  # fmt: skip  # test_constrain's
    free = Chat(bundle, template_kwargs=NO_THINK).send("def add(a, b):", max_new_tokens=24)
    c = Chat(bundle, template_kwargs=NO_THINK)
    held = c.send("def add(a, b):", max_new_tokens=24, regex=r"(?s:.*)")
    assert held.ids == free.ids and held.constraint["kind"] == "regex"
    assert c.retry(max_new_tokens=24).ids == free.ids
    narrow = c.retry(max_new_tokens=24, regex="[0-9]{4}")  # one that does not allow it: another reply
    assert narrow.text.isdigit() and len(narrow.text) == 4 and narrow.ids != free.ids
