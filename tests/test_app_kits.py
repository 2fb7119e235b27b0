"""App kits: the names, shapes and dtypes the generated Swift/Kotlin uses, against the real artifacts.

Nothing here compiles Swift or Kotlin (no toolchains on this machine); the checks read the generated
source text and compare every name it uses with the .mlpackage's spec (coremltools) or the ONNX
graph (onnx), and mutate the source to see the check fail.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from deltaship.apps import PLATFORMS, write_kit
from deltaship.errors import DeltashipError

PRESET = "qwen3.5-tiny"


def _export(root: Path, target: str, precision: str, **opts) -> Path:
    from deltaship.export import export
    out = root / f"{target}-{precision}"
    export(PRESET, out, target=target, precision=precision, max_context=128, prefill_chunk=16, verify=False,
           progress=False, **opts)
    return out


# ---------------------------------------------------------------- write_kit itself

def test_platforms_and_refusals(tmp_path, monkeypatch):
    import deltaship.apps as apps
    assert PLATFORMS == ("android", "ios", "web", "desktop")
    bundle = tmp_path / "b"
    bundle.mkdir()
    (bundle / "manifest.json").write_text(json.dumps({"target": "executorch"}))
    with pytest.raises(DeltashipError, match="executorch bundle.*ios kit runs coreml") as e:
        write_kit(bundle, tmp_path / "kit", "ios")
    assert "--target coreml" in e.value.fix
    with pytest.raises(DeltashipError, match="unknown platform 'watch'"):
        write_kit(bundle, tmp_path / "kit", "watch")
    with pytest.raises(DeltashipError, match="no manifest.json"):
        write_kit(tmp_path, tmp_path / "kit", "android")
    (bundle / "manifest.json").write_text(json.dumps({"target": "onnx"}))
    monkeypatch.setitem(apps._KITS, "web", ("deltaship.apps.not_written_yet", ("onnx",), "x"))
    with pytest.raises(DeltashipError, match="web kit generator .*not installed"):
        write_kit(bundle, tmp_path / "kit", "web")
    assert not (tmp_path / "kit").exists() and not list(tmp_path.glob(".kit.*"))  # nothing left behind


# ---------------------------------------------------------------- Swift / Core ML

@pytest.fixture(scope="module")
def coreml_bundles(tmp_path_factory) -> dict[str, Path]:
    """fp32 (every state an fp32 input/output, one package) and int4 split into several packages
    (KV cache as fp16 MLStates, hidden states passed between packages)."""
    root = tmp_path_factory.mktemp("coreml")
    return {"fp32": _export(root, "coreml", "fp32"),
            "int4-parts": _export(root, "coreml", "int4", coreml_part_gb=0.0015)}


def coreml_functions(package: Path) -> dict[str, dict[str, dict[str, tuple[list[int], str]]]]:
    """function -> {"inputs"|"outputs"|"states": name -> (shape, dtype)} from the saved package's spec."""
    import coremltools as ct
    from coremltools.proto import FeatureTypes_pb2 as ft
    spec = ct.utils.load_spec(str(package))

    def array(t) -> tuple[list[int], str]:
        return list(t.shape), ft.ArrayFeatureType.ArrayDataType.Name(t.dataType).lower()

    return {f.name: {"inputs": {i.name: array(i.type.multiArrayType) for i in f.input},
                     "outputs": {o.name: array(o.type.multiArrayType) for o in f.output},
                     "states": {s.name: array(s.type.stateType.arrayType) for s in f.state}}
            for f in spec.description.functions}


def check_swift_kit(kit: Path, bundle: Path) -> list[str]:
    """Every name/shape/dtype the Swift sources use against the packages; [] when they agree."""
    from deltaship.apps.swift import identifier_literals, parse_kit_spec
    texts = {p.name: p.read_text() for p in (kit / "Sources").rglob("*.swift")}
    spec = parse_kit_spec(texts["KitSpec.swift"])
    problems = []
    if spec != json.loads((kit / "kit.json").read_text())["swift"]:
        problems.append("KitSpec.swift differs from kit.json")
    names = set(spec["functions"].values()) | {"mlmodelc"}  # the compiled-model extension the driver looks for
    for part in spec["parts"]:
        funcs = coreml_functions(bundle / part["package"])
        if set(funcs) != set(spec["functions"].values()):
            problems.append(f"{part['package']}: functions {sorted(funcs)} != swift {sorted(spec['functions'].values())}")
        swift = {"inputs": [part["input"], part["position"]] + [dict(s, name=s["input"]) for s in part["io_states"]],
                 "outputs": [part["output"]] + [dict(s, name=s["output"]) for s in part["io_states"]],
                 "states": part["ml_states"]}
        for role, tokens in (("prefill", spec["prefill_chunk"]), ("decode", 1)):
            fname = spec["functions"][role]
            if fname not in funcs:
                continue
            for kind, feats in swift.items():
                have = funcs[fname][kind]
                for f in feats:
                    want = ([tokens if d == -1 else d for d in f["shape"]], f["dtype"])
                    if have.get(f["name"]) != want:
                        problems.append(f"{part['package']}:{fname} {kind[:-1]} {f['name']}: swift {want}, "
                                        f"package {have.get(f['name'])}")
                missing = set(have) - {f["name"] for f in feats}
                if missing:
                    problems.append(f"{part['package']}:{fname} {kind} the swift never names: {sorted(missing)}")
        names |= {part["package"]} | {f["name"] for fs in swift.values() for f in fs}
    stray = set().union(*(identifier_literals(t) for t in texts.values())) - names
    if stray:
        problems.append(f"names in the swift sources that are not in the packages: {sorted(stray)}")
    return problems


@pytest.mark.parametrize("which", ["fp32", "int4-parts"])
def test_swift_kit_names_match_the_packages(coreml_bundles, tmp_path, which):
    bundle = coreml_bundles[which]
    record = write_kit(bundle, tmp_path / "kit", "ios")
    kit = tmp_path / "kit"
    assert check_swift_kit(kit, bundle) == []
    spec = record["swift"]
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert [p["package"] for p in spec["parts"]] == [p["package"] for p in manifest["lowering"]["parts"]]
    io = [s for p in spec["parts"] for s in p["io_states"]]
    ml = [s for p in spec["parts"] for s in p["ml_states"]]
    assert len(io) + len(ml) == len(manifest["states"])
    if which == "fp32":
        assert ml == [] and len(spec["parts"]) == 1
    else:  # fp16 KV cache as MLStates, DeltaNet states fp32/fp16 io, hidden states between packages
        assert len(spec["parts"]) > 1 and {s["name"].split("_")[-1] for s in ml} == {"key", "value"}
        assert spec["parts"][1]["input"]["name"] == "hidden_in" and spec["parts"][0]["output"]["name"] == "hidden_out"
    package = (kit / "Package.swift").read_text()
    assert ".iOS(.v18), .macOS(.v15)" in package and '.product(name: "Tokenizers", package: "swift-transformers")' in package
    driver = (kit / "Sources" / record["name"] / "DeltashipModel.swift").read_text()
    for api in ("config.functionName = name", "makeState()", "prediction(from: provider, using:",
                "AsyncThrowingStream", "AutoTokenizer.from(modelFolder:"):
        assert api in driver
    assert "not compiled or run by deltaship" in (kit / "README.md").read_text().lower()


@pytest.mark.parametrize("mutation", ["state name", "dtype", "function name", "hard-coded name", "dropped state"])
def test_swift_check_catches_a_changed_name(coreml_bundles, tmp_path, mutation):
    bundle = coreml_bundles["int4-parts"]
    record = write_kit(bundle, tmp_path / "kit", "ios")
    src = tmp_path / "kit" / "Sources" / record["name"]
    spec_file, driver = src / "KitSpec.swift", src / "DeltashipModel.swift"
    text = spec_file.read_text()
    io0 = record["swift"]["parts"][0]["io_states"][0]
    if mutation == "state name":
        spec_file.write_text(text.replace(f'"{io0["output"]}"', f'"{io0["output"]}x"', 1))
    elif mutation == "dtype":
        spec_file.write_text(text.replace("dataType: .float16)", "dataType: .float32)", 1))
    elif mutation == "function name":
        spec_file.write_text(text.replace('decodeFunction = "decode"', 'decodeFunction = "decode_step"'))
    elif mutation == "hard-coded name":
        driver.write_text(driver.read_text().replace("for s in part.spec.ioStates { feeds[s.input] = io[i][s.input] }",
                                                     'feeds["past_conv_0"] = io[i]["past_conv_0"]'))
    else:
        spec_file.write_text(re.sub(r"\n\s*IOState\([^\n]*", "", text, count=1))
    problems = check_swift_kit(tmp_path / "kit", bundle)
    assert problems
    if mutation != "hard-coded name":  # also wrong against the package, not only against kit.json
        assert any("package" in p or "never names" in p for p in problems if "kit.json" not in p), problems


def test_existing_kit_needs_force(coreml_bundles, tmp_path):
    bundle = coreml_bundles["fp32"]
    write_kit(bundle, tmp_path / "kit", "ios")
    (tmp_path / "kit" / "mine.txt").write_text("x")
    with pytest.raises(DeltashipError, match="already exists"):
        write_kit(bundle, tmp_path / "kit", "ios")
    assert (tmp_path / "kit" / "mine.txt").exists()
    write_kit(bundle, tmp_path / "kit", "ios", force=True)
    assert not (tmp_path / "kit" / "mine.txt").exists()
    with pytest.raises(DeltashipError, match="coreml bundle; the android kit runs onnx or executorch"):
        write_kit(bundle, tmp_path / "kit2", "android")
