"""transformers eager on the GPU: the baseline a user starts from, for the GPU tier table (docs/results/gpu.md).

    python bench/gpu/gpu_transformers.py --model qwen3.5-9b [--dtype bfloat16] [--json OUT.json]

Qwen3_5ForCausalLM at the preset's published shape, random weights (speed does not depend on the values),
on cuda:0. Prefill tokens/s for 128- and 512-token prompts
(--prompt-lengths) (one forward, logits of the last token), decode
ms per token (64 greedy steps with transformers' own cache, after a 128-token prompt), and the peak of
torch's allocator. Medians of 5 runs after 2 warm-ups, timed with torch.cuda.synchronize. Whether the
flash-linear-attention kernels were importable is recorded (without them transformers runs its torch
implementation of the gated delta rule).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3.5-9b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", default=None)
    p.add_argument("--prompt-lengths", default="128,512", help="comma-separated prefill lengths")
    a = p.parse_args()
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from deltaship.models import qwen3_5 as fam
    from deltaship.models.presets import get_preset
    from deltaship.oracle.compat import CACHE_NAME, output_cache  # transformers 5.24 renamed past_key_values
    from deltaship.oracle.reference import recompute_rotary

    spec = get_preset(a.model).spec()
    cfg = Qwen3_5TextConfig(**fam.hf_config(spec))
    dtype = getattr(torch, a.dtype)
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(cfg)
    model.to_empty(device="cuda")
    with torch.no_grad():
        for prm in model.parameters():
            prm.normal_(0.0, 0.02)
        recompute_rotary(model, cfg, "cuda")
    model = model.to(dtype).eval()
    fla_kernels = importlib.util.find_spec("fla") is not None
    g = torch.Generator().manual_seed(0)
    res: dict = {
        "model": a.model,
        "dtype": a.dtype,
        "torch": torch.__version__,
        "fla_kernels": fla_kernels,
        "gpu": torch.cuda.get_device_name(0),
    }

    def timed(fn, warm=2, reps=5):
        for _ in range(warm):
            fn()
        out = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            out.append(time.perf_counter() - t)
        return statistics.median(out)

    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        for n in [int(x) for x in a.prompt_lengths.split(",")]:
            ids = torch.randint(0, spec.vocab_size, (1, n), generator=g).cuda()
            s = timed(lambda: model(ids, use_cache=False, logits_to_keep=1))
            res[f"prefill_{n}_tok_s"] = n / s
        ids = torch.randint(0, spec.vocab_size, (1, 128), generator=g).cuda()
        steps = 64

        def decode():
            out = model(ids, use_cache=True, logits_to_keep=1)
            cache, tok = output_cache(out), out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(steps):
                out = model(tok, use_cache=True, **{CACHE_NAME: cache})
                cache, tok = output_cache(out), out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            res.setdefault("_decode", []).append((time.perf_counter() - t) / steps)

        for _ in range(4):
            decode()
        res["decode_ms_per_token"] = statistics.median(res.pop("_decode")[1:]) * 1e3
    res["gpu_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
