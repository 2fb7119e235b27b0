"""`generate` and `inspect`: the CLI subcommands as Python functions (no torch)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from deltaship.errors import DeltashipError
from deltaship.runtimes import open_bundle
from deltaship.runtimes.bundle import check_files, read_manifest
from deltaship.runtimes.tokenizer import load_tokenizer


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise DeltashipError(f"--input-ids {text!r} is not a comma-separated list of integers",
                             "pass e.g. --input-ids 1,2,3") from None
    if not ids:
        raise DeltashipError("--input-ids is empty", "pass at least one token id")
    return ids


def generate(bundle: str | Path, prompt: str | None = None, input_ids: str | list[int] | None = None,
             max_new_tokens: int = 32, threads: int | None = None, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int | None = None, stop_at_eos: bool = True,
             dump_logits: str | Path | None = None, provider: str = "cpu") -> dict[str, Any]:
    """Generate from a prompt (text, needs the bundle's tokenizer) or token ids; return a result dict."""
    if (prompt is None) == (input_ids is None):
        raise DeltashipError("pass exactly one of --prompt or --input-ids", "e.g. --prompt 'Hello' or --input-ids 1,2,3")
    if dump_logits is not None and Path(dump_logits).exists():
        raise DeltashipError(f"--dump-logits {dump_logits} already exists; nothing was overwritten",
                             "choose another file name or remove the old one")
    session = open_bundle(bundle, threads=threads, provider=provider)
    tok = load_tokenizer(Path(bundle), session.manifest) if prompt is not None else None
    ids = tok.encode(prompt) if tok else (parse_ids(input_ids) if isinstance(input_ids, str) else list(input_ids))
    t0 = time.monotonic()
    gen = session.generate(ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                           stop_at_eos=stop_at_eos, keep_logits=dump_logits is not None)
    elapsed = time.monotonic() - t0
    result: dict[str, Any] = {"input_ids": gen.input_ids, "output_ids": gen.output_ids, "stopped": gen.stopped,
                              "seconds": round(elapsed, 4), "runtime": session.runtime_name()}
    if tok is None:
        try:
            tok = load_tokenizer(Path(bundle), session.manifest)
        except DeltashipError:
            tok = None
    if tok is not None:
        result["text"] = tok.decode(gen.output_ids)
    if dump_logits is not None:
        arr = np.stack(gen.logits).astype(np.float32) if gen.logits else np.zeros((0, session.vocab_size), np.float32)
        path = Path(dump_logits)
        tmp = path.with_name(f".{path.name}.partial-{os.getpid()}.npy")
        np.save(tmp, arr)
        tmp.rename(path)
        result["logits_file"] = str(path)
    return result


def inspect(bundle: str | Path, check_hashes: bool = True) -> dict[str, Any]:
    """The manifest plus a fresh check of every file's size and sha256."""
    manifest = read_manifest(bundle)
    problems = check_files(bundle, manifest, hashes=check_hashes)
    return {"manifest": manifest, "intact": not problems, "problems": problems}


def describe(info: dict[str, Any]) -> str:
    """Human form of `inspect`'s result."""
    m = info["manifest"]
    spec = m["model"]
    lines = [
        f"bundle      {m['target']} / {m['precision']}   (schema v{m['schema_version']}, created {m['created']})",
        f"source      {m['source']['model']} ({m['source']['kind']}, {m['source']['architecture']})",
        f"            sha256 {m['source']['sha256'][:16]}...",
        f"model       {spec['num_layers']} layers ({spec['layer_types'].count('linear_attention')} DeltaNet + "
        f"{spec['layer_types'].count('full_attention')} attention), hidden {spec['hidden_size']}, vocab "
        f"{spec['vocab_size']}, {spec['parameters']['total'] / 1e6:.1f}M parameters",
        f"context     max {m['max_context']} tokens, prefill chunk {m['prefill_chunk']}",
        f"state       {m['state_bytes'] / 2**20:.2f} MiB per sequence in {len(m['states'])} tensors",
    ]
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
        lines.append(f"  {s['name']:<16} -> {s['output']:<18} L{s['layer']:<3} {s['kind']:<20} {s['dtype']:<8} "
                     f"{s['shape']} {s['init']}/{s['reset']}")
    tok = m.get("tokens", {})
    lines.append("tokens      " + ", ".join(f"{k}={v}" for k, v in tok.items() if v not in (None, [])))
    lines.append(f"tokenizer   {', '.join(m['tokenizer']['files']) or 'none'}")
    lines.append("passes")
    for p in m["passes"]:
        counts = ", ".join(f"{k} {v}" for k, v in p["counts"].items())
        lines.append(f"  {p['pass']:<26} {counts}")
    v = m.get("verification", {})
    if v.get("status") in ("passed", "failed"):
        lines.append(f"verified    {v['status']} in {v.get('runtime')} over prompts of "
                     f"{[p['prompt_length'] for p in v['prompts']]} tokens + {v['steps']} steps:")
        lines.append(f"            parity: max |logit diff| {v['max_abs_logit_diff']:.3g} ({v['max_rel_logit_diff']:.3g} of "
                     f"the logit std), greedy agreement {v['greedy_agreement']:.3f} (tie-aware "
                     f"{v['tie_aware_agreement']:.3f})")
        lines.append(f"            fidelity vs unrounded fp32: KL {v['kl_divergence']:.3g}, top-1 agreement "
                     f"{v['top1_agreement']:.3f}")
    else:
        lines.append(f"verified    {v.get('status', 'unknown')}: {v.get('reason', '')}")
    lines.append("tools       " + ", ".join(f"{k} {v}" for k, v in m["tools"].items()))
    lines.append("files")
    for name, f in m["files"].items():
        lines.append(f"  {name:<28} {f['bytes'] / 2**20:10.2f} MiB  sha256 {f['sha256'][:16]}...")
    if info["intact"]:
        lines.append("integrity   all file hashes match the manifest")
    else:
        lines.append("integrity   FAILED: " + "; ".join(info["problems"]))
    return "\n".join(lines)
