"""The model a torch build compiles, placed on its device and exported: one prefill graph (batch and
prompt length dynamic) and one decode graph per batch bucket (static batch, dynamic cache window),
with trtbuild's kernels routed in as the build's plans say. The build process and its compile workers
(`compile_workers.py`) both export through here, so a worker's export has the build's cache key.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from trtbuild.backends.torch import decode_kernels, prefill_attention
from trtbuild.errors import TrtbuildError

# options.kv_cache: "paged" adds the paged graphs (models/paged.py), which `trtbuild serve` runs over a block pool:
# the paged step (a decode step's rows, or prompt chunks) and the mixed step (both in one forward). Run and bench
# keep the row cache's graphs either way.
# options.compile: "regional" exports and compiles a layer of each kind once and runs it for every layer of that
# kind (models/regions.py), where that saves most of the work, for every graph but the paged step (`regional`);
# "whole" compiles the unrolled model; "regional-all" the paged step by regions too.
OPTIONS = {"kv_cache": ("rows", "paged"), "compile": ("regional", "whole", "regional-all")}
PAGED = "paged"
PAGED_MIXED = "paged_mixed"
PAGED_ROWS = 256  # the most sequences one paged step serves


def place_model(cfg: Any, shapes: Any, dtype: Any, device: str, state: dict[str, Any]) -> Any:
    """The model on `device` with `state`'s tensors (this module's fused layout) as its parameters."""
    import torch

    from trtbuild.models.llama import Transformer, rope_table

    # Made on the meta device: every parameter is replaced by `state`'s next, and initializing them first
    # would cost an 8B model 32 GB of random fp32 weights on the GPU (and seconds) for nothing.
    with torch.device("meta"):
        model = Transformer(cfg, shapes.max_batch_size, shapes.max_seq_len, dtype)
    from trtbuild.models.quantize import format_of

    for name, mod in model.named_modules():  # a quantized engine's weights (models/calibrate.py)
        if f"{name}.qweight" in state:
            mod.hold_quantized(format_of(state[f"{name}.qweight"]))
    model.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=False, assign=True)
    with torch.device(device):
        model.rope = rope_table(cfg, shapes.max_seq_len)
    for name, buf in list(model.named_buffers()):
        if buf.is_meta:  # the KV caches
            setattr(model, name, torch.zeros_like(buf, device=device))
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise TrtbuildError(f"model: no weight for {', '.join(missing[:4])} after conversion")
    return model.eval().requires_grad_(False)


def regional(name: str, mode: str) -> bool:
    """Whether graph `name` is compiled by regions under options.compile `mode`: "regional" compiles the
    prefill and decode graphs so, and keeps the paged step whole. Served by regions on an H100 (1B, 0499bf6),
    the paged decode steps took 0.17-0.21 ms more each (1.47 → 1.65 ms at one row) where the step's device time
    grew 0.05 ms: output tok/s fell 10-13% at 1-256 clients. The row engine's decode and prefill stayed level
    (3bd4cfb). "regional-all" compiles the paged step by regions too, to measure it."""
    if name == PAGED_MIXED:  # called directly, for steps whose device time is milliseconds: always whole
        return False
    return mode == "regional-all" or (mode == "regional" and name != PAGED)


def regions(model: Any, mode: str) -> list[list[int]]:
    """The layers of each region program (models/regions.plan) for options.compile `mode`; empty: whole graphs."""
    from trtbuild.models.regions import plan

    return plan(model) if mode in ("regional", "regional-all") else []


def shared_step(device: str, shapes: Any) -> tuple[int, int]:
    """(rows, tokens) of the one step program that serves the prefill and every decode bucket, or (0, 0) for a
    program per graph. On the CPU a graph is a whole Inductor and C++ compile, ~7-9 s of it for its C++
    wrapper alone whatever its size (2 cores, 2026-12-06), and nothing is captured per shape: so one decode
    step of any batch up to max_batch_size and any tokens a row up to max_input_len serves them all, a prompt
    being a step over its own positions (`graph_runners.PromptStep`), and the build compiles it once. On CUDA each
    bucket keeps its static graph (its kernels are tuned and its CUDA graphs captured at that batch) and the
    prefill its own (causal fused attention over the prompt, not a masked pass over the cache)."""
    return (shapes.max_batch_size, shapes.max_input_len) if device == "cpu" else (0, 0)


def export_graph(model: Any, name: str, shapes: Any, device: str, matmuls: dict[decode_kernels.MatmulKey, Any],
                 attention: str, prefill_kernel: str = "sdpa", step: tuple[int, int] | list[int] = (0, 0),
                 layer: int | None = None) -> dict[str, Any]:
    """Export one graph: "prefill" with its attention through `prefill_kernel`, or "decode_b<N>" with
    the decode kernels routed as planned; with `step` (`shared_step`), any of them as the one step program.
    With `layer`, only that layer's region of the graph (models/regions.py)."""
    t = time.perf_counter()
    rows, tokens = step
    if name == PAGED:
        return {"batch": "dynamic", "program": export_paged(model, shapes.max_input_len, shapes.max_seq_len, device,
                                                            layer),
                "attention": "aten", "export_s": time.perf_counter() - t}
    if name == PAGED_MIXED:
        return {"batch": "dynamic", "program": export_mixed(model, shapes.max_input_len, shapes.max_seq_len, device),
                "attention": "aten", "export_s": time.perf_counter() - t}
    if name == "prefill" and not tokens:
        with prefill_attention.routed(model, prefill_kernel), fp8_prefill(model, device):
            ep = export_prefill(model, shapes.max_batch_size, shapes.max_input_len, device, layer=layer)
        return {"batch": "dynamic", "program": ep, "prefill_attention": prefill_kernel,
                "export_s": time.perf_counter() - t}
    with decode_kernels.routed(model, matmuls, attention), quantized_decode(model, device, matmuls, bucket(name)):
        ep = export_decode(model, bucket(name) or rows, shapes.max_seq_len, device, rows, layer, tokens)
    return {"batch": "dynamic" if rows > 1 else bucket(name) or rows, "program": ep, "window": "dynamic",
            "matmuls": {decode_kernels.key_name(key): c.name for key, c in sorted(matmuls.items())},
            "attention": attention, "export_s": time.perf_counter() - t} | ({"step": True} if tokens else {})


@contextlib.contextmanager
def fp8_prefill(model: Any, device: str) -> Iterator[None]:
    """While the prefill graph is exported on CUDA, its fp8 Linears multiply in fp8 on the tensor cores
    (`Linear.fp8_prefill`); on the CPU they dequantize (no fp8 matmul there)."""
    linears = [m for m in model.modules() if getattr(m, "quant", None) == "fp8"] if device.startswith("cuda") else []
    for m in linears:
        m.fp8_prefill = True
    try:
        yield
    finally:
        for m in linears:
            del m.fp8_prefill  # back to the class's default


@contextlib.contextmanager
def quantized_decode(model: Any, device: str, configs: dict[decode_kernels.MatmulKey, Any] | None = None,
                     rows: int = 1) -> Iterator[None]:
    """While a decode graph of `rows` rows is exported on CUDA, each quantized Linear calls trtbuild's quantized
    decode matmul (`kernels/quant_matmul.py`), which reads the stored bytes; without it the graph would dequantize
    every weight every step. Its configuration is the plan's for its (out, in, format) (`configs`, timed by
    `decode_kernels.matmul_plan`), with its call site's gating or residual add where the plan's key has it; else
    its format's fixed one, the matmul alone (a build that times nothing). On the CPU, without
    Triton, and past the kernel's 16 rows, they dequantize."""
    linears = [m for m in model.modules() if getattr(m, "quant", None)] if device.startswith("cuda") else []
    try:
        from trtbuild.kernels.quant_matmul import CONFIGS, MAX_ROWS
    except ImportError:
        linears = []
    else:
        linears = linears if rows <= MAX_ROWS else []
    configs = configs or {}
    for m in linears:
        # the plan's key says whether the kernel also does the call site's epilogue (decode_kernels.quant_site)
        epilogue = decode_kernels.fusion_of(m, "epilogue")
        fused = (m.out_features, m.in_features, decode_kernels.quant_site(m.quant, epilogue))
        if epilogue != "none" and fused in configs:
            m.decode_config, m.decode_fusion = configs[fused], epilogue
        else:
            m.decode_config = configs.get((m.out_features, m.in_features, m.quant), CONFIGS[m.quant])
    try:
        yield
    finally:
        for m in linears:
            del m.decode_config
            m.__dict__.pop("decode_fusion", None)


def bucket(graph: str) -> int:
    """The batch of a decode graph's name ("decode_b8": 8); 0 for the prefill graph."""
    return int(graph.removeprefix("decode_b")) if graph.startswith("decode_b") else 0


def model_bytes(model: Any) -> int:
    """The bytes of the model's parameters and buffers (its KV caches included)."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def step_module(model: Any, from_start: bool, layer: int | None, paged: bool = False) -> Any:
    """What a graph exports: the whole step, or with `layer` that layer's region (models/regions.py)."""
    from trtbuild.models.llama import Step
    from trtbuild.models.paged import PagedStep
    from trtbuild.models.regions import Region

    if layer is not None:
        return Region(model, layer, from_start, paged)
    return PagedStep(model) if paged else Step(model, from_start)


def first_input(model: Any, layer: int | None, rows: int, tokens: int, device: str) -> Any:
    """A graph's example first input: token ids, or a region's hidden states."""
    import torch

    if layer is None:
        return torch.zeros(rows, tokens, dtype=torch.long, device=device)
    weight = model.tok_embeddings.weight
    return torch.zeros(rows, tokens, weight.shape[1], dtype=weight.dtype, device=device)


def export_prefill(model: Any, max_batch_size: int, max_input_len: int, device: str, example_len: int = 2,
                   layer: int | None = None) -> Any:
    """The prompt step: batch and prompt length dynamic; inputs tokens (B, T), positions (T,) and the cache
    row of each prompt (B,). Example sizes of 2 avoid export's 0/1 specialization (a dimension with max 1
    stays static). Inductor tunes the graph's kernels at the example sizes; `example_len` lets
    benchmarks/probes/probe.py compare other lengths. With `layer`, that layer's region."""
    import torch
    from torch.export import Dim

    # Dim.STATIC, not None, for a size that cannot vary: torch deprecates None and logs a warning for each
    batch = Dim("batch", min=1, max=max_batch_size) if max_batch_size > 1 else Dim.STATIC
    seq = Dim("seq", min=1, max=max_input_len) if max_input_len > 1 else Dim.STATIC
    ex_b, ex_t = min(2, max_batch_size), min(max(2, example_len), max_input_len)
    with torch.no_grad():
        return torch.export.export(step_module(model, True, layer),
                                   (first_input(model, layer, ex_b, ex_t, device),
                                    torch.arange(ex_t, device=device), torch.arange(ex_b, device=device)),
                                   dynamic_shapes=({0: batch, 1: seq}, {0: seq}, {0: batch}),
                                   # guards export cannot prove become runtime asserts, not failures
                                   prefer_deferred_runtime_asserts_over_guards=True)


def export_decode(model: Any, batch: int, max_seq_len: int, device: str, rows_max: int = 0,
                  layer: int | None = None, tokens_max: int = 0) -> Any:
    """The decode step at one batch size: inputs the tokens (B, 1), each row's position (B, 1), each row's
    cache row (B,) and the span of cache slots attended over. Static batch, and one dynamic dimension, the
    span (the runtime picks the smallest window that covers every row's position); with `rows_max` > 1 the
    batch is dynamic too, 1 to `rows_max`, exported at 2 rows whatever `batch` is (every bucket the same
    program); with `tokens_max` > 1 the tokens a row too (`shared_step`: the step a prompt runs through as well).
    With `layer`, that layer's region."""
    import torch
    from torch.export import Dim

    window = {0: Dim("window", min=2, max=max_seq_len)} if max_seq_len > 2 else None
    rows = {0: Dim("rows", min=1, max=rows_max)} if rows_max > 1 else {}
    grid = rows | ({1: Dim("tokens", min=1, max=tokens_max)} if tokens_max > 1 else {})
    if rows:
        batch = 2  # an example of 1 row would specialize the dimension to 1
    t = 2 if tokens_max > 1 else 1  # likewise
    with torch.no_grad():
        return torch.export.export(step_module(model, False, layer),
                                   (first_input(model, layer, batch, t, device),
                                    torch.ones(batch, t, dtype=torch.long, device=device),
                                    torch.arange(batch, device=device),
                                    torch.arange(max_seq_len, device=device)),
                                   # a region takes the span among its *rest
                                   dynamic_shapes=(grid or None, grid or None, rows or None,
                                                   window if layer is None else (window,)),
                                   prefer_deferred_runtime_asserts_over_guards=True)


def export_paged(model: Any, max_input_len: int, max_seq_len: int, device: str, layer: int | None = None) -> Any:
    """The paged step (models/paged.PagedStep): rows, tokens a row (a prompt chunk or one decode token), blocks
    a table and the pools' blocks all dynamic. Inputs: tokens (B, T), positions (B, T), block tables (B, N),
    then each layer's K and V pool, written in place; with `layer`, that layer's region and its two pools."""
    import torch
    from torch.export import Dim

    from trtbuild.models.paged import BLOCK, pool_shape

    rows, seq = Dim("rows", min=1, max=PAGED_ROWS), Dim("tokens", min=1, max=max(2, max_input_len))
    width = Dim("table", min=2, max=max(3, -(-max_seq_len // BLOCK)))  # 2+: paged_runtime pads a table of 1
    pool = Dim("pool", min=2, max=2**24)
    dtype = model.tok_embeddings.weight.dtype
    layers = model.cfg.num_layers if layer is None else 1
    pools = [torch.zeros(pool_shape(model.cfg, 4), dtype=dtype, device=device) for _ in range(2 * layers)]
    example = (first_input(model, layer, 2, 2, device), torch.arange(2, device=device).expand(2, 2).contiguous(),
               torch.tensor([[0, 1], [2, 3]], device=device), *pools)
    with torch.no_grad():
        return torch.export.export(step_module(model, False, layer, paged=True), example,
                                   # the pools are the step's *args: one entry holding each pool's spec
                                   dynamic_shapes=({0: rows, 1: seq}, {0: rows, 1: seq}, {0: rows, 1: width},
                                                   tuple({0: pool} for _ in pools)),
                                   prefer_deferred_runtime_asserts_over_guards=True)


def export_mixed(model: Any, max_input_len: int, max_seq_len: int, device: str) -> Any:
    """The mixed paged step (models/paged.MixedStep): decode rows (Bd, 1) and prompt-chunk rows (Bc, Tc), each
    kind's rows, tokens and table width dynamic, then the pools as in `export_paged`. Chunk rows hold 2 tokens
    or more (Tc 1 specializes the export); the runtime pads a one-token chunk (paged_runtime.PagedCache.mixed)."""
    import torch
    from torch.export import Dim

    from trtbuild.models.paged import BLOCK, MixedStep, pool_shape

    most = max(3, -(-max_seq_len // BLOCK))
    rows, width = Dim("rows", min=1, max=PAGED_ROWS), Dim("table", min=2, max=most)
    chunks, seq = Dim("chunks", min=1, max=PAGED_ROWS), Dim("tokens", min=2, max=max(3, max_input_len))
    chunk_width = Dim("chunk_table", min=2, max=most)
    pool = Dim("pool", min=2, max=2**24)
    dtype = model.tok_embeddings.weight.dtype
    pools = [torch.zeros(pool_shape(model.cfg, 8), dtype=dtype, device=device) for _ in range(2 * model.cfg.num_layers)]

    def longs(*values: Any) -> Any:
        return torch.tensor(values, dtype=torch.long, device=device)

    # example sizes all different (3 decode rows, 2 chunk rows of 4 tokens, tables of 2 and 3), so that export
    # ties no two of the dimensions together
    example = (longs([1], [2], [3]), longs([5], [17], [20]), longs([0, 1], [2, 3], [4, 1]),
               longs([1, 2, 3, 4], [5, 6, 7, 8]), longs([0, 1, 2, 3], [16, 17, 18, 19]),
               longs([5, 1, 1], [6, 7, 1]), *pools)
    dec, chunk = {0: rows}, {0: chunks, 1: seq}
    with torch.no_grad():
        return torch.export.export(MixedStep(model), example,
                                   dynamic_shapes=(dec, dec, {0: rows, 1: width}, chunk, chunk,
                                                   {0: chunks, 1: chunk_width}, tuple({0: pool} for _ in pools)),
                                   prefer_deferred_runtime_asserts_over_guards=True)
