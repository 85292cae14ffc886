"""The ONNX-parsing half of the TensorRT double: OnnxParser, ParserError, INetworkDefinition, ITensor, Dims.

The parser reads a real ONNX file with the `onnx` package: graph inputs (initializers excluded) and
outputs become ITensors (symbolic dimensions are -1, as TensorRT reports dynamic ones), every node
becomes a layer, and a node whose op the double does not "import" becomes a ParserError with its
index, name and operator, which is what the real parser reports.
"""

from __future__ import annotations

from typing import Any

from tests.doubles.strict import StrictBase

ONNX_SUPPORTED = {"Add", "Cast", "Gather", "Gemm", "Identity", "MatMul", "Mul", "Relu", "Reshape", "Softmax",
                  "Sub", "Tanh", "Transpose", "Sigmoid", "Div"}
ONNX_TO_TRT = {1: "FLOAT", 10: "HALF", 16: "BF16", 6: "INT32", 7: "INT64", 3: "INT8", 9: "BOOL", 2: "UINT8"}


class DimsImpl(StrictBase):
    _fake_impl = True

    def __init__(self, shape: Any = ()) -> None:
        self._fake_dims = tuple(int(d) for d in shape)

    def _fake_init(self, shape: Any = ()) -> None:
        self._fake_dims = tuple(int(d) for d in shape)

    def __len__(self) -> int:
        return len(self._fake_dims)

    def __getitem__(self, i: int) -> int:
        return self._fake_dims[i]  # IndexError at the end makes iteration work, as pybind's Dims does

    def __eq__(self, other: object) -> bool:
        return self._fake_dims == (tuple(other) if isinstance(other, (tuple, list, DimsImpl)) else other)

    def __repr__(self) -> str:
        return repr(self._fake_dims)


class ITensorImpl(StrictBase):
    _fake_impl = True

    def _fake_init(self, name: str, shape: tuple[int, ...], dtype: str) -> None:
        self._fake_name_ = name
        self._fake_shape = shape
        self._fake_dtype = dtype

    @property
    def name(self) -> str:
        return self._fake_name_

    @property
    def shape(self) -> Any:
        return type(self)._fake_module._fake_cls("Dims")._fake_new(self._fake_shape)

    @property
    def dtype(self) -> Any:
        return type(self)._fake_module._fake_enum("DataType", self._fake_dtype)

    @property
    def is_network_input(self) -> bool:
        return self._fake_is_input


class INetworkDefinitionImpl(StrictBase):
    _fake_impl = True

    def _fake_init(self, flags: int) -> None:
        self._fake_flags = flags
        self._fake_inputs: list[Any] = []
        self._fake_outputs: list[Any] = []
        self._fake_nodes: list[dict[str, Any]] = []
        self._fake_onnx = b""

    @property
    def num_inputs(self) -> int:
        return len(self._fake_inputs)

    @property
    def num_outputs(self) -> int:
        return len(self._fake_outputs)

    @property
    def num_layers(self) -> int:
        return len(self._fake_nodes)

    def get_input(self, index: int) -> Any:
        return self._fake_inputs[index]

    def get_output(self, index: int) -> Any:
        return self._fake_outputs[index]


class ParserErrorImpl(StrictBase):
    _fake_impl = True

    def _fake_init(self, code: Any, desc: str, node: int = -1, name: str = "", op: str = "") -> None:
        self._fake_fields = (code, desc, node, name, op)

    def code(self) -> Any:
        return self._fake_fields[0]

    def desc(self) -> str:
        return self._fake_fields[1]

    def node(self) -> int:
        return self._fake_fields[2]

    def node_name(self) -> str:
        return self._fake_fields[3]

    def node_operator(self) -> str:
        return self._fake_fields[4]

    def file(self) -> str:
        return "ModelImporter.cpp"

    def line(self) -> int:
        return 0

    def func(self) -> str:
        return "parseGraph"

    def __str__(self) -> str:
        code, desc, node, name, op = self._fake_fields
        return f"In node {node} with name: {name} and operator: {op} (parseGraph): {code.name}: {desc}"


class OnnxParserImpl(StrictBase):
    _fake_impl = True

    def __init__(self, network: Any, logger: Any) -> None:
        self._fake_network = network
        self._fake_logger = logger
        self._fake_errors: list[Any] = []

    def _fake_error(self, code: str, desc: str, node: int = -1, name: str = "", op: str = "") -> None:
        mod = type(self)._fake_module
        self._fake_errors.append(mod._fake_cls("ParserError")._fake_new(mod._fake_enum("ErrorCode", code), desc, node, name, op))

    def parse(self, model: Any, path: str | None = None) -> bool:
        return self._fake_parse(bytes(memoryview(model)))

    def _fake_parse(self, data: bytes) -> bool:
        import onnx

        try:
            proto = onnx.load_from_string(data)
        except Exception:  # protobuf's DecodeError and friends: not an ONNX file
            self._fake_error("MODEL_DESERIALIZE_FAILED", "Failed to parse ONNX model from the buffer.")
            return False
        if not proto.graph.node:
            self._fake_error("INVALID_GRAPH", "The graph has no nodes.")
        mod = type(self)._fake_module
        tensor_cls = mod._fake_cls("ITensor")
        initializers = {i.name for i in proto.graph.initializer}
        net = self._fake_network

        def tensor(vi: Any, is_input: bool) -> Any:
            dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in vi.type.tensor_type.shape.dim)
            t = tensor_cls._fake_new(vi.name, dims, ONNX_TO_TRT.get(vi.type.tensor_type.elem_type, "FLOAT"))
            t._fake_is_input = is_input
            return t

        net._fake_inputs = [tensor(v, True) for v in proto.graph.input if v.name not in initializers]
        net._fake_outputs = [tensor(v, False) for v in proto.graph.output]
        net._fake_nodes = []
        for i, node in enumerate(proto.graph.node):
            name = node.name or f"node_of_{node.output[0]}"
            if node.op_type not in ONNX_SUPPORTED:
                self._fake_error("UNSUPPORTED_NODE", f"No importer registered for op: {node.op_type}.",
                                 i, name, node.op_type)
                continue
            net._fake_nodes.append({"name": name, "op": node.op_type})
        net._fake_onnx = data
        return not self._fake_errors

    def parse_from_file(self, model: str) -> bool:
        try:
            with open(model, "rb") as f:
                data = f.read()
        except OSError:
            self._fake_error("MODEL_DESERIALIZE_FAILED", f"Failed to open file: {model}")
            return False
        return self._fake_parse(data)

    @property
    def num_errors(self) -> int:
        return len(self._fake_errors)

    def get_error(self, index: int) -> Any:
        return self._fake_errors[index]

    def clear_errors(self) -> None:
        self._fake_errors = []


IMPLS: dict[str, type] = {"Dims": DimsImpl, "ITensor": ITensorImpl, "INetworkDefinition": INetworkDefinitionImpl,
                          "ParserError": ParserErrorImpl, "OnnxParser": OnnxParserImpl}
