"""The `deltaship` command. Each subcommand calls the public function of the same name and arguments."""

from __future__ import annotations

import argparse
import json
import sys

from deltaship.errors import DeltashipError


def _export(a: argparse.Namespace) -> int:
    from deltaship.export import export
    export(model=a.model, out=a.out, target=a.target, precision=a.precision, max_context=a.max_context,
           force=a.force, verify=not a.no_verify, prefill_chunk=a.prefill_chunk, block_size=a.block_size,
           deltanet_int8=a.deltanet_int8, accuracy_level=a.accuracy_level, threads=a.threads, progress=not a.quiet)
    return 0


def _generate(a: argparse.Namespace) -> int:
    from deltaship.runtimes.commands import generate
    res = generate(a.bundle, prompt=a.prompt, input_ids=a.input_ids, max_new_tokens=a.max_new_tokens,
                   threads=a.threads, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed,
                   stop_at_eos=not a.no_stop_at_eos, dump_logits=a.dump_logits)
    if a.json:
        print(json.dumps(res))
    elif "text" in res:
        print((a.prompt or "") + res["text"])
    else:
        print(" ".join(map(str, res["output_ids"])))
    return 0


def _inspect(a: argparse.Namespace) -> int:
    from deltaship.runtimes.commands import describe, inspect
    info = inspect(a.bundle)
    print(json.dumps(info, indent=2) if a.json else describe(info))
    return 0 if info["intact"] else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltaship", description="Deployment compiler for Qwen3.5 hybrid models.")
    sub = p.add_subparsers(dest="command", required=True)

    e = sub.add_parser("export", help="compile a checkpoint or preset into a verified bundle")
    e.add_argument("--model", required=True, help="checkpoint directory or preset (qwen3.5-tiny, qwen3.5-0.8b, ...)")
    e.add_argument("--target", default="onnx", help="onnx, executorch or coreml (default onnx)")
    e.add_argument("--precision", default="fp32", help="fp32, fp16, int8 or int4 (default fp32)")
    e.add_argument("--max-context", type=int, default=None, help="KV-cache length in tokens")
    e.add_argument("--out", required=True, help="bundle directory to write")
    e.add_argument("--force", action="store_true", help="replace an existing --out")
    e.add_argument("--no-verify", action="store_true", help="skip the parity check against transformers")
    e.add_argument("--prefill-chunk", type=int, default=None, help="tokens per prefill call (default 512)")
    e.add_argument("--block-size", type=int, default=32, help="quantization block size (int8/int4)")
    e.add_argument("--deltanet-int8", action="store_true", help="with int4: keep DeltaNet projections at int8")
    e.add_argument("--accuracy-level", type=int, default=4,
                   help="ONNX int8/int4: 4 = int8 activation blocks (fast, default), 0 = float activations")
    e.add_argument("--threads", type=int, default=None, help="threads for verification")
    e.add_argument("--quiet", action="store_true", help="no progress display")
    e.set_defaults(func=_export)

    g = sub.add_parser("generate", help="generate tokens with a bundle")
    g.add_argument("bundle")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text prompt (needs the bundle's tokenizer)")
    src.add_argument("--input-ids", help="comma-separated token ids, e.g. 1,2,3")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--json", action="store_true", help="print one JSON object (input_ids, output_ids, ...)")
    g.add_argument("--dump-logits", default=None, help="save the logits of each new token as float32 [N, vocab] .npy")
    g.add_argument("--threads", type=int, default=None)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--no-stop-at-eos", action="store_true", help="keep going past end-of-sequence tokens")
    g.set_defaults(func=_generate)

    i = sub.add_parser("inspect", help="show a bundle's manifest and re-check its file hashes")
    i.add_argument("bundle")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=_inspect)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except DeltashipError as e:
        print(f"deltaship {args.command}: error: {e.message}", file=sys.stderr)
        if e.fix:
            print(f"  fix: {e.fix}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; nothing was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
