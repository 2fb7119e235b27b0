"""The iOS kit's speculative-decoding table, for Core ML bundles exported with --mtp (docs/speculative.md).

KitSpec.swift gets `speculative`: a `SpeculativeSpec` naming the verify functions by token count, their inputs and
outputs, the MTP head's function, its inputs, outputs and own KV cache (io tensors or Core ML states), and which of
the decoder's states hold DeltaNet state (what a snapshot copies before a verify call). Every name is read from the
manifest's `speculative` block and `states`; templates/DeltashipSpeculative.swift drives them. A bundle without the
head gets `speculative = nil`.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

from deltaship.errors import DeltashipError

_FEATURES = (  # SpeculativeSpec fields that are one Feature each: (field, Swift label)
    ("verify_input", "verifyInput"),
    ("verify_position", "verifyPosition"),
    ("verify_logits", "verifyLogits"),
    ("verify_hidden", "verifyHidden"),
    ("draft_hidden", "draftHidden"),
    ("draft_input", "draftInput"),
    ("draft_position", "draftPosition"),
    ("draft_logits", "draftLogits"),
    ("draft_hidden_out", "draftHiddenOut"),
)


def speculative_spec(manifest: dict[str, Any], parts: list, feature: Callable) -> dict[str, Any] | None:
    """The table from the manifest, or None for a bundle without the head. `feature(name, shape, dtype)` makes one
    feature entry (swift.kit_spec's, so shapes and dtypes are checked the same way)."""
    block = manifest.get("speculative")
    if not block:
        return None
    if len(parts) != 1:
        raise DeltashipError(
            f"the bundle's --mtp package comes in {len(parts)} parts: the kit's speculative path runs one package",
            "export again with --mtp and a larger --coreml-part-gb",
        )
    verify, draft = block["verify"], block["draft"]
    if draft.get("vocab"):  # the Swift driver takes the draft's argmax as a token id: it has no id map
        raise DeltashipError(
            f"the bundle's draft head covers {draft['vocab']['size']} of {manifest['model']['vocab_size']} token ids "
            "(--mtp-draft-vocab): the iOS kit's speculative path drafts over the full vocabulary only",
            "export the Core ML bundle again without --mtp-draft-vocab (or with --mtp-draft-vocab full) for the kit",
        )

    def by_kind(items: list[dict], what: str) -> dict[str, dict]:
        out = {i["kind"]: i for i in items}
        if len(out) != len(items):
            raise DeltashipError(f"manifest speculative.{what}: two entries of one kind", "re-export the bundle")
        return out

    def feat(entry: dict) -> dict:
        return feature(entry["name"], entry["shape"], entry["dtype"])

    vin, vout = by_kind(verify["inputs"], "verify.inputs"), by_kind(verify["outputs"], "verify.outputs")
    din, dout = by_kind(draft["inputs"], "draft.inputs"), by_kind(draft["outputs"], "draft.outputs")
    io, ml = [], []
    for s in draft["states"]:
        if s["mode"] == "io":
            f = feat(dict(s, name=s["coreml_input"]))
            io.append(
                {"input": s["coreml_input"], "output": s["coreml_output"], "shape": f["shape"], "dtype": f["dtype"]}
            )
        else:
            ml.append(feat(dict(s, name=s["coreml_input"])))
    deltanet = [s for s in manifest["states"] if s["kind"].startswith("deltanet")]
    functions = {str(t): name for t, name in sorted(verify["functions"].items(), key=lambda kv: int(kv[0]))}
    if "1" not in functions:
        raise DeltashipError(
            f"manifest speculative.verify.functions {sorted(functions)}: no one-token function", "re-export the bundle"
        )
    return {
        "verify_functions": functions,
        "verify_input": feat(vin["tokens"]),
        "verify_position": feat(vin["position"]),
        "verify_logits": feat(vout["logits"]),
        "verify_hidden": feat(vout["hidden_states"]),
        "draft_function": draft["function"],
        "draft_hidden": feat(din["hidden_states"]),
        "draft_input": feat(din["tokens"]),
        "draft_position": feat(din["position"]),
        "draft_logits": feat(dout["logits"]),
        "draft_hidden_out": feat(dout["hidden_states"]),
        "draft_io_states": io,
        "draft_ml_states": ml,
        "snapshot_io_states": [s["coreml_input"] for s in deltanet if s["mode"] == "io"],
        "snapshot_ml_states": [s["coreml_input"] for s in deltanet if s["mode"] == "state"],
    }


def render(sp: dict[str, Any] | None, feature: Callable, iostate: Callable) -> list[str]:
    """KitSpec.swift's `speculative` line(s)."""
    if sp is None:
        return ["    static let speculative: SpeculativeSpec? = nil  // the bundle has no MTP head (export --mtp)"]
    funcs = ", ".join(f'{t}: "{n}"' for t, n in sp["verify_functions"].items())
    lines = [
        "    static let speculative: SpeculativeSpec? = SpeculativeSpec(",
        f"        verifyFunctions: [{funcs}],",
        *[f"        {label}: {feature(sp[k])}," for k, label in _FEATURES[:4]],
        f'        draftFunction: "{sp["draft_function"]}",',
        *[f"        {label}: {feature(sp[k])}," for k, label in _FEATURES[4:]],
        "        draftIOStates: [",
        *[f"            {iostate(s)}," for s in sp["draft_io_states"]],
        "        ],",
        "        draftMLStates: [",
        *[f"            {feature(s)}," for s in sp["draft_ml_states"]],
        "        ],",
        f"        snapshotIOStates: {_strings(sp['snapshot_io_states'])},",
        f"        snapshotMLStates: {_strings(sp['snapshot_ml_states'])}",
        "    )",
    ]
    return lines


def _strings(names: list[str]) -> str:
    return "[" + ", ".join(f'"{n}"' for n in names) + "]"


def parse(text: str, feature_re: re.Pattern, iostate_re: re.Pattern, feat: Callable, iost: Callable) -> dict | None:
    """The table back out of KitSpec.swift's text (the inverse of render)."""
    m = re.search(r"static let speculative: SpeculativeSpec\? = (.*?)\n    \)\n", text, re.S)
    if m is None:
        if re.search(r"static let speculative: SpeculativeSpec\? = nil", text):
            return None
        raise DeltashipError("KitSpec.swift has no speculative entry", "regenerate the kit with `deltaship app`")
    block = m.group(1)

    def field(label: str) -> str:
        f = re.search(rf"\n\s*{label}: (.*?),?(?:\n|$)", block)
        if f is None:
            raise DeltashipError(f"KitSpec.swift's speculative entry has no {label}", "regenerate the kit")
        return f.group(1)

    out: dict[str, Any] = {
        "verify_functions": {t: n for t, n in re.findall(r'(\d+): "([^"]*)"', field("verifyFunctions"))},
        "draft_function": json.loads(field("draftFunction")),
    }
    for key, label in _FEATURES:
        out[key] = feat(feature_re.search(field(label)))
    io, ml = block.split("draftIOStates: [", 1)[1].split("draftMLStates: [", 1)
    out["draft_io_states"] = [iost(s) for s in iostate_re.finditer(io)]
    out["draft_ml_states"] = [feat(s) for s in feature_re.finditer(ml.split("snapshotIOStates:", 1)[0])]
    out["snapshot_io_states"] = json.loads(field("snapshotIOStates"))
    out["snapshot_ml_states"] = json.loads(field("snapshotMLStates"))
    # key order as speculative_spec writes it (kit.json holds that dict)
    order = ["verify_functions", *[k for k, _ in _FEATURES[:4]], "draft_function", *[k for k, _ in _FEATURES[4:]]]
    order += ["draft_io_states", "draft_ml_states", "snapshot_io_states", "snapshot_ml_states"]
    return {k: out[k] for k in order}
