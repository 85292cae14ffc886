"""The TensorRT-LLM backend: TensorRT-LLM's TensorRT-engine flow (0.12 - 1.2), through its LLM API.

Build: a Hugging Face-format folder (hub snapshot, local folder or a synthetic checkpoint) goes to
the TensorRT-engine `LLM` with a `BuildConfig` from the recipe's shapes and a `QuantConfig` from its
precision; `llm.save()` writes `config.json` + `rank{N}.engine` (+ tokenizer files) into the entry.
TensorRT's timing cache comes from the store's tactic cache: a private copy is passed as both the
input and the output timing cache (absolute path, so nothing lands in the working directory), and
what the build measured is merged back under the tactic cache's lock.

Run: the same `LLM` class loads the engine folder (no rebuild: the folder is detected as an engine);
generation streams token ids, and the per-token arrival times give time to first token and time per
output token. TensorRT-LLM 1.3 removed this flow; the error says so.
"""

from __future__ import annotations

import difflib
import json
import re
import shutil
import time
import types
import uuid
from itertools import pairwise
from pathlib import Path
from typing import Any

from trtbuild.backends import BuildJob, BuildOutput, Generation, unavailable
from trtbuild.backends.tensorrt import common
from trtbuild.errors import TrtbuildError
from trtbuild.store.tactics import write_atomic

OPTIONS = ("pp", "max_num_tokens", "opt_batch_size", "gemm_plugin", "multiple_profiles",
           "use_paged_context_fmha", "kv_cache_dtype", "dtype", "trust_remote_code")
QUANT_ALGO = {"fp8": "FP8", "int8_wo": "W8A16", "int4_wo": "W4A16", "int4_awq": "W4A16_AWQ"}
DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
GEMM_PLUGIN = ("auto", "float16", "float32", "bfloat16", "fp8", "disable")
NEEDS_CALIBRATION = ("fp8", "int4_awq")  # ModelOpt calibration (a dataset download); weight-only needs none


class TensorRTLLMBackend:
    name = "tensorrt-llm"
    build_modules = ("trtbuild.backends.tensorrt.common",)  # the shared builder settings and timing cache

    def check(self, recipe: Any) -> list[str]:
        problems = []
        opts = recipe.options
        if recipe.model.kind == "onnx":
            problems.append("model.source: backend tensorrt-llm builds from a Hugging Face model, not ONNX "
                            "(use backend: tensorrt for .onnx files)")
        for key in opts:
            if key == "tp":  # every backend reads the rank count from one recipe field
                problems.append("options.tp: moved to the recipe's parallel.tp (parallel: {tp: N})")
            elif key not in OPTIONS:
                close = difflib.get_close_matches(key, OPTIONS, n=1)
                hint = f"; did you mean '{close[0]}'?" if close else f"; known options: {', '.join(OPTIONS)}"
                problems.append(f"options.{key}: unknown option for backend tensorrt-llm{hint}")
        for key in ("pp", "max_num_tokens", "opt_batch_size"):
            value = opts.get(key)
            if key in opts and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                problems.append(f"options.{key}: expected a positive integer, got {value!r}")
        obs = opts.get("opt_batch_size")
        if isinstance(obs, int) and not isinstance(obs, bool) and obs > recipe.shapes.max_batch_size:
            problems.append(f"options.opt_batch_size: {obs} exceeds shapes.max_batch_size {recipe.shapes.max_batch_size}")
        for key in ("multiple_profiles", "use_paged_context_fmha", "trust_remote_code"):
            if key in opts and not isinstance(opts[key], bool):
                problems.append(f"options.{key}: expected true or false, got {opts[key]!r}")
        gemm = opts.get("gemm_plugin")
        if "gemm_plugin" in opts and gemm not in GEMM_PLUGIN:
            problems.append(f"options.gemm_plugin: expected one of {', '.join(GEMM_PLUGIN)}, got {gemm!r}")
        elif gemm == "fp8" and recipe.precision != "fp8":
            problems.append(f"options.gemm_plugin: 'fp8' needs precision: fp8, got {recipe.precision}")
        if opts.get("kv_cache_dtype", "auto") not in ("auto", "fp8"):
            problems.append(f"options.kv_cache_dtype: expected auto or fp8, got {opts['kv_cache_dtype']!r}")
        if "dtype" in opts:
            if recipe.precision in DTYPES:
                problems.append(f"options.dtype: only for quantized precisions; precision {recipe.precision} "
                                f"already means {DTYPES[recipe.precision]}")
            elif opts["dtype"] not in ("auto", "float16", "bfloat16"):
                problems.append(f"options.dtype: expected auto, float16 or bfloat16, got {opts['dtype']!r}")
        if len(recipe.shapes.batch_buckets) > 1:
            problems.append("shapes.batch_buckets: tensorrt-llm makes its own optimization profiles; give one bucket "
                            "(max_batch_size) and use options.opt_batch_size / options.multiple_profiles")
        if recipe.tactics_level != "default":
            problems.append(f"tactics.level: tensorrt-llm's build API has no builder optimization level; "
                            f"only 'default' is possible, got '{recipe.tactics_level}'")
        return problems

    def toolchain(self) -> dict[str, str]:
        lib = _import()
        return dict(lib.versions)

    # -- build -----------------------------------------------------------------------------------
    def build(self, job: BuildJob) -> BuildOutput:
        lib = _import()
        recipe, opts, shapes = job.recipe, job.recipe.options, job.recipe.shapes
        plan = quant_plan(recipe.precision, opts)
        phases: dict[str, float] = {}
        folder = job.model.materialize()

        # A private copy of the store's cache: TensorRT-LLM overwrites its output file without a lock.
        own_cache = job.tactics.path / f".build-{uuid.uuid4().hex[:12]}.timing.cache"
        write_atomic(own_cache, common.read_snapshot(job.tactics))
        build_config = lib.BuildConfig(max_batch_size=shapes.max_batch_size, max_input_len=shapes.max_input_len,
                                       max_seq_len=shapes.max_seq_len, input_timing_cache=str(own_cache.absolute()),
                                       output_timing_cache=str(own_cache.absolute()))
        if "max_num_tokens" in opts:
            build_config.max_num_tokens = opts["max_num_tokens"]
        if "opt_batch_size" in opts:
            build_config.opt_batch_size = opts["opt_batch_size"]
        plugins = build_config.plugin_config
        if "gemm_plugin" in opts:
            plugins.gemm_plugin = None if opts["gemm_plugin"] == "disable" else opts["gemm_plugin"]
        for key in ("multiple_profiles", "use_paged_context_fmha"):
            if key in opts:
                setattr(plugins, key, opts[key])
        quant = lib.QuantConfig(
            quant_algo=getattr(lib.QuantAlgo, plan["quant_algo"]) if plan["quant_algo"] else None,
            kv_cache_quant_algo=getattr(lib.QuantAlgo, plan["kv_cache_quant_algo"]) if plan["kv_cache_quant_algo"] else None)
        workspace = job.workdir / ".llm-workspace"
        workspace.mkdir()
        job.progress(f"building TensorRT-LLM engines (tp {recipe.parallel.tp}, pp {opts.get('pp', 1)}, {recipe.precision})")
        t = time.perf_counter()
        try:
            llm = lib.LLM(model=str(folder), dtype=plan["dtype"], tensor_parallel_size=recipe.parallel.tp,
                          pipeline_parallel_size=opts.get("pp", 1), build_config=build_config, quant_config=quant,
                          workspace=str(workspace), trust_remote_code=opts.get("trust_remote_code", False))
            phases["llm_build_s"] = time.perf_counter() - t
            try:
                t = time.perf_counter()
                llm.save(str(job.workdir))
                phases["save_s"] = time.perf_counter() - t
                steps = [(str(label), float(sec)) for label, sec in getattr(llm.llm_build_stats, "build_steps_info", [])]
            finally:
                llm.shutdown()
            t = time.perf_counter()
            cache_info = _merge_timing_cache(own_cache, job)
            phases["timing_cache_s"] = time.perf_counter() - t
        finally:
            shutil.rmtree(workspace, ignore_errors=True)
            own_cache.unlink(missing_ok=True)
        for label, sec in steps:
            phases["step_" + re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_") + "_s"] = sec
        config = json.loads((job.workdir / "config.json").read_text())
        tactics = {"level": recipe.tactics_level, "timing_cache": cache_info,
                   "note": "TensorRT-LLM chooses tactics itself; only the timing cache is shared"}
        extra = {"versions": dict(lib.versions), "gpu": job.device, "quant": plan, "build_steps": steps,
                 "engine_config_version": config.get("version"), "calibrated": recipe.precision in NEEDS_CALIBRATION}
        return BuildOutput(phases=phases, tactics=tactics, extra=extra)

    def load(self, entry: Path, manifest: dict[str, Any]) -> "TensorRTLLMEngine":
        try:
            config = json.loads((entry / "config.json").read_text())
            mapping = config["pretrained_config"]["mapping"]
        except (OSError, ValueError, KeyError) as exc:
            raise TrtbuildError(f"engine entry {entry} has no readable TensorRT-LLM config.json ({exc})",
                                hint="rebuild it") from None
        tp, pp = int(mapping.get("tp_size", 1)), int(mapping.get("pp_size", 1))
        world = int(mapping.get("world_size", tp * pp))
        missing = [f"rank{n}.engine" for n in range(world) if not (entry / f"rank{n}.engine").is_file()]
        if missing:
            raise TrtbuildError(f"engine entry {entry} is incomplete: {', '.join(missing)} missing", hint="rebuild it")
        lib = _import()  # only now: the checks above need no library
        built = dict(manifest.get("backend_info", {}).get("versions", {})) or {"tensorrt_llm": config.get("version")}
        for name in ("tensorrt_llm", "tensorrt"):
            if built.get(name) and built[name] != lib.versions.get(name):
                raise common.IncompatibleEngineError(
                    "version_mismatch", f"the engine was built with {name} {built[name]}; installed is "
                    f"{lib.versions.get(name)}")
        return TensorRTLLMEngine(entry, lib, config, tp, pp)


def quant_plan(precision: str, options: dict[str, Any]) -> dict[str, Any]:
    """precision (+ options.dtype, options.kv_cache_dtype) -> the LLM's dtype and QuantAlgo names."""
    return {"dtype": DTYPES.get(precision) or options.get("dtype", "auto"),
            "quant_algo": QUANT_ALGO.get(precision),
            "kv_cache_quant_algo": "FP8" if options.get("kv_cache_dtype") == "fp8" else None}


class _Lib(types.SimpleNamespace):
    LLM: Any
    BuildConfig: Any
    QuantConfig: Any
    QuantAlgo: Any
    SamplingParams: Any
    versions: dict[str, str]


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:2])


def _import() -> _Lib:
    """The TensorRT-engine LLM class and its config types, or BackendUnavailableError saying why."""
    try:
        import tensorrt_llm
    except ImportError as exc:
        raise unavailable("tensorrt-llm", f"the tensorrt_llm Python package cannot be imported ({exc})") from None
    version = str(tensorrt_llm.__version__)
    if _version_tuple(version) >= (1, 3):
        raise unavailable("tensorrt-llm", f"tensorrt_llm {version} removed the TensorRT engine backend (it ended "
                          "with 1.2); install tensorrt_llm 1.2 or older, or use backend: torch")
    try:
        from tensorrt_llm._tensorrt_engine import LLM  # 1.x: tensorrt_llm.LLM is the PyTorch flow there
    except ImportError:
        if _version_tuple(version) >= (1, 0):
            raise unavailable("tensorrt-llm", f"tensorrt_llm {version} has no tensorrt_llm._tensorrt_engine") from None
        from tensorrt_llm import LLM  # 0.1x: the TensorRT-engine flow is the default LLM
    from tensorrt_llm.llmapi import BuildConfig, QuantAlgo, QuantConfig, SamplingParams

    import tensorrt
    import torch

    versions = {"tensorrt_llm": version, "tensorrt": str(tensorrt.__version__), "cuda": str(torch.version.cuda or "")}
    return _Lib(LLM=LLM, BuildConfig=BuildConfig, QuantConfig=QuantConfig, QuantAlgo=QuantAlgo,
                SamplingParams=SamplingParams, versions=versions)


def _merge_timing_cache(own_cache: Path, job: BuildJob) -> dict[str, Any]:
    """Fold what TensorRT-LLM wrote to our private copy back into the store's cache, under its lock."""
    if not own_cache.is_file() or own_cache.stat().st_size == 0:
        return {"merged": False, "note": "TensorRT-LLM wrote no timing cache"}
    import tensorrt as trt

    logger = common.capturing_logger(trt)
    config = trt.Builder(logger).create_builder_config()
    built = config.create_timing_cache(own_cache.read_bytes())
    return common.merge_back(config, logger, job.tactics, built)


class TensorRTLLMEngine:
    """An engine folder. Construction reads files only; the LLM (GPU memory, workers) starts in __enter__."""

    device = "cuda"

    def __init__(self, entry: Path, lib: _Lib, config: dict[str, Any], tp: int, pp: int) -> None:
        self.entry, self._lib, self.config, self.tp, self.pp = entry, lib, config, tp, pp
        self.max_batch_size = int(config.get("build_config", {}).get("max_batch_size", 1))
        self.cfg = types.SimpleNamespace(vocab_size=int(config.get("pretrained_config", {}).get("vocab_size", 32000)))
        self._llm: Any = None

    def __enter__(self) -> "TensorRTLLMEngine":
        # skip_tokenizer_init: trtbuild passes token ids, and synthetic models have no tokenizer.
        self._llm = self._lib.LLM(model=str(self.entry), tensor_parallel_size=self.tp,
                                  pipeline_parallel_size=self.pp, skip_tokenizer_init=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    def warmup(self, batch_size: int, input_len: int, output_len: int) -> None:
        self.generate([[1] * input_len for _ in range(batch_size)], min(output_len, 2))

    def generate(self, input_ids: list[list[int]], max_new_tokens: int) -> Generation:
        """Greedy, EOS ignored (end_id -1), one streaming request per row, all in flight together.

        Step k's time is when the last row received its k-th token (host clock at arrival; the
        executor has synchronized by then), so prefill_s is the batch's time to first token."""
        if self._llm is None:
            raise RuntimeError("the engine is not loaded; use it in a `with` block")
        params = self._lib.SamplingParams(max_tokens=max_new_tokens, end_id=-1, ignore_eos=True, detokenize=False,
                                          top_k=1)
        t0 = time.perf_counter()
        requests = [self._llm.generate_async(list(ids), params, streaming=True) for ids in input_ids]
        arrivals: list[list[float]] = [[] for _ in requests]
        live = set(range(len(requests)))
        while live:
            for i in sorted(live):
                try:
                    out = next(requests[i])
                except StopIteration:
                    live.discard(i)
                    continue
                now = time.perf_counter()
                arrivals[i].extend([now] * (len(out.outputs[0].token_ids) - len(arrivals[i])))
                if out.finished:
                    live.discard(i)
        steps = [max(a[k] for a in arrivals) for k in range(min(len(a) for a in arrivals))] if arrivals else []
        output_ids = [list(r.outputs[0].token_ids) for r in requests]
        decode = [b - a for a, b in pairwise(steps)]
        return Generation(output_ids=output_ids, prefill_s=(steps[0] - t0) if steps else 0.0, decode_step_s=decode)
