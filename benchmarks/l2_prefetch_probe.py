"""Weights prefetched into L2 while a decode step's attention runs: does the next matmul get faster?

Why: in the H200 profiles (benchmarks/RESULTS.md) the small per-layer matmuls of a decode step run at
1.5-3 TB/s against a 4.2 TB/s copy rate (a 1B output projection, 8.4 MB, takes ~5.5 us against a
2 us floor): one launch's ramp, not bandwidth. Meanwhile the attention kernel of a short sequence reads
~0.1 MB a layer for ~5 us, and the memory bus idles. If the next matmul's weights are pulled into L2
during that window, the matmul reads them from L2. This probe measures that before any engine code
changes: it replays, in one CUDA graph, a decode step's layer sequence over every layer's distinct
weights (QKV, attention with rope and the cache writes, output projection, residual, gate/up, SiLU·up,
down; cuBLAS except where named), with and without a prefetch of the output projection's weight
(and optionally the first part of gate/up's) on a second stream of the graph, concurrent with the
attention:
  - bulk: `cp.async.bulk.prefetch.L2.global` (Hopper), one instruction per 4 KB, issued and forgotten,
  - load: programs that load the weight (evict_last) and discard it (what a kernel without inline PTX can do).
The output projection runs through cuBLAS and through trtbuild's decode matmul kernel (its best
configuration for the shape, selected here). The final hidden state must be the same in every variant.
Needs CUDA + Triton (sm_90 for `bulk`). First run (RESULTS.md, eleventh session): no gain; the prefetch
made the 8B layer slower.

    python benchmarks/l2_prefetch_probe.py recipes/llama-3.2-1b.yaml recipes/llama-3.1-8b.yaml --out $OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import probe_report  # noqa: E402  (a sibling script's module: this folder is on sys.path)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from trtbuild.kernels.decode_attention import decode_attention_rope  # noqa: E402
from trtbuild.kernels.decode_matmul import MatmulConfig, decode_matmul, select  # noqa: E402
from trtbuild.models.llama import LlamaConfig, rope_table  # noqa: E402
from trtbuild.recipe import load_recipe  # noqa: E402
from trtbuild.timing import graph_seconds  # noqa: E402

CHUNK = 4096  # bytes per bulk prefetch instruction
THREADS = 128  # num_warps=4: one chunk per thread


@triton.jit
def _prefetch_bulk(w_ptr, n_chunks, CHUNK_ELEMS: tl.constexpr, THREADS: tl.constexpr):
    i = tl.minimum(tl.program_id(0) * THREADS + tl.arange(0, THREADS), n_chunks - 1)
    size = tl.full([THREADS], CHUNK_ELEMS * 2, tl.int32)
    # a dummy result: inline asm must return one; is_pure=False keeps the instruction
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                              [w_ptr + i * CHUNK_ELEMS, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_load(w_ptr, sink_ptr, n, PER: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, PER, BLOCK):
        offs = pid * PER + i + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + offs, mask=offs < n, other=0.0, eviction_policy="evict_last").to(tl.float32)
    tl.store(sink_ptr + pid, tl.sum(acc, 0))  # a use, so the loads are not removed


def prefetch(w: torch.Tensor, mode: str, nbytes: int, sink: torch.Tensor) -> None:
    """Start pulling the first `nbytes` of w (contiguous bf16) into L2."""
    elems = min(nbytes, w.numel() * 2) // 2
    if mode == "bulk":
        chunk = CHUNK // 2
        n_chunks = elems // chunk
        _prefetch_bulk[(triton.cdiv(n_chunks, THREADS),)](w, n_chunks, CHUNK_ELEMS=chunk, THREADS=THREADS, num_warps=4)
    elif mode == "load":
        programs = sink.numel()
        block = 2048
        per = triton.cdiv(triton.cdiv(elems, programs), block) * block
        _prefetch_load[(programs,)](w, sink, elems, PER=per, BLOCK=block, num_warps=4)
    else:
        raise ValueError(mode)


def probe_recipe(path: str, batches: list[int], position: int, gu_mb: float, reps: int) -> dict[str, Any]:
    recipe = load_recipe(path)
    assert recipe.model.config is not None, "the probe takes recipes with an inline (synthetic) config"
    cfg = LlamaConfig.from_hf(recipe.model.config)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    hidden, inter, heads, kv, d = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    width = (heads + 2 * kv) * d
    slots = position + 64
    bmax = max(batches)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dtype, generator=gen) * scale

    layers = [{"qkv": rand(width, hidden, scale=hidden**-0.5), "o": rand(hidden, heads * d, scale=(heads * d) ** -0.5),
               "gu": rand(2 * inter, hidden, scale=hidden**-0.5), "down": rand(hidden, inter, scale=inter**-0.5),
               "k": rand(bmax, kv, slots, d), "v": rand(bmax, kv, slots, d)} for _ in range(cfg.num_layers)]
    rope = rope_table(cfg, slots).to(dev)
    pos = torch.tensor([position], device=dev)
    sink = torch.empty(132, device=dev, dtype=torch.float32)
    side = torch.cuda.Stream()
    out: dict[str, Any] = {"recipe": recipe.name, "layers": cfg.num_layers, "position": position,
                           "o_weight_MB": hidden * heads * d * 2 / 1e6, "gate_up_prefetch_MB": gu_mb, "rows": []}
    for b in batches:
        x0 = rand(b, hidden)
        sel = select([L["o"] for L in layers], b, reps=5)
        o_cfg = None if sel["choice"] == "cublas" else MatmulConfig.parse(sel["choice"])
        for o_kernel in ("cublas", "kernel"):
            if o_kernel == "kernel" and o_cfg is None:
                # cuBLAS won the selection: time the kernel's best candidate anyway, for the A/B
                timed = {k: v for k, v in sel["candidates"].items() if isinstance(v, float)}
                o_cfg = MatmulConfig.parse(min(timed, key=timed.__getitem__))
            finals: dict[str, torch.Tensor] = {}
            row: dict[str, Any] = {"batch": b, "o_matmul": o_kernel if o_cfg is None or o_kernel == "cublas" else o_cfg.name,
                                   "o_selection_cublas_us": sel["cublas_us"], "o_selection_choice": sel["choice"]}
            for variant in ("none", "bulk", "load", f"bulk+gu{gu_mb:g}MB"):
                mode = variant.split("+")[0]
                # argument defaults bind this iteration's values (the closure runs later, in graph_seconds)

                def step(mode: str = mode, variant: str = variant, o_kernel: str = o_kernel, b: int = b,
                         x0: torch.Tensor = x0, finals: dict[str, torch.Tensor] = finals,
                         o_cfg: MatmulConfig | None = o_cfg) -> None:
                    x = x0
                    main = torch.cuda.current_stream()
                    for L in layers:
                        qkv = F.linear(x, L["qkv"]).view(b, 1, width)
                        if mode != "none":
                            side.wait_stream(main)
                            with torch.cuda.stream(side):
                                prefetch(L["o"], mode, L["o"].numel() * 2, sink)
                                if "+gu" in variant:
                                    prefetch(L["gu"], mode, int(gu_mb * 1e6), sink)
                        y = decode_attention_rope(qkv, rope, L["k"], L["v"], pos, heads).view(b, heads * d)
                        if mode != "none":
                            main.wait_stream(side)
                        o = F.linear(y, L["o"]) if o_kernel == "cublas" or o_cfg is None else decode_matmul(y, L["o"], o_cfg)
                        h = x + o
                        gu = F.linear(h, L["gu"])
                        # normalized, as the next layer's norm would: random weights otherwise grow the
                        # residual stream to inf over 16-32 layers (the first run's outputs were NaN)
                        x = F.rms_norm(h + F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], L["down"]), (hidden,))
                    finals[variant] = x

                try:
                    s = graph_seconds(step, reps)
                    row[f"{variant}_us_per_layer"] = s / cfg.num_layers * 1e6
                except Exception as e:  # e.g. the bulk prefetch needs sm_90; a failure is a finding
                    row[f"{variant}_us_per_layer"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
            base = finals.get("none")
            row["max_abs_diff_vs_none"] = max(((v.float() - base.float()).abs().max().item() for v in finals.values()),
                                              default=None) if base is not None else None
            out["rows"].append(row)
            cells = ", ".join(f"{k[:-len('_us_per_layer')]} {v:.2f}" if isinstance(v, float) else f"{k}: {v}"
                              for k, v in row.items() if k.endswith("_us_per_layer"))
            print(f"{recipe.name} b{b} O by {row['o_matmul']}: us/layer {cells}; max |diff| {row['max_abs_diff_vs_none']}",
                  flush=True)
    layers.clear()  # free this recipe's weights before the next
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipes", nargs="+")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--position", type=int, default=200)
    ap.add_argument("--gate-up-mb", type=float, default=16.0, help="MB of gate/up's weight prefetched after O's")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    probe_report.run(args.recipes, lambda path: probe_recipe(path, batches, args.position, args.gate_up_mb, args.reps), args.out,
                     "l2-prefetch-probe.json")


if __name__ == "__main__":
    main()
