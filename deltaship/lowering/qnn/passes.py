"""The qnn target's capture pass: the canonical model captured twice, for exactly 1 token (decode) and for exactly
the prefill chunk (prefill), every shape static (QNN's HTP takes no dynamic dimension)."""

from __future__ import annotations

import torch

from deltaship.lowering.passes import Capture, ExportContext, Made, PassError, capture

DECODE, PREFILL = "decode", "prefill"


class CaptureStatic:
    """torch.export the canonical model on meta tensors for a fixed token count: programs["decode"] (1 token)
    and programs["prefill"] (prefill_chunk tokens; none when the chunk is 1); program is the decode one. Returned
    as products (Made), as Capture does."""

    name = "capture_static"

    def requires(self, ctx: ExportContext) -> None:
        Capture().requires(ctx)
        if getattr(ctx.model, "mtp", None) is not None:
            raise PassError("the qnn target has no --mtp graphs")

    def run(self, ctx: ExportContext) -> Made:
        states = ctx.model.state_specs(ctx.dtype)
        chunk = ctx.settings.prefill_chunk
        programs = dict(ctx.programs)
        programs[DECODE] = capture(ctx.model, states, ctx.max_context, static=1)
        if chunk > 1:
            programs[PREFILL] = capture(ctx.model, states, ctx.max_context, static=chunk)
        counts = {f"{k}_graph_nodes": _calls(p) for k, p in programs.items()}
        return Made(counts, {"states": states, "program": programs[DECODE], "programs": programs})

    def ensures(self, ctx: ExportContext) -> None:
        for key, program in ctx.programs.items():
            user_in = [
                s
                for s in program.graph_signature.input_specs
                if s.kind == torch.export.graph_signature.InputKind.USER_INPUT
            ]
            if len(user_in) != 2 + len(ctx.states) or len(program.graph_signature.output_specs) != 1 + len(ctx.states):
                raise PassError(f"the {key} program does not take and return every state ({len(ctx.states)})")


def _calls(program) -> int:
    return sum(1 for n in program.graph.nodes if n.op == "call_function")
