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
import re
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
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "deltaship", "bench/chat"], cwd=ROOT,
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

    session = open_bundle(Path(args.bundle[0]), threads=args.threads)
    return {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit(),
            "memory": memory(session, args.checkpoints, rss())}  # fmt: skip


PARTS = ("turns", "retry_undo", "save_load", "prompt_cache", "memory")


class Bench:
    """One bundle's sessions and the chat's tokenizer and template, shared by its parts."""

    def __init__(self, bundle: Path, args, tok, template):
        from deltaship.targets import open_bundle

        self.bundle, self.args, self.tok, self.template = bundle, args, tok, template
        manifest = json.loads((bundle / "manifest.json").read_text())
        self.out: dict = {"bundle": str(bundle), "model": manifest["source"]["model"],
                          "precision": manifest["precision"], "target": manifest["target"],
                          "max_context": manifest["max_context"], "prefill_chunk": manifest["prefill_chunk"],
                          "threads": args.threads}  # fmt: skip
        t_open = time.perf_counter()
        self.session = open_bundle(bundle, threads=args.threads)
        self.other = open_bundle(bundle, threads=args.threads)  # the re-prefill baseline's, and a loaded chat's
        self.out["open_s"] = round(time.perf_counter() - t_open, 2)
        self.out["runtime"] = self.session.runtime_name()
        self.rss0 = rss()
        self.chat = None  # the retry/undo part's chat, which the save/load part saves

    def reprefill(self, session, ids: list[int]) -> float | None:
        """reprefill(), unless the history is longer than --reprefill-max (None: not run)."""
        if self.args.reprefill_max and len(ids) > self.args.reprefill_max:
            return None
        return round(reprefill(session, ids), 3)


def part_turns(b: Bench) -> dict:
    args = b.args
    chat = make_chat(b.session, b.tok, b.template)
    baseline = {int(k) for k in args.baseline_turns.split(",") if k}
    turns = []
    for k in range(1, args.turns + 1):
        reply = chat.send(text_of(args.turn_tokens - 10, k), max_new_tokens=args.reply_tokens)
        row = {"turn": k, "ttft_s": round(reply.ttft_s, 3), "prefill_tokens": reply.prefill_tokens,
               "history_tokens": reply.context_tokens, "decode_tok_s": round(reply.decode_tok_s, 2)}  # fmt: skip
        if k in baseline:
            row["reprefill_s"] = b.reprefill(b.other, chat.ids[: reply.context_tokens])
        turns.append(row)
        b.say(f"turn {k}: {row}")
    b.out["checkpoint_bytes"] = chat.turns[-1].before.nbytes()
    return {"turns": turns}


def send_seeking(session, chat, text: str, measured: int) -> tuple:
    """chat.send(text) with the state's depth reached by Session.seek for all but the last `measured` tokens of the
    message: their KV entries and DeltaNet states are not computed (what follows costs what it costs at that depth:
    attention reads that many KV entries, a checkpoint copies the same DeltaNet states, a save writes the KV caches
    up to the position). Returns the reply and the measured tail's prefill: its first position, tokens and seconds."""
    real, deep = session.prefill, {}

    def prefill(ids):
        ids = list(ids)
        if len(ids) <= measured:
            return real(ids)
        session.seek(session.position + len(ids) - measured)
        deep["from_position"] = session.position
        t = time.perf_counter()
        out = real(ids[-measured:])
        deep.update(tokens=measured, seconds=round(time.perf_counter() - t, 3))
        return out

    session.prefill = prefill  # this instance only, for this one message
    try:
        return chat.send(text, max_new_tokens=1), deep
    finally:
        del session.prefill


def extrapolated_prefill(b: Bench, tokens: int, deep: dict) -> dict:
    """A fresh prefill of --reprefill-measure tokens, timed; with the deep tail's rate, the time to prefill `tokens`
    from an empty state, taking a token's cost as linear in its depth (attention reads one KV entry more per token
    of depth; the rest is constant): tokens x the mean of the shallow and the deep per-token time."""
    n = b.args.reprefill_measure
    t = reprefill(b.other, text_ids(b, n))
    shallow, deep_rate = t / n, deep["seconds"] / deep["tokens"]
    shallow_depth, deep_depth = n / 2, deep["from_position"] + deep["tokens"] / 2
    per_token = shallow + (deep_rate - shallow) * (tokens / 2 - shallow_depth) / (deep_depth - shallow_depth)
    return {"measured_tokens": n, "measured_s": round(t, 3), "deep": deep, "tokens": tokens,
            "extrapolated_s": round(per_token * tokens, 1)}  # fmt: skip


def text_ids(b: Bench, n: int) -> list[int]:
    return b.tok.encode(text_of(n, 3000))[:n]


def part_retry_undo(b: Bench) -> dict:
    args = b.args
    chat = b.chat = make_chat(b.session, b.tok, b.template)
    deep = None
    if args.seek_history:  # the history's depth reached without computing it (costs after it depend on the depth)
        first, deep = send_seeking(b.session, chat, text_of(args.history, 1000), args.seek_history)
    else:
        first = chat.send(text_of(args.history, 1000), max_new_tokens=1)  # the history, prefilled once
    b.say(f"history: {first.context_tokens} tokens in {first.ttft_s:.1f} s")
    last = chat.send(text_of(args.turn_tokens - 10, 1001), max_new_tokens=args.reply_tokens)
    cp = b.session.checkpoint()  # a restore is one copy of the DeltaNet states, whatever the position
    t = time.perf_counter()
    b.session.restore(cp)
    restore_s = time.perf_counter() - t
    retry = chat.retry(max_new_tokens=args.reply_tokens)
    t = time.perf_counter()
    chat.undo()
    undo_s = time.perf_counter() - t
    again = chat.send(text_of(args.turn_tokens - 10, 1002), max_new_tokens=args.reply_tokens)
    b.out.setdefault("checkpoint_bytes", cp.nbytes())
    return {"retry_undo": {
        "history_tokens": last.context_tokens,
        "history_prefill_tokens": first.context_tokens,
        "history_prefill_s": None if deep else round(first.ttft_s, 3),  # seeking: not a prefill of it
        "restore_s": round(restore_s, 5),
        "restore_bytes": cp.nbytes(),
        "retry_ttft_s": round(retry.ttft_s, 3),
        "retry_prefill_tokens": retry.prefill_tokens,
        "undo_s": round(undo_s, 5),
        "turn_after_undo_ttft_s": round(again.ttft_s, 3),
        "turn_after_undo_prefill_tokens": again.prefill_tokens,
        "reprefill_tokens": again.context_tokens,
        "reprefill_s": b.reprefill(b.other, chat.ids[: again.context_tokens]),
        **({"history_seek": deep, "reprefill_extrapolated": extrapolated_prefill(b, again.context_tokens, deep)}
           if deep else {}),
    }}  # fmt: skip


def part_save_load(b: Bench) -> dict:
    from deltaship.chat import Chat

    args, chat = b.args, b.chat
    if chat is None:
        raise SystemExit("--parts save_load needs retry_undo before it (its chat is the one saved)")
    path = Path(tempfile.mkdtemp(prefix="chat-bench-")) / "talk.dschat"
    t = time.perf_counter()
    chat.save(path)
    save_s = time.perf_counter() - t
    t = time.perf_counter()
    loaded = Chat.load(path, b.other, tokenizer=b.tok, template=b.template)
    load_s = time.perf_counter() - t
    nxt = loaded.send(text_of(args.turn_tokens - 10, 1003), max_new_tokens=args.reply_tokens)
    row = {
        "history_tokens": nxt.context_tokens - nxt.prefill_tokens,
        "file_bytes": path.stat().st_size,
        "save_s": round(save_s, 3),
        "load_s": round(load_s, 3),
        "turn_after_load_ttft_s": round(nxt.ttft_s, 3),
        "turn_after_load_prefill_tokens": nxt.prefill_tokens,
        "reprefill_tokens": nxt.context_tokens,
        "reprefill_s": b.reprefill(b.session, loaded.ids[: nxt.context_tokens]),
    }
    if "reprefill_extrapolated" in (b.out.get("retry_undo") or {}):  # the same rates, this many tokens
        ex = b.out["retry_undo"]["reprefill_extrapolated"]
        row["reprefill_extrapolated_s"] = round(ex["extrapolated_s"] * nxt.context_tokens / ex["tokens"], 1)
    path.unlink()
    return {"save_load": row}


def part_prompt_cache(b: Bench) -> dict:
    from deltaship.chat import Chat

    args = b.args
    system = text_of(args.cache_tokens - 20, 2000)
    cold = make_chat(b.session, b.tok, b.template, system=system)
    r_cold = cold.send(text_of(args.turn_tokens - 10, 2001), max_new_tokens=args.reply_tokens)
    primed = make_chat(b.session, b.tok, b.template, system=system)
    fed = primed.prime()
    cache = Path(tempfile.mkdtemp(prefix="chat-bench-")) / "prompt_cache.dschat"
    primed.save(cache)
    t = time.perf_counter()
    warm = Chat.load(cache, b.other, tokenizer=b.tok, template=b.template)
    cache_load_s = time.perf_counter() - t
    r_warm = warm.send(text_of(args.turn_tokens - 10, 2001), max_new_tokens=args.reply_tokens)
    assert r_warm.ids == r_cold.ids, "the cached start gave another reply"
    return {"prompt_cache": {
        "cache_tokens": fed,
        "cache_file_bytes": cache.stat().st_size,
        "no_cache_ttft_s": round(r_cold.ttft_s, 3),
        "no_cache_prefill_tokens": r_cold.prefill_tokens,
        "cache_load_s": round(cache_load_s, 3),
        "cached_ttft_s": round(r_warm.ttft_s, 3),
        "cached_prefill_tokens": r_warm.prefill_tokens,
    }}  # fmt: skip


def part_memory(b: Bench) -> dict:
    return {"memory": memory(b.session, b.args.checkpoints, b.rss0)}


def run(args) -> dict:
    """Every part in --parts, each on every bundle in turn (bundles alternate part by part, so that the figures
    compared across bundles were taken under the same load)."""
    from deltaship.models.presets import get_preset, write_tiny_tokenizer
    from deltaship.runtimes.tokenizer import BundleTokenizer

    tmp = Path(tempfile.mkdtemp(prefix="chat-bench-"))
    write_tiny_tokenizer(tmp)
    tok = BundleTokenizer(tmp / "tokenizer.json")
    template = get_preset("qwen3.5-tiny").chat_template()
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if not args.quiet else (lambda *a: None)
    out: dict = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
                 "commit": commit(), "parts": args.parts}  # fmt: skip
    benches = []
    for bundle in args.bundle:
        b = Bench(Path(bundle), args, tok, template)
        b.say = lambda *a, _t=b.out["target"]: say(f"[{_t}]", *a)
        benches.append(b)
    parts = {"turns": part_turns, "retry_undo": part_retry_undo, "save_load": part_save_load,
             "prompt_cache": part_prompt_cache, "memory": part_memory}  # fmt: skip
    for name in args.parts.split(","):
        for b in benches:
            got = parts[name](b)
            b.out.update(got)
            b.say(f"{name}: {got if name != 'turns' else '(above)'}")
    out["runs"] = [b.out for b in benches]
    out["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    out["load_average_end"] = list(os.getloadavg())
    return out


def markdown(r: dict, command: str, long_history: str = "32K tokens of history: not run on this bundle.") -> str:
    """The page and the first run's sections (the single-bundle format of the 4K ONNX run); long_history: where the
    32K measurements are."""
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
        long_history,
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


def _cell(v, fmt: str, scale: float = 1.0) -> str:
    return "" if v is None else format(v * scale, fmt)


def _title(run: dict) -> str:
    names = {"onnx": "ONNX", "executorch": "ExecuTorch", "coreml": "Core ML"}
    return f"{names.get(run['target'], run['target'])} ({run['max_context'] // 1024}K)"


def sections(r: dict, heading: str, intro: list[str]) -> str:
    """A run of one or more bundles (new format: r["runs"]) as tables with one column per bundle."""
    mib = 2**20
    runs = r["runs"]
    m = r["machine"]
    head = " | ".join(_title(x) for x in runs)
    rule = "|---|" + "---:|" * len(runs)
    lines = [
        f"## {heading}",
        "",
        f"- **Measured:** {r['started']} to {r['finished']} UTC, commit `{r['commit']}`, one invocation"
        + (", the bundles alternating part by part (each part ran on one bundle, then on the next)" if len(runs) > 1
           else "") + ".",
        f"- **Machine:** the same 2-core machine, **shared** (load average {m['load_average'][0]:.1f} at the start, "
        f"{r['load_average_end'][0]:.1f} at the end), the bench under `flock /tmp/heavy.lock nice -n 5`.",
        "- **Bundles:** " + "; ".join(
            f"{_title(x)}: {x['model']} {x['precision']} {x['target']}, context {x['max_context']}, prefill chunk "
            f"{x['prefill_chunk']}, {x['runtime']}, {x['threads']} threads (`deltaship export --model {x['model']} "
            f"--target {x['target']} --precision {x['precision']} --no-verify"
            + (f" --max-context {x['max_context']}" if x["max_context"] != 4096 else "") + " --out BUNDLE`)"
            for x in runs) + ".",
        f"- **Command:** `{r['command']}`. Raw JSON: [bench/results/{r['json_name']}](../../bench/results/{r['json_name']}).",
        *intro,
    ]  # fmt: skip
    if all("turns" in x for x in runs):
        lines += ["", "### TTFT of turn k against re-prefilling the history", "",
                  "| turn | history tokens | " + " | ".join(f"{_title(x)} fed | TTFT s | re-prefill s" for x in runs)
                  + " |", "|---:|---:|" + "---:|---:|---:|" * len(runs)]  # fmt: skip
        for k, row in enumerate(runs[0]["turns"]):
            cells = []
            for x in runs:
                t = x["turns"][k]
                cells += [str(t["prefill_tokens"]), f"{t['ttft_s']:.2f}", _cell(t.get("reprefill_s"), ".2f")]
            lines.append(f"| {row['turn']} | {row['history_tokens']:,} | " + " | ".join(cells) + " |")
    if all("retry_undo" in x for x in runs):
        ru = [{**x["retry_undo"], "extrapolated_reprefill_s": (x["retry_undo"].get("reprefill_extrapolated") or {})
               .get("extrapolated_s")} for x in runs]  # fmt: skip
        for row in ru:  # a seeked history had no prefill of its own: neither its time nor its tokens are shown
            if row.get("history_prefill_s") is None:
                row["history_prefill_tokens"] = None
        lines += _what_table(f"/retry and /undo after {ru[0]['history_tokens']:,} tokens of history", head, rule, ru, [
            ("checkpoint restore (DeltaNet states copied back, position moved), ms", "restore_s", ".2f", 1000),
            ("bytes a checkpoint copies, MiB", "restore_bytes", ".1f", 1 / mib),
            ("retry TTFT (restore + the generation prompt's tokens), s", "retry_ttft_s", ".2f", 1),
            ("tokens retry fed", "retry_prefill_tokens", "d", 1),
            ("undo, ms", "undo_s", ".2f", 1000),
            ("next turn after undo, TTFT s", "turn_after_undo_ttft_s", ".2f", 1),
            ("tokens that turn fed", "turn_after_undo_prefill_tokens", "d", 1),
            ("re-prefilling the history and that turn, s", "reprefill_s", ".2f", 1),
            ("the same, extrapolated (see above), s", "extrapolated_reprefill_s", ".0f", 1),
            ("the history's own prefill when the chat built it (a fresh state fed it), s", "history_prefill_s",
             ".2f", 1),
            ("tokens of that prefill", "history_prefill_tokens", ",", 1),
        ])  # fmt: skip
    if all("save_load" in x for x in runs):
        sl = [x["save_load"] for x in runs]
        lines += _what_table(f"Saved session at {sl[0]['history_tokens']:,} tokens of history", head, rule, sl, [
            ("file (DeltaNet states, KV caches up to the position, two checkpoints), MiB", "file_bytes", ".1f",
             1 / mib),
            ("`Chat.save` (hashing, atomic replace), s", "save_s", ".2f", 1),
            ("`Chat.load` into another session (every hash checked), s", "load_s", ".2f", 1),
            ("next turn after loading, TTFT s", "turn_after_load_ttft_s", ".2f", 1),
            ("tokens that turn fed", "turn_after_load_prefill_tokens", "d", 1),
            ("re-prefilling the history and that turn instead, s", "reprefill_s", ".2f", 1),
            ("the same, extrapolated (see above), s", "reprefill_extrapolated_s", ".0f", 1),
        ])  # fmt: skip
    if all("prompt_cache" in x for x in runs):
        pc = [x["prompt_cache"] for x in runs]
        lines += _what_table(
            f"First turn with a {pc[0]['cache_tokens']:,}-token prompt cache",
            head,
            rule,
            pc,
            [
                ("system message fed: tokens", "no_cache_prefill_tokens", ",", 1),
                ("system message fed: TTFT s", "no_cache_ttft_s", ".2f", 1),
                ("its state loaded: file MiB", "cache_file_bytes", ".1f", 1 / mib),
                ("its state loaded: load s", "cache_load_s", ".2f", 1),
                ("its state loaded: tokens fed", "cached_prefill_tokens", ",", 1),
                ("its state loaded: TTFT s", "cached_ttft_s", ".2f", 1),
            ],
        )
        lines += ["", "Both starts give the same reply tokens (asserted)."]
    for x in runs:
        mem = x.get("memory")
        if not mem:
            continue
        lines += ["", f"### Memory held by N checkpoints: {_title(x)}", "", mem.get("note", "Each N held at once."), "",
                  "| checkpoints | bytes held | RSS growth |", "|---:|---:|---:|"]  # fmt: skip
        for row in mem["rows"]:
            lines.append(
                f"| {row['checkpoints']} | {row['bytes'] / mib:.1f} MiB | {row['rss_growth_bytes'] / mib:.1f} MiB |"
            )
    return "\n".join(lines) + "\n"


def _what_table(title: str, head: str, rule: str, parts: list[dict], rows: list[tuple]) -> list[str]:
    """A section's "| what | run ... |" table: one line per (label, key, format, scale), one cell per run's part."""
    lines = ["", f"### {title}", "", f"| what | {head} |", rule]
    for label, key, fmt, scale in rows:
        lines.append(f"| {label} | " + " | ".join(_cell(x.get(key), fmt, scale) for x in parts) + " |")
    return lines


def about(r: dict) -> tuple[str, list[str]]:
    """A run's section heading and what to know before its tables (how its long history was reached and its
    re-prefill obtained), from the run itself."""
    runs, notes = r["runs"], []
    names = " beside ".join(_title(x) for x in runs)
    for x in runs:
        ru = x.get("retry_undo") or {}
        if "history_seek" in ru:
            seek, ex = ru["history_seek"], ru["reprefill_extrapolated"]
            notes += [
                f"- **The history's depth was reached with `Session.seek`** (`--seek-history`): of the {_title(x)} "
                f"history's {ru['history_prefill_tokens']:,} tokens only the last {seek['tokens']:,} were computed "
                f"(from position {seek['from_position']:,}, in {seek['seconds']:.1f} s); the KV entries and DeltaNet "
                "states before them were not. What is timed after it costs what it costs at that depth, whatever the "
                "values: the attention of each later token reads that many KV entries, a checkpoint copies the same "
                "fixed-size DeltaNet states, a save writes the KV caches up to the position, a load reads them.",
                f"- **Re-prefill at this length: extrapolated, not measured** (a prefill of {ex['tokens']:,} tokens "
                "would have taken longer than this session's time on the shared machine). Measured: a fresh prefill "
                f"of {ex['measured_tokens']:,} tokens, {ex['measured_s']:.1f} s, and the computed tail above "
                f"({seek['tokens']:,} tokens at depth {seek['from_position']:,}, {seek['seconds']:.1f} s); taking a "
                "token's cost as linear in its depth (attention reads one KV entry more per token of depth, the rest "
                f"is constant), re-prefilling {ex['tokens']:,} tokens from an empty state takes about "
                f"{ex['extrapolated_s']:.0f} s. The tables' re-prefill rows are empty; this is the figure to hold the "
                "turn costs against.",
            ]
        elif ru and ru.get("reprefill_s") is None:
            notes.append(
                f"- {_title(x)}: the re-prefills of the long histories (the retry / undo and saved-session tables) "
                "were not run again (`--reprefill-max`, to fit this session's time on the shared machine): the "
                f"history's own prefill, a fresh state fed {ru['history_prefill_tokens']:,} tokens in the same calls, "
                f"took {ru['history_prefill_s']:.1f} s (its row below) and stands for them."
            )
    if any(x["max_context"] > 4096 for x in runs):
        return f"{runs[0]['max_context'] // 1024}K tokens of history: {names}", notes
    return f"{names}: 0.8B int4", notes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("bundle", nargs="*", help="one or more bundles: each part runs on each in turn")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"which parts, in order (default {','.join(PARTS)})")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--turn-tokens", type=int, default=100)
    ap.add_argument("--reply-tokens", type=int, default=8)
    ap.add_argument("--baseline-turns", default="1,2,5,10,15,20")
    ap.add_argument("--history", type=int, default=3700)
    ap.add_argument("--reprefill-max", type=int, default=0,
                    help="re-prefill no history longer than this many tokens (0: every one); the history's own "
                         "prefill, a fresh state fed it, is measured in any case")  # fmt: skip
    ap.add_argument("--seek-history", type=int, default=0, metavar="N",
                    help="reach the retry/undo history's depth with Session.seek, computing only its last N tokens "
                         "(0: prefill it all)")  # fmt: skip
    ap.add_argument(
        "--reprefill-measure",
        type=int,
        default=2048,
        help="with --seek-history: the fresh prefill timed for the re-prefill extrapolation, tokens",
    )
    ap.add_argument("--cache-tokens", type=int, default=1024)
    ap.add_argument("--checkpoints", default="2,16,32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--memory-only", action="store_true", help="only the checkpoints' memory, in this fresh process")
    ap.add_argument("--memory-into", type=Path, help="with --memory-only: put it into this run's JSON, as the memory "
                    "of its run of the same bundle")  # fmt: skip
    ap.add_argument("--render", type=Path, nargs="+",
                    help="write --markdown from these JSONs (runs') instead of running: the first is the page's "
                         "single-bundle run, the others follow as sections")  # fmt: skip
    args = ap.parse_args()
    command = "python bench/chat/chat.py " + " ".join(sys.argv[1:])
    if args.memory_only:
        mem = memory_only(args)
        if args.memory_into:
            r = json.loads(args.memory_into.read_text())
            entry = next(x for x in r["runs"] if x["bundle"] == args.bundle[0])
            entry["memory"] = {**mem["memory"], "note": f"Measured in a second, fresh process (`{command}`, "
                             f"{mem['started']} UTC, commit `{mem['commit']}`): the session opened, 16 tokens fed, "
                             "N checkpoints taken and held at once, then freed."}  # fmt: skip
            args.memory_into.write_text(json.dumps(r, indent=2) + "\n")
        print(json.dumps(mem, indent=2))
        return
    if args.render:
        first = json.loads(args.render[0].read_text())
        rest = [{**json.loads(path.read_text()), "json_name": path.name} for path in args.render[1:]]
        headed = [(r, *about(r)) for r in rest]
        long = next((h for r, h, _ in headed if any(x["max_context"] > 4096 for x in r["runs"])), None)
        anchor = re.sub(r"[^a-z0-9 -]", "", (long or "").lower()).replace(" ", "-")
        where = f"32K tokens of history: [below](#{anchor}), on a bundle exported with `--max-context 32768`."
        page = markdown(first, first["command"], *([where] if long else []))
        for r, heading, notes in headed:
            page += "\n" + sections(r, heading, notes)
        args.markdown.write_text(page)
        return
    if not args.bundle:
        ap.error("a bundle is needed")
    r = run(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**r, "command": command}, indent=2) + "\n")
    print(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
