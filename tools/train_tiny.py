"""Train the built-in `qwen3.5-tiny` on the Python standard library's own source, on CPU.

    python tools/train_tiny.py --out deltaship/models/data/qwen3.5-tiny

The corpus is every .py file of the running Python's standard library (available offline on any
machine with Python), split by a hash of each file's path: 2% held out. Bytes are the tokens
(the tiny preset's byte-level tokenizer). Fixed seed and step count; about 25 minutes on 2 cores
with bf16 autocast. The model is transformers' own Qwen3_5ForCausalLM at the tiny preset's
config (3:1 DeltaNet/attention, 4 value heads over 2 key heads).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

HELDOUT_BYTES = 32768
SEP = b"\n\n"


def corpus_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "__pycache__" not in p.parts)


def is_heldout(path: Path) -> bool:
    root = Path(sysconfig.get_paths()["stdlib"])
    digest = hashlib.sha256(path.relative_to(root).as_posix().encode()).digest()
    return digest[0] % 50 == 0


def load_split() -> tuple[np.ndarray, np.ndarray, dict]:
    train, held = [], []
    for p in corpus_files():
        try:
            data = p.read_bytes()
        except OSError:
            continue
        (held if is_heldout(p) else train).append(data)
    info = {"python": sys.version.split()[0], "train_files": len(train), "heldout_files": len(held)}
    tr = np.frombuffer(SEP.join(train), dtype=np.uint8)
    he = np.frombuffer(SEP.join(held), dtype=np.uint8)
    info.update(train_bytes=int(tr.size), heldout_bytes=int(he.size))
    return tr, he, info


def heldout_text(n: int = HELDOUT_BYTES) -> str:
    """The first n bytes of the held-out split (what ships as heldout.txt)."""
    _, held, _ = load_split()
    return bytes(held[:n]).decode("utf-8", errors="replace")


def train(
    out: Path,
    steps: int = 2200,
    batch: int = 16,
    seq: int = 256,
    lr: float = 2e-3,
    seed: int = 0,
    threads: int = 2,
    log_every: int = 50,
) -> dict:
    import logging

    import torch

    for name in ("torchao", "torch.utils._pytree", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from deltaship.models.presets import PRESETS, write_tiny_tokenizer
    from deltaship.models.qwen3_5 import hf_config
    from deltaship.models.safetensors_io import write_safetensors

    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    rng = np.random.default_rng(seed)
    preset = PRESETS["qwen3.5-tiny"]
    spec = preset.spec()
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**hf_config(spec)))
    tr, he, info = load_split()
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.ndim < 2 else decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95)
    )
    warm = max(1, steps // 20)

    def lr_at(s: int) -> float:
        return (
            lr * s / warm
            if s < warm
            else lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm))))
        )

    def batch_of(data: np.ndarray, n: int) -> torch.Tensor:
        starts = rng.integers(0, data.size - seq - 1, n)
        return torch.from_numpy(np.stack([data[s : s + seq] for s in starts]).astype(np.int64))

    @torch.no_grad()
    def heldout_loss() -> float:
        model.eval()
        x = torch.from_numpy(he[: (min(he.size, 64 * seq) // seq) * seq].astype(np.int64)).reshape(-1, seq)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = float(model(x, labels=x, use_cache=False).loss)
        model.train()
        return loss

    log, t0 = [], time.monotonic()
    model.train()
    for step in range(1, steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x = batch_of(tr, batch)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, labels=x, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % log_every == 0 or step == steps:
            entry = {"step": step, "train_loss": round(loss.item(), 4), "seconds": round(time.monotonic() - t0, 1)}
            if step % (log_every * 10) == 0 or step == steps:
                entry["heldout_loss"] = round(heldout_loss(), 4)
            log.append(entry)
            print(json.dumps(entry), flush=True)

    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    cfg["eos_token_id"] = preset.config["eos_token_id"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = [(n, p.detach().float().numpy()) for n, p in model.state_dict().items() if n != "lm_head.weight"]
    write_safetensors(out / "model.safetensors", tensors, metadata={"format": "pt"}, dtype="BF16")
    write_tiny_tokenizer(out)
    (out / "heldout.txt").write_bytes(bytes(he[:HELDOUT_BYTES]))
    meta = {
        "steps": steps,
        "batch": batch,
        "seq": seq,
        "lr": lr,
        "seed": seed,
        "threads": threads,
        "tokens_seen": steps * batch * seq,
        "train_seconds": round(time.monotonic() - t0, 1),
        "final_heldout_loss_nats_per_byte": log[-1].get("heldout_loss"),
        "corpus": info,
        "log": log,
    }
    (out / "training.json").write_text(json.dumps(meta, indent=2))
    return meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=2200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    train(a.out, steps=a.steps, threads=a.threads, seed=a.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
