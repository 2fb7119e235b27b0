"""iOS / macOS kit: a Swift package that runs a Core ML bundle (prefill/decode functions, one MLState).

The driver (templates/DeltashipModel.swift) is the same for every bundle; KitSpec.swift is generated
from the manifest: per .mlpackage part its input, position, output, the io-states carried from
`present_*` outputs to `past_*` inputs and the MLStates, with shapes and dtypes. `parse_kit_spec`
reads those names back out of the Swift text, so a check can compare the code with the artifact.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

from deltaship.apps import kit_name
from deltaship.apps.swift_speculative import parse as parse_speculative
from deltaship.apps.swift_speculative import render as render_speculative
from deltaship.apps.swift_speculative import speculative_spec
from deltaship.chat.pieces import KIT_FIELDS, bundle_pieces, kit_fields
from deltaship.errors import DeltashipError
from deltaship.targets import on_platform

TEMPLATES = Path(__file__).parent / "templates"
SWIFT_TRANSFORMERS = ("https://github.com/huggingface/swift-transformers.git", "1.3.0")
_DTYPES = {"int32": "int32", "float32": "float32", "float16": "float16"}  # manifest -> MLMultiArrayDataType
T = -1  # the call's token count in a Swift shape
DRIVERS = ("DeltashipModel.swift", "DeltashipSpeculative.swift")  # templates copied as they are
CHAT_DRIVER = "DeltashipChat.swift"  # copied too when the bundle has a chat template


def kit_spec(manifest: dict[str, Any], bundle: Path | None = None) -> dict[str, Any]:
    """What the Swift code names, from the manifest: functions, chunk, context, eos, per part the features, every
    state as checkpoints and saved sessions see it, and (with `bundle`) the chat template's pieces."""
    runs = on_platform("ios")
    if manifest.get("target") not in {t.name for t in runs}:
        raise DeltashipError(
            f"the Swift kit runs {' or '.join(t.title or t.name for t in runs)} bundles, not {manifest.get('target')}",
            "export with " + " or ".join(f"--target {t.name}" for t in runs),
        )
    lowering = manifest["lowering"]
    funcs = list(lowering["functions"])
    if sorted(funcs) != ["decode", "prefill"]:
        raise DeltashipError(
            f"Core ML bundle functions {funcs}: this kit drives 'prefill' and 'decode'",
            "re-export the bundle with this deltaship version",
        )
    inputs = {i["kind"]: i for i in manifest["inputs"]}
    logits = next(o for o in manifest["outputs"] if o["kind"] == "logits")
    hidden = lowering["hidden_states"]
    states = {s["name"]: s for s in manifest["states"]}

    def shape(s: list) -> list[int]:
        return [T if isinstance(d, str) else int(d) for d in s]

    def feature(name: str, shp: list, dtype: str) -> dict:
        if dtype not in _DTYPES:
            raise DeltashipError(f"{name}: dtype {dtype} has no MLMultiArray type", "re-export the bundle")
        return {"name": name, "shape": shape(shp), "dtype": dtype}

    parts = []
    for p in lowering["parts"]:
        first, last = p["input"] == "input_ids", p["output"] == "logits"
        tokens_in = inputs["tokens"]
        inp = (
            feature(p["input"], tokens_in["shape"], tokens_in["dtype"])
            if first
            else feature(p["input"], hidden["shape"], hidden["dtype"])
        )
        out = (
            feature(p["output"], logits["shape"], logits["dtype"])
            if last
            else feature(p["output"], hidden["shape"], hidden["dtype"])
        )
        pos = inputs["position"]
        io, ml = [], []
        for n in p["states"]:
            s = states[n]
            if s["mode"] == "io":
                io.append(
                    {
                        "input": s["coreml_input"],
                        "output": s["coreml_output"],
                        "shape": shape(s["shape"]),
                        "dtype": s["dtype"],
                    }
                )
            else:
                ml.append(feature(s["coreml_input"], s["shape"], s["dtype"]))
        # the compiled-model cache is keyed by every file of the package (program and weights)
        files = sorted(
            (k, v.get("sha256", "")) for k, v in manifest.get("files", {}).items() if k.startswith(p["package"] + "/")
        )
        key = hashlib.sha256(json.dumps(files).encode()).hexdigest()[:16]
        parts.append(
            {
                "package": p["package"],
                "cache_key": f"sha256-{key}",
                "input": inp,
                "position": feature(pos["name"], pos["shape"], pos["dtype"]),
                "output": out,
                "io_states": io,
                "ml_states": ml,
            }
        )
    return {
        "functions": {"prefill": "prefill", "decode": "decode"},
        "prefill_chunk": int(lowering["functions"]["prefill"]["tokens"]),
        "max_context": int(manifest["max_context"]),
        "eos_token_ids": sorted(int(t) for t in manifest["tokens"]["eos"]),
        "parts": parts,
        "speculative": speculative_spec(manifest, parts, feature),
        "session_states": session_states(manifest),
        "chat": chat_spec(bundle, manifest) if bundle is not None else None,
    }


def session_states(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Every state as DeltashipChat.swift's checkpoints and saved sessions see it: its manifest name (the saved
    session's `state/<name>`), the part and Core ML feature holding it, whether a checkpoint copies it (DeltaNet),
    and its layout in a saved session, which is deltaship's Core ML session's (Python and Swift files are one
    format): io states float32 whatever the package's type, MLStates float16, a KV cache cut to the position along
    its first axis of the context's length."""
    part_of = {n: i for i, p in enumerate(manifest["lowering"]["parts"]) for n in p["states"]}
    context = int(manifest["max_context"])
    out = []
    for s in manifest["states"]:
        shape = [int(d) for d in s["shape"]]
        kv = str(s["kind"]).startswith("kv_cache")
        axis = next((a for a in range(1, len(shape)) if shape[a] == context), None) if kv else None
        if kv and axis is None:
            raise DeltashipError(
                f"state {s['name']} {shape} has no axis of the max context ({context})", "re-export the bundle"
            )
        if s["dtype"] not in _DTYPES:
            raise DeltashipError(f"{s['name']}: dtype {s['dtype']} has no MLMultiArray type", "re-export the bundle")
        io = s["mode"] == "io"
        out.append(
            {
                "name": s["name"],
                "part": part_of[s["name"]],
                "feature": s["coreml_input"],
                "in_ml_state": not io,
                "checkpoint": str(s["kind"]).startswith("deltanet"),
                "shape": shape,
                "dtype": s["dtype"],
                "file_dtype": "float32" if io else "float16",
                "sequence_axis": axis,
            }
        )
    return out


def chat_spec(bundle: Path, manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The chat template's per-role pieces (deltaship/chat/pieces.py, refused when it has no such form), the stop
    ids and the shipped prompt cache's file; None when the bundle has no chat template (no DeltashipChat.swift)."""
    chat = bundle_pieces(bundle, manifest)
    if chat is None:
        return None
    cache = chat["prompt_cache"]
    return {
        "pieces": chat["pieces"],
        "stop_ids": chat["stop_ids"],
        "prompt_cache_file": cache["file"] if cache else None,
    }


def _shape(s: list[int]) -> str:
    return "[" + ", ".join(str(d) for d in s) + "]"


def _feature(f: dict) -> str:
    return f'Feature(name: "{f["name"]}", shape: {_shape(f["shape"])}, dataType: .{_DTYPES[f["dtype"]]})'


def _iostate(s: dict) -> str:
    return (
        f'IOState(input: "{s["input"]}", output: "{s["output"]}", shape: {_shape(s["shape"])}, '
        f"dataType: .{_DTYPES[s['dtype']]})"
    )


def render_kit_spec(spec: dict[str, Any]) -> str:
    """KitSpec.swift: the bundle's names, shapes and dtypes as one Swift table."""
    lines = [
        "// Generated by deltaship from manifest.json; kit.json records the same names.",
        "// -1 in a shape is the call's token count (prefillChunk for prefill, 1 for decode).",
        "import CoreML",
        "",
        "enum KitSpec {",
        f'    static let prefillFunction = "{spec["functions"]["prefill"]}"',
        f'    static let decodeFunction = "{spec["functions"]["decode"]}"',
        f"    static let prefillChunk = {spec['prefill_chunk']}",
        f"    static let maxContext = {spec['max_context']}",
        f"    static let eosTokenIds: Set<Int> = {_shape(spec['eos_token_ids'])}",
        "    static let parts: [PartSpec] = [",
    ]
    for p in spec["parts"]:
        lines += [
            "        PartSpec(",
            f'            package: "{p["package"]}",',
            f'            cacheKey: "{p["cache_key"]}",',
            f"            input: {_feature(p['input'])},",
            f"            position: {_feature(p['position'])},",
            f"            output: {_feature(p['output'])},",
            "            ioStates: [",
        ]
        lines += [f"                {_iostate(s)}," for s in p["io_states"]]
        lines += ["            ],", "            mlStates: ["]
        lines += [f"                {_feature(s)}," for s in p["ml_states"]]
        lines += ["            ]", "        ),"]
    lines += ["    ]"]
    lines += render_speculative(spec["speculative"], _feature, _iostate)
    lines += _render_session_states(spec["session_states"])
    lines += _render_chat(spec.get("chat"))
    lines += ["}", ""]
    return "\n".join(lines)


def _render_session_states(states: list[dict[str, Any]]) -> list[str]:
    lines = [
        "    // every state as checkpoints (checkpoint: true, the DeltaNet states) and saved sessions see it; a saved",
        "    // session holds fileDataType, a KV cache cut to the position along sequenceAxis (deltaship's layout)",
        "    static let sessionStates: [SessionState] = [",
    ]
    for s in states:
        axis = "nil" if s["sequence_axis"] is None else str(s["sequence_axis"])
        lines.append(
            f'        SessionState(name: "{s["name"]}", part: {s["part"]}, feature: "{s["feature"]}", '
            f"inMLState: {str(s['in_ml_state']).lower()}, checkpoint: {str(s['checkpoint']).lower()}, "
            f"shape: {_shape(s['shape'])}, dataType: .{_DTYPES[s['dtype']]}, "
            f"fileDataType: .{_DTYPES[s['file_dtype']]}, sequenceAxis: {axis}),"
        )
    return lines + ["    ]"]


def swift_string(text: str) -> str:
    """A Swift string literal: `\\n`, `\\t`, `\\r`, `\\\\`, `\\"`, every other character outside printable ASCII
    as `\\u{X}` (so `\\(`, Swift's interpolation, never appears unescaped)."""
    out = []
    for c in text:
        if c in _NAMED_ESCAPES:
            out.append("\\" + _NAMED_ESCAPES[c])
        elif c in '"\\':
            out.append("\\" + c)
        elif " " <= c <= "~":
            out.append(c)
        else:
            out.append(f"\\u{{{ord(c):X}}}")
    return '"' + "".join(out) + '"'


_NAMED_ESCAPES = {"\n": "n", "\t": "t", "\r": "r"}
_UNNAMED = {v: k for k, v in _NAMED_ESCAPES.items()}
_SWIFT_ESCAPE = re.compile(r"\\(u\{([0-9A-Fa-f]{1,8})\}|.)")


def parse_swift_string(literal: str) -> str:
    """The text of a literal swift_string wrote."""
    body = literal[1:-1]

    def one(m: re.Match) -> str:
        return chr(int(m.group(2), 16)) if m.group(2) else _UNNAMED.get(m.group(1), m.group(1))

    return _SWIFT_ESCAPE.sub(one, body)


def _render_chat(chat: dict[str, Any] | None) -> list[str]:
    if chat is None:
        return ["    static let chat: ChatPieces? = nil  // the bundle has no chat template (no DeltashipChat.swift)"]
    pieces = chat["pieces"]
    lines = [
        "    // the chat template's pieces per role (deltaship/chat/pieces.py), rendered from the bundle's template",
        "    static let chat: ChatPieces? = ChatPieces(",
    ]
    lines += [f"        {name}: {swift_string(value)}," for name, value in kit_fields(pieces)]
    cache = chat["prompt_cache_file"]
    lines += [
        f"        dropThink: {'true' if pieces['drop_think'] else 'false'},",
        f"        stopIds: {_shape(chat['stop_ids'])},",
        "        promptCacheFile: " + (swift_string(cache) if cache else "nil"),
        "    )",
    ]
    return lines


_FEATURE = re.compile(r'Feature\(name: "([^"]*)", shape: \[([-\d, ]*)\], dataType: \.(\w+)\)')
_IOSTATE = re.compile(r'IOState\(input: "([^"]*)", output: "([^"]*)", shape: \[([-\d, ]*)\], dataType: \.(\w+)\)')
_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')


def parse_kit_spec(text: str) -> dict[str, Any]:
    """The table back out of KitSpec.swift's text (the inverse of render_kit_spec)."""

    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",") if x.strip()]

    def feat(m: re.Match) -> dict:
        return {"name": m.group(1), "shape": ints(m.group(2)), "dtype": m.group(3)}

    def scalar(name: str) -> str:
        m = re.search(rf"static let {name}(?:: [^=]+)? = (.+)", text)
        if not m:
            raise DeltashipError(f"KitSpec.swift has no {name}", "regenerate the kit with `deltaship app`")
        return m.group(1).strip()

    def iost(m: re.Match) -> dict:
        return {"input": m.group(1), "output": m.group(2), "shape": ints(m.group(3)), "dtype": m.group(4)}

    # the speculative entry ends where the session states begin
    speculative = parse_speculative(text.split("static let sessionStates", 1)[0], _FEATURE, _IOSTATE, feat, iost)
    states = [
        {
            "name": m.group(1),
            "part": int(m.group(2)),
            "feature": m.group(3),
            "in_ml_state": m.group(4) == "true",
            "checkpoint": m.group(5) == "true",
            "shape": ints(m.group(6)),
            "dtype": m.group(7),
            "file_dtype": m.group(8),
            "sequence_axis": None if m.group(9) == "nil" else int(m.group(9)),
        }
        for m in _SESSION_STATE.finditer(text)
    ]
    chat = _parse_chat(text)
    text = text.split("static let speculative", 1)[0]
    parts = []
    for block in re.split(r"\n\s*PartSpec\(", text)[1:]:
        fields = {
            k: _FEATURE.search(re.search(rf"{k}: (Feature\(.*\))", block).group(1))
            for k in ("input", "position", "output")
        }
        io = block.split("ioStates: [", 1)[1].split("mlStates: [", 1)
        parts.append(
            {
                "package": re.search(r'package: "([^"]*)"', block).group(1),
                "cache_key": re.search(r'cacheKey: "([^"]*)"', block).group(1),
                **{k: feat(m) for k, m in fields.items()},
                "io_states": [iost(m) for m in _IOSTATE.finditer(io[0])],
                "ml_states": [feat(m) for m in _FEATURE.finditer(io[1])],
            }
        )
    return {
        "functions": {"prefill": json.loads(scalar("prefillFunction")), "decode": json.loads(scalar("decodeFunction"))},
        "prefill_chunk": int(scalar("prefillChunk")),
        "max_context": int(scalar("maxContext")),
        "eos_token_ids": sorted(json.loads(scalar("eosTokenIds"))),
        "parts": parts,
        "speculative": speculative,
        "session_states": states,
        "chat": chat,
    }


_SESSION_STATE = re.compile(
    r'SessionState\(name: "([^"]*)", part: (\d+), feature: "([^"]*)", inMLState: (true|false), '
    r"checkpoint: (true|false), shape: \[([-\d, ]*)\], dataType: \.(\w+), fileDataType: \.(\w+), "
    r"sequenceAxis: (nil|\d+)\)"
)


def _parse_chat(text: str) -> dict[str, Any] | None:
    m = re.search(r"static let chat: ChatPieces\? = ChatPieces\((.*?)\n    \)", text, re.S)
    if m is None:
        if "static let chat: ChatPieces? = nil" in text:
            return None
        raise DeltashipError("KitSpec.swift has no chat entry", "regenerate the kit with `deltaship app`")
    fields = dict(re.findall(r"^\s+(\w+): (.*?),?$", m.group(1), re.M))
    pieces: dict[str, Any] = {"roles": {"system": {}, "user": {}, "assistant": {}}}
    for name, path in KIT_FIELDS:
        target = pieces
        for k in path[:-1]:
            target = target[k]
        target[path[-1]] = parse_swift_string(fields[name])
    pieces["drop_think"] = fields["dropThink"] == "true"
    cache = fields["promptCacheFile"]
    return {
        "pieces": pieces,
        "stop_ids": json.loads(fields["stopIds"]),
        "prompt_cache_file": None if cache == "nil" else parse_swift_string(cache),
    }


def identifier_literals(text: str) -> set[str]:
    """String literals in Swift source that look like feature or function names (no spaces or punctuation)."""
    return {s for s in _STRING.findall(text) if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", s)}


def generate(bundle: Path, manifest: dict[str, Any], out: Path) -> dict[str, Any]:
    """Write the Swift package into `out`; returns the kit record."""
    spec = kit_spec(manifest, bundle)
    name = kit_name(manifest)
    src = out / "Sources" / name
    src.mkdir(parents=True)
    drivers = DRIVERS + ((CHAT_DRIVER,) if spec["chat"] else ())
    for template in drivers:
        shutil.copyfile(TEMPLATES / template, src / template)
    (src / "KitSpec.swift").write_text(render_kit_spec(spec))
    url, version = SWIFT_TRANSFORMERS
    (out / "Package.swift").write_text(f"""// swift-tools-version: 5.9
// Generated by deltaship for {manifest["source"]["model"]} ({manifest["precision"]} Core ML bundle).
import PackageDescription

let package = Package(
    name: "{name}",
    platforms: [.iOS(.v18), .macOS(.v15)],  // multifunction models and MLState
    products: [.library(name: "{name}", targets: ["{name}"])],
    dependencies: [.package(url: "{url}", from: "{version}")],
    targets: [.target(name: "{name}", dependencies: [.product(name: "Tokenizers", package: "swift-transformers")])]
)
""")
    (out / "README.md").write_text(readme(name, manifest, spec))
    record = {
        "target": "coreml",
        "name": name,
        "bundle": {
            "model": manifest["source"]["model"],
            "precision": manifest["precision"],
            "created": manifest.get("created"),
        },
        "files": [
            "Package.swift",
            *[f"Sources/{name}/{template}" for template in drivers],
            f"Sources/{name}/KitSpec.swift",
            "README.md",
        ],
        "swift": spec,
        "compiled_here": False,
    }
    (out / "kit.json").write_text(json.dumps({"kit": "deltaship.app", "platform": "ios", **record}, indent=2) + "\n")
    return record


def readme(name: str, manifest: dict[str, Any], spec: dict[str, Any]) -> str:
    parts = spec["parts"]
    pkgs = ", ".join(p["package"] for p in parts)
    io = sum(len(p["io_states"]) for p in parts)
    ml = sum(len(p["ml_states"]) for p in parts)
    url, version = SWIFT_TRANSFORMERS
    return f"""# {name}: {manifest["source"]["model"]} on iOS 18 / macOS 15 (Core ML)

Generated by `deltaship app BUNDLE --platform ios` from a Core ML bundle ({manifest["precision"]}; {pkgs};
prefill chunk {spec["prefill_chunk"]} tokens; context {spec["max_context"]} tokens).

**Not compiled or run by deltaship**: there is no Swift toolchain or Apple device where the kit is made.
What is checked there: every function, input, output and state name, shape and dtype in
`Sources/{name}/KitSpec.swift` against the .mlpackage's own spec (coremltools), and that the Swift
code names nothing else. Build it in Xcode 16 or later before shipping.

## Steps
1. Add the package: in Xcode, File > Add Package Dependencies > Add Local..., pick this folder (or
   `.package(path: "<path to this folder>")` in your Package.swift, product `{name}`). It depends on
   `.package(url: "{url}", from: "{version}")`, product `Tokenizers`, which Xcode fetches.
2. Copy the whole bundle directory (`manifest.json`, {pkgs}, `tokenizer.json`, `tokenizer_config.json`)
   into your app target as a **folder reference** (blue folder), e.g. `model-bundle`. Xcode copies the
   .mlpackage as it is; the kit compiles it on first launch (`MLModel.compileModel`) into Caches and
   reuses it. To skip that, compile on a Mac with `xcrun coremlcompiler compile model.mlpackage .` and put
   the `.mlmodelc` beside the package in the folder: the kit loads it first.
3. Run:

```swift
import {name}

let url = Bundle.main.url(forResource: "model-bundle", withExtension: nil)!
let model = try await DeltashipModel.load(bundle: url)          // computeUnits: .all by default
for try await piece in model.generate(prompt: "Hello", maxNewTokens: 64) {{   // greedy
    print(piece, terminator: "")
}}
// .topK(k: 40, temperature: 0.8) samples; generation continues the conversation: try await model.reset() starts over
```

## What the driver does (from the manifest)
- Loads each package twice with `MLModelConfiguration.functionName` = `"{spec["functions"]["prefill"]}"` and
  `"{spec["functions"]["decode"]}"`; both functions share the weights and one `makeState()` per package
  ({ml} Core ML state(s): the KV cache in fp16 builds; none in an fp32 build).
- `prefill` takes exactly {spec["prefill_chunk"]} tokens, `decode` exactly one: a prompt goes in full
  chunks, its remainder token by token (no padding, so the state never holds pad tokens).
- Input `position` = tokens the state already holds. {io} state(s) travel as inputs `past_*` whose values
  are the previous call's outputs `present_*` (zeros at start and on reset); these are the DeltaNet
  conv/recurrent states (and, in fp32 builds, the KV cache too). Large models come in several packages:
  the hidden states of one are the input of the next, each with its own state.
- Tokenization: swift-transformers' `AutoTokenizer.from(modelFolder:)` reads the bundle's
  `tokenizer.json` / `tokenizer_config.json`. Prompts are used as given: for a conversation use `DeltashipChat`
  (below, when the bundle has a chat template), or apply a template yourself and pass token ids to `generate(tokens:)`.
{chat_readme(spec)}{speculative_readme(spec)}
## Why not swift-transformers' `LanguageModel`
swift-transformers' `LanguageModel` / `LanguageModelWithStatefulKVCache` (Sources/Models/LanguageModel.swift)
loads one function (the default), drives it only when it has states named `keyCache` and `valueCache`
and an `inputIds` input of ranged length, passes no other inputs than `inputIds` (plus an optional
`causalMask`/`attentionMask`), no position, and reads 3-D `logits` [1, T, V]. A deltaship bundle has two
fixed-shape functions (what the Neural Engine runs well), an explicit `position`, last-token logits, and
recurrent DeltaNet states that must persist between calls. An export shaped for `LanguageModel` would have
to drop the fixed prefill chunk for a ranged input, merge every attention layer's cache into two states,
derive the position from the mask's length, and keep the DeltaNet states as extra fp16 MLStates (the only
way they could persist, since `LanguageModel` passes no state inputs); deltaship keeps them fp32 by default
because fp16 recurrent state drifts over long prompts. So the kit ships its own small driver instead.
"""


def chat_readme(spec: dict[str, Any]) -> str:
    if spec.get("chat") is None:
        return "- Chat: this bundle has no chat template (export a checkpoint that has one for `DeltashipChat`).\n"
    cache = spec["chat"]["prompt_cache_file"]
    copied = sum(s["checkpoint"] for s in spec["session_states"])
    return f"""
## Chat (DeltashipChat.swift)
The bundle's chat template is in `KitSpec.chat` as per-role pieces (rendered from it by deltaship; no Jinja on the
phone). Each turn feeds only the tokens the state lacks; a checkpoint is a copy of the {copied} DeltaNet state(s)
(io arrays, and `MLState.withMultiArray(for:)` for those in the MLState) and the position, since the KV cache only
grows; `retry` and `undo` restore one.

```swift
let chat = try await DeltashipChat(model: model, bundle: url, system: "Be brief.")
let reply = try await chat.send("Hello", maxNewTokens: 64) {{ id in }}   // text, ids, stopped, prefillTokens
_ = try await chat.retry(); try await chat.undo(); try await chat.reset()
let data = try await chat.save()            // deltaship's saved-session format (Python's Chat.load reads it)
try await chat.load(data)                   // checks the bundle's identity and every sha256 first
```
{"A chat whose system message is the shipped prompt cache's (`" + cache + "`) starts from it." if cache else ""}
"""


def speculative_readme(spec: dict[str, Any]) -> str:
    sp = spec["speculative"]
    if sp is None:
        return "- Speculative decoding: this bundle has no MTP head (export with `--mtp` for it).\n"
    verify = ", ".join(f"`{n}`" for n in sp["verify_functions"].values())
    snap = len(sp["snapshot_io_states"]) + len(sp["snapshot_ml_states"])
    return f"""
## Speculative decoding with the MTP head (greedy)
`model.generate(prompt: "Hello", maxNewTokens: 64, speculativeDepth: 2)` (greedy only) drafts 2 tokens per step
with the bundle's multi-token-prediction head (`{sp["draft_function"]}`, its own KV cache) and checks them in one
decoder call ({verify}: every row's logits and hidden states; a call runs as a sum of
them, largest first). Every emitted token is the decoder's argmax, so the tokens equal plain greedy decoding's.
Before each verify call the driver copies the {snap} DeltaNet state(s) (io arrays, and Core ML states through
`MLState.withMultiArray(for:)`); a rejected draft puts them back. It starts a new conversation;
`speculativeStats` holds the counts. The verify and draft functions are loaded (and compiled by Core ML) on
first use. Not compiled or run by deltaship.
"""
