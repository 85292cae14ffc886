"""A strict double of tensorrt_llm's TensorRT-engine LLM API, per version flavour.

Names only from shared/reference/tensorrt_llm.md and from NVIDIA/TensorRT-LLM read at named commits:
- tensorrt_llm/sampling_params.py @ 000a01de (version.py there: 1.0.0rc4): SamplingParams is a
  kw_only dataclass; fields used here: end_id, pad_id, max_tokens, ignore_eos, detokenize, top_k,
  top_p, temperature, n, best_of, return_perf_metrics, exclude_input_from_output.
- tensorrt_llm/llmapi/llm.py @ 00966934: LLM.__init__(model, tokenizer, tokenizer_mode,
  skip_tokenizer_init, trust_remote_code, tensor_parallel_size, dtype, revision, tokenizer_revision,
  **kwargs), generate(inputs, sampling_params, use_tqdm, ...), generate_async(inputs, sampling_params,
  ..., streaming), llm_build_stats.
- tensorrt_llm/executor/result.py @ 005bc848: CompletionOutput(index, text, token_ids, ...),
  results iterate synchronously when streaming (__iter__/__next__), `.finished`, `.outputs`.
- tensorrt_llm/llmapi/__init__.py @ 036a60f7: llmapi exports LLM, BuildConfig, QuantConfig,
  QuantAlgo, SamplingParams, KvCacheConfig.
BuildConfig / PluginConfig / QuantConfig / QuantAlgo fields and defaults: tensorrt_llm.md §1b, §1d.

Flavours: "0.13" (tensorrt_llm.LLM is the TensorRT-engine LLM), "1.0" and "1.2" (that LLM lives in
tensorrt_llm._tensorrt_engine; tensorrt_llm.LLM is the PyTorch flow), "1.3" (engine flow removed).
Unknown keyword arguments and attributes raise, as the real dataclasses / pydantic models do.
The build "times" one layer kind per decoder layer through the tensorrt double's timing cache.
"""

from __future__ import annotations

import enum
import hashlib
import json
import shutil
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

ENGINE_MAGIC = b"FAKE-TRTLLM-ENGINE\n"
VERSIONS = {"0.13": "0.13.0", "1.0": "1.0.0", "1.2": "1.2.0", "1.3": "1.3.0"}
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class _Fields:
    """Keyword-only construction and attribute assignment restricted to the declared fields."""

    FIELDS: dict[str, Any] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError(f"{type(self).__name__}.__init__() takes 1 positional argument but {len(args) + 1} were given")
        for key in kwargs:
            if key not in self.FIELDS:
                raise TypeError(f"{type(self).__name__}.__init__() got an unexpected keyword argument '{key}'")
        for key, default in self.FIELDS.items():
            object.__setattr__(self, key, kwargs.get(key, default() if callable(default) else default))
        self._validate()

    def __setattr__(self, key: str, value: Any) -> None:
        if key not in self.FIELDS:
            raise AttributeError(f"'{type(self).__name__}' object has no field '{key}'")
        object.__setattr__(self, key, value)
        self._validate()

    def _validate(self) -> None:
        pass

    def to_dict(self) -> dict[str, Any]:
        return {k: (v.to_dict() if isinstance(v, _Fields) else v.value if isinstance(v, enum.Enum) else v)
                for k, v in vars(self).items()}


class QuantAlgo(str, enum.Enum):
    W8A16 = "W8A16"
    W4A16 = "W4A16"
    W4A16_AWQ = "W4A16_AWQ"
    W4A8_AWQ = "W4A8_AWQ"
    W8A16_GPTQ = "W8A16_GPTQ"
    W4A16_GPTQ = "W4A16_GPTQ"
    W8A8_SQ_PER_CHANNEL = "W8A8_SQ_PER_CHANNEL"
    FP8 = "FP8"
    FP8_PER_CHANNEL_PER_TOKEN = "FP8_PER_CHANNEL_PER_TOKEN"
    FP8_BLOCK_SCALES = "FP8_BLOCK_SCALES"
    INT8 = "INT8"
    MIXED_PRECISION = "MIXED_PRECISION"
    NVFP4 = "NVFP4"
    NO_QUANT = "NO_QUANT"


class PluginConfig(_Fields):
    FIELDS = {"dtype": "float16", "gpt_attention_plugin": "auto", "gemm_plugin": None, "nccl_plugin": "auto",
              "context_fmha": True, "paged_kv_cache": None, "remove_input_padding": True, "tokens_per_block": 32,
              "use_paged_context_fmha": True, "use_fp8_context_fmha": True, "multiple_profiles": False,
              "manage_weights": False, "use_fused_mlp": True, "reduce_fusion": False}

    def _validate(self) -> None:  # pydantic validate_assignment in 1.x
        if getattr(self, "gemm_plugin", None) not in (None, "auto", "float16", "float32", "bfloat16", "int32", "fp8", "nvfp4"):
            raise ValueError(f"gemm_plugin: invalid value {self.gemm_plugin!r}")
        for key in ("multiple_profiles", "use_paged_context_fmha", "context_fmha"):
            if not isinstance(getattr(self, key, False), bool):
                raise ValueError(f"{key}: expected a bool")


class BuildConfig(_Fields):
    FIELDS = {"max_input_len": 1024, "max_seq_len": None, "opt_batch_size": 8, "max_batch_size": 2048,
              "max_beam_width": 1, "max_num_tokens": 8192, "opt_num_tokens": None, "max_prompt_embedding_table_size": 0,
              "kv_cache_type": None, "gather_context_logits": False, "gather_generation_logits": False,
              "strongly_typed": True, "force_num_profiles": None, "profiling_verbosity": "layer_names_only",
              "enable_debug_output": False, "max_draft_len": 0, "use_refit": False, "input_timing_cache": None,
              "output_timing_cache": "model.cache", "weight_sparsity": False, "weight_streaming": False,
              "plugin_config": PluginConfig, "use_strip_plan": False, "max_encoder_input_len": 1024, "dry_run": False,
              "visualize_network": None, "monitor_memory": False, "use_mrope": False}


class QuantConfig(_Fields):
    FIELDS = {"quant_algo": None, "kv_cache_quant_algo": None, "group_size": 128, "smoothquant_val": 0.5,
              "clamp_val": None, "use_meta_recipe": False, "has_zero_point": False, "pre_quant_scale": False,
              "exclude_modules": None}


class KvCacheConfig(_Fields):
    FIELDS = {"free_gpu_memory_fraction": 0.9, "enable_block_reuse": False, "dtype": "auto", "max_tokens": None}


class SamplingParams(_Fields):
    FIELDS = {"end_id": None, "pad_id": None, "max_tokens": 32, "n": 1, "best_of": None, "use_beam_search": False,
              "top_k": None, "top_p": None, "temperature": None, "stop_token_ids": None, "ignore_eos": False,
              "detokenize": True, "return_perf_metrics": False, "exclude_input_from_output": True}


class LlmBuildStats:
    def __init__(self) -> None:
        self.build_steps_info: list[tuple[str, float]] = []
        self.cache_hitted = False


class CompletionOutput:
    def __init__(self, index: int) -> None:
        self.index, self.text, self.token_ids, self.finish_reason = index, "", [], None

    @property
    def length(self) -> int:
        return len(self.token_ids)


class RequestOutput:
    """Streaming results iterate, one token per step; `result()` runs to the end."""

    def __init__(self, request_id: int, prompt: list[int], params: SamplingParams, vocab: int, streaming: bool) -> None:
        self.request_id, self.prompt_token_ids, self._params, self._vocab = request_id, prompt, params, vocab
        self.outputs = [CompletionOutput(0)]
        self.finished = False
        self._streaming = streaming

    def _step(self) -> None:
        out = self.outputs[0]
        last = out.token_ids[-1] if out.token_ids else self.prompt_token_ids[-1]
        nxt = (last + 1) % self._vocab  # the fake model's greedy token
        out.token_ids.append(nxt)
        hit_end = nxt == self._params.end_id and not self._params.ignore_eos
        if hit_end or len(out.token_ids) >= self._params.max_tokens:
            self.finished = True
            out.finish_reason = "stop" if hit_end else "length"

    def __iter__(self) -> "RequestOutput":
        return self

    def __next__(self) -> "RequestOutput":
        if self.finished:
            raise StopIteration
        self._step()
        return self

    def result(self, timeout: float | None = None) -> "RequestOutput":
        while not self.finished:
            self._step()
        return self


# Accepted **kwargs of the TensorRT-engine LLM (TrtLlmArgs + BaseLlmArgs fields, tensorrt_llm.md §1a).
TRT_LLM_ARGS = {"pipeline_parallel_size", "context_parallel_size", "gpus_per_node", "load_format", "enable_lora",
                "kv_cache_config", "enable_chunked_prefill", "max_batch_size", "max_input_len", "max_seq_len",
                "max_beam_width", "max_num_tokens", "return_perf_metrics", "enable_tqdm", "workspace",
                "enable_build_cache", "calib_config", "quant_config", "embedding_parallel_mode", "fast_build",
                "build_config", "batching_type", "normalize_log_probs", "backend"}


class TrtLLM:
    """The TensorRT-engine LLM: builds from a Hugging Face folder, or loads an engine folder as is."""

    def __init__(self, model: str | Path, tokenizer: Any = None, tokenizer_mode: str = "auto",
                 skip_tokenizer_init: bool = False, trust_remote_code: bool = False, tensor_parallel_size: int = 1,
                 dtype: str = "auto", revision: str | None = None, tokenizer_revision: str | None = None,
                 **kwargs: Any) -> None:
        for key in kwargs:
            if key not in TRT_LLM_ARGS:
                raise ValueError(f"{key} got invalid argument")
        state = _state()
        self.args = types.SimpleNamespace(tensor_parallel_size=tensor_parallel_size, dtype=dtype, **kwargs)
        world = tensor_parallel_size * kwargs.get("pipeline_parallel_size", 1)
        if world > state["gpus"]:
            raise RuntimeError(f"Only {state['gpus']} GPUs are available, but {world} are required.")
        kv = kwargs.get("kv_cache_config")
        if kv is not None and kv.dtype != "auto":
            raise ValueError("KvCacheConfig.dtype must be 'auto' on the TensorRT backend; use "
                             "QuantConfig.kv_cache_quant_algo for an FP8 KV cache")
        self._workspace = tempfile.TemporaryDirectory(suffix="-llm-workspace", dir=kwargs.get("workspace"))
        self.llm_build_stats = LlmBuildStats()
        self._requests = 0
        self._shut = False
        folder = Path(model)
        config = json.loads((folder / "config.json").read_text())
        if "pretrained_config" in config and "build_config" in config:
            self._engine_dir: Path | None = folder
            self._config = config
            if config["version"] != sys.modules["tensorrt_llm"].__version__:
                raise RuntimeError("[TensorRT-LLM][ERROR] Serialization assertion stdVersionRead == "
                                   "kSERIALIZATION_VERSION failed.Version tag does not match.")
            state["loads"] += 1
        else:
            self._engine_dir = None
            self._build(folder, config, world, dtype, kwargs)

    def _build(self, folder: Path, hf: dict[str, Any], world: int, dtype: str, kwargs: dict[str, Any]) -> None:
        import time

        state = _state()
        arch = (hf.get("architectures") or ["?"])[0]
        if arch not in ARCHITECTURES:
            raise NotImplementedError(f"Unsupported model architecture: {arch}")
        t = time.perf_counter()
        bc: BuildConfig = kwargs.get("build_config") or BuildConfig()
        qc: QuantConfig = kwargs.get("quant_config") or QuantConfig()
        cc = sys.modules["tensorrt"]._fake_state["compute_capability"]
        if qc.quant_algo == QuantAlgo.FP8 and float(cc) < 8.9:
            raise RuntimeError(f"FP8 needs compute capability 8.9 or newer, got {cc}")
        self.llm_build_stats.build_steps_info.append(("Loading HF model to memory", time.perf_counter() - t))
        t = time.perf_counter()
        max_seq = bc.max_seq_len or hf.get("max_position_embeddings", 2048)
        hits = _time_layers(bc, qc, hf, dtype)
        state["builds"] += 1
        state["cache_hits"] += hits
        engine_dir = Path(self._workspace.name) / "tmp.engine"
        engine_dir.mkdir()
        tp = self.args.tensor_parallel_size
        pretrained = {"architecture": arch, "dtype": dtype if dtype != "auto" else hf.get("torch_dtype", "float16"),
                      "vocab_size": hf["vocab_size"], "hidden_size": hf["hidden_size"],
                      "num_hidden_layers": hf["num_hidden_layers"],
                      "mapping": {"world_size": world, "tp_size": tp, "pp_size": world // tp},
                      "quantization": {"quant_algo": qc.quant_algo.value if qc.quant_algo else None,
                                       "kv_cache_quant_algo": qc.kv_cache_quant_algo.value if qc.kv_cache_quant_algo else None}}
        build = {k: v for k, v in bc.to_dict().items() if k not in ("dry_run", "visualize_network")}
        build["max_seq_len"] = max_seq
        self._config = {"version": sys.modules["tensorrt_llm"].__version__, "pretrained_config": pretrained,
                        "build_config": build}
        (engine_dir / "config.json").write_text(json.dumps(self._config, indent=2))
        for rank in range(world):
            (engine_dir / f"rank{rank}.engine").write_bytes(ENGINE_MAGIC + json.dumps({"rank": rank, "cc": cc}).encode())
        self._engine_dir = engine_dir
        self.llm_build_stats.build_steps_info.append(("Building TRT-LLM engine", time.perf_counter() - t))

    @property
    def workspace(self) -> Path:
        return Path(self._workspace.name)

    def save(self, engine_dir: str) -> None:
        if self._engine_dir is None:
            raise RuntimeError("The engine is not built yet.")
        if Path(engine_dir).absolute() != self._engine_dir.absolute():
            shutil.copytree(self._engine_dir, engine_dir, dirs_exist_ok=True)

    def generate_async(self, inputs: Any, sampling_params: SamplingParams | None = None, lora_request: Any = None,
                       prompt_adapter_request: Any = None, streaming: bool = False, queries: Any = None,
                       kv_cache_retention_config: Any = None, disaggregated_params: Any = None) -> RequestOutput:
        if self._shut:
            raise RuntimeError("the LLM has been shut down")
        if not isinstance(inputs, list) or not all(isinstance(i, int) for i in inputs):
            raise TypeError(f"The inputs must be type str or list of int, but got {type(inputs)}")
        params = sampling_params or SamplingParams()
        if params.end_id is None and self._tokenizer_skipped():
            raise ValueError("end_id is required when the tokenizer is skipped")
        self._requests += 1
        out = RequestOutput(self._requests, inputs, params, self._config["pretrained_config"]["vocab_size"], streaming)
        return out if streaming else out.result()

    def generate(self, inputs: Any, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
                 **kwargs: Any) -> Any:
        batched = isinstance(inputs, list) and inputs and isinstance(inputs[0], list)
        results = [self.generate_async(i, sampling_params) for i in (inputs if batched else [inputs])]
        return results if batched else results[0]

    def _tokenizer_skipped(self) -> bool:
        return True  # the double has no tokenizer: callers must give end_id, as with skip_tokenizer_init

    def shutdown(self) -> None:
        self._shut = True
        self._workspace.cleanup()


def _time_layers(bc: BuildConfig, qc: QuantConfig, hf: dict[str, Any], dtype: str) -> int:
    """Use the tensorrt double's timing cache as TensorRT-LLM does (input file if it exists, output file
    always, overwritten without a lock); identical decoder layers share one entry. Returns cache hits."""
    trt = sys.modules["tensorrt"]
    with trt._fake_recorder.quiet():
        config = trt.Builder(trt.Logger()).create_builder_config()
        blob = b""
        if bc.input_timing_cache and Path(bc.input_timing_cache).exists():
            blob = Path(bc.input_timing_cache).read_bytes()
        cache = config.create_timing_cache(blob)
        hits = 0
        for kind in ("attention", "mlp", "lm_head"):
            material = json.dumps([kind, hf["hidden_size"], hf["intermediate_size"], dtype, qc.to_dict(), bc.max_batch_size])
            key = "0x" + hashlib.sha256(material.encode()).hexdigest()[:32]
            if key in cache._fake_entries:
                hits += 1
            else:
                cache._fake_entries[key] = ["0x" + key[2:18], 0.02]
        if bc.output_timing_cache is not None:
            Path(bc.output_timing_cache).write_bytes(bytes(memoryview(cache.serialize())))
    return hits


class TorchLLM:
    """1.x's tensorrt_llm.LLM (PyTorch flow): rejects TensorRT-only arguments, as _TorchLLM does."""

    def __init__(self, model: str | Path, **kwargs: Any) -> None:
        trt_only = sorted(k for k in kwargs if k in ("quant_config", "calib_config", "enable_build_cache", "workspace",
                                                     "fast_build", "embedding_parallel_mode", "batching_type"))
        if trt_only:
            raise ValueError(f"The following arguments are specific to TensorRT backend: {trt_only}. Please use "
                             "'from tensorrt_llm._tensorrt_engine import LLM' instead.")
        raise NotImplementedError("the double does not model the PyTorch flow")


def _state() -> dict[str, Any]:
    return sys.modules["tensorrt_llm"]._fake_state


def make_tensorrt_llm(flavour: str = "1.2", gpus: int = 8) -> dict[str, types.ModuleType]:
    """The package's modules for one flavour, to be put into sys.modules by a fixture."""
    version = VERSIONS[flavour]
    top = types.ModuleType("tensorrt_llm")
    top.__version__ = version  # type: ignore[attr-defined]
    top._fake_state = {"gpus": gpus, "builds": 0, "loads": 0, "cache_hits": 0}  # type: ignore[attr-defined]
    top.__path__ = []  # type: ignore[attr-defined]  # a package, so submodule imports resolve via sys.modules
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    engine_flow = flavour != "1.3"
    llm_cls = TrtLLM if flavour == "0.13" else TorchLLM
    for name, value in {"LLM": llm_cls, "SamplingParams": SamplingParams}.items():
        setattr(top, name, value)
    for name, value in {"LLM": llm_cls, "SamplingParams": SamplingParams, "QuantConfig": QuantConfig,
                        "QuantAlgo": QuantAlgo, "KvCacheConfig": KvCacheConfig}.items():
        setattr(llmapi, name, value)
    modules = {"tensorrt_llm": top, "tensorrt_llm.llmapi": llmapi}
    top.llmapi = llmapi  # type: ignore[attr-defined]
    if engine_flow:
        top.BuildConfig = llmapi.BuildConfig = BuildConfig  # type: ignore[attr-defined]
        builder = types.ModuleType("tensorrt_llm.builder")
        builder.BuildConfig = BuildConfig  # type: ignore[attr-defined]
        modules["tensorrt_llm.builder"] = builder
    if engine_flow and flavour != "0.13":
        eng = types.ModuleType("tensorrt_llm._tensorrt_engine")
        eng.LLM = TrtLLM  # type: ignore[attr-defined]
        modules["tensorrt_llm._tensorrt_engine"] = eng
        top._tensorrt_engine = eng  # type: ignore[attr-defined]
    return modules
