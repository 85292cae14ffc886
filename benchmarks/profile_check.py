"""`trtbuild profile` on a device, checked against the step time `run` measures: decode at each batch and a
long prefill, one process, one engine (built if needed).

    python benchmarks/profile_check.py recipes/llama-3.2-1b.yaml --engines /tmp/e --out $OUT

Prints each profile's table; writes profile.json (every table, the ceilings, and per decode batch the
profiled step against the TPOT of a `run` of --output-len (128) new tokens after the same prompt, with their
ratio) and one PNG a case (roofline and where the step's time goes) under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # trtbuild, run from a checkout
import trtbuild  # noqa: E402,F401  - before torch: one libstdc++ for the compiled graphs

from trtbuild.measure.ceilings import cached  # noqa: E402
from trtbuild.measure.profile import profile_engine  # noqa: E402
from trtbuild.measure.profile_report import plot, print_profile  # noqa: E402
from trtbuild.recipe import load_recipe  # noqa: E402
from trtbuild.runner import open_session, run_report  # noqa: E402
from trtbuild.store.local import Store  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("--engines", default=None)
    ap.add_argument("--out", default=".")
    ap.add_argument("--batches", default="1,8", help="decode batch sizes")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt before the decode steps")
    ap.add_argument("--prefill-len", type=int, default=2048, help="0: no prefill profile")
    ap.add_argument("--output-len", type=int, default=128, help="tokens of the `run` whose TPOT is compared")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    recipe = load_recipe(args.recipe)
    report: dict[str, Any] = {"recipe": args.recipe, "cases": {}}
    with open_session(recipe, args.engines, progress=lambda m: print(f"[profile] {m}", flush=True)) as session:
        report["ceilings"] = ceilings = cached(session.engine.device, Store(args.engines).root / "ceilings")
        cases: list[tuple[str, tuple[str, ...], int, int]] = [
            (f"decode_b{b}", ("decode",), b, args.prompt_len) for b in map(int, args.batches.split(","))]
        if args.prefill_len:
            cases.append((f"prefill_{args.prefill_len}", ("prefill",), 1, args.prefill_len))
        for name, phases, batch, length in cases:
            result = profile_engine(session, phases, batch, length, ceilings)
            print_profile(result)
            try:
                plot(result, str(out / f"profile-{name}.png"))
            except ImportError as e:  # the tables and the JSON are the record; the picture is a convenience
                print(f"[profile] no plot: {e}", flush=True)
            case: dict[str, Any] = {"profile": result}
            if phases == ("decode",):
                run = run_report(session, batch_size=batch, input_len=length, output_len=args.output_len, iterations=2)
                decode = result["phases"]["decode"]
                step, kernels, tpot = decode["step_s"] * 1e3, decode["kernel_s"] * 1e3, run["tpot_ms"]["p50"]
                # how much of the step `run` measures the profile's kernels account for: its rows explain the
                # step where this is near 1 (the profile's step itself is the engine's, timed as run times it)
                case["agreement"] = {"profile_step_ms": step, "profile_kernels_ms": kernels,
                                     "profiled_wall_ms": decode["profiled_step_s"] * 1e3, "run_tpot_p50_ms": tpot,
                                     "ratio": step / tpot, "kernel_ratio": kernels / tpot}
                print(f"[profile] {name}: profile step {step:.4f} ms (its kernels {kernels:.4f} ms), run TPOT p50 "
                      f"{tpot:.4f} ms: step {step / tpot:.3f}x, kernels {kernels / tpot:.3f}x the TPOT", flush=True)
            report["cases"][name] = case
            (out / "profile.json").write_text(json.dumps(report, indent=1) + "\n")  # kept if a later case dies


if __name__ == "__main__":
    main()
