"""Where an ExecuTorch program spends its time, per op (ExecuTorch's ETDump), for a prefill and a decode step.

    python bench/runtimes/et_ops.py [PTE_OR_BUNDLE ...] [--prompt 512] [--threads 2] [--runs 3] \
        --out docs/results/executorch-ops.md

Defaults to the programs `bench/peers/et_vs_example.py --only-build` leaves in deltaship-bench/et under the system temp dir (deltaship's
fp32 and int4 bundles and ExecuTorch's own dynamic-shape example). Each program is loaded once with
ETDump on; a `--prompt`-token prefill (one call, or ceil(prompt / max chunk) calls for a program
whose tokens input is capped) and a decode step after it run `--runs` times after a warmup.
Events are summed per op (XNNPACK's own operator names inside delegate calls, `native_call_*` for
the portable and custom kernels); the numbers are milliseconds per run, the median over the runs.
ETDump timestamps every event, so small ops read a little slow; compare programs with each other.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
WORK = Path(tempfile.gettempdir()) / "deltaship-bench" / "et"  # where bench/peers/et_vs_example.py builds by default
DEFAULTS = [WORK / n for n in ("deltaship-int4", "deltaship-fp32", "et-example-8da4w-dynamic.pte")]
MARKERS = {"DELEGATE_CALL", "OPERATOR_CALL", "Program::load_method", "Method::init"}


def pte_of(path: Path) -> Path:
    return path / "model.pte" if path.is_dir() else path


def max_tokens(path: Path, default: int) -> int:
    """The longest call a program takes: deltaship's manifest says it; the example's dynamic program takes the
    whole prompt."""
    man = path / "manifest.json" if path.is_dir() else None
    if man and man.is_file():
        return int(json.loads(man.read_text())["prefill_chunk"])
    return default if "dynamic" in path.name else 1


def op_name(event_name: str) -> str:
    return re.sub(r" #\d+$", "", event_name)


def profile(path: Path, prompt: int, runs: int) -> dict[str, dict[str, float]]:
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401  (registers the llama:: kernels)
    import executorch.kernels.quantized  # noqa: F401  (registers the quantized kernels)
    import torch
    from executorch.devtools import Inspector
    from executorch.extension.pybindings.portable_lib import _load_for_executorch

    module = _load_for_executorch(str(pte_of(path)), enable_etdump=True, debug_buffer_size=0)
    chunk = max_tokens(path, prompt)
    ids = torch.randint(0, 1000, (1, prompt))

    def prefill() -> None:
        for start in range(0, prompt, chunk):
            module.forward((ids[:, start : start + chunk], torch.tensor([start], dtype=torch.long)))

    def decode() -> None:
        module.forward((ids[:, :1], torch.tensor([prompt], dtype=torch.long)))

    phases: dict[str, list[collections.Counter]] = {"prefill": [], "decode": []}
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(runs + 1):
            for phase, fn in (("prefill", prefill), ("decode", decode)):
                dump = Path(tmp) / f"{phase}{run}.etdp"
                fn()
                module.write_etdump_result_to_file(str(dump))
                if run == 0:
                    continue  # warmup
                per: collections.Counter = collections.Counter()
                for block in Inspector(etdump_path=str(dump)).event_blocks:
                    for ev in block.events:
                        if ev.perf_data is None:
                            continue
                        if ev.name == "Method::execute":
                            name = "whole run"
                        elif ev.name in MARKERS:
                            continue
                        else:
                            name = op_name(ev.name)
                        per[name] += sum(ev.perf_data.raw)
                phases[phase].append(per)
    return {
        phase: {op: statistics.median(r.get(op, 0.0) for r in rows) for op in set().union(*rows)}
        for phase, rows in phases.items()
    }


def table(results: dict[str, dict[str, dict[str, float]]], phase: str, top: int) -> list[str]:
    names = list(results)
    ops = collections.Counter()
    for r in results.values():
        for op, ms in r[phase].items():
            if op != "whole run":
                ops[op] = max(ops[op], ms)
    rows = [
        "| op | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
        "| **whole run** | " + " | ".join(f"**{results[n][phase].get('whole run', 0):.1f}**" for n in names) + " |",
    ]
    for op, _ in ops.most_common(top):
        rows.append(f"| {op} | " + " | ".join(f"{results[n][phase].get(op, 0.0):.2f}" for n in names) + " |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("programs", nargs="*", type=Path, default=DEFAULTS)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--top", type=int, default=16)
    ap.add_argument("--out", type=Path, required=True, help="the markdown results page to write")
    a = ap.parse_args()
    missing = [str(p) for p in a.programs if not pte_of(p).is_file()]
    if missing:
        print(
            f"no program at {', '.join(missing)}: run `python bench/peers/et_vs_example.py --only-build` first",
            file=sys.stderr,
        )
        return 2
    from executorch.extension.pybindings import portable_lib

    portable_lib._unsafe_reset_threadpool(a.threads)
    results = {}
    for p in a.programs:
        name = p.name.removesuffix(".pte")
        print(f"profiling {name}", flush=True)
        results[name] = profile(p, a.prompt, a.runs)
    lines = [
        f"# ExecuTorch time per op (ETDump): {a.prompt}-token prefill and one decode step",
        "",
        f"`python bench/runtimes/et_ops.py --prompt {a.prompt} --threads {a.threads} --runs {a.runs}`: ms per run, median "
        f"of {a.runs} after a warmup, ExecuTorch's event timestamps (delegate ops by XNNPACK's operator name, "
        "portable and custom kernels as native_call_*). Programs built by "
        "`bench/peers/et_vs_example.py --only-build`.",
        "",
    ]
    for phase, title in (("prefill", f"prefill, {a.prompt} tokens"), ("decode", "one decode step")):
        lines += [f"## {title}", ""] + table(results, phase, a.top) + [""]
    a.out.write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
