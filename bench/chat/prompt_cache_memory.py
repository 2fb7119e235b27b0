"""What restoring a bundle's shipped prompt cache adds to the peak RSS, beside what `deltaship plan` counts for it.
Regenerates: the prompt cache's memory paragraph of docs/chat.md.

    python bench/chat/prompt_cache_memory.py BUNDLE [--runs 5]

BUNDLE: exported with --prompt-cache (Linux: VmHWM, reset through /proc/self/clear_refs). Each run is a fresh
process: a chat opens on the bundle without the cache (its reset() zeroes every state buffer in place, so all of them
are resident, as the plan counts them), prefills 64 tokens (the runtime's arena, as a chat that resets after a turn
holds it) and resets; then the peak RSS growth across the restore (deltaship.chat.store.apply_prompt_cache) and the
RSS it leaves. The plan's term is deltaship.devices.plan.planned_peak(manifest)["prompt_cache"]["restore_bytes"].
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MIB = 2**20


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def child(bundle: Path) -> dict:
    import gc

    import jsonschema  # noqa: F401  imported before the measurement, as in a chat that saved or loaded before
    import safetensors.numpy  # noqa: F401

    from deltaship.chat import Chat
    from deltaship.chat.store import apply_prompt_cache

    manifest = json.loads((bundle / "manifest.json").read_text())
    chat = Chat(bundle, system=manifest["chat"]["prompt_cache"]["system"], threads=1, prompt_cache=False)
    chat.session.prefill([5] * 64)
    chat.session.reset()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _status("VmRSS:")
    assert apply_prompt_cache(chat), "the bundle's prompt cache did not apply"
    gc.collect()
    return {"peak_growth_bytes": _status("VmHWM:") - before, "held_after_bytes": _status("VmRSS:") - before}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.bundle)))
        return
    from deltaship.devices.plan import planned_peak

    manifest = json.loads((a.bundle / "manifest.json").read_text())
    plan = planned_peak(manifest, 64)["prompt_cache"]
    runs = [
        json.loads(
            subprocess.run(
                [sys.executable, __file__, str(a.bundle), "--child"], check=True, capture_output=True, text=True
            ).stdout
        )  # fmt: skip
        for _ in range(a.runs)
    ]
    print(
        f"{a.bundle}: prompt cache {plan['tokens']:,} tokens, file {plan['file_bytes'] / MIB:.2f} MiB, context "
        f"{manifest['max_context']}; planned restore {plan['restore_bytes'] / MIB:.2f} MiB; measured peak growth "
        + ", ".join(f"{r['peak_growth_bytes'] / MIB:.2f}" for r in runs)
        + " MiB; held after "
        + ", ".join(f"{r['held_after_bytes'] / MIB:.2f}" for r in runs)
        + " MiB"
    )


if __name__ == "__main__":
    main()
