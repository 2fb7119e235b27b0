"""Profile bundles on this host and plan every preset for every tier.

    python bench/runtimes/profile_runs.py [--threads 2] [--work DIR] --out docs/results/profiles.md

Exports qwen3.5-tiny and qwen3.5-0.8b (ONNX int4 and fp32, ExecuTorch int4), profiles each with
`deltaship profile` (prompt lengths 128 and 512, 64 decode steps, context sweep 128/1024/4096, tier
emulation where asked), writes the JSON records and self-contained HTML reports to
--work (default: deltaship-bench/profiles in the system temp dir), opens every report in headless Chromium (the plots must decode), and adds the
`deltaship plan` tables of all four presets for every tier, with the planned memory of each profiled
bundle next to its measured peak RSS.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from deltaship.compile import export
from deltaship.devices.catalog import load_catalog
from deltaship.devices.plan import format_table, overhead_bytes, plan, state_bytes, weight_bytes
from deltaship.models.presets import PRESETS
from deltaship.profiling.profile import profile
from deltaship.profiling.report import format_results

HERE = Path(__file__).parent
RUNS = [
    ("qwen3.5-tiny", "onnx", "int4", None),
    ("qwen3.5-tiny", "onnx", "fp32", None),
    ("qwen3.5-0.8b", "onnx", "int4", "phone-8gb"),
    ("qwen3.5-0.8b", "onnx", "fp32", None),
    ("qwen3.5-0.8b", "executorch", "int4", None),
]


def browser_check(report: Path, work: Path) -> str:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        return "chromium not installed"
    cmd = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={work / 'chrome'}",
        "--virtual-time-budget=5000",
        "--dump-dom",
        report.as_uri(),
    ]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=180).stdout
    m = re.search(r'<span id="check" data-expected="(\d+)">([^<]*)</span>', dom)
    return f"{m.group(2)} plots decoded" if m else "report did not load"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "deltaship-bench" / "profiles")
    ap.add_argument("--out", type=Path, required=True, help="the markdown results page to write")
    ap.add_argument("--note", default="", help="how the run was made, when not on an idle machine (goes in the header)")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Profiles on this host, and the memory plan",
        "",
        f"`python bench/runtimes/profile_runs.py --threads {a.threads}`: Linux x86-64, 2 cores, 24 GiB; each profile "
        "is `deltaship profile BUNDLE --prompt-lengths 128,512 --gen 64 --contexts 128,1024,4096` "
        "(tiny: 4000, its limit is 4096; medians, bootstrap 95% CI). Reports: *.html in the work dir.",
        *(["", f"Run conditions: {a.note}"] if a.note else []),
        "",
    ]
    summary = [
        "| bundle | prefill 128 tok/s | prefill 512 tok/s | TTFT 512 ms | decode tok/s | decode ms at contexts "
        "128 / 1024 / 4096 | peak RSS MiB | planned MiB | report |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    tables = []
    for preset, target, precision, tier in RUNS:
        name = f"{preset}-{target}-{precision}"
        bundle = a.work / name
        spec = PRESETS[preset].spec()
        max_context = min(4608, spec.max_position_embeddings)  # the tiny model was trained to 4096
        contexts = [128, 1024, 4096 if max_context > 4096 else max_context - 96]
        if not (bundle / "manifest.json").is_file():
            export(
                preset,
                bundle,
                target=target,
                precision=precision,
                max_context=max_context,
                force=True,
                verify=False,
                progress=False,
            )
        doc = profile(
            bundle,
            prompt_lengths=[128, 512],
            gen=64,
            contexts=contexts,
            threads=a.threads,
            json_out=a.work / f"{name}.json",
            report=a.work / f"{name}.html",
        )
        check = browser_check(a.work / f"{name}.html", a.work)
        get = lambda m, **w: next(  # noqa: E731
            (r for r in doc["results"] if r["metric"] == m and all(r.get(k) == v for k, v in w.items())),
            None,
        )
        planned = (
            weight_bytes(spec, target, precision)
            + state_bytes(spec, target, precision, max_context)
            + overhead_bytes(spec, target, precision, max_context)
        )
        dec = [get("decode_latency_s", context=c) for c in contexts]
        summary.append(
            f"| {name} | {get('prefill_tok_s', prompt_length=128)['median']:.1f} | "
            f"{get('prefill_tok_s', prompt_length=512)['median']:.1f} | {get('ttft_s', prompt_length=512)['median'] * 1e3:.0f} | "
            f"{get('decode_tok_s')['median']:.1f} | "
            + " / ".join(f"{d['median'] * 1e3:.2f} (@{c})" for c, d in zip(contexts, dec))
            + f" | {get('peak_rss_bytes')['median'] / 2**20:.0f} | {planned / 2**20:.0f} | {check} |"
        )
        tables.append(f"### {name}\n\n```\n{format_results(doc)}\n```\n")
        if tier:
            tdoc = profile(
                bundle,
                prompt_lengths=[128],
                gen=32,
                contexts=[1024],
                tier=tier,
                json_out=a.work / f"{name}-{tier}.json",
                breakdown=False,
            )
            tables.append(f"### {name} under tier {tier}\n\n```\n{format_results(tdoc)}\n```\n")
    lines += summary + [""] + tables
    _, models = load_catalog()
    for preset in ("qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b", "qwen3.5-9b"):
        lines += [
            f"## plan: {preset} (family tiers: {', '.join(models.get(preset, []))})",
            "",
            f"`deltaship plan --model {preset}`",
            "",
            "```",
            format_table(plan(preset)),
            "```",
            "",
        ]
    a.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[: 12 + len(RUNS)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
