"""The TensorRT backend: an ONNX file -> a serialized TensorRT plan, for TensorRT 10.x and 11.x.

The entry holds `engine.plan`, `inspector.json` (the engine inspector's per-layer report: tactic
names when options.profiling_verbosity is 'detailed') and `engine.json` (versions, I/O tensors,
profiles, precision), which the loader reads before it touches TensorRT.

Precision: on 10.x a recipe precision other than 'onnx' sets the builder's precision flags (weak
typing, deprecated since 10.12); 'onnx' builds a strongly typed network that keeps the types the ONNX
file has. TensorRT 11 removed the precision flags (networks are always strongly typed), so there only
'onnx' is accepted: convert the model's types first (NVIDIA's ModelOpt AutoCast, or explicit Q/DQ).

Only names in TensorRT's API-surface lists are used (tests/doubles/trt_surface); where a name is not
in every 10.x (max_num_tactics is 10.4+), it is looked up only when the recipe asks for it.
"""

from __future__ import annotations

import difflib
import json
import time
from pathlib import Path
from typing import Any

from trtbuild.backends import BuildJob, BuildOutput, unavailable
from trtbuild.backends.tensorrt import common
from trtbuild.errors import InputError, TrtbuildError

OPTIONS = ("workspace_mib", "max_num_tactics", "profiling_verbosity")
VERBOSITY = {"layer_names_only": "LAYER_NAMES_ONLY", "detailed": "DETAILED", "none": "NONE"}
# tactics.level -> builder_optimization_level. 0 takes the first tactic that works (and ignores the
# timing cache), 3 is TensorRT's default, 5 compiles and compares the most kernels.
OPT_LEVEL = {"none": 0, "default": 3, "max": 5}
WEAK_FLAGS = {"fp16": ("FP16",), "bf16": ("BF16",), "fp8": ("FP8",), "int8": ("INT8",), "fp32": ()}
ENGINE_JSON = "engine.json"
INSPECTOR_JSON = "inspector.json"


class TensorRTBackend:
    name = "tensorrt"
    build_modules = ("trtbuild.backends.tensorrt.common",)  # the shared builder settings and timing cache

    def check(self, recipe: Any) -> list[str]:
        problems = []
        if recipe.model.kind != "onnx":
            problems.append("model.source: backend tensorrt builds from an .onnx file (model.source: path/to/model.onnx)")
        opts = recipe.options
        for key in opts:
            if key not in OPTIONS:
                close = difflib.get_close_matches(key, OPTIONS, n=1)
                hint = f"; did you mean '{close[0]}'?" if close else f"; known options: {', '.join(OPTIONS)}"
                problems.append(f"options.{key}: unknown option for backend tensorrt{hint}")
        for key in ("workspace_mib", "max_num_tactics"):
            value = opts.get(key)
            if key in opts and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                problems.append(f"options.{key}: expected a positive integer, got {value!r}")
        verbosity = opts.get("profiling_verbosity", "layer_names_only")
        if verbosity not in VERBOSITY:
            problems.append(f"options.profiling_verbosity: expected one of {', '.join(VERBOSITY)}, got {verbosity!r}")
        return problems

    def toolchain(self) -> dict[str, str]:
        trt = common.import_tensorrt()
        import torch

        return {"tensorrt": str(trt.__version__), "cuda": str(torch.version.cuda or "")}

    # -- build -----------------------------------------------------------------------------------
    def build(self, job: BuildJob) -> BuildOutput:
        trt = common.import_tensorrt()
        recipe, opts = job.recipe, job.recipe.options
        eleven = common.major_version(trt) >= 11
        if eleven and recipe.precision != "onnx":
            raise InputError(f"precision: {recipe.precision} needs TensorRT's precision flags, which TensorRT "
                             f"{trt.__version__} removed (networks are always strongly typed)",
                             hint="convert the ONNX model's types (e.g. with NVIDIA ModelOpt AutoCast) and set "
                                  "precision: onnx")
        logger = common.capturing_logger(trt)
        phases: dict[str, float] = {}

        t = time.perf_counter()
        builder = trt.Builder(logger)
        strongly_typed = eleven or recipe.precision == "onnx"
        # 11.x ignores the flag (always strongly typed); on 10.x it is the only way to keep ONNX types.
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strongly_typed and not eleven else 0
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, logger)
        onnx_path = job.model.materialize()
        job.progress(f"parsing {onnx_path.name}")
        if not parser.parse_from_file(str(onnx_path)):
            raise InputError(f"{onnx_path}: TensorRT's ONNX parser rejected the model:\n"
                             + "\n".join(f"  {line}" for line in _parser_errors(parser)),
                             hint="every line names the ONNX node and why it failed")
        phases["parse_s"] = time.perf_counter() - t

        config = builder.create_builder_config()
        if "workspace_mib" in opts:
            config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(opts["workspace_mib"]) << 20)
        config.builder_optimization_level = OPT_LEVEL[recipe.tactics_level]
        if "max_num_tactics" in opts:
            _set_max_num_tactics(trt, config, int(opts["max_num_tactics"]))
        verbosity = opts.get("profiling_verbosity", "layer_names_only")
        config.profiling_verbosity = getattr(trt.ProfilingVerbosity, VERBOSITY[verbosity])
        if not strongly_typed:
            for flag in WEAK_FLAGS[recipe.precision]:
                config.set_flag(getattr(trt.BuilderFlag, flag))
        inputs = [network.get_input(i) for i in range(network.num_inputs)]
        profiles = _add_profiles(builder, config, inputs, recipe.shapes)

        cache_info = common.load_into(config, logger, common.read_snapshot(job.tactics))
        job.progress(f"building the TensorRT engine (optimization level {config.builder_optimization_level})")
        t = time.perf_counter()
        plan = builder.build_serialized_network(network, config)
        if plan is None:  # the reason is only in the logger
            raise TrtbuildError("TensorRT could not build the engine: " + "; ".join(logger.errors()[-5:]),
                                hint="see the messages above; a smaller workspace_mib or tactics.level can also fail")
        phases["build_s"] = time.perf_counter() - t
        (job.workdir / "engine.plan").write_bytes(memoryview(plan))

        t = time.perf_counter()
        cache_info |= common.merge_back(config, logger, job.tactics, config.get_timing_cache())
        phases["timing_cache_s"] = time.perf_counter() - t

        t = time.perf_counter()
        layers, sidecar = _inspect(trt, logger, plan)
        (job.workdir / INSPECTOR_JSON).write_text(json.dumps(sidecar.pop("_inspector"), indent=2) + "\n")
        phases["inspect_s"] = time.perf_counter() - t
        versions = self.toolchain()
        sidecar |= {"tensorrt": versions["tensorrt"], "precision": recipe.precision, "strongly_typed": strongly_typed,
                    "profiles": profiles, "verbosity": verbosity}
        (job.workdir / ENGINE_JSON).write_text(json.dumps(sidecar, indent=2, sort_keys=True) + "\n")
        tactics = {"level": recipe.tactics_level, "builder_optimization_level": OPT_LEVEL[recipe.tactics_level],
                   "max_num_tactics": opts.get("max_num_tactics"), "timing_cache": cache_info, "layers": layers}
        return BuildOutput(phases=phases, tactics=tactics,
                           extra={"versions": versions, "gpu": job.device, "plan_bytes": int(plan.nbytes)})

    def load(self, entry: Path, manifest: dict[str, Any]) -> Any:
        from trtbuild.backends.tensorrt.runtime import TensorRTEngine

        return TensorRTEngine(entry, manifest)


def _parser_errors(parser: Any) -> list[str]:
    out = []
    for i in range(parser.num_errors):
        e = parser.get_error(i)
        where = f"node {e.node()} ({e.node_name() or '?'}, op {e.node_operator() or '?'})" if e.node() >= 0 else "model"
        out.append(f"{where}: {e.code().name}: {e.desc()}")
    return out


def _set_max_num_tactics(trt: Any, config: Any, n: int) -> None:
    try:
        config.max_num_tactics = n
    except AttributeError:  # not a property before 10.4
        raise InputError(f"options.max_num_tactics: needs TensorRT 10.4 or newer; this is {trt.__version__}") from None


def _add_profiles(builder: Any, config: Any, inputs: list[Any], shapes: Any) -> list[dict[str, Any]]:
    """One optimization profile per batch bucket. A dynamic first dimension is the batch (bucket b
    covers the batches above the previous bucket up to b); any other dynamic dimension is a sequence
    length: min 1, opt shapes.max_input_len, max shapes.max_seq_len."""
    dynamic = [t for t in inputs if -1 in tuple(t.shape)]
    if not dynamic:
        return []
    out, low = [], 1
    for bucket in shapes.batch_buckets:
        profile = builder.create_optimization_profile()
        described: dict[str, list[list[int]]] = {}
        for t in dynamic:
            dims = tuple(t.shape)
            rows = []
            for _which, batch, seq in (("min", low, 1), ("opt", bucket, shapes.max_input_len),
                                       ("max", bucket, shapes.max_seq_len)):
                rows.append([batch if i == 0 and d == -1 else seq if d == -1 else d for i, d in enumerate(dims)])
            profile.set_shape(t.name, *rows)
            described[t.name] = rows
        if config.add_optimization_profile(profile) < 0:
            raise TrtbuildError(f"TensorRT rejected the optimization profile for batch bucket {bucket}: {described}")
        out.append({"batch": bucket, "shapes": described})
        low = bucket + 1
    return out


def _inspect(trt: Any, logger: Any, plan: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per-layer tactics from the engine inspector, and the I/O table the loader checks against."""
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(plan)
    if engine is None:
        raise common.classify_deserialize_failure(logger.errors())
    info = json.loads(engine.create_engine_inspector().get_engine_information(trt.LayerInformationFormat.JSON))
    layers = [{"name": la.get("Name"), "type": la.get("LayerType"), "tactic": la.get("TacticName"),
               "tactic_value": la.get("TacticValue")} if isinstance(la, dict) else {"name": la}
              for la in info.get("Layers", [])]
    io = []
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        io.append({"name": name, "mode": engine.get_tensor_mode(name).name, "dtype": engine.get_tensor_dtype(name).name,
                   "shape": list(engine.get_tensor_shape(name))})
    return layers, {"io": io, "num_layers": int(engine.num_layers), "inspector": INSPECTOR_JSON, "_inspector": info}
