from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from helpers import ALL_CONFIGS, write_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Every tiny config of the table, written once per session with transformers."""
    root = tmp_path_factory.mktemp("ckpt")
    return {name: write_checkpoint(name, root / name, seed=i) for i, name in enumerate(ALL_CONFIGS)}


@pytest.fixture(scope="session")
def bundles(tmp_path_factory, checkpoints):
    """Exported bundles, built on first use and shared: bundles(config, target, precision)."""
    from deltaship.bundle import read_manifest, schema_problems
    from deltaship.export import export

    root = tmp_path_factory.mktemp("bundles")
    cache: dict[tuple, Path] = {}

    def get(config: str, target: str = "onnx", precision: str = "fp32", **opts) -> Path:
        key = (config, target, precision, tuple(sorted(opts.items())))
        if key not in cache:
            out = root / "-".join([config, target, precision] + [f"{k}{v}" for k, v in sorted(opts.items())])
            opts.setdefault("max_context", 128)
            opts.setdefault("prefill_chunk", 8)
            opts.setdefault("verify", False)  # the tests make their own comparisons
            export(str(checkpoints[config]), out, target=target, precision=precision, progress=False, **opts)
            problems = schema_problems(read_manifest(out))  # every test bundle against the bundle's JSON Schema
            assert not problems, problems
            cache[key] = out
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tiny_pte(tmp_path_factory):
    """The trained tiny preset as an ExecuTorch bundle (max context 128, prefill chunk 16), exported once per
    session and precision for every test that needs a .pte of it: an ExecuTorch export takes minutes."""
    from deltaship.export import export

    root = tmp_path_factory.mktemp("tiny-pte")
    cache: dict[str, Path] = {}

    def get(precision: str = "fp32") -> Path:
        if precision not in cache:
            out = root / precision
            export(
                "qwen3.5-tiny",
                out,
                target="executorch",
                precision=precision,
                max_context=128,
                prefill_chunk=16,
                verify=False,
                progress=False,
            )
            cache[precision] = out
        return cache[precision]

    return get


# The fast tier (`python -m pytest -m "not slow"`) leaves out what exports through the slow toolchains
# (ExecuTorch's XNNPACK lowering, Core ML conversion and its op-by-op evaluation), trains, profiles in
# subprocesses or drives a browser: these modules, any test parametrized with one of these targets, and any test
# that needs the session's ExecuTorch export of the tiny preset.
SLOW_MODULES = {
    "test_executorch",
    "test_coreml",
    "test_trained",
    "test_profiling",
    "test_js",
    "test_app_kits",
    "test_readme",
}
SLOW_TARGETS = {"executorch", "coreml"}


def pytest_collection_modifyitems(items):
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        exports_a_pte = "tiny_pte" in item.fixturenames  # the closure of the fixtures it uses
        if item.module.__name__ in SLOW_MODULES or params.get("target") in SLOW_TARGETS or exports_a_pte:
            item.add_marker(pytest.mark.slow)
