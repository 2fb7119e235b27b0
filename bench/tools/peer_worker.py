"""One measurement of one tool in a fresh process (used by bench/peers/peers.py, bench/memory/memory_peers.py and
bench/gpu/run.py). Prints one JSON line.

    python bench/tools/peer_worker.py TOOL ARTIFACT THREADS

TOOL: deltaship (any deltaship bundle, through its session), transformers-fp32, transformers-bf16 (ARTIFACT
= checkpoint dir), genai (onnxruntime-genai model dir), et-example (an ExecuTorch .pte; ARTIFACT may end
with ':1' for a one-token-per-call program), llamacpp (a GGUF file, through llama-cpp-python), ort-node (a deltaship
ONNX bundle in onnxruntime-node through the JS driver: this process execs bench/tools/ort_node_worker.mjs, which
runs the same workload and prints the same line).
Measured as `deltaship profile` measures (docs/profiling.md): prefill of 128 and 512 random-token prompts (prefill_tok_s =
P / time of the prefill call(s)), ttft_s (prompt handed over -> first token id), then 64 greedy decode
steps after the 512-token prompt (tpot = (t_last - t_first) / (N - 1)); peak RSS (VmHWM).
Tokenization is never involved (token ids in, token ids out).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

PROMPTS, GEN = (128, 512), 64


def peak_rss() -> int:
    """VmHWM of this process (getrusage's maxrss survives execve and can report the parent's peak)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def now() -> float:
    return time.monotonic_ns() / 1e9


class Deltaship:
    def __init__(self, path: str, threads: int):
        from deltaship.targets import open_bundle

        self.s = open_bundle(path, threads=threads, check_hashes=False)

    def prefill(self, ids):
        self.s.reset()
        return self.s.prefill(ids)

    def decode(self, tok):
        return self.s.decode(tok)


class Transformers:
    def __init__(self, path: str, threads: int, dtype: str):
        import torch
        from transformers import Qwen3_5ForCausalLM

        from deltaship.oracle.compat import CACHE_NAME, output_cache  # transformers 5.24 renamed past_key_values

        self.cache_name, self.output_cache = CACHE_NAME, output_cache
        torch.set_num_threads(threads)
        self.torch = torch
        self.m = Qwen3_5ForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()

    def prefill(self, ids):
        with self.torch.no_grad():
            out = self.m(self.torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        self.cache = self.output_cache(out)
        return out.logits[0, -1].float().numpy()

    def decode(self, tok):
        with self.torch.no_grad():
            out = self.m(self.torch.tensor([[tok]]), use_cache=True, **{self.cache_name: self.cache})
        self.cache = self.output_cache(out)
        return out.logits[0, -1].float().numpy()


class Genai:
    def __init__(self, path: str, threads: int):
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(path)
        # a bundle's genai_config.json may leave the threads to ONNX Runtime (every core): the same as the others
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(config)

    def prefill(self, ids):
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(ids) + GEN + 8, do_sample=False)
        self.gen = self.og.Generator(self.model, params)
        self.gen.append_tokens(np.asarray(ids, dtype=np.int32))
        return np.asarray(self.gen.get_logits()).reshape(-1)

    def decode(self, tok):
        self.gen.append_tokens(np.asarray([tok], dtype=np.int32))
        return np.asarray(self.gen.get_logits()).reshape(-1)


class ExecuTorchExample:
    def __init__(self, path: str, threads: int):
        import executorch.kernels.quantized  # noqa: F401
        import torch
        from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401
        from executorch.extension.pybindings import portable_lib
        from executorch.runtime import Runtime

        path, _, per_call = path.partition(":")
        self.chunk = int(per_call or 1024)
        portable_lib._unsafe_reset_threadpool(threads)
        self.torch = torch
        self.fwd = Runtime.get().load_program(path).load_method("forward")

    def _call(self, ids, pos):
        t = self.torch
        out = self.fwd.execute([t.tensor([ids], dtype=t.long), t.tensor([pos], dtype=t.long)])[0]
        return out.reshape(-1, out.shape[-1])[-1].float().numpy()

    def prefill(self, ids):
        self.pos = 0
        for i in range(0, len(ids), self.chunk):
            logits = self._call(list(ids[i : i + self.chunk]), self.pos)
            self.pos += len(ids[i : i + self.chunk])
        return logits

    def decode(self, tok):
        logits = self._call([tok], self.pos)
        self.pos += 1
        return logits


class LlamaCpp:
    def __init__(self, path: str, threads: int):
        import llama_cpp

        # The stand-in byte tokenizer has no BPE merges, which llama.cpp's vocabulary loader requires unless
        # the pre-tokenizer is one that needs none; token ids are fed directly, so the tokenizer is never used.
        self.m = llama_cpp.Llama(
            model_path=path,
            n_ctx=1024,
            n_threads=threads,
            n_threads_batch=threads,
            n_batch=512,
            logits_all=False,
            verbose=False,
            kv_overrides={"tokenizer.ggml.pre": "kimi-k2"},
        )
        self.lib = llama_cpp

    def last_logits(self):
        # llama-cpp-python 0.3.36 leaves `scores` at zero without logits_all, and logits_all would run the
        # 248320-wide head on every prompt token; read the last token's row from the context instead.
        row = self.lib.llama_get_logits_ith(self.m._ctx.ctx, -1)
        return np.ctypeslib.as_array(row, shape=(self.m.n_vocab(),)).copy()

    def prefill(self, ids):
        self.m.reset()
        self.m.eval(list(ids))
        return self.last_logits()

    def decode(self, tok):
        self.m.eval([tok])
        return self.last_logits()


def make(tool: str, path: str, threads: int):
    if tool == "deltaship":
        return Deltaship(path, threads)
    if tool.startswith("transformers"):
        return Transformers(path, threads, "bfloat16" if tool.endswith("bf16") else "float32")
    if tool == "genai":
        return Genai(path, threads)
    if tool == "et-example":
        return ExecuTorchExample(path, threads)
    if tool == "llamacpp":
        return LlamaCpp(path, threads)
    raise SystemExit(f"unknown tool {tool}")


def main() -> int:
    tool, path, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if tool == "ort-node":  # exec, not a child: the measured process is node itself (VmHWM starts again at exec)
        os.execvp("node", ["node", str(Path(__file__).with_name("ort_node_worker.mjs")), path, str(threads)])
    t0 = now()
    m = make(tool, path, threads)
    load = now() - t0
    rng = np.random.default_rng(0)
    out = {"tool": tool, "load_s": load}
    m.prefill(rng.integers(0, 1000, 16).tolist())  # warm up threads and allocations
    for p in PROMPTS:
        ids = rng.integers(0, 1000, p).tolist()
        t0 = now()
        logits = m.prefill(ids)
        t1 = now()
        tok = int(np.argmax(logits))
        out[f"prefill_{p}_tok_s"] = p / (t1 - t0)
        out[f"ttft_{p}_s"] = now() - t0
    stamps = []
    for _ in range(GEN):
        stamps.append(now())
        tok = int(np.argmax(m.decode(tok)))
    stamps.append(now())
    out["decode_tok_s"] = (GEN - 1) / (stamps[-1] - stamps[1])
    out["peak_rss_bytes"] = peak_rss()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
