"""What a chat turn costs with O(1) turn checkpoints, against re-prefilling the history (docs/results/chat.md).

    python bench/chat/chat.py BUNDLE [--turns 20] [--turn-tokens 100] [--reply-tokens 8] [--baseline-turns 1,2,5,10,15,20]
                              [--history 3700] [--cache-tokens 1024] [--checkpoints 2,16,32] [--threads 2]
                              [--json bench/results/chat.json] [--markdown docs/results/chat.md]

On one bundle (an ONNX one: 0.8B int4 at the published shape, random weights), through deltaship.chat.Chat:
- turns: TTFT of turn k (k = 1..turns), each user message about --turn-tokens tokens, each reply --reply-tokens
  tokens; for the turns in --baseline-turns, the same history re-prefilled on a second session (what a runtime
  without checkpoints does each turn: every token the state holds, then one token sampled);
- retry / undo after a history of --history tokens: the checkpoint restore (time and bytes), retry's TTFT, undo's
  time, against re-prefilling that history;
- save / load at that history: file size and time (Chat.save, Chat.load into a second session), the first turn
  after loading, against re-prefilling it;
- a prompt cache of --cache-tokens tokens: the first turn's TTFT with the system message's state loaded from a
  saved session (Chat.load: the reader a shipped prompt_cache.safetensors goes through) against feeding it;
- memory: the RSS growth and the bytes of N checkpoints held.
A published-shape preset ships no tokenizer or template: the chat gets the preset's template and the tiny preset's
byte-level tokenizer (one token per ASCII character; ids below 260 of the 248K vocabulary), so a turn's length in
tokens is its length in characters. Replies of random weights rarely stop early: they run --reply-tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

WORDS = "alpha beta gamma delta state token turn model cache layer value query key chunk north south".split()


def text_of(n: int, seed: int) -> str:
    """About n characters (= n tokens of the byte-level tokenizer) of words."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = ""
    while len(out) < n:
        out += WORDS[int(rng.integers(len(WORDS)))] + " "
    return out[:n].strip()


def rss() -> int:
    """This process's resident set, bytes (Linux /proc)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def machine() -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    total = next(int(ln.split()[1]) * 1024 for ln in open("/proc/meminfo") if ln.startswith("MemTotal:"))
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(total / 2**30, 1),
        "load_average": list(os.getloadavg()),
    }


def commit() -> str:
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "deltaship", "bench"], cwd=ROOT,
                           capture_output=True, text=True).stdout  # fmt: skip
    return sha.strip() + ("+dirty" if dirty.strip() else "")


def make_chat(session, tokenizer, template, system=None):
    from deltaship.chat import Chat

    return Chat(session, system=system, tokenizer=tokenizer, template=template, prompt_cache=False)


def reprefill(session, ids: list[int]) -> float:
    """A fresh state fed every token, then one token sampled: seconds."""
    import numpy as np

    t = time.perf_counter()
    session.reset()
    logits = session.prefill(ids)
    int(np.argmax(logits))
    return time.perf_counter() - t


def memory(session, counts: str, rss0: int) -> dict:
    """The RSS growth and the bytes of N checkpoints held at once (each N on its own, freed before the next).
    Meaningful in a fresh process: memory freed by earlier work is reused by the allocator without growing RSS."""
    session.reset()
    session.prefill(list(range(16)))
    rows = []
    for n in (int(x) for x in counts.split(",")):
        before = rss()
        held = [session.checkpoint() for _ in range(n)]
        rows.append({"checkpoints": n, "bytes": sum(c.nbytes() for c in held), "rss_growth_bytes": rss() - before})
        del held
    return {"rss_after_open_bytes": rss0, "rows": rows}


def memory_only(args) -> dict:
    from deltaship.targets import open_bundle

    session = open_bundle(Path(args.bundle), threads=args.threads)
    return {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit(),
            "memory": memory(session, args.checkpoints, rss())}  # fmt: skip


def run(args) -> dict:
    from deltaship.models.presets import get_preset, write_tiny_tokenizer
    from deltaship.runtimes.tokenizer import BundleTokenizer
    from deltaship.targets import open_bundle

    bundle = Path(args.bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    tmp = Path(tempfile.mkdtemp(prefix="chat-bench-"))
    write_tiny_tokenizer(tmp)
    tok = BundleTokenizer(tmp / "tokenizer.json")
    template = get_preset("qwen3.5-tiny").chat_template()
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if not args.quiet else (lambda *a: None)
    out: dict = {"bundle": str(bundle), "model": manifest["source"]["model"], "precision": manifest["precision"],
                 "target": manifest["target"], "max_context": manifest["max_context"], "threads": args.threads,
                 "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
                 "commit": commit()}  # fmt: skip
    t_open = time.perf_counter()
    session = open_bundle(bundle, threads=args.threads)
    other = open_bundle(bundle, threads=args.threads)  # the re-prefill baseline's, and a loaded chat's
    out["open_s"] = round(time.perf_counter() - t_open, 2)
    rss0 = rss()

    # ---- turns
    chat = make_chat(session, tok, template)
    baseline = {int(k) for k in args.baseline_turns.split(",") if k}
    turns = []
    for k in range(1, args.turns + 1):
        reply = chat.send(text_of(args.turn_tokens - 10, k), max_new_tokens=args.reply_tokens)
        row = {"turn": k, "ttft_s": round(reply.ttft_s, 3), "prefill_tokens": reply.prefill_tokens,
               "history_tokens": reply.context_tokens, "decode_tok_s": round(reply.decode_tok_s, 2)}  # fmt: skip
        if k in baseline:
            row["reprefill_s"] = round(reprefill(other, chat.ids[: reply.context_tokens]), 3)
        turns.append(row)
        say(f"turn {k}: {row}")
    out["turns"] = turns
    cp = chat.turns[-1].before
    out["checkpoint_bytes"] = cp.nbytes()

    # ---- retry / undo after a long history
    chat = make_chat(session, tok, template)
    first = chat.send(text_of(args.history, 1000), max_new_tokens=1)  # the history, prefilled once
    last = chat.send(text_of(args.turn_tokens - 10, 1001), max_new_tokens=args.reply_tokens)
    cp = session.checkpoint()  # a restore is one copy of the DeltaNet states, whatever the position
    t = time.perf_counter()
    session.restore(cp)
    restore_s = time.perf_counter() - t
    retry = chat.retry(max_new_tokens=args.reply_tokens)
    t = time.perf_counter()
    chat.undo()
    undo_s = time.perf_counter() - t
    again = chat.send(text_of(args.turn_tokens - 10, 1002), max_new_tokens=args.reply_tokens)
    out["retry_undo"] = {
        "history_tokens": last.context_tokens,
        "history_prefill_s": round(first.ttft_s, 3),
        "restore_s": round(restore_s, 5),
        "restore_bytes": cp.nbytes(),
        "retry_ttft_s": round(retry.ttft_s, 3),
        "retry_prefill_tokens": retry.prefill_tokens,
        "undo_s": round(undo_s, 5),
        "turn_after_undo_ttft_s": round(again.ttft_s, 3),
        "turn_after_undo_prefill_tokens": again.prefill_tokens,
        "reprefill_s": round(reprefill(other, chat.ids[: again.context_tokens]), 3),
    }
    say(f"retry/undo: {out['retry_undo']}")

    # ---- save / load at that history
    from deltaship.chat import Chat

    path = tmp / "talk.dschat"
    t = time.perf_counter()
    chat.save(path)
    save_s = time.perf_counter() - t
    t = time.perf_counter()
    loaded = Chat.load(path, other, tokenizer=tok, template=template)
    load_s = time.perf_counter() - t
    nxt = loaded.send(text_of(args.turn_tokens - 10, 1003), max_new_tokens=args.reply_tokens)
    out["save_load"] = {
        "history_tokens": nxt.context_tokens - nxt.prefill_tokens,
        "file_bytes": path.stat().st_size,
        "save_s": round(save_s, 3),
        "load_s": round(load_s, 3),
        "turn_after_load_ttft_s": round(nxt.ttft_s, 3),
        "turn_after_load_prefill_tokens": nxt.prefill_tokens,
        "reprefill_s": round(reprefill(session, loaded.ids[: nxt.context_tokens]), 3),
    }
    say(f"save/load: {out['save_load']}")

    # ---- a prompt cache of the system message
    system = text_of(args.cache_tokens - 20, 2000)
    cold = make_chat(session, tok, template, system=system)
    r_cold = cold.send(text_of(args.turn_tokens - 10, 2001), max_new_tokens=args.reply_tokens)
    primed = make_chat(session, tok, template, system=system)
    fed = primed.prime()
    cache = tmp / "prompt_cache.dschat"
    primed.save(cache)
    t = time.perf_counter()
    warm = Chat.load(cache, other, tokenizer=tok, template=template)
    cache_load_s = time.perf_counter() - t
    r_warm = warm.send(text_of(args.turn_tokens - 10, 2001), max_new_tokens=args.reply_tokens)
    assert r_warm.ids == r_cold.ids, "the cached start gave another reply"
    out["prompt_cache"] = {
        "cache_tokens": fed,
        "cache_file_bytes": cache.stat().st_size,
        "no_cache_ttft_s": round(r_cold.ttft_s, 3),
        "no_cache_prefill_tokens": r_cold.prefill_tokens,
        "cache_load_s": round(cache_load_s, 3),
        "cached_ttft_s": round(r_warm.ttft_s, 3),
        "cached_prefill_tokens": r_warm.prefill_tokens,
    }
    say(f"prompt cache: {out['prompt_cache']}")

    out["memory"] = memory(session, args.checkpoints, rss0)
    say(f"memory: {out['memory']}")
    out["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    out["load_average_end"] = list(os.getloadavg())
    return out


def markdown(r: dict, command: str) -> str:
    mib = 2**20
    m = r["machine"]
    lines = [
        "# Chat: turn costs with O(1) checkpoints, against re-prefilling the history",
        "",
        f"- **Measured:** {r['started']} to {r['finished']} UTC, commit `{r['commit']}`, one invocation.",
        f"- **Machine:** {m['platform']}, {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, no GPU, **shared**: "
        f"other sessions' jobs ran beside it (load average {m['load_average'][0]:.1f} at the start, "
        f"{r['load_average_end'][0]:.1f} at the end, on {m['cores']} cores), the bench under `nice -n 10`. Times are "
        "rough; the ratios and the token counts are the result.",
        f"- **Bundle:** {r['model']} {r['precision']} {r['target']} (published shape, random weights), context "
        f"{r['max_context']}, {r['threads']} threads: `deltaship export --model {r['model']} --target onnx "
        "--precision int4 --no-verify --out BUNDLE`.",
        f"- **Command:** `{command}`. Raw JSON: [bench/results/chat.json](../../bench/results/chat.json).",
        "- The preset ships no tokenizer or chat template: the chat gets the preset's template and the tiny preset's "
        "byte-level tokenizer (one token per character), so a turn of ~100 characters is ~100 tokens. TTFT is "
        "`Reply.ttft_s`: from `send()` to the first token (rendering, the turn's prefill, one sample).",
        "",
        "## TTFT of turn k: the turn's own tokens, against re-prefilling the history",
        "",
        "| turn | history tokens | tokens fed | TTFT s | re-prefill s | re-prefill / TTFT |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for t in r["turns"]:
        base = t.get("reprefill_s")
        ratio = f"{base / t['ttft_s']:.1f}" if base else ""
        lines.append(f"| {t['turn']} | {t['history_tokens']:,} | {t['prefill_tokens']} | {t['ttft_s']:.2f} | "
                     f"{base if base is not None else ''} | {ratio} |")  # fmt: skip
    ru = r["retry_undo"]
    lines += [
        "",
        "Re-prefill: a second session of the same bundle, reset, fed every token the chat's state held when the reply "
        "began, one token sampled (what a runtime that cannot rewind a recurrent state does each turn). Measured for "
        "the turns that have a number. Tokens fed per turn: the turn's own ~100, plus the previous reply's ~20 "
        "(its role header and 8 tokens) fed again from the checkpoint before it, because the template renders a past "
        "reply without the generation prompt's `<think>` ([chat.md](../chat.md#how-a-turn-is-fed)): the reply's tokens, "
        "never the history. A turn's TTFT still grows slowly with the history: its attention reads a longer KV cache.",
        "",
        f"## /retry and /undo after {ru['history_tokens']:,} tokens of history",
        "",
        "| what | value |",
        "|---|---:|",
        f"| checkpoint restore (DeltaNet states copied back, position moved) | {ru['restore_s'] * 1000:.2f} ms |",
        f"| bytes a checkpoint copies | {ru['restore_bytes'] / mib:.1f} MiB |",
        f"| retry TTFT (restore + {ru['retry_prefill_tokens']} generation-prompt tokens) | {ru['retry_ttft_s']:.2f} s |",
        f"| undo | {ru['undo_s'] * 1000:.2f} ms |",
        f"| next turn after undo ({ru['turn_after_undo_prefill_tokens']} tokens fed) | "
        f"{ru['turn_after_undo_ttft_s']:.2f} s |",
        f"| re-prefilling the history and that turn | {ru['reprefill_s']:.2f} s |",
        f"| the history's own prefill when the chat built it | {ru['history_prefill_s']:.2f} s |",
        "",
        "32K tokens of history: not run. The bundle's context is 4,096 (the export's default), and at the prefill rate "
        "measured here on this loaded machine a 32K history would take longer than this run's time; the restore is the "
        "same copy at any history (the DeltaNet states do not grow; the KV cache is not copied).",
    ]
    sl = r["save_load"]
    lines += [
        "",
        f"## Saved session at {sl['history_tokens']:,} tokens of history",
        "",
        "| what | value |",
        "|---|---:|",
        f"| file (DeltaNet states, KV caches up to the position, two checkpoints) | {sl['file_bytes'] / mib:.1f} MiB |",
        f"| `Chat.save` (hashing, atomic replace) | {sl['save_s']:.2f} s |",
        f"| `Chat.load` into another session (every hash checked) | {sl['load_s']:.2f} s |",
        f"| next turn after loading ({sl['turn_after_load_prefill_tokens']} tokens fed) | "
        f"{sl['turn_after_load_ttft_s']:.2f} s |",
        f"| re-prefilling the history and that turn instead | {sl['reprefill_s']:.2f} s |",
    ]
    pc = r["prompt_cache"]
    lines += [
        "",
        f"## First turn with a {pc['cache_tokens']:,}-token prompt cache",
        "",
        "| start | tokens fed | load s | TTFT s |",
        "|---|---:|---:|---:|",
        f"| system message fed | {pc['no_cache_prefill_tokens']:,} | | {pc['no_cache_ttft_s']:.2f} |",
        f"| system message's state loaded ({pc['cache_file_bytes'] / mib:.1f} MiB file) | "
        f"{pc['cached_prefill_tokens']} | {pc['cache_load_s']:.2f} | {pc['cached_ttft_s']:.2f} |",
        "",
        "Both give the same reply tokens (asserted). The cached start is loaded with `Chat.load` from a primed, saved "
        "session: the same reader and state loading a shipped `prompt_cache.safetensors` goes through "
        "(`export --prompt-cache` needs the bundle's tokenizer, which a published-shape preset does not ship).",
    ]
    mem = r["memory"]
    lines += [
        "",
        "## Memory held by N checkpoints",
        "",
        mem.get("note", "Each N held at once, then freed."),
        "",
        "| checkpoints | bytes held | RSS growth |",
        "|---:|---:|---:|",
    ]
    for row in mem["rows"]:
        lines.append(
            f"| {row['checkpoints']} | {row['bytes'] / mib:.1f} MiB | {row['rss_growth_bytes'] / mib:.1f} MiB |"
        )
    lines += [
        "",
        f"A chat keeps two checkpoints per turn for its last 16 turns (32 at most: "
        f"{32 * r['checkpoint_bytes'] / mib:.0f} MiB here); the measuring process's RSS after opening its session "
        f"was {mem['rss_after_open_bytes'] / mib:.0f} MiB.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--turn-tokens", type=int, default=100)
    ap.add_argument("--reply-tokens", type=int, default=8)
    ap.add_argument("--baseline-turns", default="1,2,5,10,15,20")
    ap.add_argument("--history", type=int, default=3700)
    ap.add_argument("--cache-tokens", type=int, default=1024)
    ap.add_argument("--checkpoints", default="2,16,32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--memory-only", action="store_true", help="only the checkpoints' memory, in this fresh process")
    ap.add_argument("--render", type=Path, help="write --markdown from this JSON (a run's) instead of running")
    args = ap.parse_args()
    if args.memory_only:
        print(json.dumps(memory_only(args), indent=2))
        return
    if args.render:
        r = json.loads(args.render.read_text())
        args.markdown.write_text(markdown(r, r["command"]))
        return
    r = run(args)
    command = "python bench/chat/chat.py " + " ".join(sys.argv[1:])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**r, "command": command}, indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(markdown(r, command))
    print(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
