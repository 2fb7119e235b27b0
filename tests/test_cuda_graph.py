"""CUDA graph plumbing of the ONNX session, checked on the CPU (whether capture works needs a GPU: not run here)."""

from __future__ import annotations

import numpy as np
import pytest

from deltaship.errors import DeltashipError


@pytest.fixture(scope="module")
def tiny_onnx(tmp_path_factory):
    from deltaship.export import export

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
    )
    return out


def test_cuda_graph_without_the_cuda_provider_is_a_clear_error(tiny_onnx):
    from deltaship.runtimes import open_bundle

    with pytest.raises(DeltashipError) as e:
        open_bundle(tiny_onnx, cuda_graph=True)
    assert "cuda_graph=True needs the CUDA execution provider" in str(e.value) and "cpu" in str(e.value)
    assert "provider='cuda'" in e.value.fix


def test_cuda_graph_on_an_onnxruntime_without_cuda_names_the_package(tiny_onnx):
    import onnxruntime as ort

    from deltaship.runtimes import open_bundle

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


def test_graph_id_is_uncaptured_for_prefill_and_follows_the_buffer_parity_for_decode(tiny_onnx):
    from deltaship.runtimes import open_bundle

    s = open_bundle(tiny_onnx)
    assert s._graph_id(np.array([1, 2, 3])) == "-1"
    s.prefill([1, 2, 3])  # one run: the alternating states moved to their second buffer
    ids = [s._graph_id(np.array([5]))]
    for _ in range(3):
        s.decode(1)
        ids.append(s._graph_id(np.array([5])))
    assert ids == ["2", "1", "2", "1"]


def test_placement_lists_the_position_arithmetic_and_its_copies_to_the_gpu(tiny_onnx):
    import importlib.util
    import json
    from pathlib import Path

    import onnx

    spec = importlib.util.spec_from_file_location(
        "gpu_placement", Path(__file__).resolve().parents[1] / "bench" / "gpu" / "placement.py"
    )
    placement = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(placement)
    entry = json.loads((tiny_onnx / "manifest.json").read_text())["entry"]
    res = placement.cpu_candidates(onnx.load(str(tiny_onnx / entry), load_external_data=False))
    ops = sorted(n["op"] for n in res["cpu_nodes"])
    # current_sequence_length -> position (Cast, Sub of the call's length, a Shape); + query length (Gather of a
    # Shape); seqlens_k (Sub, Cast) and total_sequence_length (Squeeze, Cast). With position_ids in place of the
    # pair it was Slice + Reshape for the position: what ORT placed on the CPU on the H100 (7 nodes)
    assert ops == ["Add", "Cast", "Cast", "Cast", "Gather", "Squeeze", "Sub", "Sub"]
    assert res["graph_inputs_read"] == ["current_sequence_length"] and res["gqa_nodes"] == 2
    copied = {e["tensor"]: (e["to_op"], e["input"]) for e in res["predicted_memcpy_edges"]}
    assert len(copied) == 2  # the 2 Memcpy nodes ORT reported for fp16-activation bundles
    assert ("GroupQueryAttention", 5) in copied.values()  # seqlens_k lives in device memory


def test_graph_buffers_give_the_same_tokens_on_the_cpu(tiny_onnx):
    # the cuda_graph binding path (fixed decode buffers, logits OrtValue, gpu_graph_id run options) with its buffers
    # on the CPU: same greedy tokens and logits as the plain session, and the buffers never move
    from deltaship.runtimes import open_bundle

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
    from deltaship.runtimes import open_bundle

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


def test_a_bundle_with_position_ids_still_runs(tiny_onnx, tmp_path):
    # bundles from before the sequence-length pair take position_ids [1, positions]; the driver reads the form from
    # the manifest's input kinds: the same graph rewritten to position_ids gives the same tokens and logits
    import hashlib
    import json
    import shutil

    from deltaship.export.onnx.model import position_ids_io
    from deltaship.runtimes import open_bundle

    old = tmp_path / "old"
    shutil.copytree(tiny_onnx, old)
    position_ids_io(old / "model.onnx")
    m = json.loads((old / "manifest.json").read_text())
    m["inputs"] = m["inputs"][:1] + [
        {"name": "position_ids", "shape": [1, "positions"], "dtype": "int64", "kind": "position_ids", "doc": ""}
    ]
    data = (old / "model.onnx").read_bytes()
    m["files"]["model.onnx"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (old / "manifest.json").write_text(json.dumps(m))
    a, b = open_bundle(tiny_onnx), open_bundle(old)
    assert a.counted and not b.counted
    prompt = [5, 17, 99, 3, 250, 8, 8, 1, 42, 7]
    x = a.generate(prompt, 6, stop_at_eos=False, keep_logits=True)
    y = b.generate(prompt, 6, stop_at_eos=False, keep_logits=True)
    assert x.output_ids == y.output_ids
    np.testing.assert_array_equal(np.stack(x.logits), np.stack(y.logits))
