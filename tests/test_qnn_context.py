"""bundle/qnn_context.py reads a compiled QNN context model without a toolchain, and trusts nothing in it: the
binaries it names stay beside it, an embedded or foreign model is refused (no onnxruntime-qnn needed here)."""

from __future__ import annotations

import pytest
from onnx import TensorProto, helper

from deltaship.bundle.qnn_context import read_context_model
from deltaship.errors import DeltashipError

RECORD = "v2:6:2.51.0:5.51.0:79:69:0:0"


def _context_model(path, binary: str = "decode_8elite_ctx_qnn.bin", embed: int = 0, record: str | None = RECORD):
    node = helper.make_node(
        "EPContext",
        ["x"],
        ["y"],
        domain="com.microsoft",
        main_context=1,
        ep_cache_context=binary,
        embed_mode=embed,
        ep_sdk_version="v2.51.0.260929181845",
        source="QNNExecutionProvider",
    )
    g = helper.make_graph(
        [node],
        "ctx",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 8])],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    if record is not None:
        helper.set_model_props(m, {"ep_compatibility_info.QNNExecutionProvider": record})
    path.write_bytes(m.SerializeToString())
    return path


def test_a_context_model_reads_its_record_binaries_and_build(tmp_path):
    read = read_context_model(_context_model(tmp_path / "decode_8elite_ctx.onnx"))
    assert read.binaries == ("decode_8elite_ctx_qnn.bin",) and read.other_ops == ()
    assert read.qnn_builds == ("v2.51.0.260929181845",)
    assert (read.compat.htp_archs, read.compat.soc_models, read.compat.qnn_sdk) == ((79,), (69,), "2.51.0")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"binary": "../../etc/passwd"}, "names the context binary '../../etc/passwd', not a file beside it"),
        ({"binary": "/abs/x.bin"}, "not a file beside it"),
        ({"embed": 1}, "the context binary is embedded in the model"),
        ({"record": None}, "no ep_compatibility_info.QNNExecutionProvider metadata"),
    ],
)
def test_a_context_model_naming_outside_its_directory_or_embedded_is_refused(tmp_path, kwargs, message):
    with pytest.raises(DeltashipError, match=message.replace("(", r"\(").replace(".", r"\.")):
        read_context_model(_context_model(tmp_path / "m_ctx.onnx", **kwargs))


def test_bytes_that_are_not_a_model_are_refused(tmp_path):
    (tmp_path / "junk_ctx.onnx").write_bytes(b"\xff" * 64)
    with pytest.raises(DeltashipError, match="junk_ctx.onnx: not an ONNX model"):
        read_context_model(tmp_path / "junk_ctx.onnx")
