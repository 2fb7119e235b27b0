"""The test run's layout: under pytest-xdist each module's tests stay on one worker (conftest marks them with
xdist_group, pyproject runs --dist loadgroup), so a module's fixtures, ExecuTorch exports among them, are built
once. pytest 9.2 stores node ids where pytest-xdist 3.8 cannot suffix them with the group, and every module's tests
spread over the workers instead, each worker building the module's fixtures (the whole suite on 2 cores, 2026-11-26:
52 min 54 s with pytest 9.2.0, 43 min 11 s with 9.1.1); pyproject pins pytest below 9.2, and this test fails if the
grouping stops working."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_modules_tests_run_on_one_worker():
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "-v", "-p", "no:cacheprovider", "tests/test_gpu_bench.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    workers = re.findall(r"\[(gw\d+)\] .*PASSED tests/test_gpu_bench\.py", r.stdout)
    assert len(workers) >= 5 and len(set(workers)) == 1, sorted(set(workers))
