"""CUDA graph capture: the --onnx-cuda-graph graph and the session's plumbing, checked on the CPU; the captured
path against the CPU provider where a CUDA provider is present (it ran on an H200: docs/results/gpu.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from deltaship.errors import DeltashipError


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory):
    from deltaship.compile import export

    out = tmp_path_factory.mktemp("cg") / "tiny-int4"
    export(
        "qwen3.5-tiny",
        out,
        target="onnx",
        precision="int4",
        onnx_activations="fp16",
        verify=False,
        progress=False,
        max_context=64,
        prefill_chunk=8,
        onnx_cuda_graph=True,
    )
    return out


def _export(tmp_path_factory, name: str, precision: str, max_context: int = 64, **options):
    from deltaship.compile import export

    out = tmp_path_factory.mktemp("cg") / name
    export(
        "qwen3.5-tiny",
        out,
        target="onnx",
        precision=precision,
        verify=False,
        progress=False,
        max_context=max_context,
        prefill_chunk=8,
        **options,
    )
    return out


@pytest.fixture(scope="module")
def fp16_pair(tmp_path_factory):
    """The trained tiny at fp16, without and with --onnx-cuda-graph."""
    return _export(tmp_path_factory, "plain", "fp16"), _export(
        tmp_path_factory, "capture", "fp16", onnx_cuda_graph=True
    )


def test_cuda_graph_without_the_cuda_provider_is_a_clear_error(tiny_onnx):
    from deltaship.targets import open_bundle

    with pytest.raises(DeltashipError) as e:
        open_bundle(tiny_onnx, cuda_graph=True)
    assert "cuda_graph=True needs the CUDA execution provider" in str(e.value) and "cpu" in str(e.value)
    assert "provider='cuda'" in e.value.fix


def test_cuda_graph_on_an_onnxruntime_without_cuda_names_the_package(tiny_onnx):
    import onnxruntime as ort

    from deltaship.targets import open_bundle

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider")
    with pytest.raises(DeltashipError) as e:
        open_bundle(tiny_onnx, provider="cuda", cuda_graph=True)
    assert "no CUDA execution provider" in str(e.value) and "onnxruntime-gpu" in e.value.fix


def test_cuda_provider_options():
    from deltaship.runtimes.onnx import cuda_provider_options

    assert cuda_provider_options(True) == {"enable_cuda_graph": "1"}
    assert cuda_provider_options(False) == {}


def test_decode_inputs_are_preallocated_and_written_in_place():
    import onnxruntime as ort

    from deltaship.runtimes.onnx import DecodeInputs

    for counted in (True, False):  # the sequence-length pair, and older bundles' position_ids
        d = DecodeInputs(ort, "cpu", counted)  # the "cuda" code path but for the device the buffers live on
        ptrs = {n: v.data_ptr() for n, v in d.values.items()}
        for tok, pos in ((7, 0), (300, 41), (2, 63)):
            d.set(tok, pos)
            assert {n: v.data_ptr() for n, v in d.values.items()} == ptrs  # a captured graph would still see them
            got = {n: v.numpy().tolist() for n, v in d.values.items()}
            want = {"current_sequence_length": [pos + 1], "past_sequence_length": [[pos]]} if counted else {}
            assert got == {"input_ids": [[tok]], **(want or {"position_ids": [[pos]]})}
            assert d.input_ids.shape() == [1, 1] and d.input_ids.data_type() == "tensor(int64)"
        d.device = "cuda"  # the host-to-device path: update_inplace from the host arrays (here onto the CPU)
        d.set(9, 12)
        assert d.input_ids.numpy().tolist() == [[9]]


def _graph_session(bundle):
    """A session on the CPU provider running the captured path's code: its state buffers planned as the CUDA provider
    shares them (the KV caches in one buffer, the DeltaNet states in two), fixed decode buffers, gpu_graph_ids."""
    from deltaship.targets import open_bundle

    s = open_bundle(bundle)
    s.cuda_graph = True
    s._graph_buffers("cpu", plan_for="CUDAExecutionProvider")
    return s


def test_graph_ids_are_uncaptured_for_prefill_and_follow_the_buffer_sets_for_decode(tiny_onnx):
    s = _graph_session(tiny_onnx)
    assert all(len(s._vals[st["name"]]) == (1 if st["kind"].startswith("kv") else 2) for st in s.states)
    s.prefill([1, 2, 3])
    assert s._graphs == {}  # prefill runs with gpu_graph_id -1
    ids = []
    for _ in range(5):
        parity = tuple(s._cur[n] for n in s._alternating)
        s.decode(1)
        io, opts = s._decode_io[parity]
        ids.append(opts.get_run_config_entry("gpu_graph_id"))
    # decode alternates two buffer sets (the states' parity): two graphs, each always on its own addresses
    assert ids == ["1", "2", "1", "2", "1"] and len(s._graphs) == 2
    assert len({key[2] for key in s._graphs}) == 2


def _placement():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "gpu_placement", Path(__file__).resolve().parents[1] / "bench" / "gpu" / "placement.py"
    )
    placement = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(placement)
    return placement


def test_the_capture_graph_has_no_copies_between_cpu_and_gpu(fp16_pair):
    # the replay of ORT's CPU placement matched ORT's own log on an H200 for both graphs (2 CPU nodes and 3 Memcpy
    # nodes; 1 and 0): the plain graph copies the call's token count and the query length to the GPU and
    # total_sequence_length to the host, which ORT refuses to capture
    import onnx

    place = _placement().placement
    plain, capture = (onnx.load(str(b / "model.onnx"), load_external_data=False) for b in fp16_pair)
    res = place(plain)
    assert sorted(n["op"] for n in res["cpu_nodes"]) == ["Gather", "Gather"]
    assert sorted(d for _, d in res["memcpy_tensors"]) == ["to_cpu", "to_gpu", "to_gpu"]
    assert ("seqlen_call_tokens", "to_gpu") in res["memcpy_tensors"]
    assert {e["input"] for e in res["predicted_memcpy_edges"] if e["to_op"] == "GroupQueryAttention"} == {6}
    res = place(capture)
    assert res["predicted_memcpy_edges"] == [] and [n["op"] for n in res["cpu_nodes"]] == ["Gather"]
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in capture.graph.initializer}
    gqa = [n for n in capture.graph.node if n.op_type == "GroupQueryAttention"]
    assert gqa and all(n.input[5] == "capture_seqlens_k" for n in gqa)
    assert all(consts[n.input[6]].tolist() == 64 for n in gqa)  # total_sequence_length = max_context
    m = json.loads((fp16_pair[1] / "manifest.json").read_text())
    assert m["lowering"]["cuda_graph"]["total_sequence_length"] == 64
    assert "cuda_graph" not in json.loads((fp16_pair[0] / "manifest.json").read_text())["lowering"]


def test_the_capture_graph_gives_the_plain_graphs_tokens_on_the_cpu(fp16_pair):
    from helpers import code_prompt

    from deltaship.targets import open_bundle

    plain, capture = (open_bundle(b) for b in fp16_pair)
    said = set()
    for n in (1, 7, 20):  # one token, under a prefill chunk (8), and three chunks
        plain.reset()
        capture.reset()
        a = plain.generate(code_prompt(n), 40, stop_at_eos=False, keep_logits=True)
        b = capture.generate(code_prompt(n), 40, stop_at_eos=False, keep_logits=True)
        assert a.output_ids == b.output_ids
        said.update(a.output_ids)
        # fp16: the capture graph's fused norms normalize the unrounded residual sum, with gamma rounded to fp16
        la, lb = np.stack(a.logits), np.stack(b.logits)
        assert np.abs(la - lb).max() / la.std() < 0.01
    assert len(said) > 5  # the trained model says something, not one token over and over


def test_the_capture_graph_runs_unchanged_in_onnxruntime_genai(fp16_pair):
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is in the dev extra; CI installs it")
    from helpers import code_prompt

    from deltaship.targets import open_bundle

    for n in (1, 20):
        own = open_bundle(fp16_pair[1]).generate(code_prompt(n), 24, stop_at_eos=False).output_ids
        genai = open_bundle(fp16_pair[1], runtime="genai").generate(code_prompt(n), 24, stop_at_eos=False)
        assert genai.output_ids == own


def test_a_plain_bundle_asked_for_a_cuda_graph_names_the_export_option(fp16_pair):
    from deltaship.targets import open_bundle

    with pytest.raises(DeltashipError) as e:
        open_bundle(fp16_pair[0], provider="cuda", cuda_graph=True)
    assert "--onnx-cuda-graph" in str(e.value) and "Memcpy" in str(e.value)


@pytest.mark.parametrize(
    "precision, options, words",
    [
        ("fp32", {}, "fp16 activations only"),
        ("int4", {}, "fp16 activations only"),
    ],
)
def test_export_refuses_what_the_capture_rewrite_does_not_cover(tmp_path, precision, options, words):
    from deltaship.compile import export

    with pytest.raises(DeltashipError) as e:
        export(
            "qwen3.5-tiny",
            tmp_path / "b",
            target="onnx",
            precision=precision,
            verify=False,
            progress=False,
            onnx_cuda_graph=True,
            **options,
        )
    assert words in str(e.value) and not (tmp_path / "b").exists()


def test_an_uncaptured_cuda_session_binds_each_decode_call_afresh(tiny_onnx):
    # a host array bound for a device input is copied at bind time, so a kept decode binding would replay the first
    # call's token and position (wrong tokens on an H200 until this was fixed): a session on the device must not
    # keep one. Here the session's buffers stay on the CPU and only its device is said to be the GPU.
    from deltaship.targets import open_bundle

    plain = open_bundle(tiny_onnx, cuda_graph=False)
    device = open_bundle(tiny_onnx, cuda_graph=False)
    device.device = "cuda"
    prompt = [5, 17, 99, 3, 250, 8, 8, 1, 42, 7]
    a = plain.generate(prompt, 10, stop_at_eos=False, keep_logits=True)
    b = device.generate(prompt, 10, stop_at_eos=False, keep_logits=True)
    assert a.output_ids == b.output_ids and plain._decode_io and not device._decode_io
    np.testing.assert_array_equal(np.stack(a.logits), np.stack(b.logits))


def _has_cuda() -> bool:
    try:
        import onnxruntime as ort
    except ImportError:
        return False
    return "CUDAExecutionProvider" in ort.get_available_providers()


@pytest.mark.skipif(
    not _has_cuda(), reason="needs onnxruntime-gpu and an NVIDIA GPU (ran on an H200, docs/results/gpu.md)"
)
@pytest.mark.parametrize("precision, options", [("fp16", {}), ("int4", {"onnx_activations": "fp16"})])
def test_captured_decode_gives_the_cpu_providers_tokens(tmp_path_factory, precision, options):
    from helpers import code_prompt

    from deltaship.targets import open_bundle

    b = _export(tmp_path_factory, f"cuda-{precision}", precision, 128, onnx_cuda_graph=True, **options)
    cpu, graph = open_bundle(b), open_bundle(b, provider="cuda", cuda_graph=True)
    assert graph.cuda_graph and "CUDA graphs" in graph.runtime_name()
    for n in (1, 7, 20):
        cpu.reset()
        want = cpu.generate(code_prompt(n), 64, stop_at_eos=False).output_ids
        for _ in range(2):  # the second run replays the graphs captured in the first, at other positions
            graph.reset()
            assert graph.generate(code_prompt(n), 64, stop_at_eos=False).output_ids == want


def test_graph_buffers_give_the_same_tokens_on_the_cpu(tiny_onnx):
    # the cuda_graph binding path (fixed decode buffers, logits OrtValue, gpu_graph_id run options) with its buffers
    # on the CPU: same greedy tokens and logits as the plain session, and the buffers never move
    from deltaship.targets import open_bundle

    plain = open_bundle(tiny_onnx)
    graph = open_bundle(tiny_onnx)
    graph.cuda_graph = True
    graph._graph_buffers("cpu")
    ptrs = [v.data_ptr() for v in graph._decode_in.values.values()] + [graph._logits_val.data_ptr()]
    prompt = [5, 17, 99, 3, 250, 8, 8, 1, 42, 7]  # > prefill_chunk (8): two prefill calls, then decode
    a = plain.generate(prompt, 12, stop_at_eos=False, keep_logits=True)
    b = graph.generate(prompt, 12, stop_at_eos=False, keep_logits=True)
    assert a.output_ids == b.output_ids
    np.testing.assert_array_equal(np.stack(a.logits), np.stack(b.logits))
    assert [v.data_ptr() for v in graph._decode_in.values.values()] + [graph._logits_val.data_ptr()] == ptrs
    # the last decode call's: tokens held after it
    assert graph._decode_in.values["current_sequence_length"].numpy().tolist() == [len(prompt) + 12 - 1]


def test_decode_reuses_one_binding_per_parity_with_the_same_results(tiny_onnx):
    # a plain CPU session binds a one-token call once per parity of the alternating states and then only writes
    # the token and position; the results equal those of a session that binds every decode step afresh
    from deltaship.targets import open_bundle

    kept, fresh = open_bundle(tiny_onnx), open_bundle(tiny_onnx)
    prompt = [5, 17, 99, 3, 250, 8, 8, 1, 42, 7]
    a = kept.generate(prompt, 10, stop_at_eos=False, keep_logits=True)
    bindings = {k: id(v[0]) for k, v in kept._decode_io.items()}
    assert sorted(bindings) == [(0,) * len(kept._alternating), (1,) * len(kept._alternating)]
    kept.decode(3)
    assert {k: id(v[0]) for k, v in kept._decode_io.items()} == bindings  # reused, not made again
    fresh._decode_io = _Forgetful()
    b = fresh.generate(prompt, 10, stop_at_eos=False, keep_logits=True)
    assert a.output_ids == b.output_ids
    np.testing.assert_array_equal(np.stack(a.logits), np.stack(b.logits))


class _Forgetful(dict):
    """A binding cache that never keeps anything: every decode step binds afresh."""

    def __setitem__(self, key, value):
        pass


def test_a_bundle_with_position_ids_still_runs(fp16_pair, tmp_path):
    # bundles from before the sequence-length pair take position_ids [1, positions]; the driver reads the form from
    # the manifest's input kinds: the same graph rewritten to position_ids gives the same tokens and logits
    import hashlib
    import json
    import shutil

    from deltaship.lowering.onnx.model import position_ids_io
    from deltaship.targets import open_bundle

    old = tmp_path / "old"
    shutil.copytree(fp16_pair[0], old)
    position_ids_io(old / "model.onnx")
    m = json.loads((old / "manifest.json").read_text())
    m["inputs"] = m["inputs"][:1] + [
        {"name": "position_ids", "shape": [1, "positions"], "dtype": "int64", "kind": "position_ids", "doc": ""}
    ]
    data = (old / "model.onnx").read_bytes()
    m["files"]["model.onnx"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (old / "manifest.json").write_text(json.dumps(m))
    a, b = open_bundle(fp16_pair[0]), open_bundle(old)
    assert a.counted and not b.counted
    prompt = [5, 17, 99, 3, 250, 8, 8, 1, 42, 7]
    x = a.generate(prompt, 6, stop_at_eos=False, keep_logits=True)
    y = b.generate(prompt, 6, stop_at_eos=False, keep_logits=True)
    assert x.output_ids == y.output_ids
    np.testing.assert_array_equal(np.stack(x.logits), np.stack(y.logits))


# ---- nodes per layer: today's budget (deltaship/lowering/onnx/census.py) ----------------------------------------
# The decode step's kernel count on a GPU. Tiny preset (8 layers: 6 DeltaNet, 2 attention), fp16 activations.
# A change that adds nodes to a layer fails here; one that removes some updates these numbers (and says so).
# Counted in the order ONNX Runtime runs the graph, where each layer's two state writes run inside the layer (2 more
# than the program order's count, which had them after the last layer: bundle/node_order.py).
NODES_PER_LAYER = {
    # default lowering: DeltaNet conv as 4 Mul/Add taps over a Concat, output norm as norm * SiLU(gate)
    "plain": {"deltanet": 61, "attention": 55},
    "contrib": {"deltanet": 44, "attention": 55},  # --onnx-deltanet-ops contrib: CausalConvWithState, GatedRMSNorm
    # --onnx-cuda-graph: the residual Add + RMSNorm (+ Cast to fp16) -> SkipSimplifiedLayerNormalization, twice a layer
    "capture": {"deltanet": 57, "attention": 51},
    "capture+contrib": {"deltanet": 40, "attention": 51},
}


@pytest.fixture(scope="module")
def contrib_pair(tmp_path_factory):
    """fp16 with --onnx-deltanet-ops contrib, without and with --onnx-cuda-graph."""
    return tuple(
        _export(tmp_path_factory, name, "fp16", onnx_deltanet_ops="contrib", **opts)
        for name, opts in (("contrib", {}), ("capture-contrib", {"onnx_cuda_graph": True}))
    )


def _census(bundle):
    import onnx

    from deltaship.lowering.onnx.census import nodes_per_layer

    return nodes_per_layer(onnx.load(str(bundle / "model.onnx"), load_external_data=False).graph.node)


def test_nodes_per_layer_stay_within_todays_budget(fp16_pair, contrib_pair, tiny_onnx):
    graphs = {"plain": fp16_pair[0], "contrib": contrib_pair[0], "capture": fp16_pair[1]}
    graphs["capture+contrib"] = contrib_pair[1]
    for name, bundle in graphs.items():
        c = _census(bundle)
        assert {k: c[k] for k in ("deltanet", "attention")} == NODES_PER_LAYER[name], name
        # 6 DeltaNet layers, 2 attention; under --onnx-cuda-graph two DeltaNet layers run one node more in the
        # runtime's order (layer 0's unfused first norm, the device's start-position Sub at its first use)
        assert c["layers"].count(c["deltanet"]) >= 4 and len(c["layers"]) == 8
        manifest = json.loads((bundle / "manifest.json").read_text())
        assert manifest["lowering"]["nodes_per_layer"] == {k: v for k, v in c.items() if k not in ("layers", "ops")}
    assert {k: _census(tiny_onnx)[k] for k in ("deltanet", "attention")} == NODES_PER_LAYER["capture"]  # int4
    # what each CUDA choice removes, per layer: the fused norms 4 (2 x Add + Cast into the norm), contrib 17
    fused = json.loads((fp16_pair[1] / "manifest.json").read_text())["lowering"]["fusions"]
    assert fused["skip_norm"]["nodes_removed"] == 8 * 4
    ops = _census(fp16_pair[1])["ops"]
    assert (
        ops["deltanet"]["SkipSimplifiedLayerNormalization"] == ops["attention"]["SkipSimplifiedLayerNormalization"] == 2
    )
    assert ops["deltanet"]["Add"] == 3  # the conv's taps; no residual Add is left
    assert "fusions" not in json.loads((fp16_pair[0] / "manifest.json").read_text())["lowering"]


def test_the_census_follows_the_runtimes_order_and_refuses_interleaved_layers(fp16_pair):
    import onnx

    from deltaship.bundle.node_order import runtime_order
    from deltaship.lowering.onnx.census import layer_segments, nodes_per_layer

    nodes = list(onnx.load(str(fp16_pair[0] / "model.onnx"), load_external_data=False).graph.node)
    last = max(i for i, n in enumerate(nodes) if any(x.startswith("model_layers_7_") for x in n.input))
    moved = list(nodes)
    moved.insert(60, moved.pop(last))  # a node of layer 7 written among layer 1's: the runtime still runs it in 7
    assert nodes_per_layer(moved) == nodes_per_layer(nodes)
    ran = [nodes[i] for i in runtime_order(nodes)]
    last = max(i for i, n in enumerate(ran) if any(x.startswith("model_layers_7_") for x in n.input))
    ran.insert(60, ran.pop(last))  # a run in which layer 7's node ran among layer 1's: not one layer after another
    with pytest.raises(DeltashipError, match="not written in order"):
        layer_segments(ran)


def test_the_fused_capture_graphs_give_the_plain_graphs_tokens(fp16_pair, contrib_pair):
    from helpers import code_prompt

    from deltaship.targets import open_bundle

    want = open_bundle(fp16_pair[0]).generate(code_prompt(20), 24, stop_at_eos=False, keep_logits=True)
    for b in contrib_pair:
        got = open_bundle(b).generate(code_prompt(20), 24, stop_at_eos=False, keep_logits=True)
        assert got.output_ids == want.output_ids
        rel = np.abs(np.stack(got.logits) - np.stack(want.logits)).max() / np.stack(want.logits).std()
        assert rel < 0.05  # fp16: the fused norm normalizes the unrounded sum, its gamma rounded to fp16


# ---- speculative decoding captured: --onnx-cuda-graph --mtp ------------------------------------------------------
@pytest.fixture(scope="module")
def mtp_capture(tmp_path_factory):
    return _export(tmp_path_factory, "mtp-capture", "fp16", onnx_cuda_graph=True, mtp=True)


def test_the_speculative_capture_graphs_copy_nothing_between_cpu_and_gpu(mtp_capture):
    import onnx

    place = _placement().placement
    decoder = onnx.load(str(mtp_capture / "model.onnx"), load_external_data=False)
    head = onnx.load(str(mtp_capture / "mtp.onnx"), load_external_data=False)
    for graph in (decoder, head):
        assert place(graph)["predicted_memcpy_edges"] == []
    assert not [n for n in decoder.graph.node if "logit_rows" in n.input]  # the rows are a Slice, not a Gather
    m = json.loads((mtp_capture / "manifest.json").read_text())
    assert m["speculative"]["draft"]["cuda_graph"]["total_sequence_length"] == 64
    hidden = {i["name"]: i["dtype"] for i in m["speculative"]["draft"]["inputs"]}["hidden_states"]
    assert hidden == "float16"  # the activations' dtype, as the graphs declare it


def test_captured_speculative_decoding_gives_plain_greedy_tokens(mtp_capture):
    from helpers import code_prompt

    from deltaship.runtimes.speculative import generate_speculative
    from deltaship.targets import open_bundle

    plain, s = open_bundle(mtp_capture), _graph_session(mtp_capture)
    stats = []
    for n in (1, 7):  # both reject drafts (the trained head accepts about 3 in 4)
        plain.reset()
        want = plain.generate(code_prompt(n), 32, stop_at_eos=False).output_ids
        keys = {k: k[2] for k in s._graphs}
        got, st = generate_speculative(s, code_prompt(n), 32, stop_at_eos=False)
        assert got.output_ids == want, n
        stats.append(st)
        assert all(s._graphs[k] is not None and k[2] == keys[k] for k in keys)  # a graph keeps its addresses
    assert sum(st.rollbacks for st in stats) > 0 and sum(st.accepted for st in stats) > 0
    # verify calls of 2 tokens, on a bounded number of buffer sets (rollbacks swap a state's three buffers)
    # (a one-token prompt's prefill is a verify call of one row: captured too, harmlessly)
    shapes = {k[:2] for k in s._graphs}
    assert ("verify", (2, 2)) in shapes and shapes <= {("verify", (2, 2)), ("verify", (1, 1))}
    assert 2 <= sum(k[1] == (2, 2) for k in s._graphs) <= 12
    drafts = {k[0] for k, o in s._draft_graphs.items() if o.get_run_config_entry("gpu_graph_id") != "-1"}
    assert drafts == {1, 2}  # the head captured per call length; its first call, over the prompt, is not


def test_speculative_decoding_with_rollback_buffers_apart_gives_plain_greedy_tokens(mtp_capture):
    # an uncaptured session on a device binds every rollback output to a buffer of its own (no CUDA kernel is
    # declared safe in place): its verify and rollback path, run here on the CPU, keeps plain greedy's tokens
    from helpers import code_prompt

    from deltaship.runtimes.speculative import generate_speculative
    from deltaship.targets import open_bundle

    plain, apart = open_bundle(mtp_capture, in_place=False), open_bundle(mtp_capture, in_place=False)
    apart._rollback_apart = lambda: True
    want = plain.generate(code_prompt(7), 24, stop_at_eos=False).output_ids
    got, st = generate_speculative(apart, code_prompt(7), 24, stop_at_eos=False)
    assert got.output_ids == want and st.rollbacks > 0
    assert all(len(v) == 2 for v in apart._vals.values()) and apart._rollback is not None
