"""This machine's memory read bandwidth, the denominator of every decode roofline in bench/.
Regenerates no page: the bandwidth the roofline columns of docs/results/peers.md and docs/results/mtp.md divide by.

    python bench/tools/bandwidth.py [--threads 2]

Imported by bench/peers/peers.py, bench/runtimes/onnx_decode_split.py and bench/speculative/mtp_costs.py
(each puts bench/tools/ on sys.path); run alone it prints the GB/s.
"""

from __future__ import annotations

import argparse
import time


def bandwidth(threads: int) -> float:
    """Read bandwidth: a multi-threaded sum over a 1 GiB array, best of 5 (GB/s)."""
    import torch  # lazy: torch

    torch.set_num_threads(threads)
    a = torch.ones(1 << 28, dtype=torch.float32)
    best = 0.0
    for _ in range(5):
        t0 = time.monotonic()
        float(a.sum())
        best = max(best, a.numel() * 4 / (time.monotonic() - t0) / 1e9)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    print(f"{bandwidth(a.threads):.1f} GB/s read, {a.threads} threads")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
