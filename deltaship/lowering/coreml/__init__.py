"""The Core ML target's lowering: one stateful multifunction .mlpackage (iOS 18 / macOS 15).

Two functions share every weight: `prefill` over a fixed chunk of tokens and `decode` over one,
both at fixed shapes (the Neural Engine needs them). The KV cache is a Core ML state (MLState,
fp16); the DeltaNet conv and recurrent states travel as fp32 inputs/outputs (default, chosen by
measured drift: docs/results/coreml-drift.md) or as fp16 states (`coreml_states="state"`). An fp32
build keeps every state as fp32 inputs/outputs for exact structure checks against transformers.

`package.py` builds the package (`lower`, the static capture pass, spec checks), `lowering.py` lowers
each captured op to MIL; deltaship/runtimes/mil_eval.py evaluates a saved program op by op on Linux.
"""
