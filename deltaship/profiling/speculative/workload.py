"""The speculative profile's fixed workload and the parent's side of it: the prompt set, what is refused before
any work, and the measuring process launched (speculative/run.py) and its output placed in the profile document."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deltaship.devices.discovery import fingerprint
from deltaship.errors import DeltashipError
from deltaship.models.presets import PRESETS
from deltaship.models.trained import HELDOUT
from deltaship.profiling.launch import run_worker
from deltaship.runtimes.speculative import require_head
from deltaship.runtimes.tokenizer import load_tokenizer

PROMPTS = 8
PROMPT_BYTES = 64


def random_weights(manifest: dict[str, Any]) -> bool:
    """True for a bundle of a preset whose weights are random (its head drafts nothing worth accepting)."""
    source = manifest.get("source") or {}
    if source.get("kind") != "preset":
        return False
    preset = PRESETS.get(source.get("model", ""))
    return preset is not None and preset.weights.startswith("random")


def prompt_set(bundle: Path, manifest: dict[str, Any]) -> list[list[int]]:
    """The fixed prompts: PROMPTS windows of PROMPT_BYTES bytes of the tiny preset's held-out text."""
    text = HELDOUT.read_bytes()
    windows = [text[o : o + PROMPT_BYTES] for o in range(0, PROMPTS * 500, 500)]
    if "tokenizer.json" in manifest.get("tokenizer", {}).get("files", []):
        tok = load_tokenizer(bundle, manifest)
        return [tok.encode(w.decode("utf-8", "replace")) for w in windows]
    return [list(w) for w in windows]


def check(
    bundle: Path,
    manifest: dict[str, Any],
    cfg: dict[str, Any],
    depth: int,
    *,
    device: str = "host",
    runtime: str | None = None,
    provider: str = "cpu",
    tier: str | None = None,
    acceptance: float | None = None,
) -> None:
    """Refuse what cannot be profiled speculatively, before any work."""
    require_head(bundle, manifest)
    if acceptance is not None and not 0 < acceptance <= 1:
        raise DeltashipError(
            f"--acceptance {acceptance}: an acceptance rate is a fraction above 0, at most 1", "e.g. --acceptance 0.75"
        )
    if device != "host" or runtime is not None or provider != "cpu" or tier is not None:
        raise DeltashipError(
            "--speculative profiles on this host, in deltaship's own runtime on the CPU (no --tier yet)",
            "drop --device/--runtime/--provider/--tier, or drop --speculative",
        )
    mc, c, gen = int(manifest["max_context"]), min(cfg["contexts"] or [128]), int(cfg["gen"])
    if c + 2 * depth + 2 > mc or PROMPT_BYTES + gen > mc or gen < 2:
        raise DeltashipError(
            f"the speculative workload does not fit this bundle's max context of {mc}: calls of up to "
            f"{2 * depth + 2} tokens at context {c}, and prompts of up to {PROMPT_BYTES} tokens + --gen {gen}",
            "pass a smaller --contexts / --gen (at least 2), or export with a larger --max-context",
        )


def profile_speculative(
    path: Path, cfg: dict[str, Any], depth: int, threads: int | None, say, acceptance: float | None = None
) -> dict[str, Any]:
    """Run the measuring process; the parts of the profile document it fills: results, speculative, runtime."""
    wcfg = {
        "bundle": str(path),
        "threads": threads,
        "depth": depth,
        "context": min(cfg["contexts"] or [128]),
        "gen": cfg["gen"],
        "warmups": cfg["warmups"],
        "reps": cfg["reps"],
        "min_seconds": cfg["min_seconds"],
        **({"acceptance": acceptance, "acceptance_source": "given with --acceptance"} if acceptance else {}),
    }
    say(f"profiling speculative decoding (mtp:{depth}) of {path.name} on the host ({threads or 'default'} threads)")
    out, died = run_worker(wcfg, module="deltaship.profiling.speculative.run")
    doc: dict[str, Any] = {"device": fingerprint("host"), "threads": threads}
    if died:
        doc["results"] = [died]
    else:
        doc.update(results=out["results"], speculative=out["speculative"], runtime=out["runtime"])
    return doc
