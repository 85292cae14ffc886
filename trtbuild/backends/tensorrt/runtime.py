"""Running a stored TensorRT plan: deserialize, pick the profile for the batch, bind, execute, time.

What `generate()` means for an ONNX network (the Engine protocol is shaped for LLMs):
- a language-model-shaped network (an integer input whose name contains 'input_ids', [batch, seq],
  and a rank-3 first output, [batch, seq, vocab]) is run as a greedy loop *without a KV cache*:
  every step re-runs the whole sequence and appends the argmax of the last position. prefill_s is
  the first run (the prompt), decode_step_s the later runs, each over a sequence one token longer.
- any other network is run on random inputs (batch = len(input_ids), other dynamic dimensions at
  their profile's opt value) max_new_tokens times: prefill_s is the first (cold) run, decode_step_s
  the steady-state runs, and output_ids holds no tokens.
Buffers live on the GPU (torch tensors on the current CUDA device, a non-default stream); every
reading is taken after the stream is synchronized.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from trtbuild.backends import Generation
from trtbuild.backends.tensorrt import common
from trtbuild.errors import TrtbuildError

TORCH_DTYPES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT32": "int32", "INT64": "int64",
                "INT8": "int8", "BOOL": "bool", "UINT8": "uint8", "FP8": "float8_e4m3fn"}


class TensorRTEngine:
    """A stored plan. Cheap to construct: files are checked, TensorRT is not touched until __enter__."""

    def __init__(self, entry: Path, manifest: dict[str, Any]) -> None:
        self.entry = entry
        for name in ("engine.plan", "engine.json"):
            if not (entry / name).is_file():
                raise TrtbuildError(f"engine entry {entry} has no {name}", hint="rebuild it")
        self.meta = json.loads((entry / "engine.json").read_text())
        self.profiles: list[dict[str, Any]] = self.meta.get("profiles", [])
        self.max_batch_size = max((p["batch"] for p in self.profiles), default=1)
        self.device = "cuda"
        self.load_s = 0.0
        self._state: dict[str, Any] = {}

    def __enter__(self) -> "TensorRTEngine":

        import torch

        trt = common.import_tensorrt()
        if str(trt.__version__) != self.meta["tensorrt"]:  # refuse by name before deserializing
            raise common.IncompatibleEngineError(
                "version_mismatch", f"the engine was built by TensorRT {self.meta['tensorrt']}; this is {trt.__version__}")
        # The double of tensorrt runs on host memory; a real TensorRT always has a CUDA device here.
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        t = time.perf_counter()
        logger = common.capturing_logger(trt)
        runtime = trt.Runtime(logger)
        engine = runtime.deserialize_cuda_engine(common.plan_path(self.entry).read_bytes())
        if engine is None:
            raise common.classify_deserialize_failure(logger.errors())
        context = engine.create_execution_context()
        stream = torch.cuda.Stream() if self.device == "cuda" else None  # TensorRT advises against the default stream
        io = [(engine.get_tensor_name(i),) for i in range(engine.num_io_tensors)]
        tensors = {n: {"input": engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT,
                       "dtype": getattr(torch, TORCH_DTYPES[engine.get_tensor_dtype(n).name]),
                       "shape": tuple(engine.get_tensor_shape(n))} for (n,) in io}
        self._state = {"trt": trt, "logger": logger, "runtime": runtime, "engine": engine, "context": context,
                       "stream": stream, "tensors": tensors, "profile": None}
        self._sync()
        self.load_s = time.perf_counter() - t
        return self

    def __exit__(self, *exc: object) -> None:
        for name in ("context", "engine", "runtime"):  # release in dependency order
            self._state.pop(name, None)
        self._state.clear()

    # -- protocol ----------------------------------------------------------------------------------
    def warmup(self, batch_size: int, input_len: int, output_len: int) -> None:
        self.generate([[0] * input_len for _ in range(batch_size)], min(output_len, 2))

    def generate(self, input_ids: list[list[int]], max_new_tokens: int) -> Generation:
        if not self._state:
            raise RuntimeError("the engine is not loaded; use it in a `with` block")
        import torch

        batch = len(input_ids)
        profile = self._profile_for(batch)
        lm = self._lm_names()
        times: list[float] = []
        if lm is None:
            feeds = self._random_inputs(batch, profile)
            for _ in range(max(1, max_new_tokens)):
                times.append(self._run(profile, feeds)[1])
            return Generation(output_ids=[[] for _ in range(batch)], prefill_s=times[0], decode_step_s=times[1:])
        ids_name, logits_name = lm
        dtype = self._state["tensors"][ids_name]["dtype"]
        tokens = torch.tensor(input_ids, dtype=dtype, device=self.device)
        new: list[Any] = []
        for _ in range(max_new_tokens):
            outputs, dt = self._run(profile, self._lm_feeds(ids_name, tokens))
            times.append(dt)
            nxt = outputs[logits_name][:, -1, :].argmax(-1).to(dtype)
            new.append(nxt)
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        out = torch.stack(new, dim=1).tolist() if new else [[] for _ in range(batch)]
        return Generation(output_ids=out, prefill_s=times[0] if times else 0.0, decode_step_s=times[1:])

    # -- internals -----------------------------------------------------------------------------------
    def _profile_for(self, batch: int) -> int:
        if not self.profiles:
            return 0
        for i, p in enumerate(self.profiles):
            if batch <= p["batch"]:
                return i
        raise TrtbuildError(f"batch {batch} exceeds the engine's largest batch bucket {self.max_batch_size}")

    def _lm_names(self) -> tuple[str, str] | None:
        tensors = self._state["tensors"]
        ids = [n for n, t in tensors.items() if t["input"] and "input_ids" in n and len(t["shape"]) == 2
               and not t["dtype"].is_floating_point]
        outs = [n for n, t in tensors.items() if not t["input"] and len(t["shape"]) == 3]
        return (ids[0], outs[0]) if ids and outs else None

    def _lm_feeds(self, ids_name: str, tokens: Any) -> dict[str, Any]:
        import torch

        feeds = {ids_name: tokens}
        for name, t in self._state["tensors"].items():
            if not t["input"] or name == ids_name:
                continue
            if "attention_mask" in name:
                feeds[name] = torch.ones_like(tokens, dtype=t["dtype"])
            elif "position_ids" in name:
                feeds[name] = torch.arange(tokens.shape[1], device=self.device, dtype=t["dtype"]).expand_as(tokens)
            else:
                raise TrtbuildError(f"input '{name}' of this language-model-shaped network is not one trtbuild "
                                    "can fill (input_ids, attention_mask, position_ids)")
        return feeds

    def _random_inputs(self, batch: int, profile: int) -> dict[str, Any]:
        import torch

        gen = torch.Generator(device="cpu").manual_seed(0)
        shapes = self.profiles[profile]["shapes"] if self.profiles else {}
        feeds = {}
        for name, t in self._state["tensors"].items():
            if not t["input"]:
                continue
            opt = shapes.get(name, [None, list(t["shape"])])[1]
            shape = [batch if i == 0 and d == -1 else o for i, (d, o) in enumerate(zip(t["shape"], opt, strict=False))]
            if t["dtype"].is_floating_point:
                feeds[name] = torch.randn(shape, generator=gen).to(self.device, t["dtype"])
            else:
                feeds[name] = torch.zeros(shape, dtype=t["dtype"], device=self.device)
        return feeds

    def _run(self, profile: int, feeds: dict[str, Any]) -> tuple[dict[str, Any], float]:
        """Bind and execute once; returns the outputs and the synchronized wall time of the execution."""
        import torch

        s = self._state
        ctx, trt_errors = s["context"], s["logger"].errors
        handle = s["stream"].cuda_stream if s["stream"] is not None else 0
        if s["profile"] != profile:
            ctx.set_optimization_profile_async(profile, handle)
            s["profile"] = profile
        mark = len(s["logger"].messages)
        for name, value in feeds.items():
            if not ctx.set_input_shape(name, tuple(value.shape)):
                raise TrtbuildError(f"input '{name}' shape {tuple(value.shape)} is outside optimization profile "
                                    f"{profile}: " + "; ".join(trt_errors(mark)))
        outputs = {n: torch.empty(tuple(ctx.get_tensor_shape(n)), dtype=t["dtype"], device=self.device)
                   for n, t in s["tensors"].items() if not t["input"]}
        for name, value in {**feeds, **outputs}.items():
            ctx.set_tensor_address(name, value.data_ptr())
        self._sync()
        t = time.perf_counter()
        ok = ctx.execute_async_v3(handle)
        self._sync()
        dt = time.perf_counter() - t
        if not ok:
            raise TrtbuildError("TensorRT failed to execute the engine: " + "; ".join(trt_errors(mark)))
        return outputs, dt

    def _sync(self) -> None:
        stream = self._state.get("stream")
        if stream is not None:
            stream.synchronize()
