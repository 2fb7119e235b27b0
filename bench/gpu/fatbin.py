"""Zero the CUDA kernels of a shared library that a given GPU will never load, so that the library compresses to
what fits the device machine's transfer limit (bench/gpu/capture.sh carries onnxruntime-gpu this way).
Regenerates no page: a tool of bench/gpu/capture.sh, whose runs docs/results/gpu.md reports.

    python bench/gpu/fatbin.py LIB.so                 # the fat binaries' contents by kind and architecture
    python bench/gpu/fatbin.py LIB.so OUT.so --keep 90

A library built for several GPUs holds, per compilation unit, a fat binary container (magic 0xBA55ED50) with one
ELF (SASS) entry per architecture and possibly PTX. The CUDA driver loads the entry of the running GPU's
architecture; in a container that has an sm_KEEP ELF entry, every other entry's payload is set to zeros, its
header kept, so every offset in the file stays as it was. A container without such an entry is left whole. The
entry header layout is the one documented by reverse engineering (e.g. the cuda-fatbin-decompression project):
kind u16 (1 PTX, 2 ELF), u16, header size u32, payload size u64, ..., architecture u32 at offset 28.
No library does this (nvprune works on object files, not on linked shared libraries): written here.

How bench/gpu/capture.sh's parts are made (a device call carries at most 64 MiB; onnxruntime-gpu 1.31.1's CUDA
provider library is 277 MB, 135 MB of it kernels for GPUs other than sm_90; trimmed, xz takes the wheel to 68 MB):

    pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 -d W \
        "onnxruntime-gpu==1.31.*"
    cd W && mkdir site && (cd site && unzip -q ../onnxruntime_gpu-*.whl)
    python bench/gpu/fatbin.py site/onnxruntime/capi/libonnxruntime_providers_cuda.so cuda90.so --keep 90
    mv cuda90.so site/onnxruntime/capi/libonnxruntime_providers_cuda.so
    rm -r site/onnxruntime/capi/libonnxruntime_providers_tensorrt.so site/onnxruntime/{transformers,quantization,tools}
    tar cf - -C site . | xz -9e -T2 > ort90.tar.xz && split -b 34300000 -d -a 1 ort90.tar.xz ortpart
    # .gpu/p0: ortpart0 + transformers-5.24.0-py3-none-any.whl; .gpu/p1: ortpart1 (.gpu/ is in .git/info/exclude)
"""

from __future__ import annotations

import argparse
import collections
import struct
import sys

MAGIC = struct.pack("<I", 0xBA55ED50)


def entries(data: bytes):
    """Yield (container offset, [(kind, arch, entry offset, header size, payload size)])."""
    i = 0
    while (i := data.find(MAGIC, i)) >= 0:
        _, version, header, size = struct.unpack_from("<IHHQ", data, i)
        if version != 1 or header != 16 or i + header + size > len(data):
            i += 4
            continue
        p, end, found = i + header, i + header + size, []
        while p < end:
            kind, _, eh, n = struct.unpack_from("<HHIQ", data, p)
            if kind not in (1, 2) or eh < 32 or p + eh + n > end:
                break
            found.append((kind, struct.unpack_from("<I", data, p + 28)[0], p, eh, n))
            p += eh + n
        yield i, found
        i = end


def main() -> int:
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("lib")
    a.add_argument("out", nargs="?")
    a.add_argument("--keep", type=int, default=90, help="the architecture whose ELF entries stay (90: H100/H200)")
    args = a.parse_args()
    data = bytearray(open(args.lib, "rb").read())
    sizes, whole, zeroed = collections.Counter(), 0, 0
    for _, found in entries(data):
        for kind, arch, *_, n in found:
            sizes[("PTX" if kind == 1 else "ELF", arch)] += n
        if not any(k == 2 and arch == args.keep for k, arch, *_ in found):
            whole += 1
            continue
        for kind, arch, p, eh, n in found:
            if args.out and not (kind == 2 and arch == args.keep):
                data[p + eh : p + eh + n] = bytes(n)
                zeroed += n
    for (kind, arch), n in sorted(sizes.items()):
        print(f"{kind} sm_{arch}: {n / 2**20:.1f} MiB")
    print(f"containers without an sm_{args.keep} ELF entry (left whole): {whole}")
    if args.out:
        with open(args.out, "wb") as f:
            f.write(data)
        print(f"zeroed {zeroed / 2**20:.1f} MiB -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
