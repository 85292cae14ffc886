"""Where a built engine's compile seconds went: each compiled program (a graph, or a region of one), who
compiled it (the build or a worker), its Inductor and C++ seconds, and Inductor's own timers above a
threshold, read from the engine's engine.json (trtbuild/backends/torch/inductor.compile_parts).

    python3 benchmarks/probes/build_breakdown.py /tmp/gate-engines [--min 1.0] [--json out.json]

Every engine entry under the store is listed, newest first.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def programs(engine: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(name, record) for each compiled program of an engine spec, regions by their graph and index."""
    out: list[tuple[str, dict[str, Any]]] = []
    for name, graph in sorted(engine.get("graphs", {}).items()):
        if "regions" in graph:
            out += [(f"{name}.r{k}", region) for k, region in enumerate(graph["regions"])]
        else:
            out.append((name, graph))
    return out


def describe(record: dict[str, Any], floor: float) -> dict[str, Any]:
    """One program's compile facts; a worker's own report where a worker compiled it."""
    source = record.get("worker") or record
    timers = {k: v for k, v in (source.get("compile_timers") or {}).items() if v >= floor}
    return {"by": "worker" if record.get("worker") else ("cache" if record.get("reused") else "build"),
            "compile_s": round(float(record.get("compile_s", 0.0)), 2),
            "worker_compile_s": round(float(source.get("compile_s", 0.0)), 2) if record.get("worker") else None,
            "inductor_s": round(float(source.get("compile_inductor_s", 0.0)), 2),
            "cxx_s": round(float(source.get("compile_cxx_s", 0.0)), 2), "timers": timers}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("store", type=Path)
    ap.add_argument("--min", type=float, default=1.0, help="show timers of at least this many seconds")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    entries = sorted(args.store.glob("v1/*/engine.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    report: dict[str, Any] = {}
    for spec in entries:
        engine = json.loads(spec.read_text())
        rows = {name: describe(record, args.min) for name, record in programs(engine)}
        report[spec.parent.name] = rows
        print(spec.parent.name)
        for name, row in rows.items():
            print(f"  {name:14s} {row['by']:6s} wall {row['compile_s']:7.2f} s  inductor {row['inductor_s']:6.2f}"
                  f"  c++ {row['cxx_s']:6.2f}")
            for timer, seconds in row["timers"].items():
                print(f"      {timer:44s} {seconds:7.2f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
