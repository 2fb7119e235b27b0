#!/bin/bash
# The GPU tier run on a lent NVIDIA machine that has python3 with torch but no network (as run on 2026-11-22).
# On a machine with PyPI access, bench/gpu/run.sh does the whole bench in one resumable command.
# onnxruntime-gpu 1.31.1 (CUDA 13 build) travels as an xz'd tar of its wheel's contents split into
# .gpu/c*/ortpart* (each under the transfer limit; one call per part, each copying its part to $W/ch, since
# the working tree is sent afresh with each call), transformers 5.23 as a wheel in .gpu/c4. The parts:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
#       -d /tmp/ortgpu "onnxruntime-gpu==1.31.*"
#   cd /tmp/ortgpu && mkdir site && (cd site && unzip -q ../onnxruntime_gpu-*.whl \
#       && rm onnxruntime/capi/libonnxruntime_providers_tensorrt.so)
#   tar cf - -C site . | xz -9e -T2 > ort.tar.xz && split -b 50000000 -d -a 1 ort.tar.xz ortpart   # -> .gpu/c0 .. c4
#   (.gpu/c4 also holds transformers-5.23.0-py3-none-any.whl; .gpu/c5 transformers + flash-linear-attention 0.6.0
#   + fla-core 0.6.0). As run on 2026-11-22, one call per line, each carrying the part named:
#   bash bench/gpu/gpu_tier.sh keep && bash bench/gpu/gpu_tier.sh start   # .gpu/c0; the 9B export in the background
#   bash bench/gpu/gpu_tier.sh keep                                       # .gpu/c1, c2, c3 (one call each)
#   bash bench/gpu/gpu_tier.sh keep && bash bench/gpu/gpu_tier.sh install && bash bench/gpu/gpu_tier.sh same  # .gpu/c4
#   bash bench/gpu/gpu_tier.sh baseline && bash bench/gpu/gpu_tier.sh parity
#   bash bench/gpu/gpu_tier.sh keep     # copy the carried parts into $W/ch
#   bash bench/gpu/gpu_tier.sh start    # background: export the 9B int4 bundle (fp16 activations) on the machine's CPUs
#   bash bench/gpu/gpu_tier.sh status   # the exports' logs
#   bash bench/gpu/gpu_tier.sh install  # unpack onnxruntime-gpu + transformers into /tmp/site, check the CUDA provider
#   bash bench/gpu/gpu_tier.sh parity   # tiny bundles: CUDA against transformers and against the CPU provider
#   bash bench/gpu/gpu_tier.sh same     # 0.8B int4 (fp16 and fp32 activations) and the 9B profiled on CUDA into $OUT
#   bash bench/gpu/gpu_tier.sh baseline # transformers eager (bf16) on the same GPU, 0.8B and 9B
set -u
W=${DELTASHIP_GPU_WORK:-/tmp/deltaship-gpu-tier}  # kept between calls (the runs in docs/results/gpu.md used /root/gpu)
mkdir -p "$W"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
cuda_libs() {
  for l in libcublas.so.13 libcublasLt.so.13 libcudart.so.13 libcurand.so.10 libcufft.so.12 libcudnn.so.9 libnvrtc.so.13; do
    f=$(find / -xdev -name "$l" 2>/dev/null | head -1)
    [ -n "$f" ] && dirname "$f"
  done | sort -u | paste -sd:
}
timed() {  # wall time and the peak RSS of the child, then its exit status
  python3 -c 'import resource, subprocess, sys, time
t = time.time(); rc = subprocess.call(sys.argv[1:])
print(f"wall_s={time.time() - t:.0f} peak_rss_gib={resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20:.2f} rc={rc}")' "$@"
}
case "$1" in
keep)
  mkdir -p "$W/ch" && cp .gpu/c*/* "$W/ch/" && ls "$W/ch" ;;
start)
  nproc; free -g | head -2; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import sys, torch, onnx, numpy; print(sys.version.split()[0], "torch", torch.__version__, "onnx", onnx.__version__, "numpy", numpy.__version__)'
  export -f timed
  setsid nohup bash -c "cd $PWD; timed python3 -m deltaship.cli export --model qwen3.5-9b \
      --target onnx --precision int4 --onnx-activations fp16 --no-verify --quiet --out $W/q9b-int4-fp16act \
      > $W/export-9b.log 2>&1; touch $W/exports.done" > /dev/null 2>&1 < /dev/null &
  sleep 20; tail -3 "$W"/export-*.log ;;
status)
  tail -4 "$W"/export-*.log; ls "$W"; du -sh "$W"/q* 2>/dev/null ;;
install)
  if [ ! -d /tmp/site/onnxruntime ]; then
    mkdir -p /tmp/site && cat "$W"/ch/ortpart* | xz -d | tar x -C /tmp/site || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$W"/ch/transformers-*.whl || exit 1
  fi
  export LD_LIBRARY_PATH=$(cuda_libs)
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  python3 -c 'import onnxruntime as o, transformers as t; print("onnxruntime", o.__version__, o.get_available_providers(), "transformers", t.__version__)' ;;
parity)  # tiny bundles on CUDA against transformers and against the CPU provider
  export LD_LIBRARY_PATH=$(cuda_libs)
  python3 bench/gpu/gpu_tier.py parity --out "$OUT" 2>&1 | grep -v "W:onnx\|E:onnx" ;;
same)  # one machine, one call: the 0.8B with fp16 and fp32 activations and the 9B (exported by start), on CUDA
  export LD_LIBRARY_PATH=$(cuda_libs)
  for acts in fp16 fp32; do
    timed python3 -m deltaship.cli export --model qwen3.5-0.8b --target onnx --precision int4 --onnx-activations $acts \
      --no-verify --quiet --out "$W/q0.8b-int4-${acts}act"
  done
  while [ ! -f "$W/exports.done" ]; do sleep 5; done
  tail -1 "$W/export-9b.log"
  for b in q0.8b-int4-fp16act q0.8b-int4-fp32act q9b-int4-fp16act; do
    python3 -m deltaship.cli profile "$W/$b" --device host --provider cuda --prompt-lengths 128,512 --gen 64 \
      --contexts 128,1024,4000 --no-breakdown --json "$OUT/$b-cuda.json" 2>&1 | grep -v "W:onnx\|E:onnx"
  done ;;
baseline)  # transformers eager on the same GPU; with .gpu/c5 carried: transformers + flash-linear-attention wheels
  if [ -d .gpu/c5 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/c5/*.whl || exit 1
  fi
  for m in 0.8b 9b; do python3 bench/gpu/gpu_transformers.py --model qwen3.5-$m --json "$OUT/transformers-$m.json" 2>&1 | grep -v "falling back"; done ;;
esac
