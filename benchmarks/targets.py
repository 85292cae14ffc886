"""The project's speed targets (RESULTS.md's first table), checked against one run's report: met or not, with the measured figure.

A verdict is computed only from figures measured in the same run (the floors, peers and restart read
are all from that report); a target whose figures are missing says so instead of passing.
"""

from __future__ import annotations

from typing import Any

# Per recipe name: decode time per token ÷ its floor at each batch size, prefill time ÷ its floor per
# prompt length (≥ 60% of the matmul rate is ≤ 1/0.6 of the floor), restart ÷ reading the weights.
TARGETS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {"decode": {"1": 1.12, "8": 1.30}, "prefill": {"2048": 1 / 0.60}, "restart": 2.0},
    "llama-3.2-1b": {"decode": {"1": 1.30, "8": 1.30}},
    # the chosen experts' bytes, the attention and the shared weights once a step (bench.decode_bytes)
    "qwen3-30b-a3b": {"decode": {"1": 1.60}},
}
REBUILD_X_COLD = 0.5  # every recipe: a rebuild with the tactic cache kept, against the cold build
ENGINE = "engine"

Verdict = dict[str, Any]


def _verdict(target: str, measured: str, met: bool | None) -> Verdict:
    return {"target": target, "measured": measured, "met": met}


def _ratio(variant: dict[str, Any], kind: str, point: str) -> float | None:
    figure = variant.get(kind, {}).get(point)
    return figure.get("x_floor") if figure else None


def check(rec: dict[str, Any]) -> list[Verdict]:
    """Verdicts for one recipe's section of a bench report (`report["recipes"][path]`)."""
    out: list[Verdict] = []
    limits = TARGETS.get(rec.get("recipe", ""), {})
    variants = rec.get("variants", {})
    engine = variants.get(ENGINE, {})
    for kind in ("decode", "prefill"):
        for point, limit in limits.get(kind, {}).items():
            what = f"{kind} {'batch ' + point if kind == 'decode' else point + ' tokens'} <= {limit:.2f}x floor"
            x = _ratio(engine, kind, point)
            out.append(_verdict(what, f"{x:.2f}x" if x is not None else "not measured",
                                None if x is None else x <= limit))
    out.extend(_ahead_of_peers(variants))
    if "restart" in limits:
        for cache in ("cold", "warm"):
            r = rec.get("restart", {}).get(cache)
            x = r.get("ratio_to_floor") if r and "error" not in r["engine"] else None
            # the first restart reads the weights with safetensors' loader (TRTBUILD_LOAD_THREADS=0); the
            # threaded reader, the default for CUDA engines since 2026-12-04, is reported beside it
            out.append(_verdict(f"restart ({cache} page cache), safetensors' loader <= {limits['restart']:.1f}x "
                                "reading the weights",
                                f"{x:.2f}x" if x is not None else "not measured",
                                None if x is None else x <= limits["restart"]))
            # what no restart that imports torch can go under, measured in the same round (warm only)
            ready = r.get("torch_process_floor") if r else None
            alone = (f"; a process that only imports torch: {ready['ratio_to_floor']:.2f}x"
                     if ready and "error" not in ready else "")
            for key, how in (("load_threads", "weights read by the threaded reader after start-up (TRTBUILD_PRELOAD=0)"),
                             ("load_threads_preload", "weights read onto the GPU during start-up (the CUDA default)")):
                run = r.get(f"engine_{key}") if r else None
                if run is not None:
                    x = r[f"ratio_to_floor_{key}"] if "error" not in run else None
                    out.append(_verdict(f"restart ({cache} page cache), {how} <= {limits['restart']:.1f}x reading the "
                                        "weights", f"{x:.2f}x{alone}" if x is not None else "not measured",
                                        None if x is None else x <= limits["restart"]))
    build = rec.get("build", {})
    ratio = build.get("ratio")
    out.append(_verdict(f"rebuild with the tactic cache <= {REBUILD_X_COLD}x the cold build",
                        f"{ratio:.2f}x" if ratio is not None else "not measured",
                        None if ratio is None else ratio <= REBUILD_X_COLD))
    return out


def _ahead_of_peers(variants: dict[str, Any]) -> list[Verdict]:
    """One verdict per figure the engine and at least one peer both measured: strictly faster than
    every peer (a tie is not a lead), with the closest peer and the margin named. Where the run measured
    the engine again (`engine@again`), a lead no larger than the engine's own drift on that row is
    unknown, not met: the same graph moved by 5% within one run (RESULTS.md, 2026-12-04 H200)."""
    engine = variants.get(ENGINE, {})
    again = variants.get(f"{ENGINE}@again", {})
    # engine@LEVEL is trtbuild itself at another tactics level: an A/B, never a peer to beat
    peers = {name: v for name, v in variants.items()
             if name.split("@")[0] != ENGINE and (v.get("decode") or v.get("prefill"))}
    if not peers:
        return [_verdict("ahead of every peer in the same run", "no peer measured", None)]
    out = []
    for kind in ("decode", "prefill"):
        for point, mine in sorted(engine.get(kind, {}).items(), key=lambda kv: int(kv[0])):
            theirs = {name: v[kind][point]["p50"] for name, v in peers.items() if point in v.get(kind, {})}
            if not theirs:
                continue
            closest = min(theirs, key=theirs.__getitem__)
            margin = theirs[closest] / mine["p50"] - 1
            label = f"batch {point}" if kind == "decode" else f"{point} tokens"
            measured = (f"{mine['p50'] * 1e3:.3f} ms vs {closest} {theirs[closest] * 1e3:.3f} ms "
                        f"({closest} {abs(margin):.1%} {'slower' if margin > 0 else 'faster'})")
            met: bool | None = margin > 0
            if point in again.get(kind, {}):
                drift = abs(again[kind][point]["p50"] / mine["p50"] - 1)
                measured += f"; the engine itself moved {drift:.1%} within the run"
                met = None if met and margin <= drift else met
            out.append(_verdict(f"{kind} {label}: ahead of {', '.join(sorted(theirs))}", measured, met))
    return out


def table(report: dict[str, Any]) -> str:
    lines = []
    for rec in report["recipes"].values():
        lines.append(f"== targets, {rec.get('recipe')}")
        for v in rec.get("targets", []):
            state = {True: "met", False: "NOT MET", None: "unknown"}[v["met"]]
            lines.append(f"  {state:8} {v['target']}: {v['measured']}")
    return "\n".join(lines)
