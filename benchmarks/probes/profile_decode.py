"""Where a decode step's time goes: the kernels of a cached engine's decode step, per batch bucket.

Opens the engine as a user would (a cache hit), fills the cache with one short generation, then
profiles `--steps` decode steps alone (CUDA-graph replays on a GPU) with torch.profiler and prints,
per kernel, launches per step and device time per step, with the step's wall time beside the sum
of kernel time: the difference is what the device spent between kernels. Writes the same as JSON.

    python benchmarks/probes/profile_decode.py recipes/llama-3.2-1b.yaml --engines /tmp/bench-engines --out prof.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from trtbuild.recipe import load_recipe  # noqa: E402
from trtbuild.runner import open_session  # noqa: E402
from trtbuild.timing import sync  # noqa: E402


def profile_bucket(engine: Any, batch: int, prompt_len: int, steps: int) -> dict[str, Any]:
    prompts = [[(7 * i + r) % 100 + 1 for i in range(prompt_len)] for r in range(batch)]
    engine.generate(prompts, 8)  # captures the graphs and fills the cache up to the prompt
    return profile_steps(engine._decoder(engine.bucket_for(batch)), batch, prompt_len, steps, engine.device)


def profile_steps(decoder: Any, batch: int, prompt_len: int, steps: int, device: str) -> dict[str, Any]:
    """Time `steps` decode steps from position prompt_len, then profile as many again."""
    first = torch.ones(decoder.tok.shape[0], dtype=torch.long, device=device)
    decoder.prepare(prompt_len, prompt_len + steps)  # captures the graphs these steps replay
    decoder.start(first, prompt_len)
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        decoder.step()
    sync(device)
    wall = (time.perf_counter() - t) / steps

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    decoder.start(first, prompt_len)
    sync(device)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            decoder.step()
        sync(device)
    kernels = kernels_of(prof, steps)
    return {"batch": batch, "bucket": decoder.tok.shape[0], "prompt_len": prompt_len, "steps": steps,
            "window": decoder.window_for(prompt_len),  # at the first step
            "wall_us_per_step": wall * 1e6,
            "kernel_us_per_step": sum(k["us_per_step"] for k in kernels),
            "launches_per_step": sum(k["per_step"] for k in kernels), "kernels": kernels}


def kernels_of(prof: Any, calls: int) -> list[dict[str, Any]]:
    """Device kernels a profile saw, per call of what was profiled (`calls` of them), slowest first."""
    kernels = []
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(e, "self_cuda_time_total", 0)
        if device_us and "CUDA" in str(e.device_type):
            kernels.append({"name": e.key, "per_step": e.count / calls, "us_per_step": device_us / calls})
    return sorted(kernels, key=lambda k: -k["us_per_step"])


def show(r: dict[str, Any], top: int) -> str:
    lines = [f"== batch {r['batch']} (bucket {r['bucket']}), after a {r['prompt_len']}-token prompt, window "
             f"{r['window']} slots: wall {r['wall_us_per_step']:.1f} us/step, kernels {r['kernel_us_per_step']:.1f} "
             f"us/step in {r['launches_per_step']:.0f} launches (gaps {r['wall_us_per_step'] - r['kernel_us_per_step']:.1f} us)"]
    lines.append(f"  {'us/step':>9} {'share':>6} {'per step':>8}  kernel")
    for k in r["kernels"][:top]:
        share = k["us_per_step"] / max(r["wall_us_per_step"], 1e-9)
        lines.append(f"  {k['us_per_step']:9.2f} {share:6.1%} {k['per_step']:8.1f}  {k['name'][:110]}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("--engines", default=None)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--out", default="profile_decode.json")
    args = ap.parse_args()
    recipe = load_recipe(args.recipe)
    results = []
    with open_session(recipe, args.engines, build=False) as session:
        engine = session.engine
        for b in (int(x) for x in args.batches.split(",")):
            if b > engine.max_batch_size:
                continue
            r = profile_bucket(engine, b, args.prompt_len, args.steps)
            results.append(r)
            print(show(r, args.top), flush=True)
    Path(args.out).write_text(json.dumps({"recipe": args.recipe, "device": torch.cuda.get_device_name(0)
                                          if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
                                          "buckets": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
