"""The runtime half of the TensorRT double: Runtime, ICudaEngine, IExecutionContext, EngineInspector.

A fake plan is `MAGIC + header length + JSON header + ONNX bytes`. Deserializing checks what the
real runtime checks (magic tag, serialization version, compute capability) and logs the messages
tensorrt.md quotes from users' reports, returning None as the real binding does. Execution evaluates
the ONNX graph with onnx's reference evaluator on the bytes at the tensor addresses it was given
(host memory here: the double runs on CPU), so outputs are the network's real outputs.
"""

from __future__ import annotations

import ctypes
import json
import struct
from typing import Any

import numpy as np

from tests.doubles.strict import StrictBase

PLAN_MAGIC = b"FAKETRT-PLAN1\n"
NUMPY = {"FLOAT": np.float32, "HALF": np.float16, "INT32": np.int32, "INT64": np.int64, "INT8": np.int8,
         "BOOL": np.bool_, "UINT8": np.uint8}


def pack_plan(header: dict[str, Any], onnx_bytes: bytes) -> bytes:
    blob = json.dumps(header, sort_keys=True).encode()
    return PLAN_MAGIC + struct.pack("<Q", len(blob)) + blob + onnx_bytes


def unpack_plan(data: bytes) -> tuple[dict[str, Any], bytes] | None:
    if not data.startswith(PLAN_MAGIC):
        return None
    (n,) = struct.unpack_from("<Q", data, len(PLAN_MAGIC))
    start = len(PLAN_MAGIC) + 8
    return json.loads(data[start:start + n]), data[start + n:]


def serialization_tag(version: str) -> int:
    major, minor = version.split(".")[:2]
    return 200 + 10 * int(major) + int(minor)  # invented; only inequality matters


def _log(logger: Any, severity: str, msg: str) -> None:
    from tests.doubles.fake_tensorrt import log

    log(logger, severity, msg)


class RuntimeImpl(StrictBase):
    _fake_impl = True

    def __init__(self, logger: Any) -> None:
        self._fake_logger = logger

    @property
    def logger(self) -> Any:
        return self._fake_logger

    def deserialize_cuda_engine(self, serialized_engine: Any) -> Any:
        mod = type(self)._fake_module
        data = bytes(memoryview(serialized_engine))
        unpacked = unpack_plan(data)
        where = "IRuntime::deserializeCudaEngine: "
        if unpacked is None:
            _log(self._fake_logger, "ERROR", where + "Error Code 1: Serialization (Serialization assertion "
                 "magicTagRead == kMAGIC_TAG failed.Magic tag does not match)")
            return None
        header, onnx_bytes = unpacked
        current, built = serialization_tag(mod._fake_version), serialization_tag(header["version"])
        if current != built or header["version"] != mod._fake_version:
            _log(self._fake_logger, "ERROR", where + "Error Code 1: Serialization (Serialization assertion "
                 "stdVersionRead == kSERIALIZATION_VERSION failed.Version tag does not match. Note: Current "
                 f"Version: {current}, Serialized Engine Version: {built})")
            return None
        cc = mod._fake_state["compute_capability"]
        if header["compute_capability"] != cc:
            _log(self._fake_logger, "ERROR", where + "Error Code 6: API Usage Error (The engine plan file is "
                 f"generated on an incompatible device, expecting compute {header['compute_capability']} got "
                 f"compute {cc}, please rebuild.)")
            _log(self._fake_logger, "ERROR", "2: [engine.cpp::deserializeEngine::1312] Error Code 2: Internal Error "
                 "(Assertion engine->deserialize(start, size, allocator, runtime) failed. )")
            return None
        engine = mod._fake_cls("ICudaEngine")._fake_new(header, onnx_bytes, data)
        engine._fake_logger = self._fake_logger
        return engine


class ICudaEngineImpl(StrictBase):
    _fake_impl = True

    def _fake_init(self, header: dict[str, Any], onnx_bytes: bytes, plan: bytes) -> None:
        self._fake_header, self._fake_onnx, self._fake_plan = header, onnx_bytes, plan
        self._fake_io = [(n, "INPUT", s, d) for n, s, d in header["inputs"]] + \
                        [(n, "OUTPUT", s, d) for n, s, d in header["outputs"]]

    def _fake_tensor(self, name: str) -> tuple[str, str, list[int], str]:
        for t in self._fake_io:
            if t[0] == name:
                return t
        raise RuntimeError(f"no tensor named {name}")  # the real API logs an error and returns a default

    @property
    def num_io_tensors(self) -> int:
        return len(self._fake_io)

    @property
    def num_layers(self) -> int:
        return len(self._fake_header["layers"])

    @property
    def num_optimization_profiles(self) -> int:
        return max(1, len(self._fake_header["profiles"]))

    @property
    def profiling_verbosity(self) -> Any:
        return type(self)._fake_module._fake_enum("ProfilingVerbosity", self._fake_header["verbosity"])

    def get_tensor_name(self, index: int) -> str:
        return self._fake_io[index][0]

    def get_tensor_mode(self, name: str) -> Any:
        return type(self)._fake_module._fake_enum("TensorIOMode", self._fake_tensor(name)[1])

    def get_tensor_shape(self, name: str) -> Any:
        return type(self)._fake_module._fake_cls("Dims")._fake_new(self._fake_tensor(name)[2])

    def get_tensor_dtype(self, name: str) -> Any:
        return type(self)._fake_module._fake_enum("DataType", self._fake_tensor(name)[3])

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[Any]:
        dims = type(self)._fake_module._fake_cls("Dims")
        shapes = self._fake_header["profiles"][profile_index].get(name) if self._fake_header["profiles"] else None
        if shapes is None:
            shapes = [self._fake_tensor(name)[2]] * 3
        return [dims._fake_new(s) for s in shapes]

    def serialize(self) -> Any:
        return type(self)._fake_module._fake_cls("IHostMemory")._fake_new(self._fake_plan)

    def create_execution_context(self, strategy: Any = None) -> Any:
        return type(self)._fake_module._fake_cls("IExecutionContext")._fake_new(self)

    def create_engine_inspector(self) -> Any:
        return type(self)._fake_module._fake_cls("EngineInspector")._fake_new(self)


class IExecutionContextImpl(StrictBase):
    _fake_impl = True

    def _fake_init(self, engine: Any) -> None:
        self._fake_engine = engine
        self._fake_profile = 0
        self._fake_shapes: dict[str, tuple[int, ...]] = {}
        self._fake_addresses: dict[str, int] = {}
        self._fake_out_shapes: dict[tuple[Any, ...], dict[str, tuple[int, ...]]] = {}
        self._fake_session: Any = None

    @property
    def engine(self) -> Any:
        return self._fake_engine

    @property
    def active_optimization_profile(self) -> int:
        return self._fake_profile

    def set_optimization_profile_async(self, profile_index: int, stream_handle: int) -> bool:
        if not 0 <= profile_index < max(1, len(self._fake_engine._fake_header["profiles"])):
            raise RuntimeError("Error in set optimization profile async.")
        self._fake_profile = profile_index
        self._fake_shapes = {}
        return True

    def set_input_shape(self, name: str, shape: Any) -> bool:
        shape = tuple(int(d) for d in shape)
        n, mode, static, _ = self._fake_engine._fake_tensor(name)
        profiles = self._fake_engine._fake_header["profiles"]
        lo, _, hi = profiles[self._fake_profile][name] if profiles and name in profiles[self._fake_profile] else (static,) * 3
        if mode != "INPUT" or len(shape) != len(static) or any(not a <= s <= b for a, s, b in zip(lo, shape, hi, strict=True)):
            _log(self._fake_engine._fake_logger, "ERROR", f"IExecutionContext::setInputShape: Error Code 3: "
                 f"API Usage Error (Given shape {shape} for {name} is outside profile {self._fake_profile}: "
                 f"min {lo}, max {hi})")
            return False
        self._fake_shapes[name] = shape
        return True

    def _fake_inputs(self) -> list[tuple[str, str, list[int], str]]:
        return [t for t in self._fake_engine._fake_io if t[1] == "INPUT"]

    @property
    def all_binding_shapes_specified(self) -> bool:
        return self._fake_all_specified()

    def _fake_all_specified(self) -> bool:
        return all(n in self._fake_shapes or -1 not in s for n, _, s, _ in self._fake_inputs())

    def _fake_input_shape(self, name: str, static: list[int]) -> tuple[int, ...]:
        return self._fake_shapes.get(name, tuple(static))

    def get_tensor_shape(self, name: str) -> Any:
        n, mode, static, _ = self._fake_engine._fake_tensor(name)
        dims = type(self)._fake_module._fake_cls("Dims")
        if mode == "INPUT":
            return dims._fake_new(self._fake_input_shape(name, static))
        if not self._fake_all_specified():
            return dims._fake_new(static)
        key = tuple(sorted(self._fake_shapes.items()))
        if key not in self._fake_out_shapes:  # shape inference by evaluating once on zeros
            feeds = {t[0]: np.zeros(self._fake_input_shape(t[0], t[2]), NUMPY[t[3]]) for t in self._fake_inputs()}
            outs = self._fake_run(feeds)
            self._fake_out_shapes[key] = {k: tuple(v.shape) for k, v in outs.items()}
        return dims._fake_new(self._fake_out_shapes[key][name])

    def set_tensor_address(self, name: str, memory: int) -> bool:
        self._fake_engine._fake_tensor(name)
        self._fake_addresses[name] = int(memory)
        return True

    def get_tensor_address(self, name: str) -> int:
        return self._fake_addresses.get(name, 0)

    def _fake_run(self, feeds: dict[str, Any]) -> dict[str, Any]:
        import onnx
        from onnx.reference import ReferenceEvaluator

        if self._fake_session is None:
            self._fake_session = ReferenceEvaluator(onnx.load_from_string(self._fake_engine._fake_onnx))
        outs = self._fake_session.run(None, feeds)
        return {name: np.asarray(v) for name, v in zip(self._fake_session.output_names, outs, strict=True)}

    def execute_async_v3(self, stream_handle: int) -> bool:
        mod = type(self)._fake_module
        missing = [t[0] for t in self._fake_engine._fake_io if not self._fake_addresses.get(t[0])]
        if missing or not self._fake_all_specified():
            _log(self._fake_engine._fake_logger, "ERROR", "IExecutionContext::enqueueV3: Error Code 3: API Usage Error "
                 f"(Parameter check failed: addresses or shapes missing for {missing or 'dynamic inputs'})")
            return False
        feeds = {}
        for name, _, static, dtype in self._fake_inputs():
            shape = self._fake_input_shape(name, static)
            feeds[name] = _view(self._fake_addresses[name], shape, NUMPY[dtype]).copy()
        for name, value in self._fake_run(feeds).items():
            dtype = NUMPY[self._fake_engine._fake_tensor(name)[3]]
            np.copyto(_view(self._fake_addresses[name], value.shape, dtype), value.astype(dtype))
        mod._fake_state["executions"] += 1
        return True


def _view(address: int, shape: tuple[int, ...], dtype: Any) -> Any:
    count = int(np.prod(shape)) if shape else 1
    raw = (ctypes.c_byte * (count * np.dtype(dtype).itemsize)).from_address(address)
    return np.frombuffer(raw, dtype=dtype, count=count).reshape(shape)


class EngineInspectorImpl(StrictBase):
    _fake_impl = True

    def _fake_init(self, engine: Any) -> None:
        self._fake_engine = engine
        self._fake_context: Any = None

    @property
    def execution_context(self) -> Any:
        return self._fake_context

    @execution_context.setter
    def execution_context(self, value: Any) -> None:
        self._fake_context = value

    def _fake_layer(self, layer: dict[str, Any]) -> Any:
        verbosity = self._fake_engine._fake_header["verbosity"]
        if verbosity == "DETAILED":
            return {"Name": layer["name"], "LayerType": layer["type"], "TacticName": layer["tactic_name"],
                    "TacticValue": layer["tactic_value"]}
        return layer["name"] if verbosity == "LAYER_NAMES_ONLY" else None

    def get_layer_information(self, layer_index: int, format: Any) -> str:
        info = self._fake_layer(self._fake_engine._fake_header["layers"][layer_index])
        return json.dumps(info) if format.name == "JSON" else str(info)

    def get_engine_information(self, format: Any) -> str:
        header = self._fake_engine._fake_header
        layers = [x for x in (self._fake_layer(la) for la in header["layers"]) if x is not None]
        bindings = [t[0] for t in self._fake_engine._fake_io]
        if format.name == "JSON":
            return json.dumps({"Layers": layers, "Bindings": bindings})
        return "\n".join(str(la) for la in layers)


IMPLS: dict[str, type] = {"Runtime": RuntimeImpl, "ICudaEngine": ICudaEngineImpl,
                          "IExecutionContext": IExecutionContextImpl, "EngineInspector": EngineInspectorImpl}
