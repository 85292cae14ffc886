"""Tiny ONNX models for the TensorRT contract tests, written with the `onnx` package (a test dependency).

`lm()` is a language-model-shaped network whose greedy next token is (token + 1) % vocab, so a run's
tokens can be predicted exactly; `mlp()` is a plain tensor network; `unsupported()` has an op the
parser double does not import.
"""

from __future__ import annotations

import numpy as np


def lm(vocab: int = 16) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    shift = np.zeros((vocab, vocab), np.float32)
    shift[np.arange(vocab), (np.arange(vocab) + 1) % vocab] = 1.0  # row i scores token i+1 highest
    graph = helper.make_graph(
        [helper.make_node("Gather", ["embedding", "input_ids"], ["hidden"], name="embed"),
         helper.make_node("MatMul", ["hidden", "lm_head"], ["logits"], name="lm_head_matmul")],
        "tiny_lm",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", vocab])],
        [numpy_helper.from_array(np.eye(vocab, dtype=np.float32), "embedding"),
         numpy_helper.from_array(shift, "lm_head")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def mlp(features: int = 8, out: int = 4) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).standard_normal((features, out)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"), helper.make_node("Relu", ["h"], ["y"], name="act")],
        "tiny_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", out])],
        [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8).SerializeToString()


def unsupported() -> bytes:
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["h"], name="ok_relu"),
         helper.make_node("FancyCustomOp", ["h"], ["y"], name="my_custom_node", domain="example.custom")],
        "bad", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("example.custom", 1)],
                             ir_version=8).SerializeToString()


if __name__ == "__main__":  # regenerates the example model checked in under recipes/models/
    import sys

    open(sys.argv[1], "wb").write(lm(vocab=64))
