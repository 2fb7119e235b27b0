"""Reports of a profile: a terminal table, PNG plots and a self-contained HTML page."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from deltaship.bundle.destination import PLOTS_MARKER, replace_file
from deltaship.bundle.writer import write_dir
from deltaship.profiling.speculative.report import format_speculative, headline, plot_speculative

UNITS = {"s": 1e3, "tok/s": 1.0, "bytes": 1 / 2**20}
SHOWN = {"s": "ms", "tok/s": "tok/s", "bytes": "MiB"}


def _fmt(value: float, unit: str) -> str:
    return f"{value * UNITS.get(unit, 1):.2f}"


def label(metric: str, unit: str) -> str:
    """The metric's name in the unit it is shown in: ttft_s (seconds in the JSON) reads ttft_ms in a table that
    shows milliseconds, peak_rss_bytes reads peak_rss_mib; tok/s metrics keep their names."""
    for suffix, shown in (("_s", "s"), ("_bytes", "bytes")):
        if unit == shown and metric.endswith(suffix):
            return metric[: -len(suffix)] + "_" + SHOWN[unit].lower()
    return metric


def _threads(doc: dict[str, Any]) -> str:
    n = doc.get("threads")
    return f"{n} threads" if n else "threads: the runtime's default"


def _where(r: dict) -> str:
    parts = []
    for k, label in (
        ("prompt_length", "P="),
        ("from_context", "after P="),  # decode runs after its own fixed prompt (worker.py), not --prompt-lengths
        ("context", "ctx="),
        ("op_kind", "op="),
        ("tokens", "T="),
        ("positions", "pos="),
        ("prompts", "prompts="),
    ):
        if r.get(k) is not None:
            parts.append(f"{label}{r[k]}")
    if r.get("image") is not None:  # profiling/vision.py: the image size, and its tokens after resizing
        parts.append(f"img {r['image']}" + (f" ({r['image_tokens']} tok)" if r.get("image_tokens") else ""))
    return " ".join(parts)


def format_results(doc: dict[str, Any], speculative: bool = True) -> str:
    dev, b = doc.get("device", {}), doc["bundle"]
    lines = [
        f"{b['name']}: {b['target']} / {b['precision']} on {dev.get('device', '?')} ({dev.get('model', '?')}, "
        f"{dev.get('cores', '?')} cores), {doc.get('runtime', '')}, {_threads(doc)}"
    ]
    if doc.get("emulation"):
        e = doc["emulation"]
        lines.append(
            f"emulating tier {e['tier']}: {e['threads']} threads, memory cap {e['memory_cap_bytes'] / 2**30:.2f} "
            f"GiB ({e['memory_cap']})"
        )
    w = max([16] + [len(_where(r)) for r in doc["results"]])  # "ctx=4096 op=deltanet" is wider than 16
    m = max([18] + [len(label(r.get("metric", ""), r.get("unit", ""))) for r in doc["results"]])
    head = (
        f"{'metric':<{m}} {'where':<{w}} {'unit':>6} {'median':>10} {'p90':>10} {'ci95':>23} {'cv':>6} {'n':>4}  flags"
    )
    lines += [head, "-" * len(head)]
    for r in doc["results"]:
        if r.get("status") == "died":
            lines.append(f"{'run':<{m}} {_where(r):<{w}} DIED: {r['reason']}")
            continue
        name = label(r["metric"], r.get("unit", ""))
        if not r.get("samples"):
            lines.append(f"{name:<{m}} {_where(r):<{w}} {'':>6} {'-':>10}  {' '.join(r.get('flags', []))}")
            continue
        u = r["unit"]
        ci = f"[{_fmt(r['ci95'][0], u)}, {_fmt(r['ci95'][1], u)}]"
        lines.append(
            f"{name:<{m}} {_where(r):<{w}} {SHOWN.get(u, u):>6} {_fmt(r['median'], u):>10} "
            f"{_fmt(r['p90'], u):>10} {ci:>23} {r['cv']:>6.3f} {r['n']:>4}  {' '.join(r['flags'])}"
        )
    after = sorted({r["from_context"] for r in doc["results"] if r.get("from_context") and r.get("samples")})
    if after:
        lines.append(
            f"note: decode_tok_s and tpot_ms decode after a random prompt of {', '.join(map(str, after))} tokens "
            "(after P=), whatever --prompt-lengths; decode_latency_ms is per --contexts depth"
        )
    if speculative and doc.get("speculative"):
        lines += ["", format_speculative(doc["speculative"])]
    if doc.get("memory_plan"):
        m, g = doc["memory_plan"], 2**30
        lines.append(
            f"peak RSS: measured {m['peak_rss_bytes'] / g:.3f} GiB, plan {m['total_bytes'] / g:.3f} GiB "
            f"(x{m['plan_over_measured']:.2f}: weights as loaded {m['weights_loaded_bytes'] / g:.3f}, states "
            f"{m['state_bytes'] / g:.3f}, activations {m['activation_bytes'] / g:.3f}, runtime "
            f"{m['runtime_bytes'] / g:.3f}; context {m['context']}, prefill chunk {m['prefill_chunk']}; {m['terms']})"
        )
        if m.get("prompt_cache"):  # the bundle ships one (export --prompt-cache); this workload never restores it
            c = m["prompt_cache"]
            lines.append(
                f"prompt cache {c['tokens']:,} tokens: {c['file_bytes'] / 2**20:.2f} MiB in the bundle; a chat "
                f"starting from it: plan {c['chat_total_bytes'] / g:.3f} GiB (+{c['restore_bytes'] / 2**20:.2f} MiB "
                "while it restores; not in this profile, which prefills from an empty state)"
            )
    if doc.get("fit"):
        f = doc["fit"]
        lines.append(
            f"fit on {f['tier']}: peak RSS {(f['peak_rss_bytes'] or 0) / 2**30:.2f} GiB vs budget "
            f"{f['budget_bytes'] / 2**30:.2f} GiB -> {'fits' if f['fits'] else 'DOES NOT FIT'}"
        )
    return "\n".join(lines)


def format_compare(rows: list[dict[str, Any]], a: str, b: str) -> str:
    w = max([16] + [len(_where(r)) for r in rows])
    m = max([18] + [len(label(r["metric"], r["unit"])) for r in rows])
    lines = [
        f"B = {b}\nA = {a}",
        f"{'metric':<{m}} {'where':<{w}} {'A':>10} {'B':>10} {'B/A':>7} {'ci95':>16}  significant",
    ]
    for r in rows:
        u = r["unit"]
        lines.append(
            f"{label(r['metric'], u):<{m}} {_where(r):<{w}} {_fmt(r['a'], u):>10} {_fmt(r['b'], u):>10} "
            f"{r['ratio']:>7.3f} "
            f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]  {'yes' if r['significant'] else 'no'}"
        )
    return "\n".join(lines)


# ---- plots --------------------------------------------------------------------------------------
def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    import matplotlib.pyplot as plt  # lazy: matplotlib: plots only

    plt.close(fig)
    return buf.getvalue()


def plots(doc: dict[str, Any]) -> dict[str, bytes]:
    """PNG plots: decode latency vs context (whole model and per op kind), memory, RSS trace, prefill."""
    import matplotlib  # lazy: matplotlib: plots only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: matplotlib: plots only

    out: dict[str, bytes] = {}
    res = [r for r in doc["results"] if r.get("samples")]
    ctx = sorted((r for r in res if r["metric"] == "decode_latency_s"), key=lambda r: r["context"])
    if ctx:
        kinds = sorted({r["op_kind"] for r in res if r["metric"] == "decode_op_s"})
        fig, axes = plt.subplots(1, 2 if kinds else 1, figsize=(11 if kinds else 6, 4), squeeze=False)
        ax = axes[0][0]
        xs = [r["context"] for r in ctx]
        ax.errorbar(
            xs,
            [r["median"] * 1e3 for r in ctx],
            yerr=[[(r["median"] - r["ci95"][0]) * 1e3 for r in ctx], [(r["ci95"][1] - r["median"]) * 1e3 for r in ctx]],
            marker="o",
            capsize=3,
        )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context depth (tokens)")
        ax.set_ylabel("decode step latency (ms), median and 95% CI")
        ax.set_title("Whole model: one decode step vs context depth")
        if kinds:
            ax2 = axes[0][1]
            for k in kinds:
                rows = sorted(
                    (r for r in res if r["metric"] == "decode_op_s" and r["op_kind"] == k), key=lambda r: r["context"]
                )
                ax2.plot([r["context"] for r in rows], [r["median"] * 1e3 for r in rows], marker="o", label=k)
            ax2.set_xscale("log", base=2)
            ax2.set_xlabel("context depth (tokens)")
            ax2.set_ylabel("ms per decode step")
            ax2.set_title("Per op kind (ONNX Runtime profiler, adds overhead)")
            ax2.legend(fontsize=8)
        out["latency_vs_context.png"] = _png(fig)
    depth_rss = sorted((r for r in res if r["metric"] == "rss_bytes" and r.get("context")), key=lambda r: r["context"])
    if depth_rss:
        out["memory_vs_context.png"] = _memory_vs_context(plt, ctx, depth_rss)
    peak = next((r["median"] for r in res if r["metric"] in ("peak_rss_bytes", "peak_pss_bytes")), None)
    b = doc["bundle"]
    if peak:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        parts = {"bundle files": b.get("bundle_bytes") or 0, "state (manifest)": b.get("state_bytes") or 0}
        parts["runtime + activations"] = max(0, peak - sum(parts.values()))
        left = 0.0
        for name, v in parts.items():
            ax.barh(["measured peak"], [v / 2**20], left=left, label=name)
            left += v / 2**20
        if doc.get("fit"):
            ax.axvline(doc["fit"]["budget_bytes"] / 2**20, color="red", linestyle=":", label="tier budget")
        ax.set_xlabel("MiB")
        ax.set_title("Memory breakdown")
        ax.legend(fontsize=8, loc="lower right")
        out["memory.png"] = _png(fig)
    trace = doc.get("rss_trace") or []
    if trace:
        fig, ax = plt.subplots(figsize=(7, 3))
        ax.plot([t[0] for t in trace], [t[1] / 2**20 for t in trace], linewidth=1)
        ax.set_xlabel("seconds")
        ax.set_ylabel("RSS (MiB)")
        ax.set_title("RSS trace")
        out["rss_trace.png"] = _png(fig)
    images = _image_plot(res)
    if images:
        out["images.png"] = images
    pre = sorted((r for r in res if r["metric"] == "prefill_tok_s"), key=lambda r: r["prompt_length"])
    if pre:
        fig, ax = plt.subplots(figsize=(5, 3))
        ax.bar(
            [str(r["prompt_length"]) for r in pre],
            [r["median"] for r in pre],
            yerr=[[r["median"] - r["ci95"][0] for r in pre], [r["ci95"][1] - r["median"] for r in pre]],
            capsize=3,
        )
        ax.set_xlabel("prompt length")
        ax.set_ylabel("prefill tokens/s")
        ax.set_title("Prefill throughput")
        out["prefill.png"] = _png(fig)
    if doc.get("speculative"):
        out["speculative.png"] = _png(plot_speculative(doc["speculative"], plt))
    return out


def _memory_vs_context(plt, ctx: list[dict], mem: list[dict]) -> bytes:
    """Decode latency and resident memory against the context depth (the synthetic fill), with the manifest's
    arithmetic: the RSS after the real prefix plus the KV bytes of the rows past it."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot([r["context"] for r in ctx], [r["median"] * 1e3 for r in ctx], marker="o")
    a1.set_ylabel("decode step latency (ms, median)")
    a1.set_title("Decode latency vs context")
    xs = [r["context"] for r in mem]
    a2.plot(xs, [r["median"] / 2**20 for r in mem], marker="o", label="measured RSS")
    if all("manifest_kv_bytes_past_prefix" in r for r in mem):
        a2.plot(
            xs,
            [(r["rss_after_prefix_bytes"] + r["manifest_kv_bytes_past_prefix"]) / 2**20 for r in mem],
            linestyle="--",
            label="RSS after prefix + manifest KV bytes",
        )
    a2.set_ylabel("MiB")
    a2.set_title("Resident memory vs context")
    a2.legend(fontsize=8)
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context depth (tokens)")
    synthetic = any(r.get("fill") == "synthetic" for r in mem)
    fig.suptitle("KV cache and DeltaNet states filled synthetically (no prefill)" if synthetic else "", fontsize=9)
    return _png(fig)


def _image_plot(res: list[dict[str, Any]]) -> bytes | None:
    """Per image size (profiling/vision.py): encode latency and image+question TTFT, and the peak RSS."""
    import matplotlib.pyplot as plt  # lazy: matplotlib: plots only

    by = {m: {r["image"]: r for r in res if r["metric"] == m} for m in ("image_encode_s", "image_ttft_s")}
    rss = {r["image"]: r for r in res if r["metric"] == "image_peak_rss_bytes"}
    names = list(by["image_encode_s"])
    if not names:
        return None
    labels = [f"{n}\n{by['image_encode_s'][n].get('image_tokens', '?')} tok" for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
    x = np.arange(len(names))
    for i, (m, label) in enumerate((("image_encode_s", "encode"), ("image_ttft_s", "TTFT (image + question)"))):
        rows = [by[m].get(n) for n in names]
        axes[0].bar(
            x + (i - 0.5) * 0.4,
            [r["median"] * 1e3 if r else 0 for r in rows],
            width=0.4,
            yerr=[
                [(r["median"] - r["ci95"][0]) * 1e3 if r else 0 for r in rows],
                [(r["ci95"][1] - r["median"]) * 1e3 if r else 0 for r in rows],
            ],
            capsize=3,
            label=label,
        )
    axes[0].set_xticks(x, labels, fontsize=8)
    axes[0].set_ylabel("ms, median and 95% CI")
    axes[0].set_title("Image encode and TTFT per image size")
    axes[0].legend(fontsize=8)
    axes[1].bar(x, [rss[n]["median"] / 2**20 if n in rss else 0 for n in names])
    axes[1].set_xticks(x, labels, fontsize=8)
    axes[1].set_ylabel("MiB")
    axes[1].set_title("Peak RSS of a session encoding that size")
    return _png(fig)


def write_plots(doc: dict[str, Any], directory: Path, inputs: tuple[str | Path, ...] = ()) -> list[Path]:
    """The PNG plots in `directory` (replaced whole, through the bundle writer; plots.json marks it as
    deltaship's, so a later --plots may replace it and nothing else)."""

    def build(tmp: Path) -> list[Path]:
        names = []
        for name, data in plots(doc).items():
            (tmp / name).write_bytes(data)
            names.append(name)
        marker, key, value = PLOTS_MARKER
        (tmp / marker).write_text(json.dumps({key: value, "files": names}, indent=1) + "\n")
        return [directory / n for n in names]

    return write_dir(directory, True, build, inputs, option="--plots", replaces=("plots",))


def summary(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """The headline numbers, for the top of the report: prefill per prompt length, decode, TTFT, peak memory."""
    out = []
    for r in doc["results"]:
        if not r.get("samples") or r["metric"] not in (
            "prefill_tok_s",
            "decode_tok_s",
            "ttft_s",
            "peak_rss_bytes",
            "gpu_peak_bytes",
            "load_cold_s",
            "image_encode_s",
            "image_ttft_s",
        ):
            continue
        where = _where(r)
        out.append(
            (
                f"{label(r['metric'], r['unit'])}{' (' + where + ')' if where else ''}",
                f"{_fmt(r['median'], r['unit'])} {SHOWN.get(r['unit'], r['unit'])}",
            )
        )
    if doc.get("memory_plan"):
        m = doc["memory_plan"]
        out.append(("peak RSS planned (deltaship plan)", f"{m['total_bytes'] / 2**30:.3f} GiB"))
    if doc.get("fit"):
        out.append((f"fits {doc['fit']['tier']}", "yes" if doc["fit"]["fits"] else "no"))
    if doc.get("speculative"):
        out += headline(doc["speculative"])
    return out


def _plain(v: Any, key: str = "") -> str:
    """A device record's value as text: nested records flattened, byte counts in GiB (ram_bytes 25276510208
    reads 23.54 GiB)."""
    if isinstance(v, dict):
        return ", ".join(f"{k} {_plain(x, str(k))}" for k, x in v.items())
    if isinstance(v, list):
        return "; ".join(_plain(x, key) for x in v)
    if key.endswith("_bytes") and isinstance(v, (int, float)) and not isinstance(v, bool):
        return f"{v / 2**30:.2f} GiB"
    return str(v)


def write_html(doc: dict[str, Any], path: Path) -> Path:
    """One self-contained HTML file (plots inlined as data URIs). A small script reports, in
    #check, how many plots the browser decoded, so a headless browser test can read it."""
    imgs = plots(doc)
    e = html.escape
    body = [
        f"<h1>deltaship profile: {e(doc['bundle']['name'])}</h1>",
        f"<p>{e(doc['bundle']['target'])} / {e(doc['bundle']['precision'])}, created {e(doc.get('created', ''))}</p>",
        "<h2>Summary</h2><table id='summary'>"
        + "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in summary(doc))
        + "</table>",
        "<h2>Device</h2><table id='device'>"
        + "".join(
            f"<tr><th>{e(str(k))}</th><td>{e(_plain(v, str(k)))}</td></tr>"
            for k, v in doc.get("device", {}).items()
            if v not in (None, "", [], {})
        )
        + "</table>",
    ]
    if doc.get("emulation"):
        body.append("<h2>Tier emulation</h2><pre>" + e(json.dumps(doc["emulation"], indent=1)) + "</pre>")
    if doc.get("fit"):
        body.append(f"<p id='fit'>fits {e(doc['fit']['tier'])}: {'yes' if doc['fit']['fits'] else 'no'}</p>")
    if doc.get("speculative"):
        spec = format_speculative(doc["speculative"])
        body.append("<h2>Speculative decoding</h2><pre id='speculative'>" + e(spec) + "</pre>")
    body.append("<h2>Results</h2><pre id='table'>" + e(format_results(doc, speculative=False)) + "</pre>")
    fill = next((r for r in doc["results"] if r.get("fill") == "synthetic"), None)
    if fill is not None:
        body.append(f"<p id='fill'>Context depths: {e(fill['note'])}.</p>")
    body.append("<h2>Plots</h2>")
    for name, data in imgs.items():
        b64 = base64.b64encode(data).decode()
        body.append(
            f"<figure><img class='plot' alt='{e(name)}' src='data:image/png;base64,{b64}'>"
            f"<figcaption>{e(name)}</figcaption></figure>"
        )
    body.append(f"<p>plots decoded: <span id='check' data-expected='{len(imgs)}'>not run</span></p>")
    script = (
        "<script>window.addEventListener('load',()=>{const imgs=[...document.querySelectorAll('img.plot')];"
        "document.getElementById('check').textContent=imgs.filter(i=>i.complete&&i.naturalWidth>0).length+"
        "'/'+imgs.length;});</script>"
    )
    page = (
        "<!doctype html><html><head><meta charset='utf-8'><title>deltaship profile</title><style>"
        "body{font-family:sans-serif;max-width:1000px;margin:auto}pre{font-size:12px;overflow-x:auto}"
        "img{max-width:100%}th{text-align:left;padding-right:1em}</style></head><body>"
        + "\n".join(body)
        + script
        + "</body></html>"
    )
    path.parent.mkdir(parents=True, exist_ok=True)

    replace_file(path, page, "--report")  # whole or not at all
    return path
