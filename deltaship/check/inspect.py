"""`deltaship inspect`: a bundle's manifest in human form, with a fresh integrity check (no toolchain)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deltaship.bundle.reader import check_files, read_manifest
from deltaship.bundle.validate import schema_problems
from deltaship.errors import DeltashipError
from deltaship.runtimes.numbers import number_problems
from deltaship.targets import get_target, target_names


def inspect(bundle: str | Path, check_hashes: bool = True) -> dict[str, Any]:
    """The manifest plus a fresh check of it against the bundle schema, of every file's size and sha256, and
    of the artifact's own inputs, outputs and states against the manifest's (read without the toolchain). A
    manifest naming a path outside the bundle is refused (DeltashipError), unopened."""
    manifest = read_manifest(bundle, validate=False)
    problems = schema_problems(manifest)
    schema_ok = not problems
    problems += check_files(bundle, manifest, hashes=check_hashes)
    if not problems:
        problems += artifact_problems(Path(bundle), manifest)
    return {"manifest": manifest, "intact": not problems, "problems": problems, "schema_ok": schema_ok}


def artifact_problems(bundle: Path, manifest: dict[str, Any]) -> list[str]:
    """Where the artifact disagrees with the manifest (its target checks what its toolchain can read cheaply)."""
    # the registry imports no toolchain; the target's check loads its own lazily (onnx for ONNX bundles)

    if manifest["target"] not in target_names():
        return [f"target {manifest['target']!r}: not a target this deltaship knows"]
    try:
        return get_target(manifest["target"]).artifact_problems(bundle, manifest) + number_problems(manifest)
    except DeltashipError as e:
        return [e.message]


def describe(info: dict[str, Any]) -> str:
    """Human form of `inspect`'s result."""
    if not info.get("schema_ok", True):  # the fields below may be missing or of another type
        return "integrity   FAILED: " + "; ".join(info["problems"])
    try:
        return _describe(info)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        # the schema leaves optional blocks (verification, speculative, quantization details) loosely typed
        return f"integrity   FAILED: a manifest field is not what deltaship writes ({type(e).__name__}: {e})"


def _describe(info: dict[str, Any]) -> str:
    m = info["manifest"]
    spec = m["model"]
    lines = [
        f"bundle      {m['target']} / {m['precision']}   (schema v{m['schema_version']}, created {m['created']})",
        f"source      {m['source']['model']} ({m['source']['kind']}, {m['source']['architecture']})",
        f"            sha256 {m['source']['sha256'][:16]}...",
        "model card  " + ", ".join(f"{k} {v}" for k, v in m["model_card"].items() if v is not None),
        f"model       {spec['num_layers']} layers ({spec['layer_types'].count('linear_attention')} DeltaNet + "
        f"{spec['layer_types'].count('full_attention')} attention), hidden {spec['hidden_size']}, vocab "
        f"{spec['vocab_size']}, {spec['parameters']['total'] / 1e6:.1f}M parameters",
        f"context     max {m['max_context']} tokens, prefill chunk {m['prefill_chunk']}",
        f"state       {m['state_bytes'] / 2**20:.2f} MiB per sequence in {len(m['states'])} tensors",
    ]
    if spec.get("mtp_num_hidden_layers"):
        sp = m.get("speculative")
        shared = sum((sp or {}).get("shared_tensors", {}).values()) / 2**20
        dup = (
            f"no, {sp['duplicated_bytes'] / 2**20:.2f} MiB duplicated"
            if sp and not sp["shares_weights"]
            else "yes, methods of one program (its constants are stored once)"
            if sp and "program_method" in sp["draft"]
            else "yes, functions of one package (its weight blob stores them once)"
            if sp and "function" in sp["draft"]
            else f"yes, {shared:.2f} MiB read from the decoder's data file"
        )
        lines.append(
            f"mtp head    {spec['mtp_num_hidden_layers']} layer(s) in the checkpoint; "
            + (
                f"exported as {_part(sp['draft'])} (generate --speculative mtp[:k]); shares the embedding/LM head: "
                f"{dup}"
                if sp
                else "not exported (export with --mtp to draft with it)"
            )
        )
    if m.get("speculative"):
        sp = m["speculative"]
        lines.append(f"speculative draft {_part(sp['draft'])}: inputs {[t['name'] for t in sp['draft']['inputs']]}")
        lines.append(
            f"            verify {_part(sp['verify'])}: + input {[t['name'] for t in sp['verify']['inputs']]}, "
            f"outputs {[t['name'] for t in sp['verify']['outputs']]}"
        )
        lines.append(
            f"            rollback: DeltaNet {sp['rollback']['deltanet'].split(':')[0]}; KV cache: length pointer"
        )
        dv = sp["draft"].get("vocab")
        if dv:  # --mtp-draft-vocab N
            cover = f", {dv['coverage']:.1%} of its ranking text's tokens" if dv.get("coverage") is not None else ""
            lines.append(
                f"            draft vocabulary: {dv['size']} of {dv['vocab_size']} token ids ({dv['file']}{cover}); "
                f"ranked by {dv['ranking']}"
            )
    for note in m["source"].get("notes", []):
        lines.append(f"note        {note}")
    q = m.get("quantization", {})
    if q.get("scheme", "none") != "none":
        lines.append(f"quantized   {q['scheme']}, block {q['block_size']}, tensors {q['tensors']}")
    lines.append("inputs")
    for i in m["inputs"]:
        lines.append(f"  {i['name']:<22} {i['dtype']:<8} {i['shape']}  {i.get('doc', '')}")
    lines.append("outputs")
    for o in m["outputs"]:
        lines.append(f"  {o['name']:<22} {o['dtype']:<8} {o['shape']}  {o.get('doc', '')}")
    lines.append("states (input -> output, layer, kind, init/reset)")
    for s in m["states"]:
        lines.append(
            f"  {s['name']:<16} -> {s['output']:<18} L{s['layer']:<3} {s['kind']:<20} {s['dtype']:<8} "
            f"{s['shape']} {s['init']}/{s['reset']}" + (f" {s['layout']}" if "layout" in s else "")
        )
    graphs, soc = m.get("lowering", {}).get("graphs"), m.get("lowering", {}).get("soc")
    if graphs:  # fixed-shape graphs, one per call size (qnn: decode.onnx, prefill.onnx)
        on = f" for {soc['chip']} ({soc['marketing']}, soc {soc['soc_model']}, HTP v{soc['htp_arch']})" if soc else ""
        fallback = m["lowering"].get("cpu_fallback")
        lines.append(f"graphs{on}" + ("; CPU fallback disabled" if fallback is False else ""))
        for key, g in graphs.items():
            lines.append(
                f"  {key:<10} {g['file']:<16} {g['tokens']:>5} token{'s' if g['tokens'] != 1 else ''} a call "
                f"{g['nodes']:>7} nodes"
            )
            made = (m["lowering"].get("context") or {}).get(key)
            if made:  # export --qnn-context: the EPContext model compiled for the SoC
                size = sum(f["bytes"] for f in made["files"]) / 2**20
                lines.append(
                    f"  {'':<10} compiled: {made['model']} + {len(made['files']) - 1} context binary ({size:.2f} MiB), "
                    f"needs QNN >= {made['qnn_sdk']}"
                )
    needs = m.get("lowering", {}).get("runtime_requirements")
    if needs:
        lines.append(
            f"runtime     opset {m['lowering'].get('opset')}: needs " + ", ".join(f"{k} {v}" for k, v in needs.items())
        )
    tok = m.get("tokens", {})
    lines.append("tokens      " + ", ".join(f"{k}={v}" for k, v in tok.items() if v not in (None, [])))
    lines.append(f"tokenizer   {', '.join(m['tokenizer']['files']) or 'none'}")
    cache = (m.get("chat") or {}).get("prompt_cache")
    if cache:  # export --prompt-cache: the state after a system message, which a chat with it starts from
        size = m["files"].get(cache["file"], {}).get("bytes", 0) / 2**20
        system = cache["system"] if len(cache["system"]) <= 60 else cache["system"][:57] + "..."
        lines.append(
            f"chat        prompt cache {cache['file']} ({size:.2f} MiB): {cache['tokens']} tokens of the system "
            f"message {system!r}" + (f", template {cache['template_kwargs']}" if cache.get("template_kwargs") else "")
        )
    lines.append("passes")
    for p in m["passes"]:
        counts = ", ".join(f"{k} {v}" for k, v in p["counts"].items())
        lines.append(f"  {p['pass']:<26} {counts}")
    v = m.get("verification", {})
    if v.get("status") in ("passed", "failed"):
        lines.append(
            f"verified    {v['status']} in {v.get('runtime')} over prompts of "
            f"{[p['prompt_length'] for p in v['prompts']]} tokens + {v['steps']} steps:"
        )
        lines.append(
            f"            parity: max |logit diff| {v['max_abs_logit_diff']:.3g} ({v['max_rel_logit_diff']:.3g} of "
            f"the logit std), greedy agreement {v['greedy_agreement']:.3f} (tie-aware "
            f"{v['tie_aware_agreement']:.3f})"
        )
        lines.append(
            f"            fidelity vs unrounded fp32: KL {v['kl_divergence']:.3g}, top-1 agreement "
            f"{v['top1_agreement']:.3f}"
        )
    else:
        lines.append(f"verified    {v.get('status', 'unknown')}: {v.get('reason', '')}")
    lines.append("tools       " + ", ".join(f"{k} {v}" for k, v in m["tools"].items()))
    lines.append("files")
    for name, f in m["files"].items():
        lines.append(f"  {name:<28} {f['bytes'] / 2**20:10.2f} MiB  sha256 {f['sha256'][:16]}...")
    if info["intact"]:
        lines.append("integrity   the manifest follows the bundle schema; all file hashes match the manifest")
    else:
        lines.append("integrity   FAILED: " + "; ".join(info["problems"]))
    return "\n".join(lines)


def _part(part: dict) -> str:
    """mtp.onnx, model.pte:mtp_draft (a method of an ExecuTorch program), model.mlpackage:mtp_draft or
    model.mlpackage:verify_1|verify_2|... (functions of a Core ML package)."""
    if "program_method" in part:
        return f"{part['file']}:{part['program_method']}"
    if "function" in part:
        return f"{part['file']}:{part['function']}"
    if "functions" in part:
        return f"{part['file']}:{'|'.join(part['functions'].values())}"
    return part["file"]
