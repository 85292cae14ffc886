"""A mixture-of-experts decode step, layer by layer, three ways: ATen's gather (`MoE._gathered`, what decode
graphs run today), trtbuild's Triton gather (kernels/moe_gather.py, the chosen experts' weights read in
place) and the dense path (every expert, what prompts run), each against its floor: the bytes of the experts
the step's tokens chose (k at batch 1; the distinct ones at batch b) at the device's copy rate. Each variant
is captured in a CUDA graph over `--layers` layers of distinct weights (more bytes than L2 holds) and
replayed; medians of many replays. A probe for choosing the decode path, not a benchmark of the engine.

    python benchmarks/probes/moe_probe.py recipes/qwen3-30b-a3b.yaml --out $OUT          # CUDA
    python benchmarks/probes/moe_probe.py recipes/qwen3-30b-a3b.yaml --quick --out /tmp/o  # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from trtbuild.measure import ceilings  # noqa: E402
from trtbuild.models.llama import LlamaConfig  # noqa: E402
from trtbuild.models.moe import MoE  # noqa: E402
from trtbuild.recipe import load_recipe  # noqa: E402


def step_seconds(layers: list[MoE], x: torch.Tensor, gathered: bool, device: str, reps: int) -> list[float]:
    """Seconds of one pass of x through every layer (no norm, no residual), replayed from a CUDA graph on a GPU."""
    def run() -> None:
        for m in layers:
            m(x, lambda t: t, None, gathered=gathered)

    if not device.startswith("cuda"):
        return ceilings.time_op(run, device, reps)
    run()  # compile the Triton kernels, warm the allocator, before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return ceilings.time_op(graph.replay, device, reps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, few repetitions (CPU smoke test)")
    ap.add_argument("--out", default="moe-probe-out")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = LlamaConfig.from_hf(load_recipe(args.recipe).model.config)
    if args.quick:
        from dataclasses import replace

        cfg = replace(cfg, hidden_size=64, moe_intermediate_size=48, num_experts=8, experts_per_token=2)
        args.layers, args.reps = 2, 3
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        layers = [MoE(cfg).to(dtype) for _ in range(args.layers)]
    for m in layers:
        for p in m.parameters():
            torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    rate = ceilings.measure(device, 64 << 20 if args.quick else 1 << 30, 256 if args.quick else 4096)["copy_Bps"]
    variants = ["aten", "dense"]
    try:
        import trtbuild.kernels.moe_gather  # noqa: F401
        variants.insert(1, "kernel")
    except ImportError as e:
        print(f"kernel: skipped ({e})")
    expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * torch.finfo(dtype).bits // 8
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                              "recipe": args.recipe, "layers": args.layers, "copy_Bps": rate, "batches": {}}
    for b in [int(v) for v in args.batches.split(",")]:
        x = torch.randn(1, b, cfg.hidden_size, device=device, dtype=dtype)
        with torch.no_grad():
            chosen = layers[0].route(x.reshape(b, -1))[1]
        distinct = len(set(chosen.flatten().tolist()))  # the first layer's, for this x: what its floor reads
        floor = distinct * expert_bytes / rate
        row: dict[str, Any] = {"distinct_experts_layer0": distinct, "floor_us_per_layer": floor * 1e6}
        for v in variants:
            for m in layers:
                m.decode_kernel = "kernel" if v == "kernel" else "aten"
            with torch.no_grad():
                s = statistics.median(step_seconds(layers, x, v != "dense", device, args.reps)) / args.layers
            row[v] = {"us_per_layer": s * 1e6, "x_floor": s / floor}
            print(f"batch {b}: {v:6s} {s * 1e6:9.1f} us a layer, {s / floor:6.2f}x its floor "
                  f"({distinct} experts, {floor * 1e6:.1f} us)")
        result["batches"][str(b)] = row
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_probe.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
