#!/bin/bash
# One GPU lease (15 minutes of device time) on a lent NVIDIA machine with python3 + torch and no network
# (bench/gpu/capture.py does the work). onnxruntime-gpu 1.31.1 (CUDA 13) travels as an xz'd tar of its wheel's files,
# split in two parts that fit the transfer limit, with its CUDA kernels for other GPUs than sm_90 zeroed
# (bench/gpu/fatbin.py), and transformers 5.24's wheel; bench/gpu/fatbin.py's docstring says how the parts are made. Two calls,
# back to back, after a dry run here:
#   bash bench/gpu/capture.sh dry-run         # on this CPU machine: the plan checked, the parts listed, and the
#                                             # lease's own code rehearsed on the tiny bundles (CPU provider)
#   bash bench/gpu/capture.sh start [A B]     # carry .gpu/p0: keep the part, install transformers, start the
#                                             # exports (two chains, comma lists of bench/gpu/capture.py BUNDLES);
#                                             # with nvcc and .gpu/p*/llama_cpp_python-*.tar.gz, build llama.cpp too
#   bash bench/gpu/capture.sh run [S SPEED]   # carry .gpu/p1: unpack onnxruntime-gpu, parity, speed and
#                                             # speculative speed into $OUT (S seconds at most), then the peers
set -u
W=${DELTASHIP_GPU_WORK:-/tmp/deltaship-gpu-capture}  # kept between calls (the runs in docs/results/gpu.md used /root/gpu)
A_DEFAULT=tiny-fp16,tiny-int4,tiny-fp32,tiny-fp16-plain,tiny-fp16-mtp,0.8b-int4,0.8b-int4-mtp,0.8b-int4-contrib,2b-int4-mtp
B_DEFAULT=9b-int4-mtp  # about 6 minutes on the machine's 16 cores (2026-11-22): its own chain, started first
SPEED_DEFAULT=0.8b-int4,0.8b-int4-contrib,0.8b-int4-mtp,2b-int4-mtp,9b-int4-mtp
export PYTHONUNBUFFERED=1
cuda_libs() {
  for l in libcublas.so.13 libcublasLt.so.13 libcudart.so.13 libcurand.so.10 libcufft.so.12 libcudnn.so.9 libnvrtc.so.13; do
    f=$(find / -xdev -name "$l" 2>/dev/null | head -1)
    [ -n "$f" ] && dirname "$f"
  done | sort -u | paste -sd:
}
case "${1:-}" in
dry-run)
  # what the two calls would read, and their code run on the CPU provider with the tiny bundles
  bash -n "$0" || exit 1
  PY=${PYTHON:-python3}
  $PY bench/gpu/capture.py check --speed "${3:-$SPEED_DEFAULT}" || exit 1
  $PY bench/gpu/capture.py check --speed "$(echo "${2:-$A_DEFAULT},$B_DEFAULT" | tr , '\n' | grep -v '^tiny' | paste -sd,)" \
    > /dev/null || { echo "the export chains name a bundle capture.py does not know"; exit 1; }
  for part in .gpu/p0 .gpu/p1; do
    if ls "$part"/* > /dev/null 2>&1; then ls -la "$part"; else echo "todo: $part is empty (bench/gpu/fatbin.py's docstring says how to build it)"; fi
  done
  ls .gpu/p*/llama_cpp_python-*.tar.gz 2> /dev/null || echo "peer llama.cpp: no sdist in .gpu/p*/ (skipped on the device)"
  [ -n "${DRY_RUN_QUICK:-}" ] && exit 0
  R=$(mktemp -d)
  $PY bench/gpu/capture.py export --work "$R/b" --only tiny-fp16,tiny-int4,tiny-fp32,tiny-fp16-plain,tiny-fp16-mtp || exit 1
  $PY bench/gpu/capture.py run --rehearse --work "$R/b" --out "$R/out" --speed "" || exit 1
  $PY bench/gpu/capture.py speed "$R/b/tiny-fp16-mtp" --json "$R/out/speed.json" --rehearse > /dev/null || exit 1
  $PY -c "import json, sys; r = json.load(open(sys.argv[1])); s = r['parity']['speculative']; \
assert s and all(x['tokens_equal_cpu_plain_greedy'] for x in s), s; print('rehearsal: parity rows', len(r['parity']['rows']), \
'speculative rows', len(s))" "$R/out/capture.json" || exit 1
  echo "dry run: ready (rehearsal in $R)" ;;
start)
  mkdir -p "$W/ch"
  cp .gpu/p*/* "$W/ch/" && ls -la "$W/ch"
  nproc; free -g | head -2; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$W"/ch/transformers-*.whl || exit 1
  rm -rf "$W/src" && mkdir -p "$W/src" && cp -r deltaship bench pyproject.toml "$W/src/"  # the exports outlive this tree
  cd "$W/src" && export PYTHONPATH=/tmp/site:$W/src
  python3 -c 'import sys, torch, onnx, numpy, transformers; print(sys.version.split()[0], "torch", torch.__version__, "onnx", onnx.__version__, "transformers", transformers.__version__)'
  # two export chains on the machine's CPUs while the second part travels: the 9B, and everything else
  A=${2:-$A_DEFAULT} B=${3:-$B_DEFAULT}
  setsid nohup python3 bench/gpu/capture.py export --work "$W/b" --only "$B" > "$W/export-b.log" 2>&1 < /dev/null &
  setsid nohup python3 bench/gpu/capture.py export --work "$W/b" --only "$A" > "$W/export-a.log" 2>&1 < /dev/null &
  SDIST=$(ls "$W"/ch/llama_cpp_python-*.tar.gz 2> /dev/null | head -1)
  if command -v nvcc > /dev/null && command -v cmake > /dev/null && [ -n "$SDIST" ]; then
    # llama.cpp CUDA (sm_90 only), a random-weights 0.8B checkpoint and its Q4_0 GGUF, in the background
    setsid nohup bash -c "mkdir -p $W/llama && tar xzf $SDIST -C $W/llama && L=\$(ls -d $W/llama/llama_cpp_python-*/vendor/llama.cpp) && \
cmake -S \$L -B $W/llama/build -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release && \
cmake --build $W/llama/build -j 8 --target llama-bench llama-quantize && \
python3 bench/tools/make_checkpoint.py qwen3.5-0.8b $W/llama/ckpt && \
python3 bench/gpu/run.py gguf \$L $W/llama/ckpt $W/llama/q0.8b-q4_0.gguf --quantize $W/llama/build/bin/llama-quantize" \
      > "$W/llama.log" 2>&1 < /dev/null &
  else
    echo "peer llama.cpp: skipped (nvcc: $(command -v nvcc || echo none), cmake: $(command -v cmake || echo none), sdist: ${SDIST:-none})" | tee "$W/llama.log"
  fi
  sleep 15; tail -n 3 "$W"/export-*.log ;;
run)
  mkdir -p "$W/ch"
  cp .gpu/p*/* "$W/ch/" 2>/dev/null; ls -la "$W/ch"
  if [ ! -d /tmp/site/onnxruntime/capi ]; then
    cat "$W"/ch/ortpart* | xz -d | tar x -C /tmp/site || exit 1
  fi
  export LD_LIBRARY_PATH=$(cuda_libs) PYTHONPATH=/tmp/site:$PWD
  python3 -c 'import onnxruntime as o; print("onnxruntime", o.__version__, o.get_available_providers())' || exit 1
  tail -n 2 "$W"/export-*.log
  T0=$(date +%s) S=${2:-480}
  python3 bench/gpu/capture.py run --work "$W/b" --out "$OUT" --deadline "$S" --speed "${3:-$SPEED_DEFAULT}" 2>&1 | grep -v "W:onnx\|E:onnx"
  left=$(( S + 60 - $(date +%s) + T0 ))  # the peers take what the deadline leaves (the call's limit is S + 60)
  if [ -x "$W/llama/build/bin/llama-bench" ] && [ -f "$W/llama/q0.8b-q4_0.gguf" ] && [ "$left" -gt 40 ]; then
    timeout $(( left - 20 )) "$W/llama/build/bin/llama-bench" -m "$W/llama/q0.8b-q4_0.gguf" -p 512,4096 -n 64 -ngl 99 -o json \
      > "$OUT/llamacpp-0.8b.json" 2> "$OUT/llamacpp-0.8b.log"
  else
    { echo "llama.cpp: not run (${left}s left)"; tail -n 5 "$W/llama.log" 2> /dev/null; } > "$OUT/llamacpp-0.8b.log"
  fi
  left=$(( S + 60 - $(date +%s) + T0 ))
  if [ "$left" -gt 60 ]; then
    timeout $(( left - 15 )) python3 bench/gpu/gpu_transformers.py --model qwen3.5-0.8b --prompt-lengths 512,4096 \
      --json "$OUT/transformers-0.8b.json" > "$OUT/transformers-0.8b.log" 2>&1
  fi
  tail -n 3 "$W"/export-*.log ;;
*)
  echo "usage: bash bench/gpu/capture.sh dry-run | start [A B] | run [S SPEED]" >&2; exit 2 ;;
esac
