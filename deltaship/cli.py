"""The `deltaship` command. Each subcommand calls the public function of the same name and arguments."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deltaship import __version__, options
from deltaship.apps import KIT_RECORD, PLATFORMS, write_kit
from deltaship.bundle.destination import check_destination
from deltaship.check import inspect as bundle_inspect
from deltaship.check.evaluate import evaluate
from deltaship.commands import fleet_run, generate, plan
from deltaship.commands.chat import chat, commands_help
from deltaship.commands.serve import serve
from deltaship.compile import export
from deltaship.compile.settings import EXPORT_OPTIONS
from deltaship.constrain import build_constraint
from deltaship.devices.catalog import load_catalog
from deltaship.devices.discovery import discover, fingerprint
from deltaship.devices.plan import format_table, format_vision, verdicts, vision_plan
from deltaship.errors import (
    EXIT_BAD_INPUT,
    EXIT_BROKEN_PIPE,
    EXIT_SIGINT,
    EXIT_SIGTERM,
    DeltashipError,
    DeltashipRunError,
)
from deltaship.failures import describe, os_error, quiet_stdout, stdout_closed
from deltaship.logs import quiet_third_party, set_verbose
from deltaship.models.presets import PRESETS
from deltaship.models.spec import KV_DTYPES
from deltaship.parser import Parser
from deltaship.profiling.profile import compare, profile
from deltaship.profiling.report import format_compare, format_results, write_plots
from deltaship.profiling.settings import ProfileSettings
from deltaship.progress import Progress
from deltaship.targets import DEFAULT_PREFILL_CHUNK, PRECISIONS, all_targets, flag, runtime_names, target_names

# export()'s keyword arguments whose flag has another name: parameter -> (the flag's dest, the flag negates it)
EXPORT_FLAGS = {
    "verify": ("no_verify", True),
    "fidelity": ("no_fidelity", True),
    "progress": ("quiet", True),
    "tiers_file": ("tiers", False),
}


def export_arguments(a: argparse.Namespace) -> dict[str, Any]:
    """`export()`'s keyword arguments from the flags add_export_arguments() parsed: one per parameter of its
    signature and per `ExportOptions` field (its **options), and the target options (the fields of each target's
    Options dataclass) the user set."""
    args: dict[str, Any] = {}
    names = [n for n, p in inspect.signature(export).parameters.items() if p.kind is not p.VAR_KEYWORD]
    for name in names + list(EXPORT_OPTIONS):
        dest, negated = EXPORT_FLAGS.get(name, (name, False))
        args[name] = not getattr(a, dest) if negated else getattr(a, dest)
    for t in all_targets():
        for f in t.Options.fields():
            if getattr(a, f.name) not in (None, False):  # only the target options the user set
                args[f.name] = getattr(a, f.name)
    return args


def run_export(a: argparse.Namespace) -> int:
    """`export()` with the arguments add_export_arguments() parsed."""
    export(**export_arguments(a))
    return 0


def _arg(parse: Callable[[str], Any], check: Callable[[Any], Any], kind: str) -> Callable[[str], Any]:
    """An argparse `type=` from a check in deltaship/options.py (the API runs the same check): a bad value is
    argparse's one-line error, exit 2, before any work."""

    def convert(text: str) -> Any:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}") from None
        try:
            return check(value)
        except DeltashipError as e:  # "--threads must be ..." -> "argument --threads: must be ..."
            what = e.message.split(" ", 1)[1] if e.message.startswith("--") else e.message
            raise argparse.ArgumentTypeError(f"{what}; fix: {e.fix}" if e.fix else what) from None

    convert.__name__ = kind  # argparse names it in "invalid <kind> value"
    return convert


THREADS = _arg(int, options.threads, "a number of threads")


def _count(flag: str, low: int = 1) -> Callable[[str], int]:
    return _arg(int, lambda v: options.at_least(flag, v, low), f"an integer >= {low}")


def _max_context(value: str) -> int | str:
    """--max-context: a number of tokens, or max (with --device)."""
    if value == "max":
        return value
    try:
        return _count("--max-context")(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens >= 1 or max, got {value!r}") from None


def _add_target_options(parser: argparse.ArgumentParser) -> None:
    """One flag per field of each target's options dataclass (deltaship/targets), with its help and default, in a
    help group that says where it applies: an option several targets take (--mtp) is one flag, in a group named
    after those targets (the shared groups first), then one group per target with that target's own."""
    takers: dict[str, list[str]] = {}
    fields = {}
    for t in all_targets():
        for f in t.Options.fields():
            takers.setdefault(f.name, []).append(t.name)
            fields.setdefault(f.name, f)
    shared = [tuple(v) for v in takers.values() if len(v) > 1]
    groups: dict[tuple[str, ...], Any] = {}
    for by in dict.fromkeys(shared):
        head = ", ".join(by[:-1])
        groups[by] = parser.add_argument_group(f"{head} and {by[-1]} options", f"apply to --target {head} or {by[-1]}")
    for t in all_targets():
        groups[(t.name,)] = parser.add_argument_group(f"{t.name} options", t.description)
    for name, f in fields.items():
        meta = f.metadata
        default = "" if f.default in (None, False) else f" (default {f.default})"
        kwargs: dict = {"help": f"{meta.get('help', '')}{default}", "default": None}
        if f.type in (bool, "bool"):
            kwargs.update(action="store_true", default=False)
        else:
            choices = meta.get("choices")
            kinds = {type(c) for c in choices or ()}
            kwargs["type"] = (
                kinds.pop()
                if len(kinds) == 1
                else (float if "float" in str(f.type) else int if "int" in str(f.type) else str)
            )
            if choices:
                kwargs["choices"] = choices
            if meta.get("metavar"):
                kwargs["metavar"] = meta["metavar"]
        groups[tuple(takers[name])].add_argument(flag(f.name), **kwargs)


def _add_constraint_arguments(p: argparse.ArgumentParser) -> None:
    """--json-schema / --regex / --grammar: one constraint (deltaship/constrain, docs/agents.md), checked as parsed."""
    c = p.add_argument_group("structured output (at most one; docs/agents.md)").add_mutually_exclusive_group()
    c.add_argument(
        "--json-schema",
        type=_arg(str, lambda v: build_constraint(json_schema=v) and v, "a JSON Schema file"),
        default=None,
        metavar="FILE",
        help="the output is compact JSON valid against this JSON Schema",
    )
    c.add_argument(
        "--regex",
        type=_arg(str, lambda v: build_constraint(regex=v) and v, "a regex"),
        default=None,
        metavar="PATTERN",
        help="the output matches this regex as a whole",
    )
    c.add_argument(
        "--grammar",
        type=_arg(str, lambda v: build_constraint(grammar=v) and v, "a grammar file"),
        default=None,
        metavar="FILE",
        help="the output is in this grammar (llguidance's Lark-like syntax, a `start:` rule)",
    )


def _constraint_kwargs(a: argparse.Namespace) -> dict:
    return {k: getattr(a, k) for k in ("json_schema", "regex", "grammar") if getattr(a, k, None) is not None}


def _generate(a: argparse.Namespace) -> int:
    res = generate(
        a.bundle,
        prompt=a.prompt,
        input_ids=a.input_ids,
        max_new_tokens=a.max_new_tokens,
        threads=a.threads,
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        seed=a.seed,
        stop_at_eos=not a.no_stop_at_eos,
        dump_logits=a.dump_logits,
        provider=a.provider,
        runtime=a.runtime,
        cuda_graph=a.cuda_graph,
        prepack_cache=a.prepack_cache,
        progress=not a.quiet,
        chat=a.chat,
        **({"speculative": a.speculative} if a.speculative else {}),
        **({"images": a.image} if a.image else {}),
        **({"videos": a.video} if a.video else {}),
        **({"fps": a.fps} if a.fps is not None else {}),
        **_constraint_kwargs(a),
    )
    c = res.get("constraint")
    if c and not c["complete"]:  # said on stderr, --json or not: the text is not a whole match
        print(
            f"deltaship generate: the output ended ({res.get('stopped')}) before the {c['kind']} constraint was "
            "complete: it is a prefix, not a valid match (raise --max-new-tokens)",
            file=sys.stderr,
        )
    for note in res.get("notices", []) if not a.json else []:
        print(f"deltaship generate: {note}", file=sys.stderr)
    if res.get("stopped") == "context" and not a.json:
        n = res.get("new_tokens", len(res.get("output_ids", [])))
        print(
            f"deltaship generate: stopped after {n} new tokens: the bundle's max context is full (export with a "
            "larger --max-context for longer generations)",
            file=sys.stderr,
        )
    if a.json:
        print(json.dumps(res))
    elif "text" in res:
        print(res["text"] if a.chat else (a.prompt or "") + res["text"])  # --chat: the reply alone
    else:
        print(" ".join(map(str, res["output_ids"])))
    return 0


def _inspect(a: argparse.Namespace) -> int:
    info = bundle_inspect.inspect(a.bundle)
    print(json.dumps(info, indent=2) if a.json else bundle_inspect.describe(info))
    return 0 if info["intact"] else EXIT_BAD_INPUT  # a bundle that fails its checks is bad input, not a deltaship bug


def _eval(a: argparse.Namespace) -> int:
    say = Progress(enabled=not a.quiet)
    say(f"eval: {a.bundle} against {a.model or 'the checkpoint it was exported from'}")
    res = evaluate(a.bundle, model=a.model, tokens=a.tokens, threads=a.threads, progress=say, text=a.text)
    say.done()
    if a.json:
        print(json.dumps(res))
    else:
        print(f"{res['target']} / {res['precision']} on {res['tokens']} tokens of {res['text']}")
        print(f"  perplexity            {res['perplexity']:.4f}")
        print(f"  reference perplexity  {res['reference_perplexity']:.4f}  (transformers fp32)")
        print(f"  KL(reference||bundle) {res['kl_divergence']:.4g} nats/token")
        print(f"  top-1 agreement       {res['top1_agreement']:.4f}")
        if res.get("kv_dtype"):
            depths = ", ".join(f"{d}: {v:.3g}" for d, v in res["kl_by_depth"].items())
            print(f"  KV cache {res['kv_dtype']:<13}KL by depth (to position) {depths}")
        if "note" in res:
            print(f"  note: {res['note']}")
        if "mtp" in res:  # the MTP head of an --mtp bundle
            m = res["mtp"]
            print(f"  MTP head top-1        {m['top1_vs_greedy']:.4f} vs greedy, {m['top1_vs_text']:.4f} vs the text")
    return 0


def _devices(a: argparse.Namespace) -> int:
    found = [fingerprint(d, a.ssh_option) for d in a.device] if a.device else discover(local_only=a.local)
    if a.json:
        print(json.dumps(found))
        return 0
    for d in found:
        ram = f"{d['ram_bytes'] / 2**30:.1f} GiB" if d.get("ram_bytes") else "?"
        print(f"{d['device']:<28} {d.get('model', '?')}  cores {d.get('cores') or '?'}  RAM {ram}  {d.get('os', '')}")
        for g in d.get("gpus") or []:
            print(f"{'':<28} GPU {g['index']}: {g['name']} {g['memory_bytes'] / 2**30:.1f} GiB")
        if d.get("runtimes"):
            print(f"{'':<28} " + ", ".join(f"{k} {v}" for k, v in d["runtimes"].items()))
    return 0


def _plan(a: argparse.Namespace) -> int:
    rows = plan(
        a.model,
        tier=a.tier,
        tiers_file=a.tiers,
        context=a.context,
        targets=[t for t in a.targets.split(",")] if a.targets else None,
        kv_dtypes=a.kv_dtypes.split(",") if a.kv_dtypes else None,
        prefill_chunk=a.prefill_chunk,
        prompt_cache=a.prompt_cache,
        prompt_cache_tokens=a.prompt_cache_tokens,
        block_size=a.block_size,
    )
    vp = vision_plan(a.model)  # None for a text-only model
    if a.vision and vp is None:
        raise DeltashipError(f"--vision: {a.model} has no vision tower", "drop --vision: the text plan is all it needs")
    if a.json:  # the rows, as ever (the vision tower's plan: deltaship.devices.plan.vision_plan)
        print(json.dumps(rows, indent=1))
        return 0
    print(format_table(rows, provenance=a.footnotes or a.verbose) + "\n\n" + "\n".join(verdicts(rows, a.tiers)))
    if a.vision:
        print("\n" + format_vision(vp))
    elif vp is not None:
        print("\n" + f"{a.model} also takes images: --vision adds its vision tower's memory per image size")
    return 0


def _profile(a: argparse.Namespace) -> int:
    if a.compare:
        if a.bundle is not None:
            raise DeltashipError("--compare takes two JSON files instead of a bundle", "drop the bundle argument")
        print(format_compare(compare(*a.compare), *a.compare))
        return 0
    if a.bundle is None:
        raise DeltashipError("profile needs a BUNDLE (or --compare A.json B.json)", "pass the bundle directory")

    say = Progress() if not a.quiet else None  # timestamped like export's steps
    if a.plots:  # checked before the profile runs (write_plots checks again, under the lock)
        check_destination(Path(a.plots), True, (a.bundle,), "--plots", replaces=("plots",))
    doc = profile(a.bundle, ProfileSettings.from_args(a), progress=say)
    if a.plots:
        write_plots(doc, Path(a.plots), (a.bundle,))
    if a.json != "-":
        print(format_results(doc))
    died = any(r.get("status") == "died" for r in doc["results"])
    return 3 if died else 0


def add_export_arguments(e: argparse.ArgumentParser, out_positional: bool = False) -> None:
    """The `export` options, on any parser (`deltaship export`, `optimum-cli export deltaship`); run_export()
    calls export() with them. out_positional: the bundle directory is a positional OUT (optimum-cli's way)."""

    e.add_argument(
        "--model",
        required=True,
        help=f"checkpoint directory, Hugging Face id (org/name[@revision], read from the local Hugging "
        f"Face cache) or preset ({', '.join(PRESETS)})",
    )
    e.add_argument(
        "--target",
        default=None,
        choices=target_names(),
        help="what to compile for (default onnx, or what --device's plan picks)",
    )
    e.add_argument(
        "--precision",
        default=None,
        choices=PRECISIONS,
        help="weight precision (default fp32, or the first the target builds: qnn fp16; or what --device's plan picks)",
    )
    e.add_argument(
        "--device",
        default=None,
        metavar="TIER",
        help="a device tier (deltaship plan): pick the target, precision and context that fit it, or refuse "
        f"with the plan's numbers; tiers: {tier_names()} (--tiers adds yours)",
    )
    e.add_argument("--tiers", default=None, help="with --device: a TOML file of extra tiers")
    e.add_argument(
        "--max-context",
        type=_max_context,
        default=None,
        help="KV-cache length in tokens (default: the preset's, else min(4096, the model's)); with --device, max: "
        "the longest context that fits the tier (with a quantized KV cache when that reaches further)",
    )
    if out_positional:
        e.add_argument("out", metavar="OUT", help="bundle directory to write")
    else:
        e.add_argument("--out", required=True, help="bundle directory to write")
    e.add_argument("--force", action="store_true", help="replace an existing output directory")
    e.add_argument(
        "--allow-download",
        action="store_true",
        help="download a Hugging Face id that is not in the local cache (default: never download)",
    )
    e.add_argument("--no-verify", action="store_true", help="skip the parity check against transformers")
    e.add_argument(
        "--no-fidelity",
        action="store_true",
        help="verify, but skip the held-out fidelity eval that follows (the manifest's `fidelity`)",
    )
    chunks = ", ".join(
        f"{t.name} {t.default_prefill_chunk}" for t in all_targets() if t.default_prefill_chunk != DEFAULT_PREFILL_CHUNK
    )
    e.add_argument(
        "--prefill-chunk",
        type=_count("--prefill-chunk"),
        default=None,
        help=f"tokens per prefill call (default {DEFAULT_PREFILL_CHUNK}; {chunks}; --device: the largest that fits)",
    )
    e.add_argument(
        "--block-size",
        type=_arg(int, options.block_size, "a power of two >= 16"),
        default=32,
        help="quantization block size (int8/int4; default 32; 128 is smaller and faster on the CPU at a small "
        "fidelity cost: docs/results/memory.md)",
    )
    e.add_argument("--deltanet-int8", action="store_true", help="with int4: keep DeltaNet projections at int8")
    e.add_argument(
        "--kv-cache",
        choices=tuple(KV_DTYPES),
        default=None,
        help="KV-cache dtype (default: the target's own at --precision; `deltaship plan --kv-dtypes` shows "
        "what each would take)",
    )
    add_prompt_cache_argument(
        e,
        "ship the state after a system message in the bundle: a chat with that system message starts without feeding "
        "it (docs/chat.md)",
    )
    e.add_argument("--threads", type=THREADS, default=None, help="threads for verification (default: the runtime's)")
    e.add_argument("--quiet", action="store_true", help="no progress display")
    e.add_argument(
        "--vision",
        action="store_true",
        help="also export the checkpoint's vision tower for image and video input (ONNX and ExecuTorch at fp32 or "
        "fp16, Core ML at fp32; docs/bundle-format.md 'Images'); off by default: text-only bundles stay as they are",
    )
    _add_target_options(e)


def tier_names() -> str:
    """The built-in tiers, from the catalog (deltaship/devices/tiers.toml), for the help of --device and --tier."""
    return ", ".join(load_catalog()[0])


def add_prompt_cache_argument(parser: argparse.ArgumentParser | Any, what: str) -> None:
    """--prompt-cache FILE, one definition for `export` (which ships the cache) and `plan` (which counts it), so that
    one file serves both."""
    parser.add_argument(
        "--prompt-cache",
        default=None,
        metavar="FILE",
        help=f"{what} (FILE: the system message's text, or JSON {{system, template_kwargs}})",
    )


def _app(a: argparse.Namespace) -> int:
    record = write_kit(Path(a.bundle), Path(a.out), a.platform, force=a.force)
    # the record's paths are relative to the kit (it was written in a staging directory, then renamed)
    names = list(dict.fromkeys([*record.get("files", []), KIT_RECORD]))  # kit.json: written beside the kit's files
    files = [(Path(a.out) / f).as_posix() for f in names]
    print(f"wrote the {a.platform} kit to {a.out}: " + ", ".join(files))
    print(f"next: read {Path(a.out) / 'README.md'}")
    return 0


def _add_prepack_cache(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prepack-cache",
        default=None,
        metavar="DIR",
        help="ONNX bundles on the CPU: save ONNX Runtime's packed weights in DIR on first use and map them after: "
        "a lower memory peak and a faster load, about twice the weights on disk (docs/results/memory.md)",
    )


def _add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """--temperature, --top-k, --top-p and --seed, one definition for every command that samples (generate, chat);
    deltaship.options checks them, and refuses the last three without --temperature."""
    parser.add_argument(
        "--temperature",
        type=_arg(float, options.temperature, "a number"),
        default=0.0,
        help="0 = greedy (default); a finite T > 0 samples. --top-k, --top-p and --seed need it: greedy decoding "
        "would ignore them, so they are refused without it",
    )
    parser.add_argument(
        "--top-k",
        type=_arg(int, options.top_k, "an integer >= 1"),
        default=None,
        help="with --temperature: sample from the K most likely tokens (default: all)",
    )
    parser.add_argument(
        "--top-p",
        type=_arg(float, options.top_p, "a number in (0, 1]"),
        default=None,
        help="with --temperature: sample from the smallest set of tokens whose probability reaches P, in (0, 1] "
        "(default 1: all)",
    )
    parser.add_argument(
        "--seed",
        type=_arg(int, options.seed, "an integer >= 0"),
        default=None,
        help="with --temperature: seed of the sampler, >= 0, for repeatable samples (default: a fresh one)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="deltaship", description="Deployment compiler for Qwen3.5 hybrid models.")
    p.add_argument("--version", action="version", version=f"deltaship {__version__}")
    p.add_argument(
        "--debug",
        action="store_true",
        help="print the full traceback of any failure (also: environment DELTASHIP_DEBUG=1); put it before the "
        "subcommand: deltaship --debug generate ...",
    )
    p.add_argument(
        "--verbose", action="store_true", help="show the toolchains' own notices and logs (hidden by default)"
    )
    sub = p.add_subparsers(dest="command", required=True, help="`deltaship COMMAND -h` shows its options")

    e = sub.add_parser("export", help="compile a checkpoint or preset into a verified bundle")
    add_export_arguments(e)
    e.set_defaults(func=run_export)

    g = sub.add_parser("generate", help="generate tokens with a bundle")
    g.add_argument("bundle", help="bundle directory (deltaship export --out)")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--prompt", type=_arg(str, options.text, "UTF-8 text"), help="text prompt (needs the bundle's tokenizer)"
    )
    src.add_argument(
        "--input-ids",
        type=_arg(str, options.token_ids, "token ids"),
        help="comma-separated non-negative token ids, e.g. 1,2,3",
    )
    g.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="an image for the prompt (repeatable; bundles exported with --vision): one vision span per image is "
        "put before the prompt unless it has <|image_pad|> markers",
    )
    g.add_argument(
        "--video",
        action="append",
        default=[],
        metavar="PATH_OR_FRAMES",
        help="a video file (MP4/WebM/... with the `video` extra, or an animated GIF), or comma-separated frame "
        "image files in time order (repeatable; after the images); frames go in pairs, one timestamped span each",
    )
    g.add_argument(
        "--fps",
        type=_arg(float, lambda v: options.number("--fps", v, 0, above=True), "a number > 0"),
        default=None,
        help="frames per second to sample from a --video file (frame files: how far apart they were taken); "
        "default: the bundle's video_preprocessor_config.json fps (2)",
    )
    g.add_argument(
        "--max-new-tokens",
        type=_arg(int, options.max_new_tokens, "an integer >= 1"),
        default=32,
        help="generate at most this many tokens (default 32; fewer at an end-of-sequence token or a full context)",
    )
    g.add_argument(
        "--chat",
        action="store_true",
        help="the --prompt as one user turn through the bundle's chat template (as `deltaship chat` renders it); "
        "prints the reply, which ends with the assistant's turn",
    )
    g.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (input_ids, output_ids, text, stopped, seconds, ttft_s, decode_tok_s, ...)",
    )
    g.add_argument(
        "--dump-logits",
        type=_arg(str, lambda v: options.new_file(v, "--dump-logits"), "a new file"),
        default=None,
        metavar="FILE",
        help="save the logits of each new token as float32 [N, vocab] .npy (a new file in an existing directory)",
    )
    g.add_argument("--threads", type=THREADS, default=None, help="runtime threads (default: the runtime's)")
    g.add_argument(
        "--provider",
        choices=("cpu", "cuda"),
        default="cpu",
        help="ONNX bundles: run on ONNX Runtime's CUDA execution provider (needs onnxruntime-gpu)",
    )
    g.add_argument(
        "--cuda-graph",
        action="store_true",
        help="with --provider cuda: capture the decode step as CUDA graphs (ONNX Runtime's enable_cuda_graph); the "
        "default for bundles exported with --onnx-cuda-graph, which it needs",
    )
    _add_prepack_cache(g)
    g.add_argument(
        "--runtime",
        choices=runtime_names(),
        default=None,
        help="run the bundle in this runtime, as an app embeds it (e.g. genai: onnxruntime-genai for ONNX "
        "bundles; default: deltaship's own session for the bundle's target)",
    )
    _add_sampling_arguments(g)
    g.add_argument("--no-stop-at-eos", action="store_true", help="keep going past end-of-sequence tokens")
    g.add_argument(
        "--quiet", action="store_true", help="no progress lines on stderr (a generation that runs long reports them)"
    )
    g.add_argument(
        "--speculative",
        default=None,
        metavar="mtp[:K]",
        help="speculative decoding with the bundle's MTP head (export --mtp), K drafts per verify call (default 1); "
        "same tokens as plain greedy decoding, same distribution when sampling",
    )
    _add_constraint_arguments(g)
    g.set_defaults(func=_generate)

    i = sub.add_parser("inspect", help="show a bundle's manifest and re-check its file hashes")
    i.add_argument("bundle", help="bundle directory")
    i.add_argument("--json", action="store_true", help="print the manifest and the checks as JSON")
    i.set_defaults(func=_inspect)
    d = sub.add_parser("devices", help="list the host and attached or reachable devices, with fingerprints")
    d.add_argument("--device", action="append", default=[], help="probe this device (host, ssh://..., adb:SERIAL)")
    d.add_argument("--ssh-option", action="append", default=None, help="extra ssh option, e.g. -i KEY (repeatable)")
    d.add_argument("--local", action="store_true", help="only this machine (what a remote profile asks for)")
    d.add_argument("--json", action="store_true", help="print the fingerprints as JSON")
    d.set_defaults(func=_devices)

    pl = sub.add_parser("plan", help="memory per tier, target and precision; does the model fit, and how")
    pl.add_argument(
        "--model",
        required=True,
        help="checkpoint directory, Hugging Face id (from the local cache) or preset to plan for",
    )
    pl.add_argument(
        "--tier",
        default=None,
        help=f"plan for this device tier only (default: every tier): {tier_names()} (--tiers adds yours)",
    )
    pl.add_argument("--tiers", default=None, help="a TOML file of extra tiers")
    pl.add_argument(
        "--context",
        default=None,
        help="context in tokens, or 'max' for the longest that fits (default: each tier's typical)",
    )
    pl.add_argument(
        "--kv-dtypes",
        default=None,
        help="comma-separated KV-cache dtypes to plan (fp32, fp16, int8, int4; default: each target's own)",
    )
    pl.add_argument(
        "--prefill-chunk",
        type=_count("--prefill-chunk"),
        default=None,
        help="tokens per prefill call (default: each target's in the table; the pick takes the largest that fits)",
    )
    pl.add_argument("--targets", default=None, help="comma-separated targets (default: each tier's)")
    pl.add_argument(
        "--block-size",
        type=_arg(int, options.block_size, "a power of two >= 16"),
        default=None,
        help="the int8/int4 quantization block the bundle is exported with (export --block-size; default 32): "
        "a larger block stores fewer scales, and ONNX Runtime packs fewer bytes",
    )
    cache = pl.add_mutually_exclusive_group()
    add_prompt_cache_argument(
        cache,
        "count the prompt cache `export --prompt-cache FILE` ships: its bytes in the bundle, and its restore on the "
        "peak when a chat starts from it (its tokens counted with the model's tokenizer and chat template)",
    )
    cache.add_argument(
        "--prompt-cache-tokens",
        type=_arg(int, lambda v: options.at_least("--prompt-cache-tokens", v, 0), "an integer >= 0"),
        default=None,
        metavar="N",
        help="as --prompt-cache, for a cache of N tokens (a model without a tokenizer)",
    )
    pl.add_argument(
        "--vision",
        action="store_true",
        help="also plan the vision tower (image input; a model that has one): weights and activation peak per image",
    )
    pl.add_argument(
        "--verbose",
        dest="footnotes",
        action="store_true",
        help="also print where each (target, precision)'s memory terms come from (measured when and where, or "
        "estimated)",
    )
    pl.add_argument("--json", action="store_true", help="print the plan's rows as JSON")
    pl.set_defaults(func=_plan)

    pr = sub.add_parser("profile", help="latency and memory of a bundle on a device")
    pr.add_argument("bundle", nargs="?", help="bundle directory (not with --compare)")
    pr.add_argument("--device", default="host", help="host, ssh://user@host[:port] or adb:SERIAL")
    pr.add_argument(
        "--prompt-lengths",
        type=_arg(str, lambda v: options.int_list(v, "--prompt-lengths", 1, "128,512"), "integers"),
        default=None,
        help="comma-separated prompt lengths for the prefill runs (default 128,512); each plus --gen must fit "
        "the bundle's max context",
    )
    pr.add_argument("--gen", type=_count("--gen"), default=None, help="tokens generated per decode run (default 64)")
    pr.add_argument(
        "--contexts",
        type=_arg(str, lambda v: options.int_list(v, "--contexts", 1, "128,1024"), "integers"),
        default=None,
        help="comma-separated context depths of the decode sweep, reached by a synthetic fill of the KV cache, not "
        "a prefill (docs/profiling.md), with RSS per depth. Default 128,1024,4096, each clipped to the bundle's max "
        "context - 1; depths you give are measured as given, so one at or past the max context is refused",
    )
    pr.add_argument(
        "--threads", type=THREADS, default=None, help="runtime threads (default: the tier's, else the runtime's)"
    )
    pr.add_argument(
        "--provider",
        choices=("cpu", "cuda"),
        default="cpu",
        help="ONNX bundles on the host: cpu, or cuda (ONNX Runtime's CUDA execution provider; GPU memory is recorded)",
    )
    pr.add_argument(
        "--runtime",
        choices=runtime_names(),
        default=None,
        help="profile the bundle in this runtime (e.g. genai for ONNX bundles; default: deltaship's own)",
    )
    pr.add_argument(
        "--warmups", type=_count("--warmups", 0), default=None, help="untimed runs before each phase (default 2)"
    )
    pr.add_argument("--reps", type=_count("--reps"), default=None, help="at least this many repetitions (default 5)")
    pr.add_argument(
        "--min-seconds",
        type=_arg(float, lambda v: options.number("--min-seconds", v, 0), "a number >= 0"),
        default=None,
        help="and at least this long per phase (default 2)",
    )
    pr.add_argument(
        "--tier",
        default=None,
        help=f"run under this tier's limits (threads, memory cap): {tier_names()} (--tiers adds yours)",
    )
    pr.add_argument("--tiers", default=None, help="a TOML file of extra tiers")
    pr.add_argument("--no-breakdown", action="store_true", help="skip the per-op breakdown (ONNX)")
    _add_prepack_cache(pr)
    pr.add_argument(
        "--image-sizes",
        default=None,
        help="a --vision bundle: image sizes for encode latency, memory and image+question TTFT (WxH, N or page; "
        "default 224,448,896,page on the host; 'none' to skip)",
    )
    pr.add_argument("--json", default=None, help="write the JSON records here ('-' for stdout)")
    pr.add_argument("--report", default=None, help="write a self-contained HTML report here")
    pr.add_argument("--plots", default=None, help="write the PNG plots into this directory")
    pr.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), help="ratios B/A with confidence intervals")
    pr.add_argument("--ssh-option", action="append", default=None, help="extra ssh option, e.g. -i KEY (repeatable)")
    pr.add_argument("--remote-deltaship", default="deltaship", help="the deltaship command on an ssh host")
    pr.add_argument("--runner", default=None, help="Android: the runner binary to push and run")
    pr.add_argument("--runner-args", default=None, help="Android: runner arguments ({model}, {prompt_length}, ...)")
    pr.add_argument(
        "--speculative",
        metavar="mtp[:K]",
        default=None,
        help="profile speculative decoding with the bundle's MTP head (export --mtp) instead: verify/draft/snapshot "
        "costs, acceptance, decode tok/s with and without, and a projection (docs/speculative.md)",
    )
    pr.add_argument(
        "--acceptance",
        type=_arg(float, lambda v: options.number("--acceptance", v, 0, above=True, high=1), "a number in (0, 1]"),
        default=None,
        help="with --speculative: the acceptance rate the projection assumes (default: the trained tiny head's 0.75)",
    )
    pr.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    pr.set_defaults(func=_profile)

    ap = sub.add_parser("app", help="write the app integration kit for a bundle (Swift, Kotlin, JavaScript)")
    ap.add_argument("bundle", help="bundle directory the kit runs")
    ap.add_argument(
        "--platform",
        required=True,
        choices=PLATFORMS,
        help="ios: Swift over Core ML; android: Kotlin over onnxruntime-android/-genai or ExecuTorch; "
        "web/desktop: JavaScript over onnxruntime-web/-node",
    )
    ap.add_argument("--out", required=True, help="kit directory to write")
    ap.add_argument("--force", action="store_true", help="replace an existing --out")
    ap.set_defaults(func=_app)

    v = sub.add_parser("eval", help="perplexity, KL and top-1 agreement of a bundle against the fp32 reference")
    v.add_argument("bundle", help="bundle directory")
    v.add_argument("--model", default=None, help="the source checkpoint (default: the one in the manifest)")
    v.add_argument(
        "--tokens",
        type=_count("--tokens", 2),
        default=512,
        help="tokens of text to score (default 512, at most the bundle's max context)",
    )
    v.add_argument(
        "--text",
        default=None,
        metavar="FILE",
        help="score your own UTF-8 text file (its first --tokens tokens; up to 16 MiB) instead of the held-out "
        "Python source that ships with the package",
    )
    v.add_argument("--threads", type=THREADS, default=None, help="runtime threads (default: the runtime's)")
    v.add_argument("--json", action="store_true", help="print the results as one JSON object")
    v.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    v.set_defaults(func=_eval)

    c = sub.add_parser(
        "chat",
        help="talk with a bundle: multi-turn chat with retry, undo and saved sessions",
        epilog=f"commands in a conversation (on a terminal and in piped input alike):\n{commands_help()}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument("bundle", help="the bundle directory (deltaship export --out)")
    c.add_argument("--system", default=None, help="the system message")
    c.add_argument(
        "--session",
        default=None,
        metavar="FILE",
        help="load FILE if it exists; save the conversation to it after every turn",
    )
    c.add_argument(
        "--max-new-tokens",
        type=_arg(int, options.max_new_tokens, "an integer >= 1"),
        default=256,
        help="each reply has at most this many tokens (default 256; fewer at an end-of-turn token or a full context)",
    )
    _add_sampling_arguments(c)  # --seed: each reply's sampler starts from it
    c.add_argument("--threads", type=THREADS, default=None, help="runtime threads (default: the runtime's)")
    c.add_argument("--no-thinking", action="store_true", help="the template's enable_thinking=false: answer directly")
    _add_prepack_cache(c)
    c.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per turn (reply, reply_ids, history_ids, prefill_tokens, ttft_s, decode_tok_s, stopped)",
    )
    _add_constraint_arguments(c)  # every reply (a /retry too) is held to it
    c.add_argument(
        "--tools",
        default=None,
        metavar="FILE",
        help="functions the assistant may call (the OpenAI function list, JSON): rendered by the bundle's chat "
        "template, calls constrained to them (docs/agents.md)",
    )
    c.add_argument(
        "--tool-choice",
        default="auto",
        metavar="auto|required|none|NAME",
        help="auto (default): the reply may call; required: it is a call; none: no call; NAME: a call of it",
    )
    c.set_defaults(func=_chat)

    v = sub.add_parser(
        "serve", help="an OpenAI-compatible local server that reuses conversations' states (docs/serve.md)"
    )
    v.add_argument("bundle", help="the bundle directory (deltaship export --out)")
    v.add_argument(
        "--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1: this machine only)"
    )
    v.add_argument("--port", type=_count("--port", 0), default=8080, help="the TCP port (default 8080)")
    v.add_argument("--api-key", default=None, metavar="KEY", help="ask every /v1 request for Authorization: Bearer KEY")
    v.add_argument(
        "--max-sessions",
        type=_count("--max-sessions", 1),
        default=64,
        help="conversations whose states are held between requests (least recently used dropped; default 64)",
    )
    v.add_argument(
        "--cache-ram",
        type=_arg(float, _gib, "a number of GiB >= 0"),
        default=2.0,
        metavar="GIB",
        help="memory the held conversations may take (least recently used dropped; default 2)",
    )
    v.add_argument(
        "--max-queue",
        type=_count("--max-queue", 1),
        default=64,
        help="requests waiting or running; past it a 503 with Retry-After (default 64)",
    )
    v.add_argument("--no-reuse", action="store_true", help="prefill every prompt whole (a baseline to measure against)")
    v.add_argument("--threads", type=THREADS, default=None, help="runtime threads (default: the runtime's)")
    v.set_defaults(func=_serve)

    fl = sub.add_parser("fleet", help="export and profile a matrix across machines and attached devices, on Ray")
    fsub = fl.add_subparsers(dest="fleet_command", required=True, help="run: a matrix file")
    fr = fsub.add_parser("run", help="run a matrix file (docs/fleet.md): its exports as tasks, its profiles on devices")
    fr.add_argument("matrix", help="the matrix TOML file (models, targets, precisions, devices, [export], [profile])")
    fr.add_argument("--out", required=True, help="the results directory (a rerun on it skips finished cells)")
    fr.add_argument(
        "--address", default=None, help="HOST:PORT of a Ray cluster's head (default: an embedded local cluster)"
    )
    fr.add_argument("--json", action="store_true", help="each row on stdout as one JSON line, no progress lines")
    fr.set_defaults(func=_fleet_run)
    return p


def _gib(value: float) -> float:
    if not 0 <= value < 1 << 20:
        raise DeltashipError(f"--cache-ram must be a number of GiB >= 0, got {value}", "e.g. --cache-ram 2")
    return value


def _serve(a: argparse.Namespace) -> int:
    return serve(
        a.bundle,
        host=a.host,
        port=a.port,
        api_key=a.api_key,
        max_sessions=a.max_sessions,
        cache_ram=a.cache_ram,
        max_queue=a.max_queue,
        no_reuse=a.no_reuse,
        threads=a.threads,
    )


def _fleet_run(a: argparse.Namespace) -> int:
    rows = fleet_run(a.matrix, out=a.out, address=a.address, json=a.json)
    return 3 if any(r["status"] == "failed" for r in rows) else 0


def _chat(a: argparse.Namespace) -> int:
    return chat(
        a.bundle,
        system=a.system,
        session=a.session,
        max_new_tokens=a.max_new_tokens,
        temperature=a.temperature,
        top_k=a.top_k,
        top_p=a.top_p,
        seed=a.seed,
        no_thinking=a.no_thinking,
        json=a.json,
        threads=a.threads,
        prepack_cache=a.prepack_cache,
        tools=a.tools,
        tool_choice=a.tool_choice,
        **_constraint_kwargs(a),
    )


class Terminated(BaseException):
    """SIGTERM, raised where the process is, so that every `finally` and partial-output cleanup runs."""


def _terminate(signum, frame) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    """Run one `deltaship` command; return its exit code. Every failure is one line of what went wrong and one of
    the fix, never a traceback (unless --debug): 2 bad input, 3 the machine (disk, memory, permissions, busy),
    1 a deltaship bug, 130 Ctrl-C, 143 SIGTERM, 141 stdout closed by its reader (docs/reliability.md)."""
    try:
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:  # while the toolchains' registries import
        print("interrupted; nothing was written", file=sys.stderr)
        return EXIT_SIGINT
    except BrokenPipeError:  # `deltaship export --help | head -1`
        quiet_stdout()
        return EXIT_BROKEN_PIPE
    except SystemExit:  # --help, --version or a usage error, printed: flush here, where a closed pipe is caught
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            quiet_stdout()
            raise SystemExit(EXIT_BROKEN_PIPE) from None
        raise
    debug = args.debug or os.environ.get("DELTASHIP_DEBUG", "") not in ("", "0")

    set_verbose(args.verbose)
    quiet_third_party()  # toolchains' notices the user cannot act on (--verbose shows them)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)  # clean up as on Ctrl-C (a staging directory can hold GBs)
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe fails here, inside the handler, not at interpreter exit
        return code
    except BrokenPipeError as e:
        failure = e
        if stdout_closed():  # `deltaship inspect B | head -1`: the reader has what it wanted
            quiet_stdout()
            return EXIT_BROKEN_PIPE
        code, what, fix = os_error(e)
    except KeyboardInterrupt as e:
        failure, (code, what, fix) = e, (EXIT_SIGINT, "interrupted; nothing was written", None)
    except Terminated as e:
        failure, (code, what, fix) = e, (EXIT_SIGTERM, "terminated; nothing was written", None)
    except Exception as e:  # noqa: BLE001  (the one place every failure becomes a message)
        failure, (code, what, fix) = e, describe(e)
        if isinstance(e, DeltashipRunError):  # what the run produced before the runtime failed, on stdout first
            print(e.text if e.text is not None else " ".join(map(str, e.output_ids)), flush=True)
    if debug:
        traceback.print_exception(failure)
    if code in (EXIT_SIGINT, EXIT_SIGTERM):
        print(what, file=sys.stderr)
    else:
        print(f"deltaship {args.command}: error: {what}", file=sys.stderr)
    if fix:
        print(f"  fix: {fix}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
