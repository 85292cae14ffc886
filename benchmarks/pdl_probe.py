"""Programmatic dependent launch (PDL): what it would save a decode step, before the engine can use it.

Why: in the H200 profiles (benchmarks/RESULTS.md) a 1B decode step is ~170 launches, most of them kernels
of 1-6 us whose ramp (blocks scheduled, first loads in flight) and tail are not hidden by the CUDA graph:
gaps alone were 53 us of a 1032 us step. With PDL (Hopper+), a kernel's blocks may start while the
previous kernel finishes and wait (`griddepcontrol.wait`) only before reading its output. Inductor emits
that wait and the launch attribute for its own Triton kernels when
`torch._inductor.config.triton.enable_pdl` is on, but only through its Python launcher: AOTInductor's C++
launcher calls cuLaunchKernel without the attribute (read in the local torch 2.13's
`codegen/cuda/device_op_overrides.py`; upstream added PDL launches to AOTInductor in 2026-08,
pytorch#194079, after the device's torch 2.11), so an engine would need its launcher changed. This probe
measures the gain first: one decode step of trtbuild's Transformer (random bf16 weights at the recipe's
real shapes; attention through trtbuild's decode kernel, as the engine runs it), compiled by
torch.compile (Inductor's defaults, fullgraph, static shapes) with and without PDL, replayed in a CUDA
graph. cuBLAS's matmul kernels and trtbuild's kernels are launched without the attribute in both, so this
is the gain at Inductor's own kernels only. The two must give the same token. Needs CUDA (sm_90) +
Triton.

    python benchmarks/pdl_probe.py recipes/llama-3.2-1b.yaml --batches 1,8 --out $OUT
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import probe_report  # noqa: E402  (a sibling script's module: this folder is on sys.path)
import torch  # noqa: E402

from trtbuild.backends.decode_kernels import routed  # noqa: E402
from trtbuild.models.llama import LlamaConfig, Transformer  # noqa: E402
from trtbuild.recipe import load_recipe  # noqa: E402
from trtbuild.timing import graph_seconds  # noqa: E402


def decode_step(model: Any, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return model(tok, pos).argmax(-1, keepdim=True)


def probe_recipe(path: str, batches: list[int], position: int, reps: int) -> dict[str, Any]:
    recipe = load_recipe(path)
    assert recipe.model.config is not None, "the probe takes recipes with an inline (synthetic) config"
    cfg = LlamaConfig.from_hf(recipe.model.config)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Transformer(cfg, max(batches), recipe.shapes.max_seq_len, torch.bfloat16)
    with torch.no_grad():  # bf16 weights (the caches already are; the rope table stays fp32, as in the engine)
        for name, p in model.named_parameters():
            p.data = (torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.02).to(torch.bfloat16)
    model = model.eval().requires_grad_(False)
    pos = torch.tensor([position], device="cuda")
    out: dict[str, Any] = {"recipe": recipe.name, "position": position, "rows": []}
    for b in batches:
        tok = torch.randint(0, cfg.vocab_size, (b, 1), device="cuda")
        row: dict[str, Any] = {"batch": b}
        tokens = {}
        for pdl in (False, True):
            torch._dynamo.reset()
            results: list[torch.Tensor] = []
            try:
                with torch._inductor.config.patch({"triton.enable_pdl": pdl}), routed(model, {}, "kernel"), \
                        torch.no_grad():
                    step = torch.compile(decode_step, fullgraph=True, dynamic=False)

                    def calls(step: Any = step, tok: torch.Tensor = tok, results: list[torch.Tensor] = results) -> None:
                        results.append(step(model, tok, pos))  # the last is the captured graph's output

                    t0 = time.perf_counter()
                    s = graph_seconds(calls, reps)
                row[f"pdl_{pdl}_us"] = s * 1e6
                row[f"pdl_{pdl}_wall_s"] = time.perf_counter() - t0
                tokens[pdl] = results[-1].flatten().tolist()
            except Exception as e:  # a failure is a finding: recorded, the other rows still run
                row[f"pdl_{pdl}_us"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        row["same_tokens"] = tokens.get(False) == tokens.get(True) if len(tokens) == 2 else None
        if all(isinstance(row.get(f"pdl_{p}_us"), float) for p in (False, True)):
            row["saving_us"] = row["pdl_False_us"] - row["pdl_True_us"]
        out["rows"].append(row)
        print(f"{recipe.name} b{b} pos {position}: step without PDL {row['pdl_False_us']}, with PDL "
              f"{row['pdl_True_us']} (us); saving {row.get('saving_us')}; same tokens {row['same_tokens']}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipes", nargs="+")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--position", type=int, default=200)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    probe_report.run(args.recipes, lambda path: probe_recipe(path, batches, args.position, args.reps), args.out,
                     "pdl-probe.json")


if __name__ == "__main__":
    main()
