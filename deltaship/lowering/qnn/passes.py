"""The qnn target's capture pass: the canonical model captured twice, for exactly 1 token (decode) and for exactly
the prefill chunk (prefill), every shape static (QNN's HTP takes no dynamic dimension)."""

from __future__ import annotations

import torch

from deltaship.lowering.passes import Capture, ExportContext, PassError, capture

DECODE, PREFILL = "decode", "prefill"


class CaptureStatic:
    """torch.export the canonical model on meta tensors for a fixed token count: ctx.programs["decode"] (1 token)
    and ctx.programs["prefill"] (prefill_chunk tokens; none when the chunk is 1); ctx.program is the decode one."""

    name = "capture_static"

    def requires(self, ctx: ExportContext) -> None:
        Capture().requires(ctx)
        if getattr(ctx.model, "mtp", None) is not None:
            raise PassError("the qnn target has no --mtp graphs")

    def run(self, ctx: ExportContext) -> dict[str, int]:
        ctx.states = ctx.model.state_specs(ctx.dtype)
        chunk = ctx.settings.prefill_chunk
        ctx.programs[DECODE] = ctx.program = capture(ctx.model, ctx.states, ctx.max_context, static=1)
        if chunk > 1:
            ctx.programs[PREFILL] = capture(ctx.model, ctx.states, ctx.max_context, static=chunk)
        return {f"{k}_graph_nodes": _calls(p) for k, p in ctx.programs.items()}

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
