"""Train the built-in `qwen3.5-tiny` on the Python standard library's own source, on CPU.

    python tools/train_tiny.py --out deltaship/models/data/qwen3.5-tiny
    python tools/train_tiny.py --out deltaship/models/data/qwen3.5-tiny --mtp-only   # the MTP head alone

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


def train_mtp(
    out: Path,
    steps: int = 200,
    batch: int = 8,
    pool: int = 192,
    seq: int = 256,
    lr: float = 3e-3,
    seed: int = 0,
    threads: int = 2,
    log_every: int = 50,
) -> dict:
    """Train the multi-token-prediction head of the checkpoint in `out` (the trunk frozen) on the same split, then
    re-save its safetensors with the `mtp.*` tensors and `mtp_num_hidden_layers: 1` in config.json.

    The head (deltaship.oracle.reference.ReferenceMTP: transformers' Qwen3.5 norms and decoder layer) learns to
    predict the token two positions on from the trunk's final-normed hidden state and the next token."""
    import logging

    import torch

    for name in ("torchao", "torch.utils._pytree", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from deltaship.models.safetensors_io import SafetensorsFile, write_safetensors
    from deltaship.models.source import load_source
    from deltaship.oracle.reference import ReferenceMTP, reference_model

    t_start = time.monotonic()
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    rng = np.random.default_rng(seed + 1)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("mtp_num_hidden_layers", None)  # the trunk alone, whatever a previous run left
    cfg_path.write_text(json.dumps(cfg, indent=2))
    source = load_source(str(out))
    trunk = reference_model(source).eval()
    for p in trunk.parameters():
        p.requires_grad_(False)
    spec = source.spec.from_dict(dict(source.spec.to_dict(), mtp_num_hidden_layers=1))
    head = ReferenceMTP(trunk, spec)
    with torch.no_grad():
        for n, p in head.named_parameters():
            if p.ndim == 1:
                p.zero_()  # zero-centred norms: scale 1
            else:
                p.normal_(0.0, 0.02)
    tr, he, _ = load_split()
    opt = torch.optim.AdamW(list(head.parameters()), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    warm = max(1, steps // 20)

    def lr_at(s: int) -> float:
        return (
            lr * s / warm
            if s < warm
            else lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - warm) / (steps - warm))))
        )

    def save_head() -> None:
        sf = SafetensorsFile(out / "model.safetensors")
        tensors = [(n, sf.read(n)) for n in sf.entries if not n.startswith("mtp.")]
        del sf
        tensors += [(f"mtp.{n}", p.detach().float().numpy()) for n, p in head.state_dict().items()]
        write_safetensors(out / "model.safetensors", tensors, metadata={"format": "pt"}, dtype="BF16")
        cfg_path.write_text(json.dumps(dict(cfg, mtp_num_hidden_layers=1), indent=2))

    # The frozen trunk's hidden states come from deltaship's own fp32 ONNX export of it (transformers' reference
    # DeltaNet kernels are far slower on CPU); the head is trained in torch on top of them.
    save_head()
    import tempfile

    from deltaship.compile import export
    from deltaship.targets import open_bundle

    tmp = Path(tempfile.mkdtemp(prefix="deltaship-mtp-train-"))
    export(
        str(out),
        tmp / "b",
        target="onnx",
        precision="fp32",
        max_context=seq,
        prefill_chunk=seq,
        mtp=True,
        verify=False,
        progress=False,
    )
    sess = open_bundle(tmp / "b", threads=threads)

    def trunk_hidden(x: torch.Tensor) -> torch.Tensor:
        rows = []
        for ids in x.numpy():
            sess.reset()
            rows.append(sess.verify(ids, np.array([ids.size - 1], np.int64))[1])
        return torch.from_numpy(np.stack(rows))

    # a fixed pool of training windows, their trunk hidden states computed once (the head is what trains)
    starts = rng.integers(0, tr.size - seq - 1, pool)
    pool_x = torch.from_numpy(np.stack([tr[s : s + seq] for s in starts]).astype(np.int64))
    pool_h = trunk_hidden(pool_x)

    def loss_of(x: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, float]:
        logits, _ = head(hidden[:, :-1], x[:, 1:])
        logits = logits[:, :-1].float()
        target = x[:, 2:]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        return loss, float((logits.argmax(-1) == target).float().mean())

    log, t0 = [], time.monotonic()
    head.train()
    for step in range(1, steps + 1):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        pick = torch.from_numpy(rng.integers(0, pool, batch))
        loss, _ = loss_of(pool_x[pick], pool_h[pick])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % log_every == 0 or step == steps:
            entry = {"step": step, "train_loss": round(loss.item(), 4), "seconds": round(time.monotonic() - t0, 1)}
            log.append(entry)
            print(json.dumps(entry), flush=True)
    head.eval()
    with torch.no_grad():
        x = torch.from_numpy(he[: (min(he.size, 16 * seq) // seq) * seq].astype(np.int64)).reshape(-1, seq)
        held_loss, held_top1 = loss_of(x, trunk_hidden(x))
    save_head()
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    meta = json.loads((out / "training.json").read_text()) if (out / "training.json").is_file() else {}
    meta["mtp"] = {
        "what": "the MTP head alone (trunk frozen): token t+2 from the trunk's hidden state at t and token t+1",
        "steps": steps,
        "batch": batch,
        "pool_windows": pool,
        "seq": seq,
        "lr": lr,
        "seed": seed,
        "threads": threads,
        "train_seconds": round(time.monotonic() - t0, 1),
        "total_seconds": round(time.monotonic() - t_start, 1),  # with the trunk's export and the pool's hidden states
        "heldout_loss_nats_per_byte": round(float(held_loss), 4),
        "heldout_top1_vs_data": round(held_top1, 4),
        "log": log,
    }
    (out / "training.json").write_text(json.dumps(meta, indent=2))
    return meta["mtp"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=2200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--mtp-only",
        action="store_true",
        help="keep the trained trunk in --out and train only its multi-token-prediction head (a few minutes)",
    )
    ap.add_argument("--mtp-steps", type=int, default=200)
    a = ap.parse_args(argv)
    if not a.mtp_only:
        train(a.out, steps=a.steps, threads=a.threads, seed=a.seed)
    train_mtp(a.out, steps=a.mtp_steps, threads=a.threads, seed=a.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
