"""The speculative block of a profile report: text, summary lines and the cost plot."""

from __future__ import annotations

from typing import Any


def format_speculative(s: dict[str, Any]) -> str:
    """The speculative block of a profile as text: costs relative to a decode step, acceptance, speeds."""
    c, rel, a, d, pr = (
        s["costs_ms"],
        s["relative_to_decode_step"],
        s["acceptance"],
        s["decode_tok_s"],
        s["projection"],
    )
    lines = [f"speculative decoding, mtp:{s['depth']}, context {s['context']} (median ms; x one decode step)"]
    if s.get("draft_vocab", s.get("vocab_size")) != s.get("vocab_size"):
        lines.append(f"  draft head over {s['draft_vocab']} of {s['vocab_size']} token ids (--mtp-draft-vocab)")
    if not s.get("device_latencies", True):
        lines.append(f"  LATENCIES: {s['latencies']}")
    lines.append(f"  decode step          {c['decode_step']:9.3f} ms  x1.00")
    lines += [f"  verify {t:>2} tokens     {v:9.3f} ms  x{rel['verify'][t]:.2f}" for t, v in c["verify"].items()]
    lines += [f"  draft {p:>2} positions   {v:9.3f} ms  x{rel['draft'][p]:.2f}" for p, v in c["draft"].items()]
    lines += [
        f"  snapshot             {c['snapshot']:9.3f} ms  x{rel['snapshot']:.2f}",
        f"  restore              {c['restore']:9.3f} ms  x{rel['restore']:.2f}",
        *(
            [f"  rollback to first    {c['rollback_to_first']:9.3f} ms  x{rel['rollback_to_first']:.2f}"]
            if "rollback_to_first" in c
            else []
        ),
        f"acceptance over {a['prompts']} prompts x {a['new_tokens']} tokens: {a['acceptance_rate']:.3f} "
        f"({a['accepted']}/{a['drafted']}), {a['mean_accepted_length']:.3f} drafts accepted per verify call, "
        f"{a['tokens_per_verify']:.3f} tokens per verify call; output identical to plain greedy on "
        f"{a['identical_to_plain']}/{a['prompts']} prompts",
    ]
    if not a["meaningful"]:
        lines.append(f"  ({a['note']})")
    lines += [
        f"decode tok/s, measured: plain {d['plain']:.2f}, speculative {d['speculative']:.2f} "
        f"(x{d['speedup']:.3f}, 95% CI [{d['speedup_ci95'][0]:.3f}, {d['speedup_ci95'][1]:.3f}])",
        f"PROJECTION at acceptance {pr['acceptance']} ({pr['source']}): {pr['tokens_per_s']:.2f} tok/s vs "
        f"{pr['tokens_per_s_plain']:.2f} plain, x{pr['speedup']:.3f} ({pr['tokens_per_verify']:.2f} tokens per "
        "verify call); a projection from the measured costs, not a measured speed",
    ]
    imp = s.get("decode_tok_s_imposed")
    if imp:
        lines.append(
            f"decode tok/s TIMED AT AN IMPOSED ACCEPTANCE {imp['acceptance']} (drafts accepted "
            f"{imp['accepted']}/{imp['drafted']} by rigging the verify logits): plain {imp['plain']:.2f}, "
            f"speculative {imp['speculative']:.2f} (x{imp['speedup']:.3f}, 95% CI [{imp['speedup_ci95'][0]:.3f}, "
            f"{imp['speedup_ci95'][1]:.3f}])"
            + (
                f"; rolling back by snapshot instead: {imp['speculative_by_snapshot']:.2f} "
                f"(x{imp['speedup_by_snapshot']:.3f})"
                if "speculative_by_snapshot" in imp
                else ""
            )
        )
    m = s["projection_at_measured_acceptance"]
    lines.append(
        f"projection at the measured acceptance {m['acceptance']:.3f}: x{m['speedup']:.3f} (against the measured "
        f"x{d['speedup']:.3f}: how well the cost model holds)"
    )
    return "\n".join(lines)


def headline(s: dict[str, Any]) -> list[tuple[str, str]]:
    """The report's summary lines for a speculative profile."""
    a, d, pr = s["acceptance"], s["decode_tok_s"], s["projection"]
    t = str(s["depth"] + 1)
    emulated = [] if s.get("device_latencies", True) else [("latencies", s["latencies"])]
    lines = emulated + [
        (f"verify of {t} tokens / decode step", f"x{s['relative_to_decode_step']['verify'][t]:.2f}"),
        ("draft step / decode step", f"x{s['relative_to_decode_step']['draft']['1']:.2f}"),
        (
            "acceptance (measured)" + ("" if a["meaningful"] else ", random weights: meaningless"),
            f"{a['acceptance_rate']:.3f}, {a['mean_accepted_length']:.2f} accepted per verify call",
        ),
        (
            "decode tok/s plain / speculative (measured)",
            f"{d['plain']:.2f} / {d['speculative']:.2f} (x{d['speedup']:.3f})",
        ),
        (f"PROJECTION at acceptance {pr['acceptance']}", f"{pr['tokens_per_s']:.2f} tok/s (x{pr['speedup']:.3f})"),
    ]
    imp = s.get("decode_tok_s_imposed")
    if imp:
        lines.append(
            (
                f"decode tok/s timed at an imposed acceptance {imp['acceptance']}",
                f"{imp['speculative']:.2f} (x{imp['speedup']:.3f})",
            )
        )
    return lines


def plot_speculative(s: dict[str, Any], plt):
    """Bars: each call's cost in decode steps (median)."""
    rel = s["relative_to_decode_step"]
    names = ["decode step"] + [f"verify {t}" for t in rel["verify"]] + [f"draft {p}" for p in rel["draft"]]
    names += ["snapshot", "restore"]
    values = [1.0, *rel["verify"].values(), *rel["draft"].values(), rel["snapshot"], rel["restore"]]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(names, values)
    ax.axhline(1.0, color="grey", linestyle=":")
    ax.set_ylabel("x one decode step (median)")
    title = f"Speculative decoding (mtp:{s['depth']}): cost of each call at context {s['context']}"
    if not s.get("device_latencies", True):
        title += "\n(latencies of an emulation, not a device: see the record's 'latencies')"
    ax.set_title(title)
    ax.tick_params(axis="x", labelrotation=45)
    return fig
