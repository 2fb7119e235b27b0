"""`deltaship serve` measured through the openai client: turn-k TTFT over a multi-turn conversation with state
reuse against a server that re-prefills every prompt (--no-reuse), and requests/s with p50/p95 latency under
1, 4 and 16 concurrent clients. Both servers run in this process on 127.0.0.1 (a free port), one after the other.

    python bench/serve/serve.py BUNDLE [--turns 20] [--reply-tokens 16] [--clients 1 4 16] [--requests 32]
        [--baseline-turns 1 5 10 15 20] [--json OUT.json] [--markdown OUT.md]

TTFT is the client's: from sending the request to the first streamed content chunk.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import openai

from deltaship.serve.run import ServeOptions, ServerThread
from deltaship.targets import open_bundle

SYSTEM = "You are a careful coding assistant. Answer with short Python snippets and one line of explanation."


def user_message(k: int) -> str:
    return f"Turn {k}: write a function step_{k}(xs) that returns the running sum of xs, skipping None values."


def ask(c, messages: list[dict], reply_tokens: int) -> tuple[dict, str]:
    """One streamed, greedy request: its TTFT (to the first content chunk), total time, usage, and text."""
    t0 = time.perf_counter()
    first, parts, use = None, [], None
    stream = c.chat.completions.create(
        model="m",
        messages=messages,
        max_tokens=reply_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            first = first or time.perf_counter()
            parts.append(ch.choices[0].delta.content)
        if ch.usage:
            use = ch.usage
    total = time.perf_counter() - t0
    row = {
        "prompt_tokens": use.prompt_tokens,
        "cached_tokens": use.prompt_tokens_details.cached_tokens,
        "ttft_s": (first or time.perf_counter()) - t0,
        "total_s": total,
    }
    return row, "".join(parts)


def conversation(url: str, turns: int, reply_tokens: int) -> tuple[list[dict], list[list[dict]]]:
    """The conversation's rows, and each turn's request messages (what the baseline sends again)."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    messages = [{"role": "system", "content": SYSTEM}]
    rows, asked = [], []
    for k in range(1, turns + 1):
        messages.append({"role": "user", "content": user_message(k)})
        asked.append([dict(m) for m in messages])
        row, text = ask(c, messages, reply_tokens)
        rows.append({"turn": k, **row})
        messages.append({"role": "assistant", "content": text})
    return rows, asked


def baseline(url: str, asked: list[list[dict]], turns: list[int], reply_tokens: int) -> list[dict]:
    """Turn k's request of the reuse run sent to a server that re-prefills (greedy: the same history, since a
    restored conversation gives a fresh prefill's tokens), for the turns asked."""
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    return [{"turn": k, **ask(c, asked[k - 1], reply_tokens)[0]} for k in turns if k <= len(asked)]


def load(url: str, clients: int, requests: int, reply_tokens: int) -> dict:
    """`requests` chat requests spread over `clients` threads, each its own short conversation's first turn."""
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def worker(w: int) -> None:
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        for i in range(w, requests, clients):
            t0 = time.perf_counter()
            try:
                c.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": f"def f_{i}(x):"}],
                    max_tokens=reply_tokens,
                    temperature=0,
                )
            except Exception as e:  # counted, reported
                with lock:
                    errors.append(type(e).__name__)
                continue
            with lock:
                latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {
        "clients": clients,
        "requests": requests,
        "ok": len(latencies),
        "errors": len(errors),
        "req_per_s": len(latencies) / wall,
        "p50_s": float(np.percentile(latencies, 50)),
        "p95_s": float(np.percentile(latencies, 95)),
    }


def tiny_tokenizer():
    from deltaship.models.presets import get_preset, write_tiny_tokenizer
    from deltaship.runtimes.tokenizer import BundleTokenizer

    tmp = Path(tempfile.mkdtemp(prefix="serve-bench-"))
    write_tiny_tokenizer(tmp)
    return BundleTokenizer(tmp / "tokenizer.json"), get_preset("qwen3.5-tiny").chat_template()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--baseline-turns", type=int, nargs="+", default=None, help="turns to re-prefill (default: all)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--tiny-tokenizer",
        action="store_true",
        help="a bundle without a tokenizer (a published-shape preset): the tiny preset's byte-level "
        "tokenizer and its chat template, as bench/chat/chat.py does",
    )
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--markdown", type=Path, default=None)
    a = ap.parse_args()
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    out: dict = {"bundle": str(a.bundle), "started": started}
    asked: list[list[dict]] = []
    tok, template = tiny_tokenizer() if a.tiny_tokenizer else (None, None)
    for reuse in (True, False):
        opts = ServeOptions(port=0, reuse=reuse)
        with ServerThread(open_bundle(a.bundle, threads=a.threads), opts, tok, template) as s:
            if reuse:
                rows, asked = conversation(s.url, a.turns, a.reply_tokens)
                out["reuse"] = {"turns": rows}
                out["reuse"]["load"] = [load(s.url, n, a.requests, a.reply_tokens) for n in a.clients]
                out["reuse"]["held_bytes"] = s.served.engine.held.nbytes
                out["reuse"]["held_conversations"] = len(s.served.engine.held)
            else:
                turns = a.baseline_turns or list(range(1, a.turns + 1))
                out["no_reuse"] = {"turns": baseline(s.url, asked, turns, a.reply_tokens)}
    out["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    out["machine"] = f"{platform.platform()}, {platform.processor() or platform.machine()}"
    out["commit"] = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    text = json.dumps(out, indent=1)
    if a.json:
        a.json.write_text(text)
    print(text if not a.markdown else "")
    if a.markdown:
        a.markdown.write_text(markdown(out))


def markdown(out: dict) -> str:
    lines = [
        "| turn | prompt tokens | cached (reuse) | TTFT reuse s | TTFT no reuse s | no reuse / reuse |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    base = {n["turn"]: n for n in out["no_reuse"]["turns"]}
    for r in out["reuse"]["turns"]:
        n = base.get(r["turn"])
        again = f"{n['ttft_s']:.3f} | {n['ttft_s'] / r['ttft_s']:.1f}" if n else " | "
        lines.append(f"| {r['turn']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['ttft_s']:.3f} | {again} |")
    lines += [
        "",
        "| clients | requests | ok | errors | requests/s | p50 s | p95 s |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in out["reuse"]["load"]:
        lines.append(
            f"| {x['clients']} | {x['requests']} | {x['ok']} | {x['errors']} | {x['req_per_s']:.2f} | "
            f"{x['p50_s']:.3f} | {x['p95_s']:.3f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
