"""What publishing an engine costs after its build, with its weights hashed at publish or while the build runs.

A weights file of --gib GiB is written into a build folder of a fresh store and published twice: once hashed and
flushed by `Store.publish` itself, once handed to a `FileDigests` when written (as the torch backend does) while
a sleep of --overlap seconds stands for the compile it overlaps. Prints the seconds publish took after the
build and the hashing thread's seconds, and writes them as JSON.

    python3 benchmarks/probes/publish_probe.py --gib 2 --out /tmp/publish.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from trtbuild.store.digests import FileDigests
from trtbuild.store.local import Store


def publish_once(store: Store, key: str, gib: int, overlap_s: float | None) -> dict[str, float]:
    work = store.new_workdir("probe", key)
    weights = work / "weights.safetensors"
    block = os.urandom(1 << 26)
    with open(weights, "wb") as f:
        for _ in range(gib * 16):
            f.write(block)
    digests = FileDigests(work)
    if overlap_s is not None:
        digests.add(weights)
        time.sleep(overlap_s)
    t = time.perf_counter()
    store.publish(work, "probe", key, {"key": key, "name": "probe", "backend": "torch"}, known=digests.known())
    return {"publish_s": time.perf_counter() - t, "hashed_during_build_s": digests.seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=int, default=2)
    ap.add_argument("--overlap", type=float, default=5.0, help="seconds of build the hashing may overlap")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        store = Store(Path(tmp) / "engines")
        rows: dict[str, Any] = {"hashed at publish": publish_once(store, "a" * 64, args.gib, None),
                                "hashed during the build": publish_once(store, "b" * 64, args.gib, args.overlap)}
    print(f"{'weights':<26} {'publish s':>10} {'hashed during build s':>22}   ({args.gib} GiB)")
    for name, r in rows.items():
        print(f"{name:<26} {r['publish_s']:10.2f} {r['hashed_during_build_s']:22.2f}")
    if args.out:
        args.out.write_text(json.dumps({"gib": args.gib, "overlap_s": args.overlap, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
