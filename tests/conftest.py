from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from filelock import FileLock

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from helpers import ALL_CONFIGS, TINY_DRAFT_VOCAB, write_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Every tiny config of the table, written once per session with transformers."""
    root = tmp_path_factory.mktemp("ckpt")
    return {name: write_checkpoint(name, root / name, seed=i) for i, name in enumerate(ALL_CONFIGS)}


def _shared_root(tmp_path_factory, name: str) -> Path:
    """A directory every pytest-xdist worker of this run sees (the workers' common base temp), else the session's."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    root.mkdir(exist_ok=True)
    return root


def _build_once(out: Path, build) -> Path:
    """Build `out` once per test run, whichever worker asks first; the others wait on the lock, then reuse it.
    (pytest-xdist runs session fixtures once per worker: an export shared this way is paid once.)"""
    with FileLock(str(out) + ".lock"):
        done = out.with_name(out.name + ".built")  # beside the bundle: nothing foreign inside it
        if not done.exists():
            build(out)
            done.touch()
    return out


@pytest.fixture(scope="session")
def bundles(tmp_path_factory, checkpoints):
    """Exported bundles, built on first use and shared: bundles(config, target, precision)."""
    from deltaship.bundle import read_manifest, schema_problems
    from deltaship.compile import export

    root = _shared_root(tmp_path_factory, "bundles")

    def get(config: str, target: str = "onnx", precision: str = "fp32", **opts) -> Path:
        out = root / "-".join([config, target, precision] + [f"{k}{v}" for k, v in sorted(opts.items())])

        def build(out: Path) -> None:
            kw = {"max_context": 128, "prefill_chunk": 8, "verify": False, **opts}  # tests make their own checks
            export(str(checkpoints[config]), out, target=target, precision=precision, progress=False, **kw)
            problems = schema_problems(read_manifest(out))  # every test bundle against the bundle's JSON Schema
            assert not problems, problems

        return _build_once(out, build)

    return get


@pytest.fixture(scope="session")
def tiny_pte(tmp_path_factory):
    """The trained tiny preset as an ExecuTorch bundle (max context 128, prefill chunk 16), exported once per
    session and precision for every test that needs a .pte of it: an ExecuTorch export takes minutes. fp32 and int4
    carry the MTP head (methods 'verify' and 'mtp_draft' beside 'forward', which the plain session and ExecuTorch's
    runner run alone), int4's drafting over a TINY_DRAFT_VOCAB-id vocabulary: the speculative tests
    (test_mtp_executorch, test_draft_vocab) read these programs instead of exporting their own."""
    from deltaship.compile import export

    root = _shared_root(tmp_path_factory, "tiny-pte")
    heads = {"fp32": {"mtp": True}, "int4": {"mtp": True, "mtp_draft_vocab": TINY_DRAFT_VOCAB}}

    def get(precision: str = "fp32") -> Path:
        def build(out: Path) -> None:
            export("qwen3.5-tiny", out, target="executorch", precision=precision, max_context=128, prefill_chunk=16,
                   verify=False, progress=False, **heads.get(precision, {}))  # fmt: skip

        return _build_once(root / precision, build)

    return get


@pytest.fixture(scope="session")
def shared_export(tmp_path_factory):
    """get(name, model, **export_kwargs): that export, built once per test run under `name`, whichever worker or
    module asks first. A module-scoped fixture is built again each time pytest-xdist hands its worker a test of
    that module after one of another (the module's fixtures are torn down in between): at minutes an ExecuTorch
    export, the 2026-11-26 run paid the MTP .pte twice. Module fixtures that export call this instead."""
    from deltaship.compile import export

    root = _shared_root(tmp_path_factory, "shared-exports")

    def get(name: str, model: str, **kwargs) -> Path:
        return _build_once(root / name, lambda out: export(model, out, progress=False, **kwargs))

    return get


@pytest.fixture(scope="session")
def tiny_coreml_mtp(tmp_path_factory):
    """The trained tiny preset exported for Core ML with its MTP head (max context 128, prefill chunk 16), built
    once per session and build for every test that needs one (speculative decoding, its profile, the Swift kit):
    fp32 (every state an io tensor), int4, or fp16-state (the DeltaNet states and both KV caches as Core ML states,
    which the snapshot copies out of the state buffers)."""
    from deltaship.compile import export

    root = _shared_root(tmp_path_factory, "coreml-mtp")

    def get(build: str = "fp32") -> Path:
        precision, _, states = build.partition("-")

        def build_it(out: Path) -> None:
            export("qwen3.5-tiny", out, target="coreml", precision=precision, max_context=128, prefill_chunk=16,
                   mtp=True, verify=False, progress=False, **({"coreml_states": states} if states else {}))  # fmt: skip

        return _build_once(root / build, build_it)

    return get


# The fast tier (`python -m pytest -m "not slow"`) leaves out what exports through the slow toolchains
# (ExecuTorch's XNNPACK lowering, Core ML conversion and its op-by-op evaluation), trains, profiles in
# subprocesses or drives a browser: these modules, any test parametrized with one of these targets, and any test
# that needs the session's ExecuTorch or Core ML --mtp export of the tiny preset.
SLOW_MODULES = {
    "test_executorch",
    "test_coreml",
    "test_trained",
    "test_profiling",
    "test_js",
    "test_app_kits",
}
SLOW_TARGETS = {"executorch", "coreml"}


# Under pytest-xdist (what CI runs: `-n auto`, with `--dist loadgroup` from pyproject.toml) a module's tests stay
# on one worker, so its module-scoped fixtures (exports, references) are built once; test_parity's rows share only
# session fixtures and spread over the workers one by one. Session exports are shared across workers (_build_once).
SPREAD_MODULES = {"test_parity"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(items):
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        # the closure of the fixtures it uses
        slow_export = "tiny_pte" in item.fixturenames or "tiny_coreml_mtp" in item.fixturenames
        if item.module.__name__ in SLOW_MODULES or params.get("target") in SLOW_TARGETS or slow_export:
            item.add_marker(pytest.mark.slow)
        if item.module.__name__ not in SPREAD_MODULES:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
