"""Quiet by default, progress on long steps: the progress display in a log, the heartbeat, native stderr capture."""

from __future__ import annotations

import io
import subprocess
import sys
import time

from deltaship.progress import Progress, heartbeat


class Log(io.StringIO):
    def isatty(self) -> bool:
        return False


def test_a_short_steps_detail_adds_no_line_to_a_log_and_a_long_one_is_never_silent():
    """In a log, a step's detail is written only once `every` seconds passed without a line: a quick lowering does
    not leave its last tensor's name behind (the stray `lm_head.weight` line), a long one reports regularly."""
    log = Log()
    say = Progress(stream=log, every=0.3)
    say("lowering to onnx")
    say("lowering to onnx: lm_head.weight", inline=True)
    assert log.getvalue().splitlines()[-1].endswith("] lowering to onnx")  # no detail line
    say("verify: parity")
    with heartbeat(lambda m: say(m, inline=True), "verify: parity, prompt 3/3", every=0.05):
        time.sleep(1.0)
    beats = [ln for ln in log.getvalue().splitlines() if "prompt 3/3" in ln]
    assert 2 <= len(beats) <= 4, beats  # about one per 0.3 s, not one per 0.05 s beat
    assert all(ln.startswith("[") and "s] verify: parity, prompt 3/3, " in ln for ln in beats)


def test_heartbeat_stops_with_its_block():
    said: list[str] = []
    with heartbeat(said.append, "still lowering to XNNPACK", every=0.02):
        time.sleep(0.2)
    n = len(said)
    time.sleep(0.1)
    assert n >= 3 and len(said) == n and said[0].startswith("still lowering to XNNPACK, ")


def test_quiet_progress_says_nothing():
    log = Log()
    say = Progress(enabled=False, stream=log, every=0.0)
    say("a")
    with heartbeat(lambda m: say(m, inline=True), "b", every=0.01):
        time.sleep(0.05)
    assert log.getvalue() == ""


NATIVE = """
import os, sys
from deltaship.logs import native_stderr
try:
    with native_stderr():
        os.write(2, b"Failed to open midr file\\n")  # as C++ writes it: to the descriptor, past sys.stderr
        if len(sys.argv) > 1:
            raise RuntimeError("load failed")
except RuntimeError:
    pass
print("after", file=sys.stderr)
"""


def run_native(*args: str, verbose: bool = False) -> str:
    import os

    env = {k: v for k, v in os.environ.items() if k != "DELTASHIP_VERBOSE"}
    if verbose:
        env["DELTASHIP_VERBOSE"] = "1"
    res = subprocess.run([sys.executable, "-c", NATIVE, *args], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    return res.stderr


def test_native_stderr_is_hidden_shown_with_verbose_and_when_the_call_fails():
    assert run_native() == "after\n"
    assert run_native(verbose=True) == "Failed to open midr file\nafter\n"
    assert run_native("fail") == "Failed to open midr file\nafter\n"  # it may explain the failure


def test_verbose_flag_reaches_the_toolchains_settings():
    """`deltaship --verbose CMD` turns the third-party quieting off (ONNX Runtime logs warnings again)."""
    code = (
        "import sys; from deltaship import cli, logs; a = cli.build_parser().parse_args(sys.argv"
        "[1:]); logs.set_verbose(a.verbose); print(logs.verbose(), logs.ort_log_severity())"
    )
    for argv, want in ((["inspect", "x"], "False 3"), (["--verbose", "inspect", "x"], "True 0")):
        res = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
        assert res.stdout.split() == want.split(), res.stderr


def test_transformers_advice_stays_out_after_quieting():
    """quiet_third_party() before transformers is imported still holds once it configures its own logger (it
    sets its level on first use): its install advice for CUDA kernels is not the CPU user's business."""
    code = (
        "from deltaship.logs import quiet_third_party; quiet_third_party()\n"
        "from transformers.utils import logging as l\n"
        "l.get_logger('transformers.integrations.hub_kernels').warning('install `causal_conv1d`')\n"
    )
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("DELTASHIP_VERBOSE", "TRANSFORMERS_VERBOSITY")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert res.returncode == 0 and "causal_conv1d" not in res.stderr, res.stderr


# The toolchain calls of ExecuTorch's text lowering that take seconds to minutes and report nothing themselves.
SLOW_CALLS = {"torch.export.export", "to_edge_transform_and_lower", "to_executorch"}


def calls_outside_heartbeats(source: str) -> list[str]:
    """`name (line N)` of each SLOW_CALLS call in `source` that no enclosing `with heartbeat(...)` reports on."""
    import ast

    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

    def name(call: ast.Call) -> str:
        return ast.unparse(call.func).split(".")[-1] if isinstance(call.func, ast.Attribute) else ast.unparse(call.func)

    def covered(node: ast.AST) -> bool:
        while node in parents:
            node = parents[node]
            if isinstance(node, ast.With) and any(
                isinstance(i.context_expr, ast.Call) and ast.unparse(i.context_expr.func) == "heartbeat"
                for i in node.items
            ):
                return True
        return False

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (ast.unparse(node.func) in SLOW_CALLS or name(node) in SLOW_CALLS):
            if not covered(node):
                found.append(f"{ast.unparse(node.func)} (line {node.lineno})")
    return found


def test_the_executorch_lowering_reports_progress_through_every_toolchain_call():
    """torch.export of each method (forward, and --mtp's verify and mtp_draft), the XNNPACK lowering and
    to_executorch run inside a heartbeat: a log or terminal hears from the export while the toolchain works."""
    from pathlib import Path

    program = Path(__file__).resolve().parents[1] / "deltaship" / "lowering" / "executorch" / "program.py"
    assert calls_outside_heartbeats(program.read_text()) == []
    bare = "def f(m):\n    with torch.no_grad():\n        return torch.export.export(m, ())\n"
    assert calls_outside_heartbeats(bare) == ["torch.export.export (line 3)"]
    held = "def f(m):\n    with torch.no_grad(), heartbeat(say, 'x'):\n        return edge.to_executorch(c)\n"
    assert calls_outside_heartbeats(held) == []


EMBEDDING = """
import numpy as np
from deltaship.lowering.executorch.quant import quantized_embedding
table = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
print(quantized_embedding(lambda rows: table[rows], table.shape, "int8")[1])
"""


def test_the_executorch_embedding_quantizer_keeps_pytorch_tokenizers_log_off_stderr(capfd):
    """An ExecuTorch int4/int8 export builds its embedding with ExecuTorch's llama example, which loads
    pytorch_tokenizers: its C++ logs "I tokenizers:regex.cpp:40] Registering override fallback regex" to fd 2 once
    per process, at load. A fresh process (an earlier test may have loaded it already) runs that call; nothing of it
    may reach fd 2 (--verbose shows it: native_stderr, tested above)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "DELTASHIP_VERBOSE"}
    res = subprocess.run([sys.executable, "-c", EMBEDDING], env=env)  # fds inherited: capfd sees them
    out, err = capfd.readouterr()
    assert res.returncode == 0 and out.split() == ["8,0"], (out, err)
    assert err == "", err  # the tokenizers line, or any other third-party line
