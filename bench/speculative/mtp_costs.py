"""Speculative decoding with the MTP head, per target, in one run: what each call costs at 0.8B int4 (random
weights), the acceptance the trained tiny head gets on the same target, and what the two give against plain
decoding and the one-token bandwidth roofline.
Regenerates: docs/results/mtp.md.

    deltaship export --model qwen3.5-0.8b --target onnx --precision int4 --mtp --mtp-draft-vocab 32768 \
        --max-context 512 --no-verify --out B08
    deltaship export --model qwen3.5-0.8b --target executorch --precision int4 --mtp --mtp-draft-vocab 32768 \
        --max-context 512 --no-verify --out B08ET
    deltaship export --model qwen3.5-tiny --target onnx --precision int4 --mtp --max-context 1024 --out TINY
    deltaship export --model qwen3.5-tiny --target executorch --precision int4 --mtp --max-context 1024 --out TINYET
    python bench/speculative/mtp_costs.py --big onnx=B08 --big executorch=B08ET --tiny onnx=TINY --tiny executorch=TINYET \
        --out bench/results/mtp.json

Every bundle is profiled by `deltaship profile BUNDLE --speculative mtp:K` (deltaship/profiling/speculative/run.py, a
fresh process each): one plain decode step, verify calls of 1 .. K+2 tokens, draft calls, the DeltaNet snapshot and
restore, then greedy decode tokens/s without and with the head over 8 fixed prompts, and the acceptance.

- tiny (trained head): the acceptance is real; its measured rate on a target is the rate the 0.8B projection of the
  same target assumes (a projection, labelled so: the 0.8B's random head accepts nothing).
- 0.8B: the costs, and decode tokens/s without the head measured (and with it, at a random head's ~0 acceptance);
  decode tokens/s with the head timed at the tiny's acceptance imposed (the driver's real calls, each draft
  accepted at that rate by rigging the verify logits: ImposedAcceptance in deltaship/profiling/speculative/imposed.py);
  the projected speculative tokens/s at the tiny's acceptance (from the per-call costs); the one-token roofline: the machine's read bandwidth
  (a multi-threaded sum over 1 GiB, best of 5: bench/tools/bandwidth.py) over the bytes of the decoder's weight files
  (ONNX: model.onnx + model.onnx.data, the head's mtp.onnx.data left out; ExecuTorch: the whole model.pte, the
  head's own weights included, since they share one file), i.e. every stored weight read once per token.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tools"))
from bandwidth import bandwidth  # noqa: E402  (bench/tools/)


def decoder_bytes(bundle: Path) -> int:
    from deltaship.bundle.reader import read_manifest

    m = read_manifest(bundle)
    if m["target"] == "onnx":
        return sum((bundle / f).stat().st_size for f in ("model.onnx", "model.onnx.data") if (bundle / f).exists())
    return sum(f.stat().st_size for f in bundle.glob("*.pte"))


def pairs(values: list[str]) -> dict[str, Path]:
    out = {}
    for v in values:
        target, _, path = v.partition("=")
        out[target] = Path(path)
    return out


def main() -> int:
    from deltaship.profiling.profile import profile

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big", action="append", default=[], help="TARGET=BUNDLE: the 0.8B int4 --mtp bundle")
    ap.add_argument("--tiny", action="append", default=[], help="TARGET=BUNDLE: the trained tiny --mtp bundle")
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gen", type=int, default=32, help="new tokens per prompt (8 prompts)")
    ap.add_argument("--tiny-gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--min-seconds", type=float, default=2.0)
    ap.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    a = ap.parse_args()
    big, tiny = pairs(a.big), pairs(a.tiny)
    spec = f"mtp:{a.depth}"
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    res: dict = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE
        ).stdout.strip(),
        "machine": f"{platform.machine()}, {platform.processor() or platform.platform()}",
        "command": " ".join(["python", "bench/speculative/mtp_costs.py", *sys.argv[1:]]),
        "depth": a.depth,
        "threads": a.threads,
        "targets": {},
    }
    bw = [bandwidth(a.threads)]
    for target in dict.fromkeys([*tiny, *big]):
        row: dict = {}
        acceptance = None
        if target in tiny:
            doc = profile(
                tiny[target], speculative=spec, threads=a.threads, gen=a.tiny_gen, reps=a.reps,
                min_seconds=a.min_seconds, progress=say,
            )  # fmt: skip
            row["tiny"] = {"bundle": str(tiny[target]), **doc["speculative"]}
            acceptance = doc["speculative"]["acceptance"]["acceptance_rate"]
        if target in big:
            doc = profile(
                big[target], speculative=spec, threads=a.threads, gen=a.gen, reps=a.reps,
                min_seconds=a.min_seconds, progress=say, acceptance=acceptance,
            )  # fmt: skip
            s = doc["speculative"]
            if acceptance is not None:
                s["projection"]["source"] = s["decode_tok_s_imposed"]["source"] = (
                    f"measured in this run on qwen3.5-tiny ({target}, {row['tiny']['acceptance']['prompts']} prompts "
                    f"x {row['tiny']['acceptance']['new_tokens']} greedy tokens): {acceptance}"
                )
            bw.append(bandwidth(a.threads))
            size = decoder_bytes(big[target])
            roof = max(bw) * 1e9 / size  # the best read bandwidth seen in the run: the roofline is an upper bound
            plain = 1e3 / s["costs_ms"]["decode_step"]
            row["big"] = {"bundle": str(big[target]), **s}
            row["roofline"] = {
                "bandwidth_gbs": [round(x, 2) for x in bw],
                "decoder_bytes": size,
                "tokens_per_s": round(roof, 2),
                "plain_decode_step_tok_s": round(plain, 2),
                "plain_percent_of_roofline": round(100 * plain / roof, 1),
                "projected_speculative_tok_s": s["projection"]["tokens_per_s"],
                "projected_percent_of_roofline": round(100 * s["projection"]["tokens_per_s"] / roof, 1),
                "plain_decode_tok_s": s["decode_tok_s_imposed"]["plain"],
                "imposed_speculative_tok_s": s["decode_tok_s_imposed"]["speculative"],
                "imposed_speedup": s["decode_tok_s_imposed"]["speedup"],
                "imposed_percent_of_roofline": round(100 * s["decode_tok_s_imposed"]["speculative"] / roof, 1),
            }
        res["targets"][target] = row
        say(json.dumps(row.get("roofline", {})))
    text = json.dumps(res, indent=1)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
