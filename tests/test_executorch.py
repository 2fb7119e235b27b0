"""ExecuTorch target: program contract, ExecuTorch's own LLM runner, delegation rules, version errors."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from deltaship.compile import export
from deltaship.errors import DeltashipError
from deltaship.lowering.executorch.program import expected_portable
from deltaship.targets import open_bundle


@pytest.fixture(scope="module")
def pte(tiny_pte):
    out = tiny_pte("fp32")  # max context 128, prefill chunk 16 (conftest)
    return out, json.loads((out / "manifest.json").read_text())


def test_program_contract_and_metadata(pte):
    path, m = pte
    from executorch.runtime import Runtime

    prog = Runtime.get().load_program(str(path / "model.pte"))
    meta = {
        name: prog.load_method(name).execute([])[0]
        for name in (
            "get_max_seq_len",
            "get_max_context_len",
            "get_vocab_size",
            "get_n_layers",
            "use_kv_cache",
            "enable_dynamic_shape",
            "get_eos_ids",
            "get_bos_id",
        )
    }
    # the runner feeds prompts in calls of get_max_seq_len tokens: the prefill chunk, not the context
    assert meta["get_max_seq_len"] == 16 and meta["get_max_context_len"] == 128
    assert meta["get_vocab_size"] == 272 and meta["get_n_layers"] == 8
    assert meta["use_kv_cache"] and meta["enable_dynamic_shape"] and meta["get_eos_ids"] == 256
    lw = m["lowering"]
    assert "llama::gated_delta_rule" in lw["gated_delta_rule"]
    # XNNPACK is cut only at the stateful kernels (one per layer) and at the last-token select before the head
    assert 0 < lw["delegate_partitions"] <= m["model"]["num_layers"] + 2, lw["delegate_partitions"]
    assert lw["reshapes_inferred"] > 0  # the prompt axis as -1 (program.infer_reshape_dims): what keeps that count
    assert all(expected_portable(op) for op in lw["portable_nodes"])
    assert {s["kind"] for s in m["states"]} == {"deltanet_conv", "deltanet_recurrent", "kv_cache_key", "kv_cache_value"}
    kv = next(s for s in m["states"] if s["kind"] == "kv_cache_key")
    assert kv["shape"] == [1, 128, 2, 64]  # ExecuTorch's [1, S, Hkv, D] layout


def test_executorch_llm_runner_drives_the_program(pte):
    """ExecuTorch's own runner (C++ TextLLMRunner) with the bundle's tokenizer: the same greedy text as
    our session, and again after its reset(), which only rewinds the position (the state is reset in
    the graph at position 0)."""
    from executorch.extension.llm.custom_ops import custom_ops  # noqa: F401
    from executorch.extension.llm.runner import GenerationConfig, TextLLMRunner

    path, _ = pte
    runner = TextLLMRunner(str(path / "model.pte"), str(path / "tokenizer.json"))
    texts = []
    for _ in range(2):
        pieces: list[str] = []
        runner.generate(
            "def ", GenerationConfig(echo=False, max_new_tokens=20, temperature=0.0), token_callback=pieces.append
        )
        texts.append("".join(pieces))
        runner.reset()
    from deltaship.commands import generate

    ours = generate(path, prompt="def ", max_new_tokens=20)["text"]
    assert texts[0] == texts[1] == ours and len(ours) >= 10


@pytest.fixture(scope="module")
def spied_export(checkpoints, tmp_path_factory):
    """One small ExecuTorch export (deltanet_only, int4, context 32) that two tests read: its DeltaNet gates use
    softplus, which lowers to ops XNNPACK does not take (exported with the fallback allowed), and spies record what
    every XNNPACK preprocess was given and whether the partitions' tensors changed. (An ExecuTorch export costs
    half a minute even this small: one serves both.)"""
    import types

    import executorch.exir.backend.backend_api as ba
    import torch
    import torch.nn.functional as F
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend

    from deltaship.lowering.executorch import lowering

    def softplus_gates(self, a, b, dt_bias, decay_scale):
        return decay_scale.float() * F.softplus(a.float() + dt_bias.float()), torch.sigmoid(b.float())

    spy = types.SimpleNamespace(partition_ptrs=set(), given_ptrs=set(), changed=[])
    lower_all, preprocess = ba.lower_all_submodules_to_backend, XnnpackBackend.preprocess

    def lower_all_spy(backend_id, method_to_nodes, programs):
        mine = []
        for nodes in method_to_nodes.values():
            for node in nodes:
                sd = node.meta["submodule_program"].state_dict
                mine.append((sd, {k: (t, t.clone()) for k, t in sd.items()}))
                spy.partition_ptrs.update(t.untyped_storage().data_ptr() for t in sd.values())
        out = lower_all(backend_id, method_to_nodes, programs)
        spy.changed.extend(
            k
            for sd, before in mine
            for k, (obj, val) in before.items()
            if sd[k] is not obj or sd[k].shape != val.shape or not torch.equal(sd[k], val)
        )
        return out

    def preprocess_spy(ep, specs):
        spy.given_ptrs.update(t.untyped_storage().data_ptr() for t in ep.state_dict.values())
        return preprocess(ep, specs)

    hook = "copy_exported_program_for_preprocess"
    spy.hook_before = vars(XnnpackBackend).get(hook)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lowering.ExecuTorchKernels, "delta_gates", softplus_gates)
        mp.setattr(ba, "lower_all_submodules_to_backend", lower_all_spy)
        mp.setattr(XnnpackBackend, "preprocess", staticmethod(preprocess_spy))
        spy.manifest = export(
            str(checkpoints["deltanet_only"]),
            tmp_path_factory.mktemp("spied") / "b",
            target="executorch",
            precision="int4",
            max_context=32,
            prefill_chunk=8,
            progress=False,
            verify=False,
            allow_portable_fallback=True,
        )
        spy.hook_after = vars(XnnpackBackend).get(hook)
    return spy


def test_node_xnnpack_cannot_take_fails_unless_allowed(spied_export, tmp_path, monkeypatch, checkpoints):
    """softplus lowers to ops XNNPACK does not take: the export names them, or accepts them when asked. One export,
    with the fallback allowed, gives the nodes; the check the lowering runs on them refuses them without it, and a
    lowering that refuses leaves no bundle behind."""
    from deltaship.lowering.executorch import program
    from deltaship.lowering.executorch.program import check_portable

    portable = spied_export.manifest["lowering"]["portable_nodes"]
    assert not all(expected_portable(op) for op in portable)
    check_portable(portable, allow=True)
    with pytest.raises(DeltashipError, match="XNNPACK does not take these nodes.*aten_"):
        check_portable(portable)

    def refusing(ctx, weights, out_dir, progress=None, tokens=None):
        check_portable(portable, allow=ctx.options.allow_portable_fallback)

    monkeypatch.setattr(program, "lower", refusing)  # the lowering, as the export calls it
    model = str(checkpoints["deltanet_only"])
    with pytest.raises(DeltashipError, match="XNNPACK does not take these nodes.*aten_"):
        export(model, tmp_path / "a", target="executorch", max_context=32, progress=False, verify=False)
    assert not (tmp_path / "a").exists()


def test_program_from_another_executorch_version_is_a_clear_error(pte, tmp_path):
    path, _ = pte
    bad = tmp_path / "old"
    shutil.copytree(path, bad)
    data = bytearray((bad / "model.pte").read_bytes())
    i = data.find(b"ET12")
    data[i : i + 4] = b"ET09"  # the program identifier of an older schema
    (bad / "model.pte").write_bytes(bytes(data))
    m = json.loads((bad / "manifest.json").read_text())
    m["tools"]["executorch"] = "0.9.0"
    m["files"]["model.pte"].update(sha256=hashlib.sha256(bytes(data)).hexdigest(), bytes=len(data))
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DeltashipError) as e:
        open_bundle(bad)
    assert "built with executorch 0.9.0" in str(e.value) and "could not load this program" in str(e.value)


@pytest.mark.parametrize("precision", ["int4", "int8"])
def test_vocabulary_tables_quantized_by_row_blocks_equal_whole_table_quantization(precision, monkeypatch):
    """The embedding and LM head are quantized a block of rows at a time (no full fp32 copy): the numbers
    must be those of quantizing the whole table at once, and the embedding those of ExecuTorch's own
    transform."""
    import numpy as np
    import torch
    from executorch.examples.models.llama.source_transformation.quantize import get_quant_embedding_transform

    from deltaship.lowering.executorch import quant

    w = (np.random.default_rng(0).standard_normal((300, 64)) * 0.05).astype(np.float32)
    monkeypatch.setattr(quant, "ROW_BLOCK", 1000)
    whole_head = quant.quantized_table_linear(lambda r: w[r], w.shape, precision, 32)
    whole_emb, scheme = quant.quantized_embedding(lambda r: w[r], w.shape, precision)
    monkeypatch.setattr(quant, "ROW_BLOCK", 64)  # 5 blocks, the last one partial
    head = quant.quantized_table_linear(lambda r: w[r], w.shape, precision, 32)
    emb, _ = quant.quantized_embedding(lambda r: w[r], w.shape, precision)
    assert torch.equal(head.qdata, whole_head.qdata) and torch.equal(head.scale, whole_head.scale)
    assert torch.equal(emb.weight, whole_emb.weight) and torch.equal(emb.scales, whole_emb.scales)
    ref = torch.nn.Module()
    ref.emb = torch.nn.Embedding(*w.shape)
    ref.emb.weight.data = torch.from_numpy(w.copy())
    get_quant_embedding_transform(scheme)(ref)
    ids = torch.arange(w.shape[0]).reshape(1, -1)
    assert torch.equal(ref.emb(ids), emb(ids))
    err = (head.dequantize().numpy() - w).std() / w.std()
    assert 0 < err < (0.15 if precision == "int4" else 0.01)  # really quantized, and not garbage


def test_lowered_weights_released_and_program_unchanged(tmp_path):
    """After lowering, each delegate's copy of the pre-lowering weights is swapped for one-element
    placeholders; serialisation still works and the program computes the same numbers."""
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.exir.lowered_backend_module import LoweredBackendModule
    from executorch.runtime import Runtime

    from deltaship.lowering.executorch.program import release_lowered_weights

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 32)).eval()
    x = torch.randn(3, 64)

    def build(release: bool):
        edge = to_edge_transform_and_lower(torch.export.export(model, (x,)), partitioner=[XnnpackPartitioner()])
        released = release_lowered_weights(edge) if release else 0
        originals = [
            m.original_module
            for m in edge.exported_program().graph_module.modules()
            if isinstance(m, LoweredBackendModule)
        ]
        path = tmp_path / f"m{int(release)}.pte"
        path.write_bytes(edge.to_executorch().buffer)
        out = Runtime.get().load_program(str(path)).load_method("forward").execute([x])[0]
        return released, originals, out

    released, originals, out = build(release=True)
    _, kept, out_kept = build(release=False)
    weight_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert released == weight_bytes, (released, weight_bytes)

    def held(eps) -> int:
        return sum(t.untyped_storage().nbytes() for ep in eps for t in ep.state_dict.values())

    assert held(kept) >= weight_bytes and held(originals) < 64
    assert all(
        t.shape == p.shape for ep in originals for t, p in zip(ep.state_dict.values(), model.state_dict().values())
    )
    torch.testing.assert_close(out, out_kept, rtol=0, atol=0)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)


def test_xnnpack_preprocess_shares_and_leaves_weights_untouched(spied_export):
    """The program each XNNPACK preprocess gets shares its weight storage with the partition it was cut from
    (no model-sized deep copy at the export's peak), and preprocess leaves the partition's own tensors as
    they were: same values, shapes and objects (what makes sharing safe)."""
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend

    from deltaship.lowering.executorch.program import preprocess_shares_weights

    spy, hook = spied_export, "copy_exported_program_for_preprocess"
    assert spy.given_ptrs and spy.given_ptrs <= spy.partition_ptrs
    assert not spy.changed, spy.changed
    assert spy.hook_after is spy.hook_before  # restored after the export
    before = vars(XnnpackBackend).get(hook)
    with pytest.raises(KeyError), preprocess_shares_weights():
        assert vars(XnnpackBackend).get(hook) is not before
        raise KeyError("lowering failed")
    assert vars(XnnpackBackend).get(hook) is before  # and after a failure


def test_xnnpack_preprocess_skips_only_the_passes_that_cannot_change_a_partition():
    """XNNPACK's pass list on a partition leaves out the bilinear-upsample, SDPA, batch-norm and PReLU passes only
    when the partition has none of their ops (all of an SDPA pattern's), the rest in order; the block swaps the pass
    manager preprocess uses and puts XNNPACK's own back, also after a failure."""
    import torch
    from executorch.backends.xnnpack import xnnpack_preprocess
    from executorch.backends.xnnpack._passes import (
        ConvertToSDPAPass,
        ConvertToUpsampleBilinear2d,
        DecomposeBatchNorm,
        FuseBatchNormPass,
        PReLUReshapePass,
        XNNPACKPassManager,
    )
    from executorch.backends.xnnpack.partition.graphs import sdpa
    from executorch.exir.dialects._ops import ops as exir_ops

    from deltaship.lowering.executorch.program import applicable_xnnpack_passes, xnnpack_passes_that_apply

    def graph(*targets):
        g = torch.fx.Graph()
        x = g.placeholder("x")
        for t in targets:
            x = g.call_function(t, (x,))
        g.output(x)
        return g

    edge = exir_ops.edge.aten
    full = XNNPACKPassManager(None).passes
    optional = [ConvertToUpsampleBilinear2d, ConvertToSDPAPass, FuseBatchNormPass, DecomposeBatchNorm, PReLUReshapePass]
    assert applicable_xnnpack_passes(full, graph(edge.linear.default, edge.add.Tensor)) == [
        p for p in full if p not in optional
    ]
    bn, prelu, up = (
        edge._native_batch_norm_legit_no_training.default,
        edge._prelu_kernel.default,
        edge.upsample_bilinear2d.vec,
    )
    assert applicable_xnnpack_passes(full, graph(bn, prelu, up)) == [p for p in full if p is not ConvertToSDPAPass]
    pattern = [n.target for n in sdpa.get_graphs()[0].graph.nodes if n.op == "call_function"]
    assert ConvertToSDPAPass in applicable_xnnpack_passes(full, graph(*pattern))
    assert ConvertToSDPAPass not in applicable_xnnpack_passes(
        full, graph(*[t for t in pattern if t != edge.bmm.default])
    )
    own = xnnpack_preprocess.XNNPACKPassManager
    with pytest.raises(KeyError), xnnpack_passes_that_apply():
        manager = xnnpack_preprocess.XNNPACKPassManager
        assert manager is not own and manager(_Program(graph(edge.add.Tensor))).passes == [
            p for p in full if p not in optional
        ]
        assert manager(_Program(graph()), passes=[PReLUReshapePass]).passes == [PReLUReshapePass]  # asked for
        raise KeyError("lowering failed")
    assert xnnpack_preprocess.XNNPACKPassManager is own


class _Program:
    def __init__(self, graph):
        self.graph = graph


def test_a_session_opens_without_the_exporter_and_quietly(pte):
    """`deltaship generate` on an ExecuTorch bundle loads the C++ runtime without executorch.runtime's import of
    executorch.exir (the exporter: most of its import time) or custom_ops.py's torch._inductor, gives the tokens of the
    in-process session, and keeps cpuinfo's probe ("Failed to open midr file") off stderr."""
    import subprocess
    import sys

    path, _ = pte
    code = (
        "import json, sys; from deltaship.commands import generate\n"
        "r = generate(sys.argv[1], input_ids=[1, 2, 3], max_new_tokens=6)\n"
        "heavy = sorted(m for m in sys.modules if m.startswith(('executorch.exir', 'torch._inductor')))\n"
        "print(json.dumps([r['output_ids'], heavy]))"
    )
    env = {k: v for k, v in os.environ.items() if k != "DELTASHIP_VERBOSE"}
    res = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    ids, heavy = json.loads(res.stdout)
    assert heavy == []
    assert ids == open_bundle(path).generate([1, 2, 3], 6).output_ids
    assert res.stderr == ""
