"""What an app must link to run a .pte: derived from the operators and delegates the program names.

ExecuTorch resolves every operator and backend of a program by name when the method loads; a kernel
library that is not linked (or, in C++, not linked whole-archive: registration is a static
initialiser) fails the load with `Missing operator`. The names below are ExecuTorch 1.5's:
CMake targets from extension/llm/custom_ops, kernels/quantized, kernels/optimized and
backends/xnnpack CMakeLists.txt (the set examples/models/llama/CMakeLists.txt links), the Apple
frameworks of scripts/build_apple_frameworks.sh, and the Android AAR of extension/android, whose
libexecutorch.so is built with the android preset (XNNPACK, optimized, quantized and LLM kernels).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# operator namespace -> (Python import that registers its kernels, C++ libraries, Apple framework)
NAMESPACES: dict[str, dict[str, Any]] = {
    "llama": {
        "python": "executorch.extension.llm.custom_ops.custom_ops",
        "cpp_link": ["custom_ops"],
        "ios": "kernels_llm",
    },
    "quantized_decomposed": {
        "python": "executorch.kernels.quantized",
        "cpp_link": ["quantized_ops_lib", "quantized_kernels"],
        "ios": "kernels_quantized",
    },
    # symbolic-size arithmetic (kernels/prim_ops): the `executorch` library itself, not executorch_core
    "executorch_prim": {"python": None, "cpp_link": ["executorch"], "ios": "executorch"},
    # aten:: ops left outside the delegate (embedding, position arithmetic, copies at partition edges);
    # the Python runtime (portable_lib) has them built in
    "aten": {
        "python": None,
        "cpp_link": ["optimized_native_cpu_ops_lib", "optimized_kernels", "portable_kernels"],
        "ios": "kernels_optimized",
    },
}
BACKENDS: dict[str, dict[str, Any]] = {
    "XnnpackBackend": {
        "python": None,
        "cpp_link": ["xnnpack_backend", "XNNPACK", "xnnpack-microkernels-prod"],
        "ios": "backend_xnnpack",
    },
}
# libraries linked with --whole-archive (they register themselves in static initialisers)
WHOLE_ARCHIVE = ("executorch", "custom_ops", "quantized_ops_lib", "optimized_native_cpu_ops_lib", "xnnpack_backend")
# the LLM runner (TextLLMRunner) and what it is built on
RUNNER = {
    "python": "executorch.extension.llm.runner",
    "cpp_link": ["extension_llm_runner", "extension_module", "extension_tensor", "extension_threadpool", "tokenizers"],
    "ios": ["executorch", "executorch_llm", "threadpool"],
}


def program_operators(program) -> tuple[list[str], list[str]]:
    """(operator names `ns::op.overload`, delegate ids) of every execution plan of an ExecuTorch program
    (executorch.exir.schema.Program, e.g. ExecutorchProgramManager.executorch_program)."""
    ops, delegates = set(), set()
    for plan in program.execution_plan:
        ops.update(f"{o.name}.{o.overload}" if o.overload else o.name for o in plan.operators)
        delegates.update(d.id for d in plan.delegates)
    return sorted(ops), sorted(delegates)


def runtime_requirements(operators: Iterable[str], delegates: Iterable[str], executorch_version: str) -> dict:
    """The kernel libraries, backends and runner pieces an app needs for a program that calls
    `operators` and `delegates`; only those its operators use (quantized kernels only when a
    quantized_decomposed:: operator is in the program)."""
    namespaces = sorted({op.split("::")[0] for op in operators})
    unknown = [n for n in namespaces if n not in NAMESPACES]
    unknown += [d for d in delegates if d not in BACKENDS]
    if unknown:  # a new kind of kernel: the manifest must not claim a list that misses it
        raise RuntimeError(
            f"executorch: no known kernel library for {unknown}; "
            "add it to deltaship/lowering/executorch/requirements.py"
        )
    parts = [NAMESPACES[n] for n in namespaces] + [BACKENDS[d] for d in sorted(set(delegates))]
    python = [p["python"] for p in parts if p["python"]]
    cpp = [lib for p in parts for lib in p["cpp_link"]]
    return {
        "operator_namespaces": namespaces,
        "delegates": sorted(set(delegates)),
        "python": python,  # imports that register the program's kernels before it loads
        "python_runner": RUNNER["python"],
        "cpp_link": cpp,
        "cpp_whole_archive": [lib for lib in cpp if lib in WHOLE_ARCHIVE],
        "cpp_runner": RUNNER["cpp_link"],
        "android_aar": {
            "maven": f"org.pytorch:executorch-android:{executorch_version}",
            "includes_all": True,
            "llm_api": "org.pytorch.executorch.extension.llm.LlmModule",
        },
        "ios": {
            "frameworks": list(dict.fromkeys(RUNNER["ios"] + [p["ios"] for p in parts])),
            "linker_flags": ["-Wl,-all_load"],
            "swiftpm_branch": f"swiftpm-{executorch_version}",
            "llm_api": "ExecuTorchLLMTextRunner",
        },
    }
