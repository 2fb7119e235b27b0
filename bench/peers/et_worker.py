"""One measurement of one .pte in a fresh process (used by bench/peers/et_vs_example.py).
Regenerates: docs/results/executorch.md, through bench/peers/et_vs_example.py.

    python bench/peers/et_worker.py PROGRAM.pte CHUNK THREADS

Drives the program the way ExecuTorch's LLM runner does (forward(tokens [1, T], input_pos [1]) with
T <= CHUNK): prefill of a 512-token prompt, then 64 greedy decode steps. Prints one JSON line:
prefill_tok_s, decode_tok_s (from tpot = (t_last - t_first) / (N - 1)), ttft_s, peak_rss_bytes.
"""

from __future__ import annotations

import json
import sys
import time

import executorch.kernels.quantized  # noqa: F401
import numpy as np
import torch
from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401  (llama:: kernels)
from executorch.extension.pybindings import portable_lib
from executorch.runtime import Runtime

PROMPT, GEN = 512, 64


def peak_rss() -> int:
    """VmHWM of this process (getrusage's maxrss survives execve and can report the parent's peak)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def main() -> int:
    path, chunk, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    portable_lib._unsafe_reset_threadpool(threads)
    torch.set_num_threads(threads)
    fwd = Runtime.get().load_program(path).load_method("forward")
    ids = np.random.default_rng(0).integers(0, 1000, PROMPT)

    def call(tokens: np.ndarray, pos: int) -> np.ndarray:
        out = fwd.execute([torch.from_numpy(tokens.reshape(1, -1)).long(), torch.tensor([pos], dtype=torch.long)])[0]
        return out.reshape(-1, out.shape[-1])[-1].float().numpy()

    call(ids[:4] if chunk > 1 else ids[:1], 0)  # warm up the threads and allocations
    t0 = time.monotonic()
    pos = 0
    while pos < PROMPT:
        n = min(chunk, PROMPT - pos)
        logits = call(ids[pos : pos + n], pos)
        pos += n
    t1 = time.monotonic()
    tok = int(np.argmax(logits))
    ttft = time.monotonic() - t0
    stamps = []
    for _ in range(GEN):
        stamps.append(time.monotonic())
        logits = call(np.array([tok]), pos)
        pos += 1
        tok = int(np.argmax(logits))
    stamps.append(time.monotonic())
    tpot = (stamps[-1] - stamps[1]) / (GEN - 1)
    print(
        json.dumps(
            {
                "prefill_tok_s": PROMPT / (t1 - t0),
                "decode_tok_s": 1 / tpot,
                "ttft_s": ttft,
                "peak_rss_bytes": peak_rss(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
