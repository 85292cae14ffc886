"""A strict double of the `tensorrt` Python module (build side), in three API flavours.

Flavours: "10.x" is the portable 10.x subset (`tensorrt_api_surface_10x_common.json`, names present
in every tag 10.0.0-10.16.1), "10.16" is TensorRT 10.16.1 (`tensorrt_api_surface.json`), "11.1" is
TensorRT 11.1 (`tensorrt_api_surface_11.1.json`). Those lists were extracted from NVIDIA/TensorRT's
pybind11 sources (commits in `trt_surface/tensorrt_api_surface_meta.json`); strict.py enforces them.

What it models, enough for a build to write plausible files and a run to compute real outputs:
- OnnxParser reads a real ONNX file (the `onnx` package) and reports unsupported ops as ParserErrors
  with node index, name and operator;
- Builder.build_serialized_network validates profiles, precision flags against strong typing and
  the optimization level, "times" one tactic per ONNX node through the timing cache (hits and misses
  are counted in `module._fake_state`) and returns an IHostMemory holding a fake plan;
- the plan records the version, compute capability, I/O tensors, profiles and chosen tactics, and
  carries the ONNX bytes, so the runtime double (fake_trt_runtime.py) can evaluate the network with
  onnx's reference evaluator on the bytes at the addresses it is given.
Wording of log messages copies the real ones only where tensorrt.md quotes them.
"""

from __future__ import annotations

import hashlib
import json
import types
from typing import Any

from tests.doubles import fake_trt_runtime as rt
from tests.doubles.strict import FakeEnum, Recorder, StrictBase, StrictMeta, Surface

FLAVOURS: dict[str, tuple[str, str, tuple[int, ...], bool]] = {
    # flavour: (surface file, __version__, version for signature filtering, is 11.x)
    "10.x": ("tensorrt_api_surface_10x_common.json", "10.0.1.6", (10, 0, 0), False),
    "10.16": ("tensorrt_api_surface.json", "10.16.1.11", (10, 16, 1), False),
    "11.1": ("tensorrt_api_surface_11.1.json", "11.1.0.10", (11, 1, 0), True),
}
TC_MAGIC = b"FAKETRT-TIMINGCACHE1\n"
WEAK_PRECISION_FLAGS = ("FP16", "BF16", "INT8", "FP8")
ONNX_SUPPORTED = {"Add", "Cast", "Gather", "Gemm", "Identity", "MatMul", "Mul", "Relu", "Reshape", "Softmax",
                  "Sub", "Tanh", "Transpose", "Sigmoid", "Div"}
ONNX_TO_TRT = {1: "FLOAT", 10: "HALF", 16: "BF16", 6: "INT32", 7: "INT64", 3: "INT8", 9: "BOOL", 2: "UINT8"}


def log(logger: Any, severity: str, msg: str) -> None:
    """Send a message to the user's logger, as the library does (not counted as a use of the API)."""
    mod = type(logger)._fake_module
    with mod._fake_recorder.quiet():
        logger.log(getattr(mod.ILogger.Severity, severity), msg)


class ILoggerImpl(StrictBase):
    _fake_impl = True

    def __init__(self) -> None:
        pass

    def log(self, severity: Any, msg: str) -> None:
        raise RuntimeError('Tried to call pure virtual function "ILogger::log"')


class LoggerImpl(ILoggerImpl):
    _fake_impl = True

    def __init__(self, min_severity: Any = None) -> None:
        self._fake_min = min_severity if min_severity is not None else type(self)._fake_module._fake_enum("ILogger.Severity", "WARNING")

    @property
    def min_severity(self) -> Any:
        return self._fake_min

    @min_severity.setter
    def min_severity(self, value: Any) -> None:
        self._fake_min = value

    def log(self, severity: Any, msg: str) -> None:
        if int(severity) <= int(self._fake_min):
            print(f"[TRT] [{severity.name[0]}] {msg}")


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
        import onnx

        data = bytes(memoryview(model))
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
        return self.parse(data)

    @property
    def num_errors(self) -> int:
        return len(self._fake_errors)

    def get_error(self, index: int) -> Any:
        return self._fake_errors[index]

    def clear_errors(self) -> None:
        self._fake_errors = []


class IOptimizationProfileImpl(StrictBase):
    _fake_impl = True

    def _fake_init(self) -> None:
        self._fake_shapes: dict[str, tuple[tuple[int, ...], ...]] = {}

    def set_shape(self, input: str, min: Any, opt: Any, max: Any) -> None:
        shapes = tuple(tuple(int(d) for d in s) for s in (min, opt, max))
        if len({len(s) for s in shapes}) != 1 or any(a > b for lo, hi in ((shapes[0], shapes[1]), (shapes[1], shapes[2]))
                                                      for a, b in zip(lo, hi)):
            raise RuntimeError("Shape provided for min|opt|max is inconsistent with other shapes.")
        self._fake_shapes[input] = shapes

    def get_shape(self, input: str) -> list[Any]:
        dims = type(self)._fake_module._fake_cls("Dims")
        return [dims._fake_new(s) for s in self._fake_shapes.get(input, ())]

    def __bool__(self) -> bool:
        return bool(self._fake_shapes)


class ITimingCacheImpl(StrictBase):
    _fake_impl = True

    def _fake_init(self, version: str, cc: str, entries: dict[str, list[Any]]) -> None:
        self._fake_version, self._fake_cc, self._fake_entries = version, cc, dict(entries)

    def serialize(self) -> Any:
        doc = {"version": self._fake_version, "compute_capability": self._fake_cc, "entries": self._fake_entries}
        return type(self)._fake_module._fake_cls("IHostMemory")._fake_new(TC_MAGIC + json.dumps(doc, sort_keys=True).encode())

    def combine(self, input_cache: Any, ignore_mismatch: bool) -> bool:
        if input_cache._fake_version != self._fake_version:
            return False  # "must be generated by a TensorRT build of exact same version"
        if input_cache._fake_cc != self._fake_cc and not ignore_mismatch:
            return False
        for key, value in input_cache._fake_entries.items():
            self._fake_entries.setdefault(key, value)  # conflicting entries are skipped
        return True

    def reset(self) -> bool:
        self._fake_entries = {}
        return True


class IHostMemoryImpl(StrictBase, bytes):
    """Buffer protocol like the real one (bytes(), write, hashlib, memoryview); no len(), no indexing."""

    _fake_impl = True

    @property
    def nbytes(self) -> int:
        return bytes.__len__(self)

    def __len__(self) -> int:
        raise TypeError("object of type 'tensorrt.tensorrt.IHostMemory' has no len()")

    def __getitem__(self, i: Any) -> Any:
        raise TypeError("'tensorrt.tensorrt.IHostMemory' object is not subscriptable")

    def __iter__(self) -> Any:
        raise TypeError("'tensorrt.tensorrt.IHostMemory' object is not iterable")


class IBuilderConfigImpl(StrictBase):
    _fake_impl = True

    def _fake_init(self) -> None:
        self._fake_flags: set[int] = set()
        self._fake_profiles: list[Any] = []
        self._fake_pools: dict[int, int] = {}
        self._fake_cache: Any = None
        self._fake_level = 3
        self._fake_tactics = -1
        self._fake_verbosity = type(self)._fake_module._fake_enum("ProfilingVerbosity", "LAYER_NAMES_ONLY")
        self._fake_avg = 1

    def set_flag(self, flag: Any) -> None:
        self._fake_flags.add(int(flag))

    def clear_flag(self, flag: Any) -> None:
        self._fake_flags.discard(int(flag))

    def get_flag(self, flag: Any) -> bool:
        return int(flag) in self._fake_flags

    def set_memory_pool_limit(self, pool: Any, pool_size: int) -> None:
        self._fake_pools[int(pool)] = int(pool_size)

    def get_memory_pool_limit(self, pool: Any) -> int:
        return self._fake_pools.get(int(pool), 80 << 30)

    def add_optimization_profile(self, profile: Any) -> int:
        if not profile._fake_shapes:
            return -1
        self._fake_profiles.append(profile)
        return len(self._fake_profiles) - 1

    @property
    def num_optimization_profiles(self) -> int:
        return len(self._fake_profiles)

    @property
    def builder_optimization_level(self) -> int:
        return self._fake_level

    @builder_optimization_level.setter
    def builder_optimization_level(self, value: int) -> None:
        self._fake_level = int(value)

    @property
    def max_num_tactics(self) -> int:
        return self._fake_tactics

    @max_num_tactics.setter
    def max_num_tactics(self, value: int) -> None:
        self._fake_tactics = int(value)

    @property
    def avg_timing_iterations(self) -> int:
        return self._fake_avg

    @avg_timing_iterations.setter
    def avg_timing_iterations(self, value: int) -> None:
        self._fake_avg = int(value)

    @property
    def profiling_verbosity(self) -> Any:
        return self._fake_verbosity

    @profiling_verbosity.setter
    def profiling_verbosity(self, value: Any) -> None:
        self._fake_verbosity = value

    def create_timing_cache(self, serialized_timing_cache: Any) -> Any:
        mod = type(self)._fake_module
        data = bytes(memoryview(serialized_timing_cache))
        cache_cls = mod._fake_cls("ITimingCache")
        fresh = cache_cls._fake_new(mod._fake_version, mod._fake_state["compute_capability"], {})
        if not data:
            return fresh
        try:
            if not data.startswith(TC_MAGIC):
                raise ValueError
            doc = json.loads(data[len(TC_MAGIC):])
            return cache_cls._fake_new(doc["version"], doc["compute_capability"], doc["entries"])
        except (ValueError, KeyError):
            logger = self._fake_builder._fake_logger
            log(logger, "ERROR", "1: [cache.cpp::deserialize] Error Code 1: Serialization (Serialization assertion "
                "magicTagRead == kMAGIC_TAG failed.Magic tag does not match)")
            log(logger, "ERROR", "4: The timing cache will not be used!")
            return fresh  # assumption: the double hands back an empty cache rather than None

    def set_timing_cache(self, cache: Any, ignore_mismatch: bool) -> bool:
        mod = type(self)._fake_module
        logger = self._fake_builder._fake_logger
        if cache._fake_version != mod._fake_version:
            log(logger, "ERROR", "Timing cache was created by a different TensorRT version.")
            return False
        if cache._fake_cc != mod._fake_state["compute_capability"] and not ignore_mismatch:
            log(logger, "ERROR", "Timing cache was created on a device with different CUDA device properties.")
            return False
        self._fake_cache = cache
        return True

    def get_timing_cache(self) -> Any:
        return self._fake_cache


class BuilderImpl(StrictBase):
    _fake_impl = True

    def __init__(self, logger: Any) -> None:
        self._fake_logger = logger

    @property
    def logger(self) -> Any:
        return self._fake_logger

    def create_network(self, flags: int = 0) -> Any:
        return type(self)._fake_module._fake_cls("INetworkDefinition")._fake_new(int(flags))

    def create_builder_config(self) -> Any:
        config = type(self)._fake_module._fake_cls("IBuilderConfig")._fake_new()
        config._fake_builder = self
        return config

    def create_optimization_profile(self) -> Any:
        return type(self)._fake_module._fake_cls("IOptimizationProfile")._fake_new()

    def build_serialized_network(self, network: Any, config: Any) -> Any:
        return build_plan(type(self)._fake_module, self._fake_logger, network, config)


def build_plan(mod: Any, logger: Any, network: Any, config: Any) -> Any:
    """What the fake builder checks and records; returns IHostMemory, or None after logging, as TRT does."""
    state = mod._fake_state
    strongly_typed = mod._fake_eleven or bool(network._fake_flags & (1 << int(mod._fake_enum("NetworkDefinitionCreationFlag", "STRONGLY_TYPED"))))
    weak_flags = {mod._fake_enum("BuilderFlag", f)._fake_value for f in WEAK_PRECISION_FLAGS
                  if mod._fake_surface.has("BuilderFlag", f)}
    if strongly_typed and config._fake_flags & weak_flags:
        log(logger, "ERROR", "Error Code 3: API Usage Error (precision builder flags are not allowed "
            "for strongly typed networks)")
        return None
    if not 0 <= config._fake_level <= 5:
        log(logger, "ERROR", f"Error Code 3: API Usage Error (builder optimization level {config._fake_level} "
            "is outside 0..5)")
        return None
    dynamic = [t for t in network._fake_inputs if -1 in t._fake_shape]
    if dynamic and not config._fake_profiles:
        log(logger, "ERROR", "Network has dynamic or shape inputs, but no optimization profile has been defined.")
        return None
    for i, profile in enumerate(config._fake_profiles):
        for t in dynamic:
            shapes = profile._fake_shapes.get(t._fake_name_)
            if shapes is None or any(len(s) != len(t._fake_shape) or any(d not in (-1, v) for d, v in zip(t._fake_shape, s))
                                     for s in shapes):
                log(logger, "ERROR", f"Error Code 4: API Usage Error (optimization profile {i} has no valid "
                    f"dimensions for input {t._fake_name_})")
                return None
    cache = config._fake_cache
    use_cache = cache is not None and config._fake_level > 0  # level 0 "will not respect a timing cache"
    cc = state["compute_capability"]
    layers = []
    for node in network._fake_nodes:
        material = json.dumps([node["op"], sorted(config._fake_flags), [p._fake_shapes for p in config._fake_profiles],
                               [t._fake_shape for t in network._fake_inputs]], sort_keys=True)
        key = "0x" + hashlib.sha256(material.encode()).hexdigest()[:32]
        if use_cache and key in cache._fake_entries:
            state["cache_hits"] += 1
            tactic = cache._fake_entries[key][0]
        else:
            state["timed"] += 1
            tactic = "0x" + hashlib.sha256((material + cc).encode()).hexdigest()[:16]
            if cache is not None:
                cache._fake_entries[key] = [tactic, 0.01]
        layers.append({"name": node["name"], "type": "gemm" if node["op"] in ("MatMul", "Gemm") else node["op"],
                       "tactic_name": f"sm{cc.replace('.', '')}_fake_{node['op'].lower()}_kernel",
                       "tactic_value": tactic})
    state["builds"] += 1
    header = {
        "version": mod._fake_version, "compute_capability": cc, "strongly_typed": strongly_typed,
        "flags": sorted(config._fake_flags), "level": config._fake_level, "max_num_tactics": config._fake_tactics,
        "verbosity": config._fake_verbosity.name, "layers": layers,
        "inputs": [[t._fake_name_, list(t._fake_shape), t._fake_dtype] for t in network._fake_inputs],
        "outputs": [[t._fake_name_, list(t._fake_shape), t._fake_dtype] for t in network._fake_outputs],
        "profiles": [{k: [list(s) for s in v] for k, v in p._fake_shapes.items()} for p in config._fake_profiles],
    }
    return mod._fake_cls("IHostMemory")._fake_new(rt.pack_plan(header, network._fake_onnx))


IMPLS: dict[str, type] = {
    "ILogger": ILoggerImpl, "Logger": LoggerImpl, "Dims": DimsImpl, "ITensor": ITensorImpl,
    "INetworkDefinition": INetworkDefinitionImpl, "ParserError": ParserErrorImpl, "OnnxParser": OnnxParserImpl,
    "IOptimizationProfile": IOptimizationProfileImpl, "ITimingCache": ITimingCacheImpl, "IHostMemory": IHostMemoryImpl,
    "IBuilderConfig": IBuilderConfigImpl, "Builder": BuilderImpl, **rt.IMPLS,
}


class FakeModule(types.ModuleType):
    """`import tensorrt`: only the names of the flavour's module namespace exist."""

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("__") and name != "__version__" or name.startswith("_fake"):
            return super().__getattribute__(name)
        surface: Surface = super().__getattribute__("_fake_surface")
        if name not in surface.members["tensorrt"]:
            raise AttributeError(f"module 'tensorrt' has no attribute '{name}'")
        super().__getattribute__("_fake_recorder").add(f"tensorrt.{name}")
        try:
            return super().__getattribute__(name)
        except AttributeError:
            raise NotImplementedError(f"the TensorRT double does not model tensorrt.{name}") from None

    def _fake_cls(self, name: str) -> Any:
        return super().__getattribute__("_fake_classes")[name]

    def _fake_enum(self, enum: str, member: str) -> Any:
        """An enum value for the double's own use: not counted, and missing members still raise."""
        try:
            return vars(self._fake_cls(enum))[member]
        except KeyError:
            raise AttributeError(f"type object 'tensorrt.tensorrt.{enum}' has no attribute '{member}'") from None


def make_tensorrt(flavour: str = "10.16", compute_capability: str = "9.0") -> FakeModule:
    """A fresh `tensorrt` double of one flavour; install it with monkeypatch.setitem(sys.modules, ...)."""
    surface_file, version, vtuple, eleven = FLAVOURS[flavour]
    surface = Surface(surface_file, vtuple, eleven)
    mod = FakeModule("tensorrt")
    recorder = Recorder()
    classes: dict[str, Any] = {}
    common = {"_fake_generated": True, "_fake_surface": surface, "_fake_recorder": recorder, "_fake_module": mod,
              "__module__": "tensorrt.tensorrt"}
    names = [n for n in surface.members["tensorrt"] if n[:1].isupper()] + ["ILogger.Severity"]
    for name in names:
        if surface.is_enum(name):
            cls = StrictMeta(name.split(".")[-1], (FakeEnum,), {**common, "_fake_name": name})
            values = surface.enum_values(name)
            members = {n: cls._fake_new(n, v) for n, v in values.items()}
            for n, member in members.items():
                type.__setattr__(cls, n, member)
            type.__setattr__(cls, "__members__", dict(members))
        else:
            cls = StrictMeta(name, (IMPLS.get(name, StrictBase),), {**common, "_fake_name": name})
        classes[name] = cls
    severity = classes["ILogger.Severity"]
    for logger_cls in (classes["ILogger"], classes["Logger"]):
        type.__setattr__(logger_cls, "Severity", severity)
        for n, member in severity.__members__.items():  # export_values() puts them on the class too
            type.__setattr__(logger_cls, n, member)
    for attr, value in {"_fake_surface": surface, "_fake_recorder": recorder, "_fake_classes": classes,
                        "_fake_eleven": eleven, "__version__": version, "_fake_version": version,
                        "_fake_state": {"compute_capability": compute_capability, "builds": 0, "timed": 0,
                                        "cache_hits": 0, "executions": 0}}.items():
        mod.__dict__[attr] = value
    for name, cls in classes.items():
        if "." not in name:
            mod.__dict__[name] = cls
    for alias, member in {"float32": "FLOAT", "float16": "HALF", "bfloat16": "BF16", "int8": "INT8", "int32": "INT32",
                          "int64": "INT64", "bool": "BOOL", "uint8": "UINT8", "fp8": "FP8"}.items():
        mod.__dict__[alias] = vars(classes["DataType"])[member]
    return mod
