"""`deltaship serve` (deltaship/serve): the OpenAI API with real clients (openai, langchain-openai), held
conversations across interleaved requests, the queue, bad requests, the bound address.

One fp32 ONNX export of the trained tiny preset per module (its greedy replies hardly depend on the history, so
exactness is also checked where a wrong state cannot hide: every state after a restore against a fresh prefill,
and sampled replies (same seed) against a fresh session's). Servers bind 127.0.0.1 on a free port.

Mutation-checked by hand (2026-12-01): restoring only the DeltaNet states of a spilled conversation (its KV prefix
not written back) fails test_restored_state_is_a_fresh_prefill and test_interleaved_conversations_keep_their_cache
(sampled replies differ); feeding one token too few after a restore fails both; not holding the point where the next
turn's rendering leaves the prompt (marks) fails test_interleaved_conversations_keep_their_cache, and so does
reporting cached_tokens as 0 (and test_openai_chat_whole_and_streamed); streaming text a stop string may still
cut fails test_completions_and_stop; not cancelling a stream whose client left fails
test_a_client_that_leaves_mid_stream_stops_decoding, and a plain request's
test_a_client_that_leaves_a_plain_request_stops_it; charging an entry less than it holds once spilled (its logits
left out) and an LRU that never evicts each fail
test_held_conversations_are_bounded; a misnamed `object` or a float `created` fails
test_responses_are_the_openai_types. response_format: sampling from the unmasked logits, or building no guide
for a request's constraint (mask and advance gone), fails every structured-output test but the bad-format ones
(test_json_schema_* on the trained tiny and on random weights, test_json_object_*, test_openai_parse_*,
test_langchain_structured_output); rendering a constrained reply with thinking on fails
test_json_schema_replies_validate (its prompt). tools: dropping the call grammar (no guide for a tools request)
fails test_required_tool_calls_parse_and_validate, test_a_tool_loop_reuses_the_held_prompt and
test_langchain_bind_tools; streaming a tools reply's text unheld (no ToolCallStream) fails
test_required_tool_calls_parse_and_validate; a named tool_choice read as `required` fails
test_a_named_function_is_forced_and_none_gives_no_call; leaving an assistant's tool_calls out of the rendered
history fails test_a_tool_loop_reuses_the_held_prompt.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import numpy as np
import pytest

from deltaship.cli import build_parser
from deltaship.runtimes.base import sample
from deltaship.serve.constraints import constraint_for
from deltaship.serve.engine import Engine, Sampling
from deltaship.serve.held import HeldConversations, common_prefix
from deltaship.serve.run import ServeOptions, ServerThread, exposure_warning
from deltaship.targets import open_bundle

openai = pytest.importorskip("openai")  # the serve extra's test clients (dev installs them)

CONTEXT = 512


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    from deltaship.compile import export

    out = tmp_path_factory.mktemp("serve") / "tiny-onnx"
    export("qwen3.5-tiny", out, target="onnx", precision="fp32", max_context=CONTEXT, verify=False, progress=False)
    return out


@pytest.fixture(scope="module")
def server(bundle):
    with ServerThread(open_bundle(bundle), ServeOptions(port=0)) as s:
        yield s


@pytest.fixture(scope="module")
def fresh(bundle):
    """A session of its own, for what a fresh prefill gives, and the server's renderer over it."""
    session = open_bundle(bundle)
    return session, Engine(session, 0, 1, reuse=False)


def client(server: ServerThread, key: str = "none"):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


def fresh_reply(fresh, prompt: list[int], max_tokens: int, temperature: float = 0.0, seed: int | None = None) -> str:
    """What a fresh session fed the whole prompt generates (the sampler the server uses, its own loop)."""
    session, engine = fresh
    session.reset()
    logits = session.prefill(prompt)
    rng, out = np.random.default_rng(seed), []
    while len(out) < max_tokens:
        tok = sample(logits, temperature, 0, 1.0, rng)
        if tok in engine.stop_ids:
            break
        out.append(tok)
        if len(out) < max_tokens:
            logits = session.decode(tok)
    return engine.tokenizer.decode(out)


def test_binds_loopback_by_default(server):
    assert server.address[0] == "127.0.0.1"
    assert ServeOptions().host == "127.0.0.1"
    assert build_parser().parse_args(["serve", "b"]).host == "127.0.0.1"
    assert "without --api-key" in exposure_warning("0.0.0.0", None)
    assert exposure_warning("192.168.1.4", None) is not None
    assert exposure_warning("0.0.0.0", "key") is None
    assert all(exposure_warning(h, None) is None for h in ("127.0.0.1", "localhost", "::1", "127.0.0.2"))


def test_the_command_serves_on_loopback_and_stops_on_sigterm(bundle):
    with socket.socket() as probe:  # a free port (closed again before the server binds it)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltaship", "serve", str(bundle), "--port", str(port)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        end = time.monotonic() + 60
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()["status"] == "ok"
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < end, "the server did not start"
                time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143
    assert f"on http://127.0.0.1:{port}/v1" in err and "warning" not in err


def test_a_missing_serve_extra_names_it():
    code = (
        "import sys; sys.modules['starlette'] = None\n"  # as if the serve extra were not installed
        "from deltaship.commands import serve\n"
        "from deltaship.errors import DeltashipError\n"
        "try:\n    serve('/nonexistent')\nexcept DeltashipError as e:\n    print(e.message, '|', e.fix)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert 'needs the serve extra (starlette is not installed) | pip install "deltaship[serve]"' in run.stdout, (
        run.stdout + run.stderr
    )


def test_openai_chat_whole_and_streamed(server, fresh):
    c = client(server)
    assert [m.id for m in c.models.list().data] == ["qwen3.5-tiny"]
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def parse(path):"}]
    whole = c.chat.completions.create(model="qwen3.5-tiny", messages=messages, max_tokens=24, temperature=0)
    text = whole.choices[0].message.content
    prompt, _ = fresh[1].render(messages, {})
    assert text == fresh_reply(fresh, prompt, 24)
    assert whole.usage.prompt_tokens == len(prompt) and whole.usage.completion_tokens == 24
    assert whole.choices[0].finish_reason == "length"
    chunks = list(
        c.chat.completions.create(
            model="qwen3.5-tiny",
            messages=messages,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == text and len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) > 1
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == len(prompt)  # the same prompt again: all reused
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
def test_responses_are_the_openai_types(server, route):
    """Whole responses and every SSE chunk validate as the openai package's own models (its copy of the API's
    schema: the client itself builds them without validating), and a stream ends with [DONE]."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    whole, chunk = (ChatCompletion, ChatCompletionChunk) if route.startswith("chat") else (Completion, Completion)
    body = {"messages": [{"role": "user", "content": "x = "}]} if route.startswith("chat") else {"prompt": "x = "}
    body |= {"max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/{route}", json=body, timeout=60)
    whole.model_validate(r.json(), strict=True)
    stream = body | {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/{route}", json=stream, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    for line in lines[:-1]:
        data = json.loads(line[6:])
        if chunk is Completion and data["choices"] and data["choices"][0]["finish_reason"] is None:
            # the openai package reuses Completion for stream chunks, whose finish_reason it types as never null,
            # while the API sends null until the last chunk (as this server does): the rest must still validate
            data = data | {"choices": [data["choices"][0] | {"finish_reason": "length"}]}
        chunk.model_validate(data, strict=True)
    assert json.loads(lines[-2][6:])["usage"]["completion_tokens"] == 4


def test_completions_and_stop(server, fresh):
    c = client(server)
    prompt = "def main():\n    "
    ids = fresh[1].tokenizer.encode(prompt)
    r = c.completions.create(model="m", prompt=prompt, max_tokens=30, temperature=0)
    expected = fresh_reply(fresh, ids, 30)
    assert r.choices[0].text == expected and r.usage.prompt_tokens == len(ids)
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(model="m", prompt=prompt, max_tokens=30, temperature=0, stream=True)
        if ch.choices
    )
    assert streamed == expected
    stop = expected[5:8]  # a stop string the greedy reply reaches
    cut = c.completions.create(model="m", prompt=prompt, max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].text == expected[: expected.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(
        ch.choices[0].text
        for ch in c.completions.create(model="m", prompt=prompt, max_tokens=30, temperature=0, stop=[stop], stream=True)
        if ch.choices
    )
    assert streamed == cut.choices[0].text


def test_interleaved_conversations_keep_their_cache(server, fresh):
    """Three conversations, turns interleaved: each turn reuses everything its previous turn's prompt shares with it
    (all but the generation prompt's `<think>\\n`, which the template renders otherwise in a past turn), and its
    sampled reply is what a fresh prefill of its whole prompt gives with the same seed."""
    c = client(server)
    convs = [[{"role": "system", "content": f"You are assistant {k}. Answer in Python."}] for k in range(3)]
    last_prompt: list[list[int] | None] = [None] * 3
    for turn in range(3):
        for k, messages in enumerate(convs):
            messages.append({"role": "user", "content": f"def f{k}_{turn}(x):"})
            r = c.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=1.0, seed=k + turn)
            prompt, _ = fresh[1].render(messages, {})
            cached = r.usage.prompt_tokens_details.cached_tokens
            if last_prompt[k] is None:
                assert cached < len(prompt)
            else:
                shared = len(last_prompt[k]) - len("<think>\n")  # the byte-level tiny tokenizer: a token a byte
                assert last_prompt[k][:shared] == prompt[:shared] and cached == shared, (k, turn, cached, shared)
            assert r.choices[0].message.content == fresh_reply(fresh, prompt, 12, 1.0, k + turn)
            last_prompt[k] = prompt
            messages.append({"role": "assistant", "content": r.choices[0].message.content})


def test_restored_state_is_a_fresh_prefill(bundle, fresh):
    """After conversations A, B, then A's next turn (A's KV prefix copied back in), every state of the session,
    the KV caches up to the position included, is what a fresh prefill of A's next prompt gives."""
    engine = Engine(open_bundle(bundle), 1 << 30, 16)
    a = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "import os"}]
    b = [{"role": "system", "content": "Be long."}, {"role": "user", "content": "class B:"}]
    for messages in (a, b):
        prompt, marks = engine.render(messages, {})
        engine.generate(prompt, Sampling(max_tokens=6), marks=marks)
    a += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "def g():"}]
    prompt, marks = engine.render(a, {})
    r = engine.generate(prompt, Sampling(max_tokens=0), marks=marks)
    assert r.cached_tokens > 20 and engine.held.spilled_bytes > 0
    got = engine.session.state_file_arrays()
    session = fresh[0]
    session.reset()
    session.prefill(prompt)
    want = session.state_file_arrays()
    assert engine.session.position == session.position == len(prompt)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_held_conversations_are_bounded(bundle):
    engine = Engine(open_bundle(bundle), 1 << 30, 3)
    for k in range(5):
        engine.generate(engine.tokenizer.encode(f"conversation {k}: " + "x" * 40), Sampling(max_tokens=2))
    assert len(engine.held) == 3  # the two least recently used dropped
    assert engine.held.longest(engine.tokenizer.encode("conversation 0: " + "x" * 40)) is None
    assert engine.held.longest(engine.tokenizer.encode("conversation 4: " + "x" * 40 + "y")) is not None
    one = engine.held.nbytes // 3
    small = Engine(open_bundle(bundle), int(one * 2.5), 64)
    for k in range(5):
        small.generate(small.tokenizer.encode(f"conversation {k}: " + "x" * 40), Sampling(max_tokens=2))
        assert small.held.nbytes <= int(one * 2.5)
    assert len(small.held) == 2
    entries = list(small.held._entries.values())
    assert small.held.nbytes == sum(h.nbytes for h in entries)
    for h in entries:  # what an entry really holds, once spilled, is what it was charged
        assert h.kv is not None or h is entries[-1]
        if h.kv is not None:
            real = sum(a.nbytes for a in h.kv.values()) + h.checkpoint.nbytes() + h.logits.nbytes
            assert real == h.nbytes
    with pytest.raises(Exception, match="max_entries"):
        HeldConversations(engine.session, 1, 0)


def test_langchain_chat_openai(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=server.url + "/v1",
        api_key="none",
        model="qwen3.5-tiny",
        max_tokens=16,
        temperature=0,
        max_retries=0,
        timeout=60,
    )
    got = llm.invoke("def area(r):")
    r = client(server).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "def area(r):"}], max_tokens=16, temperature=0
    )
    assert got.content == r.choices[0].message.content and got.content
    assert got.usage_metadata["input_tokens"] == r.usage.prompt_tokens


BAD = [
    ("not json", 400, None),
    ("[1, 2]", 400, None),
    ({"model": "m"}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10_000}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 9}, 400, "stop"),
    (
        {
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
        },
        400,
        "messages.0.content",
    ),
    (
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "1f"}}]},
        400,
        "tools",
    ),
    (
        {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
        400,
        "response_format.json_schema",
    ),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, 400, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": "y" * 600}]}, 400, "messages"),  # over the context
]


@pytest.mark.parametrize("body, status, param", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_requests_get_an_openai_error(server, body, status, param):
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(
        server.url + "/v1/chat/completions", content=data, timeout=30, headers={"content-type": "application/json"}
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error" and "Traceback" not in r.text
    assert err["param"] == param
    if param == "tools":
        assert "function name '1f'" in err["message"]


def test_the_server_keeps_serving_after_bad_requests(server):
    url = server.url
    assert httpx.post(url + "/v1/chat/completions", content=b"x" * (5 << 20), timeout=30).status_code == 413
    assert httpx.get(url + "/v1/nothing", timeout=30).status_code == 404
    assert httpx.get(url + "/v1/chat/completions", timeout=30).status_code == 405
    assert httpx.post(url + "/v1/completions", json={"prompt": [10**9]}, timeout=30).status_code == 400
    r = httpx.post(
        url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}, timeout=30
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(url + "/health", timeout=30).json()["status"] == "ok"


def _health(server) -> dict:
    return httpx.get(server.url + "/health", timeout=30).json()


def test_a_client_that_leaves_mid_stream_stops_decoding(server):
    before = _health(server)
    body = {"prompt": "def main():\n", "max_tokens": 480, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break  # one piece of text, then the client goes away
    end = time.monotonic() + 30
    while (h := _health(server))["requests"] == before["requests"] and time.monotonic() < end:
        time.sleep(0.05)
    assert h["pending"] == 0 and h["cancelled"] == before["cancelled"] + 1
    assert h["completion_tokens"] - before["completion_tokens"] < 480  # it stopped decoding
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200


def test_a_client_that_leaves_a_plain_request_stops_it(server):
    before = _health(server)
    body = {"prompt": "def main():\n", "max_tokens": 480, "temperature": 0}
    with pytest.raises(httpx.TimeoutException):  # the client gives up (and closes its connection) mid-decode
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.3)
    end = time.monotonic() + 30
    while (h := _health(server))["requests"] == before["requests"] and time.monotonic() < end:
        time.sleep(0.05)
    assert h["pending"] == 0 and h["cancelled"] == before["cancelled"] + 1
    assert h["completion_tokens"] - before["completion_tokens"] < 480


def test_sixteen_concurrent_clients(server, fresh):
    c = client(server)
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def one(k: int) -> None:
        try:
            messages = [{"role": "user", "content": f"def client_{k}():"}]
            r = c.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0)
            results[k] = r.choices[0].message.content
        except BaseException as e:  # reported below
            errors.append(e)

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and sorted(results) == list(range(16)) and time.monotonic() - t0 < 120
    for k in (0, 15):  # each answer is its own prompt's, whatever ran between
        prompt, _ = fresh[1].render([{"role": "user", "content": f"def client_{k}():"}], {})
        assert results[k] == fresh_reply(fresh, prompt, 8)
    assert _health(server)["held_bytes"] <= 2 << 30


def test_api_key_and_a_full_queue(bundle):
    with ServerThread(open_bundle(bundle), ServeOptions(port=0, api_key="sekret", max_queue=1)) as s:
        body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
        r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(s.url + "/v1/models", headers={"authorization": "Bearer nope"}, timeout=30).status_code == 401
        auth = {"authorization": "Bearer sekret"}
        assert httpx.post(s.url + "/v1/chat/completions", json=body, headers=auth, timeout=30).status_code == 200
        long = {"prompt": "def main():\n", "max_tokens": 480, "temperature": 0, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=long, headers=auth, timeout=60) as busy:
            lines = busy.iter_lines()  # kept: a dropped iterator closes the response, and the request is cancelled
            next(lines)  # it is running: the one slot is taken
            r = httpx.post(s.url + "/v1/chat/completions", json=body, headers=auth, timeout=30)
            assert r.status_code == 503 and r.headers["retry-after"] == "2"
            assert r.json()["error"]["type"] == "server_busy"
        end = time.monotonic() + 30
        while s.served.scheduler.pending and time.monotonic() < end:
            time.sleep(0.05)
        assert httpx.post(s.url + "/v1/chat/completions", json=body, headers=auth, timeout=30).status_code == 200


# ---- response_format: structured output through deltaship/constrain -------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
SCHEMAS = [
    PERSON,
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "kind": {"enum": ["cat", "dog"]},
            "pos": {"type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}], "items": False},
            "note": {"anyOf": [{"type": "null"}, {"type": "string", "pattern": "^[a-z]{1,6}$"}]},
        },
        "required": ["kind", "pos", "note"],
        "additionalProperties": False,
    },
    {
        "$defs": {"leaf": {"type": "integer", "minimum": -5, "maximum": 5}},
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/leaf"}, "y": {"$ref": "#/$defs/leaf"}},
        "required": ["x"],
        "additionalProperties": False,
    },  # fmt: skip
]
STRUCTURED = [{"role": "system", "content": "Answer in JSON."}, {"role": "user", "content": "Describe a pet."}]


def json_schema_format(schema: dict, name: str = "reply") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def random_server(tmp_path_factory):
    """A random-weights bundle (the suite's base config, the presets' byte-level tokenizer, the tiny preset's chat
    template passed in): its logits are noise, so only the constraint can make its replies valid."""
    from helpers import write_checkpoint

    from deltaship.compile import export
    from deltaship.models.presets import TINY_SPECIAL_TOKENS, get_preset, write_tiny_tokenizer

    root = tmp_path_factory.mktemp("serve-random")
    eos = TINY_SPECIAL_TOKENS["<|endoftext|>"]
    ckpt = write_checkpoint("base", root / "ckpt", seed=5, vocab_size=272, eos_token_id=eos)
    write_tiny_tokenizer(ckpt)
    out = root / "bundle"
    export(str(ckpt), out, target="onnx", precision="fp32", max_context=CONTEXT, verify=False, progress=False)
    template = get_preset("qwen3.5-tiny").chat_template()
    with ServerThread(open_bundle(out), ServeOptions(port=0), template=template) as s:
        yield s


def _whole_and_streamed(c, **kw) -> tuple:
    whole = c.chat.completions.create(model="m", messages=STRUCTURED, **kw)
    chunks = list(
        c.chat.completions.create(
            model="m", messages=STRUCTURED, stream=True, stream_options={"include_usage": True}, **kw
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    reason = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
    return whole, text, reason, chunks[-1].usage


@pytest.mark.parametrize("k", range(len(SCHEMAS)), ids=[f"schema{k}" for k in range(len(SCHEMAS))])
def test_json_schema_replies_validate(server, fresh, k):
    """Greedy and sampled, whole and streamed: the reply is JSON that validates, the streamed text is the whole
    text, the second (streamed) request reuses the whole prompt (the held prefix is the prompt, not the reply), and
    a sampled reply after that restore is what a fresh session's constrained decoding gives with the same seed."""
    c = client(server)
    schema = SCHEMAS[k]
    prompt, _ = fresh[1].render(STRUCTURED, {"enable_thinking": False})  # a constrained reply is not a think block
    for temperature, seed in ((0.0, None), (1.0, 7 + k)):
        fmt = json_schema_format(schema)
        whole, streamed, reason, use = _whole_and_streamed(
            c, response_format=fmt, max_tokens=160, temperature=temperature, seed=seed
        )
        text = whole.choices[0].message.content
        jsonschema.validate(json.loads(text), schema)
        assert whole.choices[0].finish_reason == reason == "stop"
        assert streamed == text, (streamed, text)
        assert whole.usage.prompt_tokens == len(prompt) and use.prompt_tokens_details.cached_tokens == len(prompt)
        if temperature:
            constraint = constraint_for({"response_format": fmt})
            want = fresh[1].generate(prompt, Sampling(160, temperature, 1.0, seed), guide=fresh[1].guide(constraint))
            assert text == want.text


def test_json_schema_replies_validate_on_random_weights(random_server):
    c = client(random_server)
    for k, schema in enumerate(SCHEMAS):
        for temperature, seed in ((0.0, None), (1.0, k), (1.0, 10 + k)):
            whole, streamed, reason, _ = _whole_and_streamed(
                c, response_format=json_schema_format(schema), max_tokens=200, temperature=temperature, seed=seed
            )
            text = whole.choices[0].message.content
            assert whole.choices[0].finish_reason == reason == "stop" and streamed == text, (text, streamed)
            jsonschema.validate(json.loads(text), schema)
    r = c.chat.completions.create(
        model="m", messages=STRUCTURED, response_format={"type": "json_object"}, max_tokens=200, temperature=1, seed=1
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # noise may write a long object: a prefix of one
        assert r.choices[0].message.content.startswith("{")


def test_json_object_and_a_budget_that_ends_mid_structure(server):
    c = client(server)
    r = c.chat.completions.create(
        model="m", messages=STRUCTURED, response_format={"type": "json_object"}, max_tokens=64, temperature=1, seed=3
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict) and r.choices[0].finish_reason == "stop"
    whole, streamed, reason, _ = _whole_and_streamed(
        c, response_format=json_schema_format(PERSON), max_tokens=5, temperature=0
    )
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == reason == "length" and streamed == text
    assert text.startswith('{"') and whole.usage.completion_tokens == 5  # a prefix of the structure
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    plain = c.completions.create(
        model="m",
        prompt="x = ",
        extra_body={"response_format": json_schema_format(SCHEMAS[1])},
        max_tokens=16,
        temperature=0,
    )
    jsonschema.validate(json.loads(plain.choices[0].text), SCHEMAS[1])  # /v1/completions takes it too


def test_openai_parse_with_a_pydantic_model(server):
    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        name: str = Field(max_length=10)
        legs: int = Field(ge=0, le=8)
        kind: Literal["cat", "dog", "fish"]

    c = client(server)
    parse = getattr(c.chat.completions, "parse", None) or c.beta.chat.completions.parse
    r = parse(model="m", messages=STRUCTURED, response_format=Pet, max_tokens=96, temperature=0)
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and r.choices[0].finish_reason == "stop"


def test_langchain_structured_output(server):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Answer(BaseModel):
        ok: bool
        score: int = Field(ge=0, le=9)

    llm = ChatOpenAI(
        base_url=server.url + "/v1", api_key="none", model="m", max_tokens=48, temperature=0, max_retries=0, timeout=60
    )
    got = llm.with_structured_output(Answer, method="json_schema").invoke("Grade this.")
    assert isinstance(got, Answer)


DEEP = {"type": "object", "properties": {"a": {}}}
node = DEEP["properties"]["a"]
for _ in range(80):
    node["type"], node["properties"] = "object", {"a": {}}
    node = node["properties"]["a"]
BAD_FORMATS = [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "intger"}}}, "invalid schema at /type"),
    (
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}},
        "unsupported keyword(s) uniqueItems (at /uniqueItems)",
    ),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "/etc/passwd"}}, "not str"),  # never a path
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP}}, "nested deeper than 64 levels"),
    ({"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": {}}}, "json_schema.name"),
    ({"type": "xml"}, "use 'text', 'json_object' or 'json_schema'"),
    ("json", "an object with a `type`"),
]


@pytest.mark.parametrize("fmt, says", BAD_FORMATS, ids=[f"badformat{i}" for i in range(len(BAD_FORMATS))])
def test_a_bad_response_format_is_a_400_naming_it(server, fmt, says):
    body = {"messages": [{"role": "user", "content": "x"}], "response_format": fmt, "max_tokens": 4}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert says in err["message"] and err["param"].startswith("response_format"), err
    assert err["type"] == "invalid_request_error" and "Traceback" not in r.text


def test_structured_output_refusals_and_deep_bodies(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError, match="enable_thinking"):
        c.chat.completions.create(
            model="m",
            messages=STRUCTURED,
            response_format={"type": "json_object"},
            extra_body={"chat_template_kwargs": {"enable_thinking": True}},
        )
    deep = '{"messages": [{"role": "user", "content": "x"}], "response_format": ' + "[" * 100_000 + "]" * 100_000 + "}"
    r = httpx.post(server.url + "/v1/chat/completions", content=deep, timeout=30)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    assert _health(server)["status"] == "ok"


def test_a_tokenizer_without_its_json_cannot_drive_a_constraint(fresh, monkeypatch):
    from deltaship.errors import DeltashipError

    engine = fresh[1]
    constraint = constraint_for({"response_format": {"type": "json_object"}})
    assert engine.guide(constraint).allowed().any()
    monkeypatch.setattr(engine, "tokenizer", object())  # a preset's tokenizer object, as a bench may pass
    with pytest.raises(DeltashipError, match="no tokenizer.json"):
        engine.guide(constraint)


# ---- tools -----------------------------------------------------------------------------------------------------
TOOL_CONTEXT = 4096  # the tools block is ~1,300 bytes of instructions, a token each with the byte-level tokenizer
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
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
PAINT = {
    "type": "function",
    "function": {
        "name": "paint",
        "parameters": {
            "type": "object",
            "properties": {
                "color": {"type": "string", "enum": ["red", "green", "blue"]},
                "layers": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
                "at": {
                    "type": "object",
                    "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 9}},
                    "required": ["k"],
                    "additionalProperties": False,
                },
            },
            "required": ["color", "at"],
        },
    },
}
TOOL_LISTS = [[WEATHER], [WEATHER, NOW], [PAINT, NOW]]
ASK = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "Go."}]
TOOL_BUDGET = 400  # above 4 calls (constrain's MAX_CALLS) of the longest of these functions


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    """random_server's random weights, with the context a tools block needs."""
    from helpers import write_checkpoint

    from deltaship.compile import export
    from deltaship.models.presets import TINY_SPECIAL_TOKENS, get_preset, write_tiny_tokenizer

    root = tmp_path_factory.mktemp("serve-tools")
    eos = TINY_SPECIAL_TOKENS["<|endoftext|>"]
    ckpt = write_checkpoint("base", root / "ckpt", seed=11, vocab_size=272, eos_token_id=eos)
    write_tiny_tokenizer(ckpt)
    out = root / "bundle"
    export(str(ckpt), out, target="onnx", precision="fp32", max_context=TOOL_CONTEXT, prefill_chunk=64,
           verify=False, progress=False)  # fmt: skip
    template = get_preset("qwen3.5-tiny").chat_template()
    with ServerThread(open_bundle(out), ServeOptions(port=0), template=template) as s:
        yield s


def _check_calls(calls, tools: list[dict], only: str | None = None) -> list[tuple[str, dict]]:
    """Every call is OpenAI's shape, names a declared function (`only`, if given) and its arguments (a JSON
    string) validate against that function's parameters; returns (name, arguments) of each."""
    by_name = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in tools}
    assert calls, "no call"
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call-")
        name, args = call.function.name, json.loads(call.function.arguments)
        assert name in by_name and (only is None or name == only), name
        jsonschema.validate(args, by_name[name])
        out.append((name, args))
    return out


def _tools_whole_and_streamed(c, messages, **kw):
    whole = c.chat.completions.create(model="m", messages=messages, **kw, extra_body=NO_THINK)
    chunks = list(c.chat.completions.create(model="m", messages=messages, stream=True, **kw, extra_body=NO_THINK))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    reason = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
    return whole, content, calls, reason


def test_required_tool_calls_parse_and_validate(tool_server):
    """On random weights only the call grammar makes a call: a few tool lists, greedy and sampled, whole and
    streamed (the same calls; never a part of one as content)."""
    c = client(tool_server)
    for k, tools in enumerate(TOOL_LISTS):
        for temperature, seed in ((0.0, None), (1.0, k)):
            whole, content, calls, reason = _tools_whole_and_streamed(
                c, ASK, tools=tools, tool_choice="required", max_tokens=TOOL_BUDGET, temperature=temperature, seed=seed
            )
            choice = whole.choices[0]
            assert choice.finish_reason == reason == "tool_calls" and choice.message.content is None
            assert content == "" and [x.index for x in calls] == list(range(len(calls)))
            assert _check_calls(choice.message.tool_calls, tools) == _check_calls(calls, tools)


def test_a_named_function_is_forced_and_none_gives_no_call(tool_server):
    c = client(tool_server)
    tools = [WEATHER, NOW]
    for seed in range(2):
        choice = {"type": "function", "function": {"name": "now"}}
        whole, content, calls, reason = _tools_whole_and_streamed(
            c, ASK, tools=tools, tool_choice=choice, max_tokens=TOOL_BUDGET, temperature=1.0, seed=seed
        )
        assert whole.choices[0].finish_reason == reason == "tool_calls"
        _check_calls(whole.choices[0].message.tool_calls, tools, only="now")
        _check_calls(calls, tools, only="now")
    whole, content, calls, reason = _tools_whole_and_streamed(
        c, ASK, tools=tools, tool_choice="none", max_tokens=40, temperature=1.0, seed=3
    )
    text = whole.choices[0].message.content
    assert whole.choices[0].message.tool_calls is None and calls == [] and "<tool_call>" not in text
    assert whole.choices[0].finish_reason == reason != "tool_calls" and content == text
    whole, content, calls, reason = _tools_whole_and_streamed(  # auto: text, held back only while it may be a call
        c, ASK, tools=tools, max_tokens=40, temperature=1.0, seed=5
    )
    assert whole.choices[0].message.tool_calls is None and calls == [] and content == whole.choices[0].message.content
    # thinking on (the template's default): the reply opens inside <think>, the grammar applies after it
    r = c.chat.completions.create(model="m", messages=ASK, tools=tools, tool_choice="required", max_tokens=40, seed=1)
    assert r.choices[0].finish_reason == "length" and "<tool_call>" not in r.choices[0].message.content


def test_a_tool_loop_reuses_the_held_prompt(tool_server):
    """call -> tool message -> answer: the second request's prompt (with the assistant's call and the tool's result
    rendered by the template) extends the first's, whose held state covers all of it but the generation prompt's
    empty think block the template drops from a past reply."""
    c = client(tool_server)
    tools = [WEATHER, NOW]
    first = c.chat.completions.create(
        model="m", messages=ASK, tools=tools, tool_choice="required", max_tokens=TOOL_BUDGET, seed=2, temperature=1,
        extra_body=NO_THINK,
    )  # fmt: skip
    message = first.choices[0].message
    _check_calls(message.tool_calls, tools)
    history = ASK + [message.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": t.id, "content": json.dumps({"ok": i})}
                for i, t in enumerate(message.tool_calls)]  # fmt: skip
    second = c.chat.completions.create(
        model="m", messages=history, tools=tools, max_tokens=24, seed=4, temperature=1, extra_body=NO_THINK
    )
    engine = tool_server.served.engine
    kwargs = {"tools": tools, "enable_thinking": False}
    p1, marks = engine.render(ASK, kwargs)
    p2, _ = engine.render(engine_messages(history), kwargs)
    shared = common_prefix(p1, p2)  # all of p1 but its generation prompt's "<think>\n\n</think>\n\n" (19 bytes)
    assert len(p1) - 19 < shared < len(p1) and second.usage.prompt_tokens == len(p2)
    held = max(m for m in marks if m <= shared)  # where the next turn's rendering leaves p1
    assert len(p1) - 19 <= held and second.usage.prompt_tokens_details.cached_tokens == held
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # no call answered twice, none made up
    bad = history + [{"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "again"}]
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        c.chat.completions.create(model="m", messages=bad, tools=tools, max_tokens=4)


def engine_messages(history: list[dict]) -> list[dict]:
    from deltaship.serve.api import ChatRequest, messages_for_template

    return messages_for_template(ChatRequest.model_validate({"messages": history}))


def test_langchain_bind_tools(tool_server):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Paint(BaseModel):
        """Paint a wall."""

        color: Literal["red", "green", "blue"]
        coats: int = Field(ge=1, le=3)

    llm = ChatOpenAI(
        base_url=tool_server.url + "/v1", api_key="none", model="m", max_tokens=TOOL_BUDGET, temperature=1,
        seed=1, max_retries=0, timeout=60, extra_body=NO_THINK,
    )  # fmt: skip
    got = llm.bind_tools([Paint], tool_choice="required").invoke("Paint it.")
    assert got.tool_calls and all(t["name"] == "Paint" for t in got.tool_calls)
    for t in got.tool_calls:
        Paint.model_validate(t["args"])
        jsonschema.validate(t["args"], Paint.model_json_schema())


@pytest.mark.parametrize(
    "extra, param, says",
    [
        ({"tools": [{"type": "function"}]}, "tools", "is not"),
        ({"tools": [NOW, NOW]}, "tools", "declared twice"),
        ({"tools": {"type": "function"}}, "tools", "array"),
        ({"tools": [NOW], "tool_choice": {"type": "function", "function": {"name": "weather"}}}, "tool_choice",
         "not declared"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [NOW], "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
        ({"tools": [NOW], "response_format": {"type": "json_object"}}, "response_format", "cannot be combined"),
        ({"functions": [NOW["function"]]}, "functions", "legacy"),
    ],
    ids=lambda x: x if isinstance(x, str) and x in ("tools", "tool_choice", "response_format", "functions") else None,
)  # fmt: skip
def test_bad_tool_requests_are_a_400(server, extra, param, says):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **extra}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"] and err["type"] == "invalid_request_error", err


def test_a_tool_message_must_answer_a_call(tool_server):
    server = tool_server
    call = {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    for messages, param in (
        (base + [{"role": "tool", "tool_call_id": "c2", "content": "1"}], "messages.2.tool_call_id"),
        (base + [{"role": "tool", "content": "1"}], "messages.2.tool_call_id"),
        ([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c1", "content": "1"}],
         "messages.1.tool_call_id"),
        ([base[0], dict(base[1], tool_calls=[dict(call, function={"name": "now", "arguments": "[1"})])],
         "messages.1.tool_calls.0.function.arguments"),
    ):  # fmt: skip
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "tools": [NOW]}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "tools": [NOW]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    ok = base + [{"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    r = httpx.post(
        server.url + "/v1/chat/completions", json={"messages": ok, "tools": [NOW], "max_tokens": 2}, timeout=30
    )
    assert r.status_code == 200, r.text
