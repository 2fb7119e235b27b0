#!/bin/bash
# The whole GPU bench on a bare Linux machine with an NVIDIA GPU: checks, venv, exports of the 0.8B/2B/4B/9B
# presets (int4 with fp16 activations, fp16), `deltaship profile --provider cuda` on each, the peers
# (transformers, onnxruntime-genai-cuda, llama.cpp CUDA) and one results JSON + markdown table.
# Idempotent: a re-run skips every step whose output exists. Needs only python3 (3.11+) with venv, and pip access
# to PyPI (and download.pytorch.org for --torch-cpu); llama.cpp also needs cmake and nvcc. See bench/gpu/run.py.
# Regenerates: docs/results/gpu.md's table once it runs on a GPU (not yet run).
#   bash bench/gpu/run.sh --dry-run                 # the plan, done/todo per step; runs nothing
#   bash bench/gpu/run.sh --only 0.8b,9b --work /data/gpu
#   python3 bench/gpu/run.py report /data/gpu/results/gpu-bench.json   # the table again
# A lent machine without network takes one lease script instead (bench/gpu/capture.sh: carried onnxruntime-gpu):
#   bash bench/gpu/run.sh lease dry-run | start | run S   # the same as bash bench/gpu/capture.sh ...
set -eu
cd "${0%/*}/../.."  # the repository root (no dirname: works with a bare PATH)
if [ "${1:-}" = lease ]; then
  shift
  exec bash bench/gpu/capture.sh "$@"
fi
exec python3 bench/gpu/run.py "$@"
