"""Structured output (deltaship/constrain): the constraint guarantees the form on random weights, changes nothing
the unconstrained greedy would have said where it allows it (the trained tiny), composes with MTP speculation,
and refuses bad or hostile constraints before generation."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time

import jsonschema
import numpy as np
import pytest

from deltaship.commands import generate
from deltaship.constrain import build_constraint, token_table
from deltaship.errors import DeltashipError
from deltaship.models.presets import TINY_SPECIAL_TOKENS, write_tiny_tokenizer
from deltaship.runtimes.base import masked
from deltaship.runtimes.speculative import generate_speculative
from deltaship.runtimes.tokenizer import load_tokenizer
from deltaship.targets import open_bundle

EOS = TINY_SPECIAL_TOKENS["<|endoftext|>"]
CALL = r"[a-z_]{1,10}\([a-z_, ]{0,12}\):"  # a signature the trained tiny (Python source) drafts well
TINY_ONNX = dict(target="onnx", precision="fp32", mtp=True, max_context=256, prefill_chunk=16, verify=False)


@pytest.fixture(scope="module")
def tiny_onnx(shared_export):
    """The trained tiny (its MTP head too) as an ONNX bundle: tokens mean something here."""
    return shared_export("constrain-tiny-onnx", "qwen3.5-tiny", **TINY_ONNX)


@pytest.fixture(scope="module")
def random_onnx(tmp_path_factory):
    """A random-weights checkpoint (the suite's base config) with the presets' byte-level tokenizer: its logits
    are noise, so only the constraint can make its output valid."""
    from helpers import write_checkpoint

    from deltaship.compile import export

    root = tmp_path_factory.mktemp("constrain-random")
    ckpt = write_checkpoint("base", root / "ckpt", seed=11, vocab_size=272, eos_token_id=EOS)
    write_tiny_tokenizer(ckpt)
    out = root / "bundle"
    export(str(ckpt), out, target="onnx", precision="fp32", max_context=512, prefill_chunk=16, verify=False,
           progress=False)  # fmt: skip
    return out


# ---- generated schemas, each bounded with its longest compact form known --------------------------------------
def _schema(rng: random.Random, depth: int = 0) -> tuple[dict, int]:
    """(schema, the most bytes a compact JSON value valid against it takes): every leaf is bounded."""
    kinds = ["integer", "string", "boolean", "null", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-500, 50)
        hi = lo + rng.randint(0, 2000)
        return {"type": "integer", "minimum": lo, "maximum": hi}, max(len(str(lo)), len(str(hi)))
    if kind == "string":
        n = rng.randint(0, 12)
        return {"type": "string", "maxLength": n, "pattern": "^[a-z0-9 ]*$"}, n + 2
    if kind == "boolean":
        return {"type": "boolean"}, 5
    if kind == "null":
        return {"type": "null"}, 4
    if kind == "enum":
        values = rng.sample(["red", "green", "blue", 7, -3, True, None, "a b", "x"], rng.randint(1, 4))
        return {"enum": values}, max(len(json.dumps(v, separators=(",", ":"))) for v in values)
    if kind == "array":
        item, most = _schema(rng, depth + 1)
        n = rng.randint(0, 3)
        return {"type": "array", "items": item, "minItems": min(1, n), "maxItems": n}, 2 + n * most + max(n - 1, 0)
    props, longest = {}, 2
    names = rng.sample(["id", "name", "tags", "ok", "when", "n", "kind"], rng.randint(1, 4))
    for key in names:
        props[key], most = _schema(rng, depth + 1)
        longest += len(json.dumps(key)) + 1 + most + 1
    required = [k for k in names if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}, longest


SCHEMAS = [_schema(random.Random(i)) for i in range(36)]


def _validity(bundle, cases, prompt_ids, runtime_kw=None, **kw):
    """Generate once per (schema, budget) case; return (valid, truncated) counts, checking every complete one."""
    session = open_bundle(bundle, **(runtime_kw or {}))
    tok = load_tokenizer(bundle, session.manifest)
    table = token_table(tok.json_text, session.vocab_size, sorted(session.eos_ids))
    valid = truncated = 0
    for schema, longest in cases:
        guide = build_constraint(json_schema=schema).guide(table)
        session.reset()
        gen = session.generate(prompt_ids, longest + 1, guide=guide, **kw)  # + 1: the end-of-sequence token
        out = [t for t in gen.output_ids if t != EOS]
        if not guide.complete():
            truncated += 1
            continue
        jsonschema.validate(json.loads(tok.decode(out)), schema)  # raises on an invalid output
        assert gen.stopped == "eos" and len(out) <= longest, (schema, tok.decode(out))
        valid += 1
    return valid, truncated


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "top_k": 40, "top_p": 0.95}], ids=["greedy", "sampled"])
def test_random_weights_onnx_output_validates_against_every_schema(random_onnx, sampling):
    seeded = {"seed": 3} if sampling else {}
    valid, truncated = _validity(random_onnx, SCHEMAS, [1, 2, 3], **sampling, **seeded)
    assert (valid, truncated) == (len(SCHEMAS), 0)  # budgets above the longest form: nothing cut, all valid


def test_random_weights_regex_outputs_fullmatch(random_onnx):
    session = open_bundle(random_onnx)
    tok = load_tokenizer(random_onnx, session.manifest)
    table = token_table(tok.json_text, session.vocab_size, sorted(session.eos_ids))
    patterns = [r"[0-9]{3}-[0-9]{4}", r"(yes|no|maybe)", r"[A-Z][a-z]{1,5}( [A-Z][a-z]{1,5}){0,2}", r"0x[0-9a-f]{8}"]
    for seed, pattern in enumerate(patterns):
        for kw in ({}, {"temperature": 1.5, "seed": seed}):
            guide = build_constraint(regex=pattern).guide(table)
            session.reset()
            gen = session.generate([7, 8], 40, guide=guide, **kw)
            text = tok.decode([t for t in gen.output_ids if t != EOS])
            assert guide.complete() and re.fullmatch(pattern, text), (pattern, text)


def test_budget_that_ends_mid_structure_is_counted_not_valid(random_onnx):
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 4, "maxItems": 4}
    r = generate(random_onnx, input_ids=[1, 2], max_new_tokens=3, json_schema=schema)
    assert r["constraint"] == {"kind": "json_schema", "complete": False} and r["stopped"] == "length"
    with pytest.raises(ValueError):
        json.loads(r["text"])  # what came out is a prefix, and the result says so
    valid, truncated = _validity(random_onnx, [(schema, 3)], [1, 2])
    assert (valid, truncated) == (0, 1)


def test_cli_says_an_incomplete_structure_on_stderr(random_onnx, tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}))
    run = [sys.executable, "-m", "deltaship", "generate", str(random_onnx), "--input-ids", "1,2", "--json-schema",
           str(path), "--json"]  # fmt: skip
    short = subprocess.run(run + ["--max-new-tokens", "3"], capture_output=True, text=True, timeout=120)
    assert short.returncode == 0 and "before the json_schema constraint was complete" in short.stderr
    assert json.loads(short.stdout)["constraint"]["complete"] is False
    whole = subprocess.run(run + ["--max-new-tokens", "30"], capture_output=True, text=True, timeout=120)
    res = json.loads(whole.stdout)
    assert res["constraint"] == {"kind": "json_schema", "complete": True} and "constraint" not in whole.stderr
    assert res["stopped"] == "eos" and isinstance(json.loads(res["text"])["a"], int)  # the text parses as it is


# ---- on the trained tiny: the mask changes nothing else ---------------------------------------------------------
def test_mask_keeps_allowed_logits_and_only_those(tiny_onnx):
    session = open_bundle(tiny_onnx)
    tok = load_tokenizer(tiny_onnx, session.manifest)
    table = token_table(tok.json_text, session.vocab_size, sorted(session.eos_ids))
    assert token_table(tok.json_text, session.vocab_size, sorted(session.eos_ids)) is table  # built once, cached
    guide = build_constraint(regex=r"(self|cls)[,)]").guide(table)
    logits = session.prefill(tok.encode("def f("))
    for t in tok.encode("self"):
        allowed = guide.allowed()
        m = masked(logits, guide)
        assert np.array_equal(m[allowed], logits[allowed]) and np.all(np.isneginf(m[~allowed]))
        assert allowed.sum() <= 2  # s|c, then one letter each
        guide.advance(t)
        logits = session.decode(t)
    assert set(np.nonzero(guide.allowed())[0]) == {ord(","), ord(")")}  # no EOS before the structure ends


def test_constrained_greedy_equals_unconstrained_where_allowed(tiny_onnx):
    plain = generate(tiny_onnx, prompt="def ", max_new_tokens=24)
    text = plain["text"]
    assert len(set(text)) > 3  # the trained tiny says something, so the equality below is not vacuous
    # a regex that allows the unconstrained continuation (and much else): the same tokens
    loose = generate(tiny_onnx, prompt="def ", max_new_tokens=24, regex=r"[^\n]{0,10}(.|\n){0,40}")
    assert loose["output_ids"] == plain["output_ids"] and loose["constraint"]["complete"]
    # one that cuts its first word at 6 letters: the same tokens up to there, then only what the regex allows
    word = re.match(r"[a-z_]+", text).group(0)[:6]
    cut = generate(tiny_onnx, prompt="def ", max_new_tokens=24, regex=r"[a-z_]{1,6}\(")
    got = cut["text"]  # the structure's text: no end-of-text token after it
    assert got.startswith(word) and re.fullmatch(r"[a-z_]{1,6}\(", got) and cut["constraint"]["complete"]
    assert cut["output_ids"][: len(word)] == plain["output_ids"][: len(word)]


@pytest.mark.parametrize("depth", [1, 3])
def test_speculative_constrained_equals_plain_constrained(tiny_onnx, depth):
    session = open_bundle(tiny_onnx)
    tok = load_tokenizer(tiny_onnx, session.manifest)
    table = token_table(tok.json_text, session.vocab_size, sorted(session.eos_ids))
    ids = tok.encode("def ")
    cut = 0
    for schema, longest in SCHEMAS[:6]:
        c = build_constraint(json_schema=schema)
        session.reset()
        plain = session.generate(ids, longest + 1, guide=c.guide(table))
        spec, stats = generate_speculative(session, ids, longest + 1, depth, guide=c.guide(table))
        assert spec.output_ids == plain.output_ids and spec.stopped == plain.stopped, schema
        cut += stats.disallowed
        assert stats.drafted + stats.disallowed == stats.draft_calls  # one draft a call; the cut ones not verified
    assert cut > 0  # the head drafts Python into JSON: the constraint ends those runs before the verify call
    # a regex the head drafts well: drafts are accepted, and the grammar cut the disallowed ones
    c = build_constraint(regex=CALL)
    session.reset()
    plain = session.generate(ids, 40, guide=c.guide(table))
    spec, stats = generate_speculative(session, ids, 40, depth, guide=c.guide(table))
    assert spec.output_ids == plain.output_ids and stats.accepted > 0
    assert stats.as_dict()["drafts_disallowed"] == stats.disallowed


def test_speculative_sampled_constrained_output_validates(tiny_onnx):
    session = open_bundle(tiny_onnx)
    tok = load_tokenizer(tiny_onnx, session.manifest)
    table = token_table(tok.json_text, session.vocab_size, sorted(session.eos_ids))
    for i, (schema, longest) in enumerate(SCHEMAS[6:14]):
        guide = build_constraint(json_schema=schema).guide(table)
        gen, _ = generate_speculative(session, [1, 2], longest + 1, 2, temperature=1.0, seed=i, guide=guide)
        assert guide.complete(), schema
        jsonschema.validate(json.loads(tok.decode([t for t in gen.output_ids if t != EOS])), schema)


def test_cli_speculative_reports_acceptance_with_a_constraint(tiny_onnx):
    r = generate(tiny_onnx, prompt="def ", max_new_tokens=30, regex=CALL, speculative="mtp:2")
    assert r["constraint"]["complete"] and r["speculative"]["drafted"] > 0
    assert r["output_ids"] == generate(tiny_onnx, prompt="def ", max_new_tokens=30, regex=CALL)["output_ids"]


def test_grammar_file_and_api_on_load(tiny_onnx, tmp_path):
    import deltaship

    g = tmp_path / "call.lark"
    g.write_text('start: NAME "(" args? ")"\nargs: NAME ("," NAME)*\nNAME: /[a-z_]{1,12}/\n')
    r = generate(tiny_onnx, prompt="def ", max_new_tokens=60, grammar=g)
    assert r["constraint"] == {"kind": "grammar", "complete": True}
    assert re.fullmatch(r"[a-z_]{1,12}\(([a-z_]{1,12}(,[a-z_]{1,12})*)?\)", r["text"].removesuffix("<|endoftext|>"))
    model = deltaship.load(tiny_onnx)
    out = model.generate("def ", max_new_tokens=40, json_schema={"type": "array", "items": {"type": "boolean"}})
    assert isinstance(json.loads(out.removesuffix("<|endoftext|>")), list)
    with pytest.raises(DeltashipError, match="cannot be combined"):
        model.generate("def ", regex="a", grammar=g)


def test_onnx_constrained_generate_imports_no_torch(tiny_onnx):
    code = (
        "import sys; from deltaship.commands import generate; "
        f"r = generate({str(tiny_onnx)!r}, prompt='def ', max_new_tokens=20, json_schema={{'type': 'boolean'}}); "
        "assert r['constraint']['complete'], r; assert 'torch' not in sys.modules, 'torch'"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_genai_and_text_runtimes_refuse_with_the_reason(tiny_onnx):
    with pytest.raises(DeltashipError, match="onnxruntime-genai applies its own llguidance"):
        generate(tiny_onnx, prompt="def ", regex="a+", runtime="genai")
    from deltaship.commands.generate import _constraint_runtime

    with pytest.raises(DeltashipError, match="takes text and runs its own sampler"):
        _constraint_runtime("et-runner", takes_text=True)  # what generate() asks before the runner is started
    _constraint_runtime(None, takes_text=False)  # deltaship's own session: no refusal


# ---- other runtimes through the same loop -----------------------------------------------------------------------
@pytest.mark.slow
def test_executorch_output_validates(tiny_pte):
    pte = tiny_pte("fp32")
    cases = [c for c in SCHEMAS[:8] if c[1] + 6 < 128]
    assert _validity(pte, cases, [1, 2, 3]) == (len(cases), 0)
    assert _validity(pte, cases[:4], [1, 2, 3], temperature=1.0, seed=1) == (4, 0)
    kw = dict(prompt="def ", max_new_tokens=30, regex=r"[a-z_]{1,6}\(")
    r = generate(pte, **kw, speculative="mtp:2")
    assert r["constraint"]["complete"] and r["speculative"]["drafted"] > 0
    assert r["output_ids"] == generate(pte, **kw)["output_ids"]


@pytest.mark.slow
def test_coreml_evaluator_output_validates(tiny_coreml_mtp):
    """The evaluator runs op by op (about a second a token here): three short schemas and one speculative run."""
    bundle = tiny_coreml_mtp("fp32")
    small = {"type": "integer", "minimum": -99, "maximum": 40}
    cases = [({"type": "boolean"}, 5), ({"enum": ["red", 7, None]}, 5), (small, 3)]
    assert _validity(bundle, cases[:2], [1, 2, 3]) == (2, 0)
    assert _validity(bundle, cases[2:], [1, 2, 3], temperature=1.0, seed=2) == (1, 0)
    kw = dict(prompt="def ", max_new_tokens=12, regex=r"[a-z_]{1,6}\(")
    r = generate(bundle, **kw, speculative="mtp:2")
    assert r["constraint"]["complete"] and r["speculative"]["drafted"] > 0
    assert r["output_ids"] == generate(bundle, **kw)["output_ids"]


# ---- bad input: refused before generation, one line what and how -----------------------------------------------
def _refused(match: str, **kw) -> DeltashipError:
    with pytest.raises(DeltashipError, match=match) as e:
        build_constraint(**kw)
    assert e.value.fix and "\n" not in e.value.message
    return e.value


def test_bad_constraints_are_refused_with_what_and_where(tmp_path):
    _refused(r"invalid schema at /properties/a/type", json_schema={"properties": {"a": {"type": "intger"}}})
    _refused(r"invalid schema at /minimum", json_schema={"type": "integer", "minimum": "x"})
    _refused(r"unsupported keyword\(s\) uniqueItems \(at /properties/t/uniqueItems\)",
             json_schema={"properties": {"t": {"type": "array", "uniqueItems": True}}})  # fmt: skip
    _refused(r"unsupported keyword\(s\) not", json_schema={"not": {"type": "string"}})
    _refused("unclosed group", regex="a(b")
    bad = tmp_path / "bad.lark"
    bad.write_text("start: foo\n")
    _refused('unknown name: "foo"', grammar=bad)
    notjson = tmp_path / "s.json"
    notjson.write_text("{")
    _refused("not JSON", json_schema=notjson)
    _refused("cannot be combined", regex="a", json_schema={})


def test_a_grammar_that_matches_nothing_is_refused_before_generation(tiny_onnx, tmp_path):
    g = tmp_path / "none.lark"
    g.write_text("start: A\nA: /[a-z]+/ & /[0-9]+/\n")
    with pytest.raises(DeltashipError, match="matches nothing"):
        generate(tiny_onnx, prompt="def ", grammar=g)


def test_cli_refuses_bad_constraints_with_exit_2(tiny_onnx, tmp_path):
    s = tmp_path / "s.json"
    s.write_text(json.dumps({"type": "objekt"}))
    g = tmp_path / "g.lark"
    g.write_text('start: "{" "}"\n')
    for args, says in (
        (["--json-schema", str(s)], "invalid schema at /type"),
        (["--regex", "(("], "unclosed group"),
        (["--grammar", str(s)], "s.json: "),  # a JSON text is not read as a grammar
        (["--regex", "a", "--grammar", str(g)], "not allowed with argument"),
    ):
        r = subprocess.run([sys.executable, "-m", "deltaship", "generate", str(tiny_onnx), "--prompt", "x", *args],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = generate(tiny_onnx, prompt="def ", max_new_tokens=4, grammar=g)
    assert r["text"].removesuffix("<|endoftext|>") == "{}" and r["constraint"]["complete"]


def test_hostile_constraints_are_bounded(tmp_path):
    deep: dict = {"type": "array"}
    node = deep
    for _ in range(5000):
        node["items"] = {"type": "array"}
        node = node["items"]
    t0 = time.monotonic()
    _refused("nested deeper than 64", json_schema=deep)
    path = tmp_path / "deep.json"
    path.write_text('{"items":' * 100_000 + "{}" + "}" * 100_000)
    _refused("nested deeper than 64", json_schema=path)
    _refused("more than 1,048,576 bytes", json_schema={"enum": ["v" * 40 + str(i) for i in range(40_000)]})
    wide = {"anyOf": [{"properties": {f"k{j}": {"type": "integer"} for j in range(30)}} for _ in range(300)]}
    _refused("more than 2,000 subschemas", json_schema=wide)  # seconds in llguidance's compiler otherwise
    _refused("more than 10,000", regex="a" * 10_001)
    assert time.monotonic() - t0 < 20
    # what would explode a DFA or a grammar: llguidance builds its lexer lazily, each step within LIMITS' fuel
    table = _byte_table(tmp_path)
    for kw in (
        {"regex": "(a|b)*a(a|b){400}"},
        {"regex": "(x{2,300}){300}"},
        {"regex": "(" + "|".join(f"w{i}x" for i in range(1500)) + "){3}"},
        {"json_schema": {"type": "string", "pattern": "^((a|b)*a(a|b){200}){20}$"}},
        {"json_schema": {"enum": [str(i) for i in range(80_000)]}},  # 0.7 MB: the most under the size limit
    ):
        t0 = time.monotonic()
        guide = build_constraint(**kw).guide(table)
        steps = 0
        for ch in b"ab" * 50:
            if not guide.allowed()[ch]:
                break
            guide.advance(ch)
            steps += 1
        assert time.monotonic() - t0 < 5, kw
        assert steps >= 1 or not guide.allowed()[ord("a")], kw


def _byte_table(tmp_path):
    write_tiny_tokenizer(tmp_path / "tok")
    return token_table((tmp_path / "tok" / "tokenizer.json").read_text(), 272, [EOS])


def test_a_trained_bpe_tokenizer_json_drives_the_mask(tmp_path):
    """A byte-level BPE tokenizer.json as Qwen3.5's (multi-byte tokens, a `Ġ`-style byte alphabet, added special
    tokens), trained here on the package's own source: walking random allowed tokens to the end always gives a
    valid value, so llguidance's table reads the tokens' bytes right."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    import deltaship.runtimes.base as source

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=["<|endoftext|>", "<|im_start|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator([open(source.__file__, encoding="utf-8").read()] * 2, trainer)
    eos = tok.token_to_id("<|endoftext|>")
    assert tok.get_vocab_size() > 500 and max(len(t) for t in tok.get_vocab()) > 4  # merges were learned
    table = token_table(tok.to_str(), tok.get_vocab_size() + 16, [eos])  # a vocabulary padded past the tokenizer
    rng = np.random.default_rng(0)
    multi = 0
    for schema, longest in SCHEMAS[:12]:
        guide = build_constraint(json_schema=schema).guide(table)
        out: list[int] = []
        while not guide.done():
            allowed = np.nonzero(guide.allowed())[0]
            assert allowed.max() < tok.get_vocab_size()  # the padding ids are never allowed
            t = int(rng.choice(allowed))
            guide.advance(t)
            out.append(t)
            assert len(out) <= longest + 1
        text = tok.decode([t for t in out if t != eos])
        multi += sum(len(tok.id_to_token(t)) > 1 for t in out if t != eos)
        jsonschema.validate(json.loads(text), schema)
    assert multi > 0  # some steps took a multi-byte token, so the table's bytes were read, not only single bytes
