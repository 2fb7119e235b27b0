#!/bin/bash
# CUDA graph capture on a lent NVIDIA machine with python3 + torch and no network (bench/gpu/capture.py does the
# work). onnxruntime-gpu 1.31.1 (CUDA 13) travels as an xz'd tar of its wheel's files, split in two parts that fit
# the transfer limit, with its CUDA kernels for other GPUs than sm_90 zeroed (bench/gpu/fatbin.py), and
# transformers 5.24's wheel; docs/results/gpu.md says how the parts are made. Two calls, back to back:
#   bash bench/gpu/capture.sh start [A B]     # carry .gpu/p0: keep the part, install transformers, start the
#                                             # exports (two chains, comma lists of bench/gpu/capture.py BUNDLES)
#   bash bench/gpu/capture.sh run [S SPEED]   # carry .gpu/p1: unpack onnxruntime-gpu, parity and speed into $OUT
#                                             # (S seconds at most; SPEED: the bundles to time)
set -u
W=${DELTASHIP_GPU_WORK:-/tmp/deltaship-gpu-capture}  # kept between calls (the runs in docs/results/gpu.md used /root/gpu)
mkdir -p "$W/ch"
export PYTHONUNBUFFERED=1
cuda_libs() {
  for l in libcublas.so.13 libcublasLt.so.13 libcudart.so.13 libcurand.so.10 libcufft.so.12 libcudnn.so.9 libnvrtc.so.13; do
    f=$(find / -xdev -name "$l" 2>/dev/null | head -1)
    [ -n "$f" ] && dirname "$f"
  done | sort -u | paste -sd:
}
case "$1" in
start)
  cp .gpu/p*/* "$W/ch/" && ls -la "$W/ch"
  nproc; free -g | head -2; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$W"/ch/transformers-*.whl || exit 1
  rm -rf "$W/src" && mkdir -p "$W/src" && cp -r deltaship bench pyproject.toml "$W/src/"  # the exports outlive this tree
  cd "$W/src" && export PYTHONPATH=/tmp/site:$W/src
  python3 -c 'import sys, torch, onnx, numpy, transformers; print(sys.version.split()[0], "torch", torch.__version__, "onnx", onnx.__version__, "transformers", transformers.__version__)'
  # two export chains on the machine's CPUs while the second part travels: the small bundles, and the 9B
  A=${2:-tiny-fp16,tiny-int4,tiny-fp32,tiny-fp16-plain,0.8b-int4,0.8b-fp16,2b-int4,4b-int4} B=${3:-9b-int4}
  setsid nohup python3 bench/gpu/capture.py export --work "$W/b" --only "$A" > "$W/export-a.log" 2>&1 < /dev/null &
  setsid nohup python3 bench/gpu/capture.py export --work "$W/b" --only "$B" > "$W/export-b.log" 2>&1 < /dev/null &
  sleep 15; tail -n 3 "$W"/export-*.log ;;
run)
  cp .gpu/p*/* "$W/ch/" 2>/dev/null; ls -la "$W/ch"
  if [ ! -d /tmp/site/onnxruntime/capi ]; then
    cat "$W"/ch/ortpart* | xz -d | tar x -C /tmp/site || exit 1
  fi
  export LD_LIBRARY_PATH=$(cuda_libs) PYTHONPATH=/tmp/site:$PWD
  python3 -c 'import onnxruntime as o; print("onnxruntime", o.__version__, o.get_available_providers())' || exit 1
  tail -n 2 "$W"/export-*.log
  python3 bench/gpu/capture.py run --work "$W/b" --out "$OUT" --deadline "${2:-520}" ${3:+--speed "$3"} 2>&1 | grep -v "W:onnx\|E:onnx"
  tail -n 3 "$W"/export-*.log ;;
esac
