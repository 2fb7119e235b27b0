"""deltaship/bundle/protobuf.py, the wire-format reader of the artifact checks, against onnx's own serializer."""

from __future__ import annotations

import pytest

from deltaship.bundle.protobuf import fields, messages, varint, varints


def _model() -> bytes:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 300])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [])
    return helper.make_model(graph, ir_version=9).SerializeToString()


def test_the_reader_sees_what_onnx_wrote():
    buf = _model()
    assert dict(varints(buf))[1] == 9  # ModelProto.ir_version
    graph = [(a, b) for f, a, b in messages(buf) if f == 7]  # ModelProto.graph
    assert len(graph) == 1
    names = [bytes(buf[a:b]) for f, a, b in messages(buf, *graph[0]) if f == 2]  # GraphProto.name
    assert names == [b"g"]
    kinds = {(f, kind) for f, kind, _ in fields(buf)}
    assert (1, 0) in kinds and (7, 2) in kinds
    assert varint(b"\xac\x02", 0) == (300, 2)


@pytest.mark.parametrize("cut", [1, 5, -3])
def test_a_truncated_message_is_a_value_error(cut):
    buf = _model()[:cut]
    with pytest.raises(ValueError, match="runs past"):
        list(fields(buf))


def test_an_endless_varint_is_a_value_error():
    with pytest.raises(ValueError, match="too long"):
        varint(b"\xff" * 11, 0)
