"""Android kit: Kotlin over onnxruntime-android (ONNX bundles; and onnxruntime-genai when the bundle has
genai_config.json) or over ExecuTorch's Android LLM API (ExecuTorch bundles).

The drivers (templates/kotlin/*.kt) are the same for every bundle; KitSpec.kt is generated from the
manifest: for ONNX the input/position/logits features and every past/present state pair with shapes
and dtypes, for ExecuTorch the files and the context. `parse_kit_spec` reads them back out of the
Kotlin text so a check can compare the code with the artifact.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from deltaship.apps import either, kit_name
from deltaship.chat.pieces import KIT_FIELDS, bundle_pieces, kit_fields
from deltaship.errors import DeltashipError
from deltaship.runtimes.tokenizer import load_tokenizer
from deltaship.targets import a_bundle, on_platform

TEMPLATES = Path(__file__).parent / "templates" / "kotlin"
BUNDLE_FILES = "BundleFiles.kt"  # safePath(bundleDir, name): every driver opens the bundle's files through it
CHAT_PIECES = "ChatPieces.kt"  # the class KitSpec.CHAT is, in every kit (CHAT is null without a chat template)
PACKAGE = "ai.deltaship.kit"
SOURCE_DIR = "src/main/kotlin/ai/deltaship/kit"
_DTYPES = {
    "float32": "FLOAT32",
    "float16": "FLOAT16",
    "int64": "INT64",
    "int32": "INT32",
    "int8": "INT8",  # a quantized KV cache (--kv-cache int8); int4 is two values a uint8
    "uint8": "UINT8",
}
# onnxruntime-genai is not a deltaship dependency: a bundle with genai_config.json names its version in
# manifest["tools"]; this is the release the genai path was checked with (docs: RUNTIMES.md)
GENAI_CHECKED = "0.18.0"
T = -1


def _shape(s: list) -> list[int]:
    return [T if isinstance(d, str) else int(d) for d in s]


def _dtype(name: str, dtype: str) -> str:
    if dtype not in _DTYPES:
        raise DeltashipError(f"{name}: dtype {dtype} has no Kotlin driver type", "re-export the bundle")
    return dtype


def kit_spec(bundle: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """What the Kotlin code names, from the manifest (and genai_config.json when the bundle has one)."""
    target = manifest.get("target")
    tools = manifest.get("tools", {})
    files = {"model": manifest["entry"], "tokenizer": "tokenizer.json"}
    common = {
        "target": target,
        "files": files,
        "max_context": int(manifest["max_context"]),
        "prefill_chunk": int(manifest["prefill_chunk"]),
        "eos_token_ids": sorted(int(t) for t in manifest["tokens"]["eos"]),
    }
    runs = {t.name: t.app_platforms["android"] for t in on_platform("android")}
    make = _RUNTIME_SPECS.get(runs.get(target))
    if make is None:
        raise DeltashipError(
            f"the Android kit runs {either(runs)} bundles, not {target}",
            "export with " + " or ".join(f"--target {t}" for t in runs),
        )
    return make(bundle, manifest, common, tools)


def _executorch_spec(bundle: Path, manifest: dict[str, Any], common: dict[str, Any], tools: dict[str, str]) -> dict:
    chat = _chat_spec(bundle, manifest)  # None: no chat template in the bundle (no DeltashipExecuTorchChat.kt)
    if chat is not None:  # the runner gives text pieces, not ids: the chat stops it at its stop ids' texts
        tok = load_tokenizer(bundle, manifest)
        chat["stop_texts"] = sorted({tok.decode([i]) for i in chat["stop_ids"]})
    return {**common, "runtime": "executorch", "chat": chat,
            "gradle": [f"org.pytorch:executorch-android:{tools['executorch']}"]}  # fmt: skip


def _onnx_spec(
    bundle: Path, manifest: dict[str, Any], common: dict[str, Any], tools: dict[str, str], chat: bool = True
) -> dict:
    kinds = {i["kind"]: i for i in manifest["inputs"]}
    logits = next(o for o in manifest["outputs"] if o["kind"] == "logits")

    def feature(f: dict) -> dict:
        return {"name": f["name"], "shape": _shape(f["shape"]), "dtype": _dtype(f["name"], f["dtype"])}

    spec = {
        **common,
        "runtime": "onnxruntime",
        "vocab_size": int(logits["shape"][-1]),
        "tokens": feature(kinds["tokens"]),
        # current_sequence_length [1] = start + T (with past_length: onnxruntime-genai's pair, what deltaship
        # exports), the start position [1] (kind position), or one position per token [1, T] (kind position_ids)
        "position": feature(kinds.get("current_sequence_length") or kinds.get("position") or kinds["position_ids"]),
        "past_length": feature(kinds["past_sequence_length"]) if "past_sequence_length" in kinds else None,
        # an --mtp decoder's num_logits_to_keep: fed [0] (the last row; only speculative verify asks for more)
        "keep_rows": feature(kinds["logits_to_keep"]) if "logits_to_keep" in kinds else None,
        "logits": feature(logits),
        "states": [
            {
                "input": s["name"],
                "output": s["output"],
                "shape": _shape(s["shape"]),
                "dtype": _dtype(s["name"], s["dtype"]),
                "checkpoint": str(s.get("kind", "")).startswith("deltanet"),  # what a chat turn's checkpoint copies
            }
            for s in manifest["states"]
        ],
        "chat": _chat_spec(bundle, manifest) if chat else None,  # None: no chat template (no DeltashipChat.kt)
        "gradle": [f"com.microsoft.onnxruntime:onnxruntime-android:{tools['onnxruntime']}"],
    }
    extra = set(kinds) - {
        "tokens",
        "position",
        "position_ids",
        "current_sequence_length",
        "past_sequence_length",
        "logits_to_keep",
    }
    if extra:
        raise DeltashipError(
            f"ONNX bundle inputs of kinds {sorted(extra)}: this kit feeds only tokens and position",
            "re-export the bundle with this deltaship version",
        )
    genai = Path(bundle) / "genai_config.json"
    if genai.name in manifest.get("files", {}):  # listed: read_manifest checked it is inside the bundle
        version = next((v for k, v in tools.items() if "genai" in k), GENAI_CHECKED)
        spec["files"]["genai_config"] = genai.name  # the genai driver opens it through safePath
        spec["genai"] = {
            "config": genai.name,
            "version": version,
            "gradle": f"com.microsoft.onnxruntime:onnxruntime-genai-android:{version}",
        }
    return spec


# onnxruntime-android's QNN build (Microsoft's AAR: ONNX Runtime with the QNN execution provider and Qualcomm's QNN
# libraries, libQnnHtp.so among them, in the app's native libraries): the release the kit names (docs/npu.md)
QNN_AAR = "com.microsoft.onnxruntime:onnxruntime-android-qnn:1.29.0"
QNN_HTP_LIBRARY = "libQnnHtp.so"  # backend_path: found by name in the app's native library directory
CPU_FALLBACK_KEY = "session.disable_cpu_ep_fallback"  # ONNX Runtime's session config key, set to "1"


def _qnn_spec(bundle: Path, manifest: dict[str, Any], common: dict[str, Any], tools: dict[str, str]) -> dict:
    """A qnn bundle: decode.onnx + prefill.onnx (or their EPContext models), static shapes, on the QNN HTP."""
    low = manifest.get("lowering") or {}
    graphs, soc = low.get("graphs"), low.get("soc")
    if not isinstance(graphs, dict) or "decode" not in graphs or not isinstance(soc, dict):
        raise DeltashipError(
            f"{bundle}: the manifest names no QNN graphs (lowering.graphs.decode) or SoC (lowering.soc)",
            "export the bundle again with --target qnn",
        )
    context = low.get("context") or {}  # --qnn-context: the graphs compiled for the SoC, what the app opens

    def model(key: str) -> str:
        return context[key]["model"] if key in context else graphs[key]["file"]

    spec = _onnx_spec(bundle, manifest, common, tools, chat=False)  # DeltashipChat drives DeltashipOrtModel only
    files = {"model": model("decode"), "tokenizer": common["files"]["tokenizer"]}
    if "prefill" in graphs:
        files["prefill"] = model("prefill")
    if len(context) < len(graphs):  # a graph opened from its ONNX file reads the shared weights beside it
        files["weights"] = low["weights"]["file"]
    models = {c["model"] for c in context.values()}
    binaries = sorted(f["path"] for c in context.values() for f in c["files"] if f["path"] not in models)
    options = {**{k: str(v) for k, v in (low.get("provider_options") or {}).items()}, "backend_path": QNN_HTP_LIBRARY}
    options.update(soc_model=str(soc["soc_model"]), htp_arch=str(soc["htp_arch"]))
    sdk = sorted({str(c["qnn_sdk"]) for c in context.values() if c.get("qnn_sdk")})
    spec.update(
        runtime="onnxruntime-qnn",
        files=files,
        gradle=[QNN_AAR],
        qnn={"provider_options": options, "cpu_fallback_key": CPU_FALLBACK_KEY, "context_binaries": binaries},
        soc={k: soc[k] for k in ("name", "chip", "marketing", "soc_model", "htp_arch") if k in soc},
        compiled=sorted(context),  # the graphs opened from their EPContext models
        qnn_sdk=sdk[-1] if sdk else None,  # the QNN the contexts were compiled with: the app's must be as new
    )
    for key in ("past_length", "keep_rows"):  # a qnn graph takes tokens, position and the states only
        spec.pop(key)
    return spec


# the Android runtime a target's bundles run in (Target.app_platforms["android"]) -> what the kit names for it
_RUNTIME_SPECS = {
    "onnxruntime-android": _onnx_spec,
    "executorch-android": _executorch_spec,
    "onnxruntime-android-qnn": _qnn_spec,
}


def _position_doc(spec: dict[str, Any]) -> str:
    pos, past = spec["position"], spec.get("past_length")
    if past:
        return (
            f"`{pos['name']}` ({pos['dtype']} {pos['shape']}, tokens the state holds after the call) and "
            f"`{past['name']}` ({past['dtype']} {past['shape']}, one less)"
        )
    return f"`{pos['name']}` ({pos['dtype']} {pos['shape']}, tokens the state holds)"


def render_kit_spec(spec: dict[str, Any]) -> str:
    """KitSpec.kt: the bundle's names, shapes and dtypes as one Kotlin object."""

    def arr(s: list[int]) -> str:
        return "longArrayOf(" + ", ".join(str(d) for d in s) + ")"

    def feat(f: dict) -> str:
        return f'Feature("{f["name"]}", {arr(f["shape"])}, DType.{_DTYPES[f["dtype"]]})'

    lines = [
        f"// Generated by deltaship from manifest.json ({spec['target']} bundle); kit.json records the same names.",
        f"package {PACKAGE}",
        "",
        "object KitSpec {",
        f'    const val MODEL_FILE = "{spec["files"]["model"]}"',
        f'    const val TOKENIZER_FILE = "{spec["files"]["tokenizer"]}"',
        *(
            [f'    const val GENAI_CONFIG_FILE = "{spec["files"]["genai_config"]}"']
            if "genai_config" in spec["files"]
            else []
        ),
        f"    const val MAX_CONTEXT = {spec['max_context']}",
        f"    const val PREFILL_CHUNK = {spec['prefill_chunk']}",
        "    val EOS_TOKEN_IDS = setOf(" + ", ".join(str(t) for t in spec["eos_token_ids"]) + ")",
    ]
    if spec["runtime"] == "onnxruntime":
        lines += [
            f"    const val VOCAB_SIZE = {spec['vocab_size']}",
            "    // -1 in a shape is the call's token count (1 to PREFILL_CHUNK)",
            f"    val TOKENS = {feat(spec['tokens'])}",
            "    // with PAST_LENGTH (onnxruntime-genai's pair): POSITION is current_sequence_length = start + tokens,",
            "    // PAST_LENGTH one less; without: POSITION is the start [1] or each token's position [1, -1]",
            f"    val POSITION = {feat(spec['position'])}",
            "    val PAST_LENGTH: Feature? = " + (feat(spec["past_length"]) if spec.get("past_length") else "null"),
            "    // an --mtp decoder's num_logits_to_keep, fed zeros (the last row's logits only)",
            "    val KEEP_ROWS: Feature? = " + (feat(spec["keep_rows"]) if spec.get("keep_rows") else "null"),
            f"    val LOGITS = {feat(spec['logits'])}",
            "    val STATES = listOf(",
        ]
        lines += [
            f'        StateSpec("{s["input"]}", "{s["output"]}", {arr(s["shape"])}, DType.{_DTYPES[s["dtype"]]}'
            + (", checkpoint = true" if s.get("checkpoint") else "")
            + "),"
            for s in spec["states"]
        ]
        lines += ["    )"]
    elif spec["runtime"] == "onnxruntime-qnn":
        lines += _render_qnn(spec, feat, arr)
    else:  # ExecuTorch's runner: the texts it emits for the chat's stop ids
        texts = (spec.get("chat") or {}).get("stop_texts", [])
        lines += ["    val STOP_TEXTS = setOf<String>(" + ", ".join(_kotlin_string(t) for t in texts) + ")"]
    lines += _render_chat(spec.get("chat"))
    lines += ["}", ""]
    return "\n".join(lines)


def _render_qnn(spec: dict[str, Any], feat, arr) -> list[str]:
    """KitSpec.kt's lines for a qnn bundle: the two graphs, their features and states, the QNN options."""
    q, soc = spec["qnn"], spec["soc"]
    prefill, weights = spec["files"].get("prefill"), spec["files"].get("weights")
    compiled = ", ".join(spec["compiled"]) or "none (the NPU compiles each graph when the app opens it)"
    lines = [
        "    // the prefill graph (exactly PREFILL_CHUNK tokens a call); MODEL_FILE is the decode graph (1 token a call)",
        "    val PREFILL_FILE: String? = " + (json.dumps(prefill) if prefill else "null"),
        "    // the graphs' shared weights (ONNX external data beside them); null when every graph is a compiled context",
        "    val WEIGHTS_FILE: String? = " + (json.dumps(weights) if weights else "null"),
        f"    // the QNN context binaries the EPContext models name (compiled ahead of time: {compiled})",
        "    val CONTEXT_BINARIES = listOf<String>(" + ", ".join(json.dumps(b) for b in q["context_binaries"]) + ")",
        f"    const val VOCAB_SIZE = {spec['vocab_size']}",
        "    // static shapes: -1 is the call's token count, 1 (MODEL_FILE) or PREFILL_CHUNK (PREFILL_FILE)",
        f"    val TOKENS = {feat(spec['tokens'])}",
        "    // the call's first position: the tokens the state holds",
        f"    val POSITION = {feat(spec['position'])}",
        f"    val LOGITS = {feat(spec['logits'])}",
        "    val STATES = listOf(",
        *(
            f'        StateSpec("{s["input"]}", "{s["output"]}", {arr(s["shape"])}, DType.{_DTYPES[s["dtype"]]}'
            + (", checkpoint = true" if s.get("checkpoint") else "")
            + "),"
            for s in spec["states"]
        ),
        "    )",
        f"    // QNN HTP of the {soc.get('marketing', soc.get('name'))} ({soc.get('chip')}, lowering.soc): the bundle's "
        "lowering.provider_options and backend_path, for SessionOptions.addQnn",
        "    val QNN_OPTIONS = mapOf(",
        *(f"        {json.dumps(k)} to {json.dumps(v)}," for k, v in sorted(q["provider_options"].items())),
        "    )",
        "    // ONNX Runtime's session config key, set to 1: a node the HTP refuses fails the session (no CPU fallback)",
        f"    const val DISABLE_CPU_FALLBACK = {json.dumps(q['cpu_fallback_key'])}",
    ]
    return lines


def _kotlin_string(text: str) -> str:
    """A Kotlin string literal: JSON's escapes (which Kotlin shares for these) plus `$`, Kotlin's template sign."""
    return json.dumps(text, ensure_ascii=True).replace("$", "\\$")


def _chat_spec(bundle: Path, manifest: dict[str, Any]) -> dict[str, Any] | None:
    chat = bundle_pieces(bundle, manifest)  # refuses a template per-role pieces cannot express
    if chat is None:
        return None
    cache = chat["prompt_cache"]
    return {
        "pieces": chat["pieces"],
        "stop_ids": chat["stop_ids"],
        "prompt_cache_file": cache["file"] if cache else None,
    }


def _render_chat(chat: dict[str, Any] | None) -> list[str]:
    if chat is None:
        return ["    val CHAT: ChatPieces? = null"]
    pieces = chat["pieces"]
    lines = [
        "    // the chat template's pieces per role (deltaship/chat/pieces.py), rendered from the bundle's template",
        "    val CHAT: ChatPieces? = ChatPieces(",
    ]
    lines += [f"        {name} = {_kotlin_string(value)}," for name, value in kit_fields(pieces)]
    cache = chat["prompt_cache_file"]
    lines += [
        f"        dropThink = {'true' if pieces['drop_think'] else 'false'},",
        "        stopIds = setOf(" + ", ".join(str(i) for i in chat["stop_ids"]) + "),",
        "        promptCacheFile = " + (json.dumps(cache) if cache else "null") + ",",
        "    )",
    ]
    return lines


def _parse_chat(text: str) -> dict[str, Any] | None:
    m = re.search(r"val CHAT: ChatPieces\? = ChatPieces\((.*?)\n    \)", text, re.S)
    if m is None:
        return None
    fields = dict(re.findall(r"^\s+(\w+) = (.*),$", m.group(1), re.M))
    pieces: dict[str, Any] = {"roles": {"system": {}, "user": {}, "assistant": {}}}
    for name, path in KIT_FIELDS:
        target = pieces
        for k in path[:-1]:
            target = target[k]
        target[path[-1]] = json.loads(fields[name].replace("\\$", "$"))
    pieces["drop_think"] = fields["dropThink"] == "true"
    stop = fields["stopIds"].removeprefix("setOf(").removesuffix(")")
    cache = fields["promptCacheFile"]
    return {
        "pieces": pieces,
        "stop_ids": [int(x) for x in stop.split(",") if x.strip()],
        "prompt_cache_file": None if cache == "null" else json.loads(cache),
    }


_FEATURE = re.compile(r'Feature\("([^"]*)", longArrayOf\(([-\d, ]*)\), DType\.(\w+)\)')
_STATE = re.compile(r'StateSpec\("([^"]*)", "([^"]*)", longArrayOf\(([-\d, ]*)\), DType\.(\w+)(, checkpoint = true)?\)')
_FROM_KOTLIN = {v: k for k, v in _DTYPES.items()}


def parse_kit_spec(text: str) -> dict[str, Any]:
    """KitSpec.kt's names back out of its text (the inverse of render_kit_spec, runtime-independent part)."""

    def ints(s: str) -> list[int]:
        return [int(x) for x in s.split(",") if x.strip()]

    def val(name: str) -> str | None:
        m = re.search(rf"\bval {name} = (.+)", text)
        return m.group(1).strip() if m else None

    out: dict[str, Any] = {
        "files": {"model": json.loads(val("MODEL_FILE")), "tokenizer": json.loads(val("TOKENIZER_FILE"))}
        | ({"genai_config": json.loads(val("GENAI_CONFIG_FILE"))} if val("GENAI_CONFIG_FILE") else {}),
        "max_context": int(val("MAX_CONTEXT")),
        "prefill_chunk": int(val("PREFILL_CHUNK")),
        "eos_token_ids": sorted(ints(val("EOS_TOKEN_IDS").removeprefix("setOf(").removesuffix(")"))),
    }
    if "QNN_OPTIONS" in text:  # a qnn kit: its graphs, options and the files beside them
        found = re.findall(r"\bval (PREFILL|WEIGHTS)_FILE: String\? = (.+)", text)
        out["files"] |= {k.lower(): json.loads(v) for k, v in found if v.strip() != "null"}
        options = re.search(r"val QNN_OPTIONS = mapOf\((.*?)\n    \)", text, re.S)
        binaries = re.search(r"val CONTEXT_BINARIES = listOf<String>\((.*)\)$", text, re.M)
        out["qnn"] = {
            "provider_options": dict(re.findall(r'^\s+"([^"]*)" to "([^"]*)",$', options.group(1), re.M)),
            "cpu_fallback_key": json.loads(val("DISABLE_CPU_FALLBACK")),
            "context_binaries": json.loads("[" + binaries.group(1) + "]"),
        }
    if val("TOKENS") is not None:
        for key in ("TOKENS", "POSITION", "LOGITS"):
            m = _FEATURE.fullmatch(val(key))
            out[key.lower()] = {"name": m.group(1), "shape": ints(m.group(2)), "dtype": _FROM_KOTLIN[m.group(3)]}
        for key, name in (("past_length", "PAST_LENGTH"), ("keep_rows", "KEEP_ROWS")):
            found = re.search(rf"\bval {name}: Feature\? = (.+)", text)
            m = _FEATURE.fullmatch(found.group(1).strip()) if found else None
            out[key] = {"name": m.group(1), "shape": ints(m.group(2)), "dtype": _FROM_KOTLIN[m.group(3)]} if m else None
        out["vocab_size"] = int(val("VOCAB_SIZE"))
        out["states"] = [
            {
                "input": m.group(1),
                "output": m.group(2),
                "shape": ints(m.group(3)),
                "dtype": _FROM_KOTLIN[m.group(4)],
                "checkpoint": m.group(5) is not None,
            }
            for m in _STATE.finditer(text)
        ]
    else:
        texts = re.search(r"val STOP_TEXTS = setOf<String>\((.*)\)$", text, re.M)
        stop_texts = json.loads("[" + texts.group(1).replace("\\$", "$") + "]") if texts else None
    out["chat"] = _parse_chat(text)
    if out["chat"] is not None and "tokens" not in out:
        out["chat"]["stop_texts"] = stop_texts
    return out


def identifier_literals(text: str) -> set[str]:
    """String literals in Kotlin source that look like tensor, file or option names."""
    # every literal is matched (templates too, so the quotes stay paired), then only plain names are kept
    return {s for s in re.findall(r'"((?:[^"\\]|\\.)*)"', text) if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", s)}


def generate(bundle: Path, manifest: dict[str, Any], out: Path) -> dict[str, Any]:
    """Write the Android library module into `out`; returns the kit record."""
    spec = kit_spec(bundle, manifest)
    src = out / SOURCE_DIR
    src.mkdir(parents=True)
    if spec["runtime"] == "onnxruntime":
        drivers = ["DeltashipOrtModel.kt"] + (["DeltashipChat.kt"] if spec.get("chat") else [])
        drivers += ["DeltashipGenAiModel.kt"] if "genai" in spec else []
    elif spec["runtime"] == "onnxruntime-qnn":
        drivers = ["DeltashipQnnModel.kt"]
    else:
        drivers = ["DeltashipExecuTorchModel.kt"] + (["DeltashipExecuTorchChat.kt"] if spec.get("chat") else [])
    drivers += [CHAT_PIECES]
    for d in drivers + [BUNDLE_FILES]:
        shutil.copyfile(TEMPLATES / d, src / d)
    (src / "KitSpec.kt").write_text(render_kit_spec(spec))
    deps = list(spec["gradle"]) + ([spec["genai"]["gradle"]] if "genai" in spec else [])
    (out / "build.gradle.kts").write_text(gradle(deps))
    name = kit_name(manifest)
    (out / "README.md").write_text(readme(name, manifest, spec, drivers, deps))
    files = ["build.gradle.kts", "README.md"] + [f"{SOURCE_DIR}/{f}" for f in ["KitSpec.kt", BUNDLE_FILES] + drivers]
    record = {
        "target": spec["target"],
        "name": name,
        "files": files,
        "drivers": drivers,
        "gradle": deps,
        "bundle": {
            "model": manifest["source"]["model"],
            "precision": manifest["precision"],
            "created": manifest.get("created"),
        },
        "kotlin": spec,
        "compiled_here": False,
    }
    (out / "kit.json").write_text(
        json.dumps({"kit": "deltaship.app", "platform": "android", **record}, indent=2) + "\n"
    )
    return record


def gradle(deps: list[str]) -> str:
    lines = "\n".join(f'    implementation("{d}")' for d in deps)
    return f"""// Generated by deltaship: an Android library module (include(":deltaship-kit") in settings.gradle.kts).
// Plugin versions come from the app's root build; this was not built by deltaship.
plugins {{
    id("com.android.library")
    id("org.jetbrains.kotlin.android")
}}

android {{
    namespace = "{PACKAGE}"
    compileSdk = 35
    defaultConfig {{ minSdk = 26 }}
    compileOptions {{
        sourceCompatibility = JavaVersion.VERSION_17
        targetCompatibility = JavaVersion.VERSION_17
    }}
}}

kotlin {{ jvmToolchain(17) }}

dependencies {{
{lines}
}}
"""


def _executorch_chat_readme(spec: dict[str, Any]) -> str:
    if not spec.get("chat"):
        return ""
    return """
## Chat (DeltashipExecuTorchChat.kt), as far as the runner's API allows
```kotlin
val chat = DeltashipExecuTorchChat(model, system = "Be brief.")  // KitSpec.CHAT: the template's pieces per role
val reply = chat.send("Hello", maxNewTokens = 64) { piece -> print(piece) }  // text, stopped, prefillTokens, refed
chat.retry(); chat.undo()                         // both feed the history again (the runner cannot go back)
val kept = chat.messages.toList(); chat.load(kept) // keep the messages; the next turn feeds them again
```
`LlmModule` keeps its position between `generate()` calls, so each turn feeds only the text the state lacks (the end
of the last reply, the new message, the generation prompt). Its API has no checkpoint, no rewind and no access to the
state: retry and undo cost a prefill of the history, a saved conversation is its messages, the shipped prompt cache
is not used, and a reply stays in the state as generated (`keepGenerated = false` feeds the history again as the
template renders it whenever they differ, e.g. every turn with a template that drops past `<think>` blocks). The
chat stops the runner at `KitSpec.STOP_TEXTS` (the texts of the template's end-of-turn and end-of-sequence tokens).
For checkpoints, saved states and the prompt cache, export an ONNX bundle (`DeltashipChat` over onnxruntime-android).
"""


def _qnn_readme(manifest: dict[str, Any], spec: dict[str, Any]) -> str:
    soc, q, files = spec["soc"], spec["qnn"], spec["files"]
    graphs = f"`{files['model']}` (1 token a call)" + (
        f" and `{files['prefill']}` ({spec['prefill_chunk']} tokens a call)" if "prefill" in files else ""
    )
    options = ", ".join(f"{k}={v}" for k, v in sorted(q["provider_options"].items()))
    verified = (manifest.get("lowering") or {}).get("runtime_requirements", {})
    if spec["compiled"]:
        ships = (
            f"The graphs are compiled ahead of time for this SoC (EPContext models: {', '.join(spec['compiled'])}; "
            f"context binaries {', '.join(f'`{b}`' for b in q['context_binaries'])}), compiled with QNN "
            f"{spec['qnn_sdk']}: the QNN libraries in the app must be that version or newer, and the phone's SoC the "
            "one they were compiled for (QNN refuses a context for a newer HTP and asks to recompile one for an older)."
        )
    else:
        ships = (
            "The graphs are ONNX (their weights in `" + files.get("weights", "weights.data") + "` beside them): QNN "
            "compiles each for the NPU when the app opens it (seconds on a phone at this size, more for larger "
            "models). Export with `--qnn-context` to ship them compiled for the SoC instead."
        )
    return f"""
```kotlin
val model = DeltashipQnnModel(File(context.getExternalFilesDir(null), "model-bundle"))  // fails unless all on the HTP
val ids = model.generate(intArrayOf(/* prompt token ids */), maxNewTokens = 64) {{ id -> true }}  // greedy
// or with a tokenizer (any TextTokenizer over the bundle's tokenizer.json): model.generate("Hello", tokenizer) {{ p -> true }}
model.reset()                                            // a new conversation
model.close()
```

## What the driver does (from the manifest)
- Opens {graphs} with onnxruntime-android's QNN build (`{QNN_AAR}`: ONNX Runtime with the QNN execution
  provider and Qualcomm's QNN libraries in the AAR), each with `SessionOptions.addQnn(KitSpec.QNN_OPTIONS)`
  ({options}: the {soc.get("marketing")} ({soc.get("chip")}), `lowering.soc`) and
  `addConfigEntry("{q["cpu_fallback_key"]}", "1")`, so a graph opens only when every node runs on the HTP.
- Each call feeds `{spec["tokens"]["name"]}` (int64 [1, 1] or [1, {spec["prefill_chunk"]}]: static shapes),
  `{spec["position"]["name"]}` (int64 [1], the tokens the state holds) and {len(spec["states"])} states (`past.*` take
  the previous call's `present.*`, whichever graph ran it; zeros at start and after `reset()`); `{spec["logits"]["name"]}`
  (float32 [1, {spec["vocab_size"]}]) scores the call's last token. A prompt goes in whole chunks of
  {spec["prefill_chunk"]} through the prefill graph, the rest one token a call through decode (no padding).
  `position + tokens` must stay <= {spec["max_context"]} (the static KV buffers): a call past it is refused.
- {ships}
- Greedy decoding. Prompts are used as given (apply the chat template yourself); the chat driver
  (`DeltashipChat`) runs ONNX bundles only.

## Versions
The bundle was verified with onnxruntime-qnn {verified.get("onnxruntime-qnn", "?")} (QNN SDK
{verified.get("qnn_sdk", "?")}) on QNN's HTP simulator on x86-64 Linux, never on a phone. Which QNN SDK the AAR
release bundles was not checked: if your Maven repositories lack `{QNN_AAR}`, or its QNN is older than the
bundle's, use a newer onnxruntime-android-qnn release (the Java API, `addQnn(Map<String, String>)`, is the same).
"""


def readme(name: str, manifest: dict[str, Any], spec: dict[str, Any], drivers: list[str], deps: list[str]) -> str:
    model, target = manifest["source"]["model"], spec["target"]
    dep_lines = "\n".join(f'implementation("{d}")' for d in deps)
    big = [f for k, f in spec["files"].items() if k not in ("tokenizer", "genai_config")]
    big += (spec.get("qnn") or {}).get("context_binaries", [])
    stored = ", ".join(f'"{e}"' for e in sorted({f.rsplit(".", 1)[-1] for f in big}))  # kept uncompressed in the APK
    head = f"""# {name}: {model} on Android ({target} bundle)

Generated by `deltaship app BUNDLE --platform android` from {a_bundle(target)} ({manifest["precision"]};
context {spec["max_context"]} tokens; prefill chunk {spec["prefill_chunk"]}).

**Not compiled or run by deltaship**: there is no Android SDK, Gradle or device where the kit is made.
What is checked there: every name, shape and dtype in `{SOURCE_DIR}/KitSpec.kt` against the artifact
itself, and that the Kotlin names nothing else. Build it and run it on a device before shipping.

## Steps
1. Either copy this folder into your project as module `deltaship-kit` (`include(":deltaship-kit")` in
   settings.gradle.kts, `implementation(project(":deltaship-kit"))` in the app), or copy
   `{SOURCE_DIR}/*.kt` into your app and add to its dependencies:

```kotlin
{dep_lines}
```

2. Put the bundle directory on the device where the app can open files by path (both runtimes take
   a path, not an asset stream): for development
   `adb push BUNDLE/. /sdcard/Android/data/<your.app.id>/files/model-bundle/` and
   `File(context.getExternalFilesDir(null), "model-bundle")`; for release, download it or copy it out of
   the APK's assets into `context.filesDir` on first launch (add `androidResources {{ noCompress += listOf({stored}) }}`).
3. Run generation off the main thread (e.g. `withContext(Dispatchers.IO)`).
"""
    if spec["runtime"] == "onnxruntime-qnn":
        return head + _qnn_readme(manifest, spec)
    if spec["runtime"] != "onnxruntime":  # executorch-android's LlmModule
        return (
            head
            + f"""
```kotlin
val model = DeltashipExecuTorchModel(File(context.getExternalFilesDir(null), "model-bundle"))
val text = model.generate("Hello", maxNewTokens = 64) {{ piece -> print(piece) }}   // temperature 0 = greedy
model.close()
```

## What the driver does
- `LlmModule(modelPath, tokenizerPath, temperature)` then `load()`, and
  `generate(prompt, LlmGenerationConfig(echo=false, maxNewTokens, temperature), LlmCallback)` from
  `org.pytorch.executorch.extension.llm` (executorch-android, the same version as the exporter:
  {manifest["tools"].get("executorch")}). The runner tokenizes with the bundle's `tokenizer.json`, calls
  `forward(tokens [1, T], input_pos)` and reads the .pte's metadata methods (`get_max_seq_len`,
  `get_max_context_len`, `get_eos_ids`, `use_kv_cache`, `enable_dynamic_shape`).
- The program uses ExecuTorch's LLM custom ops (`llama::custom_sdpa`, `llama::update_cache`,
  `llama::gated_delta_rule`) and XNNPACK. The Android build preset of ExecuTorch
  (`tools/cmake/preset/android.cmake`) turns on `EXECUTORCH_BUILD_KERNELS_LLM`, so the published AAR
  should register them (not checked on a device); a custom AAR needs them too.
- Prompts are used as given: apply the chat template yourself, or chat with `DeltashipExecuTorchChat` (below).
  `reset()` forgets the conversation.
- The runner splits a prompt into calls of `get_max_seq_len` tokens; a .pte whose `get_max_seq_len` is the
  context rather than the prefill chunk ({spec["prefill_chunk"]}) fails on prompts longer than the chunk
  (ExecuTorch's error: "Attempted to resize a bounded tensor"). Read the value in Python with
  `executorch.runtime.Runtime.get().load_program(pte).load_method("get_max_seq_len").execute([])`.
{_executorch_chat_readme(spec)}"""
        )
    genai = ""
    if "genai" in spec:
        genai = f"""
## onnxruntime-genai (this bundle has genai_config.json)
`DeltashipGenAiModel` runs the bundle with onnxruntime-genai's Android API (`ai.onnxruntime.genai.Model`,
`Tokenizer`, `GeneratorParams`, `Generator`): it reads the graph names from genai_config.json, owns the
state buffers, samples with genai_config.json's `search` options and tokenizes with the bundle's
tokenizer.json, so no other tokenizer is needed:

```kotlin
val model = DeltashipGenAiModel(File(context.getExternalFilesDir(null), "model-bundle"))
model.generate("Hello", maxNewTokens = 64) {{ piece -> print(piece); true }}
```

Dependency: `{spec["genai"]["gradle"]}` ({"the version in the bundle manifest" if spec["genai"]["version"] != GENAI_CHECKED else "the release the genai path was checked with in Python; the manifest names none"}).
If your Maven repositories do not have that artifact, use the `onnxruntime-genai-android-<version>.aar` from the
onnxruntime-genai GitHub release as a file dependency. Its `onnxruntime-android` must be the version it was
built against.
"""
    return (
        head
        + f"""
```kotlin
val dir = File(context.getExternalFilesDir(null), "model-bundle")
val model = DeltashipOrtModel(dir)                       // checks the graph's names against KitSpec.kt
val ids = model.generate(intArrayOf(/* prompt token ids */), maxNewTokens = 64) {{ id -> true }}
// or with a tokenizer (see below): model.generate("Hello", tokenizer) {{ piece -> print(piece); true }}
model.reset()                                            // a new conversation
model.close()
```

## What the driver does (from the manifest)
- `OrtEnvironment.getEnvironment().createSession(model path)` (onnxruntime-android
  {manifest["tools"].get("onnxruntime")}: the onnxruntime version in the bundle's manifest, the exporter's).
- Each call feeds `{spec["tokens"]["name"]}` ({spec["tokens"]["dtype"]}, 1 to {spec["prefill_chunk"]} tokens),
  {_position_doc(spec)},
  and {len(spec["states"])} states: `past.*` inputs take the previous call's `present.*` outputs (the
  previous `OrtSession.Result` stays open until the next call has run; zeros at start and after `reset()`).
  `{spec["logits"]["name"]}` gives the last token's scores. Greedy or top-k sampling.
- The driver binds no buffers: every call returns new `present.*` tensors, the KV caches included at
  their full context length. That is fine for small contexts; for long ones onnxruntime-genai (which
  shares past/present buffers) is the better driver.

## Tokenizer
onnxruntime-android has no text tokenizer. `generate(prompt: String, tokenizer, ...)` takes any
`TextTokenizer` (encode/decode of the bundle's `tokenizer.json`). Options, none built or run here:
- onnxruntime-genai's `Tokenizer` (reads tokenizer.json) needs a genai `Model`, i.e. a bundle with
  genai_config.json; then `DeltashipGenAiModel` is the simpler driver anyway.
- DJL's Hugging Face tokenizers on Android (`ai.djl.huggingface:tokenizers` with the native
  `ai.djl.android:tokenizer-native` AAR, same version): wrap `HuggingFaceTokenizer.newInstance(path)`'s
  `encode(text).ids` / `decode(ids)` in a `TextTokenizer`.
- Tokenize on a server or at build time and pass token ids to `generate(IntArray, ...)`.
Prompts are used as given: apply the chat template yourself, or chat with `DeltashipChat` (when the bundle has a
chat template: `KitSpec.CHAT` holds it as per-role pieces, rendered at `deltaship app` time):

```kotlin
val chat = DeltashipChat(DeltashipOrtModel(dir), tokenizer, system = "Be brief.")
chat.usePromptCache(dir)                         // a bundle exported with --prompt-cache of that system message
val reply = chat.send("Hello", maxNewTokens = 64) // text, ids, stopped, prefillTokens
chat.retry(); chat.undo()
val bytes = chat.save(); chat.load(bytes)         // a file or a database blob
```
{genai}"""
    )
