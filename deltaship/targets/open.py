"""Open a bundle as a session: `open_bundle(path).generate(ids, 32)`; the registry picks the target's session.

Each target's session imports only its own runtime (onnxruntime for ONNX bundles: no torch).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from deltaship.bundle.reader import read_manifest, require_intact
from deltaship.errors import DeltashipError
from deltaship.options import at_least
from deltaship.options import threads as check_threads
from deltaship.runtimes import PROVIDERS
from deltaship.runtimes.base import Session
from deltaship.runtimes.numbers import number_problems
from deltaship.targets.registry import a_bundle, all_targets, get_target, target_names


def open_bundle(
    bundle: str | Path,
    *,
    threads: int | None = None,
    check_hashes: bool = True,
    prefill_chunk: int | None = None,
    provider: str = "cpu",
    runtime: str | None = None,
    prepack_cache: str | Path | None = None,
    **options: Any,
) -> Session:
    """Open a bundle for generation. The manifest is checked against the bundle schema and its paths
    (inside the bundle, listed in `files`), the files against its sizes (and sha256), and the artifact's
    inputs, outputs and states against the manifest's (every target), before the runtime loads anything.

    provider: "cpu", or "cuda" (ONNX bundles on ONNX Runtime's CUDA execution provider).
    prepack_cache: a directory (ONNX bundles, CPU): keep ONNX Runtime's packed weights there and map them at later
    opens instead of packing them again (deltaship/runtimes/onnx_prepack.py; about twice the weights on disk).
    runtime: which runtime runs it (the target's `runtimes`, e.g. "genai" for an ONNX bundle in
    onnxruntime-genai, as apps embed it); None: deltaship's own session for the target."""
    check_threads(threads)  # >= 1 or None, as the CLI's --threads
    if prefill_chunk is not None:
        at_least("--prefill-chunk", prefill_chunk, 1)
    if not isinstance(check_hashes, bool):
        raise DeltashipError(f"check_hashes must be True or False, got {check_hashes!r}", "pass a bool")
    if runtime is not None and not isinstance(runtime, str):
        raise DeltashipError(f"runtime must be a runtime's name, got {type(runtime).__name__}", "e.g. runtime='genai'")
    if provider not in PROVIDERS:
        raise DeltashipError(f"unknown provider {provider!r}; providers: {', '.join(PROVIDERS)}", "use cpu or cuda")
    manifest = read_manifest(bundle)
    require_intact(bundle, manifest, hashes=check_hashes)
    name = manifest["target"]
    if name not in target_names():
        raise DeltashipError(
            f"{bundle}: unknown target {name!r} in the manifest; known: {', '.join(target_names())}",
            "export the bundle again with this version of deltaship",
        )
    target = get_target(name)
    require_artifact(bundle, manifest)
    if provider not in target.providers:
        raise DeltashipError(
            f"--provider {provider} runs ONNX bundles only; this is {a_bundle(name)}",
            "export the model with --target onnx for the GPU tier, or drop --provider",
        )
    if runtime in target.text_runtimes:
        raise DeltashipError(
            f"--runtime {runtime} takes text, not token ids: it runs `deltaship generate --prompt` "
            "and `deltaship profile`, not a session",
            "pass --prompt, or drop --runtime",
        )
    if prepack_cache is not None:  # only the sessions that map it take the option
        if not str(prepack_cache).strip():  # "" would be the current directory
            raise DeltashipError(
                "--prepack-cache needs a directory, got an empty path", "pass e.g. --prepack-cache DIR"
            )
        check_prepack_cache(name, runtime, provider)
        options["prepack_cache"] = prepack_cache
    if runtime is not None and runtime not in target.runtimes:
        runs = [t.name for t in all_targets() if runtime in t.runtimes or runtime in t.text_runtimes]
        raise DeltashipError(
            f"--runtime {runtime} runs {' or '.join(runs) or 'no'} bundles; this is {a_bundle(name)} "
            f"(its runtimes: {', '.join(target.runtimes)})",
            f"drop --runtime, pick one of {', '.join(target.runtimes)}, or export with --target "
            f"{runs[0] if runs else 'onnx'}",
        )
    try:
        return target.open_session(
            Path(bundle),
            manifest,
            threads=threads,
            prefill_chunk=prefill_chunk,
            provider=provider,
            runtime=runtime,
            **options,
        )
    except TypeError as e:  # a keyword no session of this target takes: the caller's, named
        unknown = [k for k in options if f"unexpected keyword argument '{k}'" in str(e)]
        if not unknown:
            raise
        raise DeltashipError(
            f"open_bundle/load: {a_bundle(name)}'s session takes no option {unknown[0]!r}",
            "check the keyword's spelling (threads, prefill_chunk, provider, runtime, prepack_cache, ...)",
        ) from None


def check_prepack_cache(target: str, runtime: str | None, provider: str) -> None:
    """Refuse --prepack-cache where it cannot apply: ONNX Runtime's packed CPU weights, mapped by deltaship's own CPU
    session of a bundle whose target's session takes them (`Target.prepacks`)."""
    if not get_target(target).prepacks or runtime is not None or provider != "cpu":
        where = f" in --runtime {runtime}" if runtime else f" on --provider {provider}" if provider != "cpu" else ""
        raise DeltashipError(
            f"--prepack-cache keeps ONNX Runtime's packed CPU weights for deltaship's own CPU session of an ONNX "
            f"bundle; this is {a_bundle(target)}{where}",
            "drop --prepack-cache",
        )


def require_artifact(bundle: str | Path, manifest: dict[str, Any]) -> None:
    """Refuse a bundle whose artifact disagrees with its manifest (inputs, outputs, states, and so max_context and
    the vocabulary; ONNX: the external data files its graphs name), for a manifest read by read_manifest and files
    that passed require_intact."""
    problems = get_target(manifest["target"]).artifact_problems(Path(bundle), manifest)
    problems += number_problems(manifest)  # max_context and the vocabulary against the states and logits checked
    if problems:
        raise DeltashipError(
            f"{bundle}: the artifact does not match its manifest: " + "; ".join(problems[:5]),
            "export the bundle again (the manifest was edited after export, or the files come from two exports)",
        )


def open_multimodal(session: Session):
    """Image + text generation beside an open session of a --vision bundle: the driver its target names
    (`Target.multimodal_session`), e.g. `open_multimodal(open_bundle(path)).generate(ids, images, 32)`."""
    return get_target(session.manifest["target"]).open_multimodal(session)


def runtime_names() -> tuple[str, ...]:
    """Every runtime some target's bundles run in (the choices of `--runtime`)."""
    return tuple(dict.fromkeys(r for t in all_targets() for r in (*t.runtimes, *t.text_runtimes)))


def text_runtime(bundle: str | Path, runtime: str | None):
    """The module of `runtime` if it is a text runtime of the bundle's target (else None)."""
    if runtime is None:
        return None
    spec = get_target(read_manifest(bundle)["target"]).text_runtimes.get(runtime)
    return (importlib.import_module(spec.module), spec) if spec else None
