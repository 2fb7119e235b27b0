"""Profiling on an Android phone over adb, with a user-supplied runner binary.

deltaship cannot run Python on a phone, so the phone runs a native runner built for its ABI:
ExecuTorch's LLM runner (`llama_main`, prints a `PyTorchObserver {...}` JSON line per run) or
ONNX Runtime's `onnxruntime_perf_test` (prints an average inference time). The bundle is pushed
to /data/local/tmp/deltaship/, the runner is started `reps` times, and `dumpsys meminfo PID` is
polled while it runs for the PSS. Not run on a real phone here (no device attached): the parsing
and the adb plumbing up to "device absent" are tested.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

from deltaship.devices.discovery import adb_fingerprint
from deltaship.errors import DeltashipError
from deltaship.files import parse_json
from deltaship.stats import summarize
from deltaship.targets import get_target

REMOTE_ROOT = "/data/local/tmp/deltaship"


def parse_runner_output(text: str) -> dict[str, float]:
    """Phase timings from a runner's output (ExecuTorch PyTorchObserver or ORT perf_test)."""
    out: dict[str, float] = {}
    m = re.search(r"PyTorchObserver\s*(\{.*\})", text)
    if m:
        fix = "run a runner that prints ExecuTorch's PyTorchObserver line"
        o = parse_json(m.group(1), "the runner's PyTorchObserver line", "record", fix)
        fields = ("model_load_start_ms", "model_load_end_ms", "inference_start_ms", "prompt_eval_end_ms")
        fields += ("first_token_ms", "inference_end_ms", "prompt_tokens")
        if not isinstance(o, dict) or any(isinstance(o.get(k), bool) or not isinstance(o.get(k), (int, float))
                                          for k in fields):  # fmt: skip
            raise DeltashipError(f"the runner's PyTorchObserver line lacks a number of {', '.join(fields)}", fix)
        ms = lambda a, b: (o[b] - o[a]) / 1000.0  # noqa: E731
        out["load_cold_s"] = ms("model_load_start_ms", "model_load_end_ms")
        prefill = ms("inference_start_ms", "prompt_eval_end_ms")
        if prefill > 0:
            out["prefill_tok_s"] = o["prompt_tokens"] / prefill
        out["ttft_s"] = ms("inference_start_ms", "first_token_ms")
        decode = ms("first_token_ms", "inference_end_ms")
        generated = o.get("generated_tokens", 0)
        if decode > 0 and isinstance(generated, int) and not isinstance(generated, bool) and generated > 1:
            out["decode_tok_s"] = (generated - 1) / decode
        return out
    m = re.search(r"Average inference time cost:\s*([\d.]+)\s*ms", text)
    if m:
        out["inference_s"] = float(m.group(1)) / 1000
    return out


def parse_pss(dumpsys: str) -> int | None:
    """Total PSS in bytes from `dumpsys meminfo PID`."""
    m = re.search(r"TOTAL PSS:\s*(\d+)", dumpsys) or re.search(r"^\s*TOTAL\s+(\d+)", dumpsys, re.M)
    return int(m.group(1)) * 1024 if m else None


def runner_command(remote: str, template: str, fields: dict[str, Any]) -> str:
    """The `adb shell` command line that runs the runner in `remote` with `template` (the runner's argument
    line, `{model}`-style fields). adb joins its arguments into one remote shell line, so every field (the
    model path comes from the bundle's manifest) and the directory are quoted: no manifest value reaches the
    phone's shell as syntax."""
    quoted = {k: shlex.quote(str(v)) for k, v in fields.items()}
    argline = template.format(**quoted)
    return f"cd {shlex.quote(remote)} && {shlex.quote(REMOTE_ROOT + '/runner')} {argline} & echo PID:$!; wait"


def _adb(serial: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["adb", "-s", serial, *args], capture_output=True, text=True, timeout=timeout)


def profile_adb(
    path: Path,
    manifest: dict[str, Any],
    serial: str,
    cfg: dict[str, Any],
    runner: str | None,
    runner_args: str | None,
    say: Callable[[str], None],
) -> dict[str, Any]:
    fp = adb_fingerprint(serial)  # clear error when adb is missing or the phone is absent
    if not runner:
        raise DeltashipError(
            "profiling on Android needs --runner: a runner binary built for the phone's ABI "
            f"({fp.get('abi')}), e.g. ExecuTorch's llama_main or onnxruntime_perf_test",
            "build the runner for Android and pass --runner PATH (and --runner-args if needed)",
        )

    target = manifest["target"]
    default_args = get_target(target).android_runner_args
    if default_args is None:
        raise DeltashipError(f"{target} bundles do not run on Android", "export for executorch or onnx")
    remote = f"{REMOTE_ROOT}/{path.name}"  # adb push keeps the directory's name; quoted in every shell line
    say(f"adb:{serial}: pushing {path.name}")
    for args in (
        ("shell", "mkdir", "-p", REMOTE_ROOT),
        ("push", str(path), REMOTE_ROOT),
        ("push", runner, f"{REMOTE_ROOT}/runner"),
        ("shell", "chmod", "755", f"{REMOTE_ROOT}/runner"),
    ):
        r = _adb(serial, *args)
        if r.returncode != 0:
            raise DeltashipError(
                f"adb:{serial}: `adb {' '.join(args)}` failed: {r.stderr.strip()[-300:]}",
                "check the phone is still attached and has free space in /data/local/tmp",
            )
    model = f"{remote}/{manifest['entry']}"
    results: list[dict[str, Any]] = []
    for p in cfg["prompt_lengths"]:
        fields = {
            "model": model,
            "prompt_length": p,
            "gen": cfg["gen"],
            "total": p + cfg["gen"],
            "threads": cfg.get("threads") or 4,
            "reps": cfg["reps"],
            "bundle_dir": remote,
        }
        cmd = runner_command(remote, runner_args or default_args, fields)
        phases: dict[str, list[float]] = {}
        pss: list[int] = []
        for _ in range(cfg["reps"]):
            proc = subprocess.Popen(
                ["adb", "-s", serial, "shell", cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            first = proc.stdout.readline()
            pid = first.strip().removeprefix("PID:")
            if not pid.isdigit():  # it goes into a shell line below: only a process id may
                pid = ""
            while proc.poll() is None:
                got = parse_pss(_adb(serial, "shell", "dumpsys", "meminfo", pid, timeout=30).stdout)
                if got:
                    pss.append(got)
                time.sleep(0.5)
            text = proc.stdout.read()
            if proc.returncode != 0:
                results.append(
                    {
                        "metric": "run",
                        "status": "died",
                        "reason": f"runner exited {proc.returncode}",
                        "prompt_length": p,
                        "stderr_tail": text[-2000:],
                        "samples": [],
                        "flags": ["died"],
                    }
                )
                break
            for k, v in parse_runner_output(text).items():
                phases.setdefault(k, []).append(v)
        for k, samples in phases.items():
            unit = "tok/s" if k.endswith("tok_s") else "s"
            results.append({"metric": k, "unit": unit, "prompt_length": p, "samples": samples, **summarize(samples)})
        if pss:
            results.append(
                {
                    "metric": "peak_pss_bytes",
                    "unit": "bytes",
                    "prompt_length": p,
                    "samples": [max(pss)],
                    **summarize([max(pss)]),
                    "note": "dumpsys meminfo TOTAL PSS, polled every 0.5 s",
                }
            )
    _adb(serial, "shell", "rm", "-rf", shlex.quote(remote))
    return {"device": fp, "results": results, "runtime": f"{target} runner {Path(runner).name}"}
