"""A bounded reliability round for the engine store, with real `python -m trtbuild` processes.

    /work/venv/bin/python benchmarks/reliability.py                 # default round: ~5-6 min on 2 CPU cores
    /work/venv/bin/python benchmarks/reliability.py --builders 8 --kill-rounds 3 --malformed 1000 --corrupt-all

Sections, each in its own store under one temporary root (or under --engines DIR, kept):
  concurrency  --builders processes for one key and --second-builders for another, all started at once;
  kills        SIGKILL via TRTBUILD_FAULT at exporting, compiling, before_publish, then an external
               kill -9 at a random moment, then a build that must succeed (per --kill-rounds);
  corruption   published entries copied to fresh stores, one file damaged one way per copy;
  malformed    generated bad recipes through `trtbuild validate` (batched) and a sample through `build`.
Prints a table last (BAD marks a figure that breaks the store's contract) and writes --out JSON.
What each figure counts: benchmarks/reliability_README.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import copy
import fcntl
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# The tests' tiny recipe, so this round builds exactly what the test suite builds.
from tests.conftest import TINY_CONFIG, tiny_recipe_doc, write_recipe  # noqa: E402

WAITING = "waiting for the build of this engine by pid"
Figure = tuple[str, str, str, str, bool]  # section, figure, value, expected, bad


@dataclass
class Proc:
    rc: int
    out: str
    err: str
    secs: float

    @property
    def traceback(self) -> bool:
        return "Traceback" in self.err


def child_env(**extra: str) -> dict[str, str]:
    """The caller's environment minus trtbuild's switches, so only what a case sets applies."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRTBUILD_")}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def spawn(args: list[Any], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    # A session of its own, so whatever a killed builder leaves running can be found by its group id.
    return subprocess.Popen([sys.executable, "-m", "trtbuild", *map(str, args)], cwd=REPO, env=env or child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                            start_new_session=True)


def finish(p: subprocess.Popen[str], timeout: float, t0: float) -> Proc:
    try:
        out, err = p.communicate(timeout=max(1.0, timeout - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        kill_group(p.pid)
        out, err = p.communicate()
        return Proc(124, out, err + "\n[reliability: timed out]", time.monotonic() - t0)
    return Proc(p.returncode, out, err, time.monotonic() - t0)


def cli(*args: Any, timeout: float, env: dict[str, str] | None = None) -> Proc:
    return finish(spawn(list(args), env), timeout, time.monotonic())


def kill_group(pgid: int) -> int:
    """SIGKILL what is left of one process group that this script started; returns how many were left."""
    left = 0
    for d in Path("/proc").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            left += d.name.isdigit() and int(fields[2]) == pgid and fields[0] != "Z"
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    return left


# -- looking at a store from outside, as a later process would ----------------------------------------
def entry_dirs(store: Path) -> list[Path]:
    v1 = store / "v1"
    return sorted(p for p in v1.iterdir() if not p.name.startswith(".")) if v1.is_dir() else []


def tmp_dirs(store: Path) -> list[str]:
    tmp = store / "v1" / ".tmp"
    return sorted(p.name for p in tmp.iterdir()) if tmp.is_dir() else []


def manifest_of(entry: Path) -> dict[str, Any] | None:
    try:
        m = json.loads((entry / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) else None


def visible_damage(store: Path, timeout: float) -> list[str]:
    """What a lookup could mistake for an engine: folders without a readable manifest, and what
    `cache verify --all` calls corrupt."""
    bad = [f"{p.name}: no readable manifest" for p in entry_dirs(store) if manifest_of(p) is None]
    v = cli("cache", "verify", "--all", "--engines", store, timeout=timeout)
    bad += [line for line in v.out.splitlines() if line.startswith("CORRUPT")]
    if v.rc not in (0, 1) or v.traceback:
        bad.append(f"cache verify exited {v.rc}: {v.err[-300:]}")
    return bad


def held_locks(store: Path) -> list[str]:
    """Build locks still held: try each flock without waiting, as the next builder's first attempt does."""
    held = []
    for lock in sorted((store / "v1" / ".locks").glob("*.lock")):
        with open(lock, "a+b") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held.append(lock.name)
            else:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    return held


def served(proc: Proc) -> dict[str, Any] | None:
    """A build's JSON report, if it exited 0 naming a published entry that holds the key it reported."""
    try:
        rep = json.loads(proc.out.strip().splitlines()[-1])
        m = manifest_of(Path(rep["engine"]["path"]))
        return rep if proc.rc == 0 and m is not None and m.get("key") == rep["engine"]["key"] else None
    except (ValueError, IndexError, KeyError, TypeError):
        return None


def synthetic(seed: int) -> dict[str, Any]:
    return {"source": "synthetic", "seed": seed, "config": dict(TINY_CONFIG)}  # another seed: another key


# -- sections ------------------------------------------------------------------------------------------
def concurrency(root: Path, a: argparse.Namespace) -> dict[str, Any]:
    store, groups = root / "flight", {"a": a.builders, "b": a.second_builders}
    recipes = {k: write_recipe(root / "recipes", tiny_recipe_doc(name=f"flight-{k}", model=synthetic(i)), f"flight-{k}.yaml")
               for i, k in enumerate(groups)}
    t0 = time.monotonic()  # both keys at once: the lock is per key, so the two builds must overlap
    procs = [(k, spawn(["build", recipes[k], "--engines", store, "--json"])) for k, n in groups.items() for _ in range(n)]
    results = [(k, finish(p, a.timeout, t0)) for k, p in procs]
    keys: dict[str, Any] = {}
    for k, n in groups.items():
        mine = [r for g, r in results if g == k]
        reps = [rep for rep in map(served, mine) if rep]
        keys[k] = {"builders": n, "builds": sum(not r["engine"]["cache_hit"] for r in reps), "served": len(reps),
                   "distinct_keys": len({r["engine"]["key"] for r in reps}), "said_waiting": sum(WAITING in r.err for r in mine),
                   "tracebacks": sum(r.traceback for r in mine), "rcs": [r.rc for r in mine],
                   "secs": [round(r.secs, 1) for r in mine], "entry": reps[0]["engine"]["path"] if reps else None,
                   "failures": [r.err[-600:] for r in mine if r.rc != 0]}
    stats = cli("cache", "stats", "--engines", store, "--json", timeout=a.timeout)
    return {"keys": keys, "stats": json.loads(stats.out) if stats.rc == 0 else stats.err[-400:],
            "damage_after": visible_damage(store, a.timeout), "wall_s": round(time.monotonic() - t0, 1),
            "recipes": {k: str(v) for k, v in recipes.items()}}


def kills(root: Path, a: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    rounds = []
    for r in range(a.kill_rounds):
        store = root / f"kills-{r}"
        # The flight builds' compile cache, so each build here takes about half a cold one; crash safety
        # does not rest on it (a killed builder's cache writes are Inductor's own atomic renames).
        if (root / "flight" / "tactics").is_dir():
            shutil.copytree(root / "flight" / "tactics", store / "tactics")
        recipe = write_recipe(root / "recipes", tiny_recipe_doc(name=f"kill-{r}", model=synthetic(100 + r)), f"kill-{r}.yaml")
        events: list[dict[str, Any]] = []
        procs: list[Proc] = []
        build_s = 30.0
        for point in ("exporting", "compiling", "before_publish", "external"):
            orphans, delay = 0, None
            if point == "external":
                # A random moment inside the build: 1-20 s, but within the build time just measured.
                delay = rng.uniform(1.0, max(1.5, min(20.0, 0.8 * build_s)))
                t0 = time.monotonic()
                p = spawn(["build", recipe, "--engines", store])  # progress on stderr tells where it died
                try:
                    p.wait(timeout=delay)
                    killed = False  # it finished first: not a kill
                except subprocess.TimeoutExpired:
                    os.kill(p.pid, signal.SIGKILL)
                    killed = True
                    time.sleep(0.5)
                    # Compiler children outliving their builder: counted, then ended, so that none holds
                    # the builder's stderr open (which would stall the read below) or outlives this script.
                    orphans = kill_group(p.pid)
                proc = finish(p, a.timeout, t0)
                lines = [ln for ln in proc.err.splitlines() if ln.startswith("trtbuild: ")]
                stage = lines[-1][10:] if lines else "before the first progress line"
            else:
                proc = cli("build", recipe, "--engines", store, "--json", env=child_env(TRTBUILD_FAULT=point), timeout=a.timeout)
                killed, stage = proc.rc == -signal.SIGKILL, point
                build_s = proc.secs if point == "before_publish" else build_s
            procs.append(proc)
            events.append({"point": point, "rc": proc.rc, "killed": killed, "stage": stage, "delay_s": delay,
                           "secs": round(proc.secs, 1), "visible": visible_damage(store, a.timeout),
                           "entries": len(entry_dirs(store)), "held_locks": held_locks(store),
                           "tmp_left": len(tmp_dirs(store)), "orphans": orphans, "traceback": proc.traceback,
                           "err_tail": proc.err[-400:] if not killed else ""})
        final = cli("build", recipe, "--engines", store, "--json", timeout=a.timeout)
        procs.append(final)
        rep = served(final)
        for i, ev in enumerate(events):
            # Stuck: still held after the kill, or the next builder had to wait for / never got the lock.
            nxt = procs[i + 1]
            ev["stuck"] = bool(ev["held_locks"]) or WAITING in nxt.err or nxt.rc == 124
        # A kill -9 that lands after the publish rename legitimately leaves a whole engine: then the
        # final build is a hit, and still a success.
        rounds.append({"recipe": str(recipe), "events": events, "final_rc": final.rc, "final_s": round(final.secs, 1),
                       "rebuilt": rep is not None, "final_cache_hit": rep["engine"]["cache_hit"] if rep else None, "entry": rep["engine"]["path"] if rep else None,
                       "tmp_left_after": tmp_dirs(store), "entries_after": len(entry_dirs(store)),
                       "visible_after": visible_damage(store, a.timeout), "final_err": final.err[-600:] if not rep else ""})
    return {"rounds": rounds}


def damage(path: Path, mode: str, frac: float) -> str:
    """Damage one file one way; `frac` places the damage, so every copy of a case gets the same bytes."""
    data = path.read_bytes()
    if mode == "delete":
        path.unlink()
        return "deleted"
    if mode == "flip":
        i = int(frac * len(data))
        path.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:])
        return f"byte {i} of {len(data)} flipped"
    if mode == "truncate":
        path.write_bytes(data[: int(frac * len(data))])
        return f"truncated to {int(frac * len(data))} of {len(data)} bytes"
    if mode == "append":
        path.write_bytes(data + b"\0garbage\n")
        return "9 bytes appended"
    path.write_text(data.decode().replace("{", "{,", 1))  # badjson: one stray comma, same size class
    return "invalid JSON"


def corruption(root: Path, a: argparse.Namespace, rng: random.Random, sources: dict[str, tuple[Path, Path]]) -> dict[str, Any]:
    cases = []
    for state, (entry, recipe) in sources.items():
        for f in sorted(p.name for p in entry.iterdir() if p.is_file()):
            for mode in ("flip", "truncate", "delete", "append") + (("badjson",) if f == "manifest.json" else ()):
                # An entry already used is looked up with size checks only, so by default only the damage that
                # check cannot see (a same-size flip) is tried on it; --corrupt-all tries every case there too.
                if state == "used" and not a.corrupt_all and (mode != "flip" or f == "manifest.json"):
                    continue
                cases.append({"state": state, "file": f, "mode": mode, "frac": rng.random(), "entry": entry, "recipe": recipe})

    def one(i: int, c: dict[str, Any]) -> dict[str, Any]:
        def fresh_copy(tag: str) -> Path:
            store = root / "corrupt" / f"{i:03d}-{tag}"
            shutil.copytree(c["entry"], store / "v1" / c["entry"].name)  # the entry alone: all a lookup reads
            c["damage"] = damage(store / "v1" / c["entry"].name / c["file"], c["mode"], c["frac"])
            return store

        run = cli("run", c["recipe"], "--engines", fresh_copy("run"), "--no-build", "--iterations", "1", timeout=a.timeout)
        ver = cli("cache", "verify", "--all", "--engines", fresh_copy("verify"), timeout=a.timeout)
        res = {k: str(v) if isinstance(v, Path) else v for k, v in c.items()}
        res.update(refused=run.rc != 0 and any(w in run.err.lower() for w in ("corrupt", "quarantine")),
                   flagged=ver.rc == 1 and "CORRUPT" in ver.out, served=run.rc == 0, run_rc=run.rc,
                   traceback=run.traceback or ver.traceback, run_err=run.err[-400:])
        # Sizes only after first use is the cost rule: a same-size flip there is served until hashes
        # are asked for, so ask (`run --verify`) and hold that answer to the never-serve rule instead.
        res["by_design"] = res["served"] and c["state"] == "used" and c["mode"] == "flip"
        if res["by_design"]:
            vrun = cli("run", c["recipe"], "--engines", fresh_copy("run-verify"), "--no-build", "--verify",
                       "--iterations", "1", timeout=a.timeout)
            res.update(verify_refused=vrun.rc != 0 and "corrupt" in vrun.err.lower(), served_anyway=vrun.rc == 0,
                       traceback=res["traceback"] or vrun.traceback)
        else:
            res["served_anyway"] = res["served"]
        res["detected"] = res["refused"] or res["flagged"] or res.get("verify_refused", False)
        return res

    with cf.ThreadPoolExecutor(a.jobs) as pool:  # threads only wait; each case is real processes
        results = list(pool.map(lambda t: one(*t), enumerate(cases)))
    return {"sources": {s: {"entry": str(e), "verified": (manifest_of(e) or {}).get("verified")} for s, (e, _) in sources.items()},
            "cases": results}


# -- malformed recipes ---------------------------------------------------------------------------------
def _paths(doc: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if not isinstance(doc, dict):
        return [prefix]
    return ([prefix] if prefix else []) + [p for k, v in doc.items() for p in _paths(v, prefix + (k,))]


def _at(doc: dict[str, Any], path: tuple[str, ...]) -> tuple[dict[str, Any], str]:
    for k in path[:-1]:
        doc = doc[k]
    return doc, path[-1]


WRONG: dict[type, list[Any]] = {int: ["12", 3.5, True, None, [1], {"x": 1}], str: [12, True, None, ["a"], {"x": 1}],
                                float: ["fast", True, None, [1.0]], bool: [1, "yes", None, 0.5],
                                list: [2, "2", None, {"x": 1}], dict: [5, "big", None, [1, 2]]}
IMPOSSIBLE: list[tuple[tuple[str, ...], Any]] = [
    (("shapes", "max_input_len"), 49), (("shapes", "max_batch_size"), 0), (("shapes", "max_batch_size"), -3),
    (("shapes", "batch_buckets"), [3]), (("shapes", "batch_buckets"), [2, 2]), (("shapes", "batch_buckets"), [1]),
    (("shapes", "max_seq_len"), 65), (("shapes", "max_seq_len"), 1), (("model", "config", "hidden_size"), 30),
    (("model", "config", "num_key_value_heads"), 3), (("model", "config", "head_dim"), 7),
    (("model", "config", "num_hidden_layers"), 0), (("model", "config", "vocab_size"), -5), (("run", "input_len"), 17),
    (("run", "output_len"), 48), (("run", "batch_size"), 3), (("backend",), "tensorrt-llm2"), (("precision",), "fp4"),
    (("precision",), "fp8"), (("tactics", "level"), "ultra"), (("name",), "Bad Name"), (("name",), "tiny\n"),
    (("model", "config", "model_type"), "gpt2"), (("model", "source"), "not a repo id"), (("model", "source"), "a/b/c"),
    (("model", "seed"), -3), (("model", "config", "rope_scaling"), {"rope_type": "yarn"}),
    (("model", "config", "rope_scaling"), {"rope_type": "llama3", "factor": 8}), (("options",), {"foo": 1}),
    (("model", "source"), "./no-such-model-folder"), (("model", "revision"), "main")]
GARBAGE = ["{", "}", "[", "]", ": ", "- ", "!!python/object:os.system", "&a", "*a", "*undefined", "\t", "'", '"', "%YAML 9",
           "---", "? ", "|", ">", "\x00", "name", "model", "shapes:", "2001-13-01", "!!timestamp x", "\n", "  ", "1e999"]


def make_malformed(folder: Path, n: int, rng: random.Random) -> list[dict[str, Any]]:
    """`n` bad recipes. Local-folder damage that only a build can see comes first (validate does not read
    model files); the rest are random mutations of the tiny recipe, each broken by construction."""
    from safetensors.torch import load_file, save_file

    from trtbuild.models.checkpoint import write_synthetic
    from trtbuild.recipe import SYNTHETIC_FIELDS

    base, cases = tiny_recipe_doc(name="bad"), []
    known = set(SYNTHETIC_FIELDS) | set(base) | {"source", "revision", "config", "seed", "batch_buckets", "level",
                                                 "max_batch_size", "max_input_len", "max_seq_len", "batch_size", "input_len", "output_len"}
    good = folder / "good-model"
    write_synthetic(good, dict(TINY_CONFIG), 0)

    def model_case(kind: str, culprit: str, hurt: Callable[[Path], None]) -> None:
        m = folder / f"model-{len(cases):03d}"
        shutil.copytree(good, m)
        hurt(m)
        doc = {**copy.deepcopy(base), "model": {"source": f"./{m.name}"}}
        cases.append({"kind": kind, "text": yaml.safe_dump(doc, sort_keys=False), "culprit": str(m / culprit),
                      "build_only": culprit != "."})

    def tensors(m: Path, change: Callable[[dict[str, Any]], None]) -> None:
        t = load_file(str(m / "model.safetensors"))
        change(t)
        save_file(t, str(m / "model.safetensors"))

    cfg_text = (good / "config.json").read_text()
    model_case("truncated config.json", "config.json", lambda m: (m / "config.json").write_text(cfg_text[: len(cfg_text) // 2]))
    model_case("config.json not an object", "config.json", lambda m: (m / "config.json").write_text("[1, 2]"))
    model_case("config.json missing hidden_size", "config.json", lambda m: (m / "config.json").write_text(
        json.dumps({k: v for k, v in json.loads(cfg_text).items() if k != "hidden_size"})))
    model_case("config.json hidden_size a string", "config.json", lambda m: (m / "config.json").write_text(
        json.dumps({**json.loads(cfg_text), "hidden_size": "32"})))
    model_case("safetensors missing a tensor", "model.safetensors", lambda m: tensors(m, lambda t: t.pop(sorted(t)[len(t) // 2])))
    model_case("safetensors mis-shaped tensor", "model.safetensors", lambda m: tensors(
        m, lambda t: t.update({k: t[k][:-1].clone() for k in sorted(t)[:1]})))
    model_case("truncated safetensors", "model.safetensors", lambda m: (m / "model.safetensors").write_bytes(
        (m / "model.safetensors").read_bytes()[:5000]))
    model_case("no safetensors file", "model.safetensors", lambda m: (m / "model.safetensors").unlink())
    model_case("model folder without config.json", ".", lambda m: (m / "config.json").unlink())
    while len(cases) < n:
        kind, doc = rng.choice(["garbage", "wrong type", "unknown key", "missing key", "impossible", "truncated yaml",
                                "yaml syntax", "binary"]), copy.deepcopy(base)
        text = None
        if kind == "garbage":
            text = "".join(rng.choice(GARBAGE) for _ in range(rng.randint(1, 40)))
        elif kind == "binary":
            text = bytes(rng.randrange(128, 256) for _ in range(rng.randint(1, 200))).decode("latin-1")
        elif kind == "wrong type":
            parent, key = _at(doc, rng.choice(_paths(doc)))
            bad = rng.choice(WRONG[type(parent[key])])
            parent[key] = bad if not isinstance(parent[key], float) or not isinstance(bad, int) else "x"
        elif kind == "unknown key":
            parent = rng.choice([doc] + [_at(doc, p)[0][p[-1]] for p in _paths(doc) if isinstance(_at(doc, p)[0][p[-1]], dict)])
            word = rng.choice(list(parent) or ["name"])
            typo = rng.choice([word + "s", word[1:], word[:-1] + "_", "x_" + word, word.replace("_", "")])
            parent[typo if typo not in known else typo + "_zz"] = rng.choice([1, "a", None])
        elif kind == "missing key":
            parent, key = _at(doc, rng.choice([("name",), ("model",), ("shapes",), ("model", "source"), ("model", "config"),
                                               ("shapes", "max_seq_len"), ("shapes", "max_input_len"), ("shapes", "max_batch_size"),
                                               *[("model", "config", k) for k, (_, req) in SYNTHETIC_FIELDS.items() if req]]))
            del parent[key]
        elif kind == "impossible":
            path, value = rng.choice(IMPOSSIBLE)
            parent, key = _at(doc, path)
            parent[key] = value
        raw = text if text is not None else yaml.safe_dump(doc, sort_keys=False)
        if kind == "truncated yaml":  # cut before `shapes:` so a required block is always gone
            raw = raw[: rng.randrange(raw.index("shapes:"))]
        elif kind == "yaml syntax":
            lines = raw.splitlines()
            i = rng.randrange(len(lines))
            lines[i] = rng.choice(["\t", "[", "{", "*undefined ", "- ", ": :"]) + lines[i]
            raw = "\n".join(lines)
        cases.append({"kind": kind, "text": raw, "culprit": None, "build_only": False})
    for i, c in enumerate(cases):
        c["path"] = str(folder / f"{i:03d}-{c['kind'].replace(' ', '-').replace('.', '')}.yaml")
        Path(c["path"]).write_text(c["text"], encoding="latin-1" if c["kind"] == "binary" else "utf-8")
    return cases


def clear_error(proc: Proc, names: list[str]) -> bool:
    return proc.rc == 2 and not proc.traceback and any(
        ln.startswith("Error:") and any(n in ln for n in names) for ln in proc.err.splitlines())


def malformed(root: Path, a: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    folder = root / "malformed"
    folder.mkdir(parents=True)
    cases = make_malformed(folder, a.malformed, rng)
    size = max(1, -(-len(cases) // a.validate_batches))
    for chunk in (cases[i:i + size] for i in range(0, len(cases), size)):
        batch = cli("validate", *[c["path"] for c in chunk], timeout=a.timeout)
        for c in chunk:
            c["accepted"] = f"{c['path']}: ok" in batch.out
            named = any(ln.startswith(f"Error: {c['path']}:") for ln in batch.err.splitlines())
            c["validate_clear"] = batch.rc == 2 and named and not batch.traceback
            if not c["accepted"] and not c["validate_clear"]:  # a crash or another status: ask about it alone
                alone = cli("validate", c["path"], timeout=a.timeout)
                c["accepted"], c["validate_clear"] = alone.rc == 0, clear_error(alone, [c["path"]])
                c["validate_traceback"], c["validate_err"] = alone.traceback, alone.err[-600:]
    rejected = [c for c in cases if not c["build_only"] and not c["accepted"]]
    sample = [c for c in cases if c["build_only"]] + rng.sample(rejected, min(a.build_sample, len(rejected)))

    def build_one(i: int, c: dict[str, Any]) -> None:
        store = root / "malformed-stores" / f"{i:03d}"
        proc = cli("build", c["path"], "--engines", store, "--json", timeout=a.timeout)
        c.update(built=True, build_rc=proc.rc, build_clear=clear_error(proc, [c["path"], c["culprit"] or c["path"]]),
                 build_traceback=proc.traceback, build_err=proc.err[-600:],
                 left_in_store=[p.name for p in entry_dirs(store)] + tmp_dirs(store))

    with cf.ThreadPoolExecutor(a.jobs) as pool:
        list(pool.map(lambda t: build_one(*t), enumerate(sample)))
    for c in cases:
        c.pop("text")
    return {"cases": cases}


# -- figures ---------------------------------------------------------------------------------------
def figures(r: dict[str, Any]) -> list[Figure]:
    out: list[Figure] = []
    fl = r["concurrency"]
    for k, g in fl["keys"].items():
        out += [("concurrency", f"key {k}: builders started", str(g["builders"]), "", False),
                ("concurrency", f"key {k}: builds done", str(g["builds"]), "1", g["builds"] != 1 or g["distinct_keys"] > 1),
                ("concurrency", f"key {k}: engines served", f"{g['served']}/{g['builders']}", "all", g["served"] != g["builders"]),
                ("concurrency", f"key {k}: waiters that said so", f"{g['said_waiting']}/{g['builders'] - 1}", "", False)]
    st = fl["stats"]
    builds = st.get("builds") if isinstance(st, dict) else None
    out.append(("concurrency", "cache stats: builds / hits", f"{builds} / {st.get('hits') if isinstance(st, dict) else '?'}",
                str(len(fl["keys"])), builds != len(fl["keys"])))
    out.append(("concurrency", "damaged entries after", str(len(fl["damage_after"])), "0", bool(fl["damage_after"])))
    evs = [e for rd in r["kills"]["rounds"] for e in rd["events"]]
    killed = [e for e in evs if e["killed"]]
    ext = [e for e in evs if e["point"] == "external"]
    out += [("kills", "kills injected", f"{len(killed)}/{len(evs)}", "all", any(not e["killed"] for e in evs if e not in ext)),
            ("kills", "external kill -9 at", "; ".join(f"{e['delay_s']:.1f}s ({e['stage'] if e['killed'] else 'missed: exited first'})"
                                                         for e in ext), "", False),
            ("kills", "corrupt/partial entries visible", str(sum(len(e["visible"]) for e in killed)), "0",
             any(e["visible"] for e in killed)),
            ("kills", "stuck locks", str(sum(e["stuck"] for e in killed)), "0", any(e["stuck"] for e in killed)),
            ("kills", "orphaned child processes", str(sum(e["orphans"] for e in evs)), "0", False),
            ("kills", "successful rebuilds", f"{sum(rd['rebuilt'] for rd in r['kills']['rounds'])}/{len(r['kills']['rounds'])}", "all",
             not all(rd["rebuilt"] for rd in r["kills"]["rounds"])),
            ("kills", "stale build folders after rebuild", str(sum(len(rd["tmp_left_after"]) for rd in r["kills"]["rounds"])), "0",
             any(rd["tmp_left_after"] or rd["visible_after"] for rd in r["kills"]["rounds"]))]
    cs = r["corruption"]["cases"]
    out += [("corruption", "corrupted files", f"{len(cs)} ({sum(c['state'] == 'fresh' for c in cs)} fresh, "
             f"{sum(c['state'] == 'used' for c in cs)} used)", "", False),
            ("corruption", "detected", str(sum(c["detected"] for c in cs)), str(len(cs)), not all(c["detected"] for c in cs)),
            ("corruption", "  refused by run --no-build", str(sum(c["refused"] for c in cs)), "", False),
            ("corruption", "  flagged by cache verify --all", str(sum(c["flagged"] for c in cs)), "", False),
            ("corruption", "served by design (used, same size)", str(sum(c["by_design"] for c in cs)), "", False),
            ("corruption", "served anyway", str(sum(c["served_anyway"] for c in cs)), "0", any(c["served_anyway"] for c in cs)),
            ("corruption", "tracebacks", str(sum(c["traceback"] for c in cs)), "0", any(c["traceback"] for c in cs))]
    ms = r["malformed"]["cases"]
    b = [c for c in ms if c.get("built")]
    clear = [c for c in ms if (c["validate_clear"] if not c["build_only"] else c.get("build_clear"))]
    tb = sum(c.get("validate_traceback", False) + c.get("build_traceback", False) for c in ms)
    wrongly = [c for c in ms if c["accepted"] and not c["build_only"]]
    out += [("malformed", "recipes tried", str(len(ms)), "", False),
            ("malformed", "clear errors", str(len(clear)), str(len(ms)), len(clear) != len(ms)),
            ("malformed", "tracebacks", str(tb), "0", tb > 0),
            ("malformed", "accepted by validate (should not)", str(len(wrongly)), "0", bool(wrongly)),
            ("malformed", "sampled builds: clear errors", f"{sum(c['build_clear'] for c in b)}/{len(b)}", "all",
             not all(c["build_clear"] for c in b)),
            ("malformed", "sampled builds: left in store", str(sum(bool(c["left_in_store"]) for c in b)), "0",
             any(c["left_in_store"] for c in b))]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=Path, help="keep the stores under DIR/reliability-<time> (default: a temp folder, removed)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "reliability.json")
    ap.add_argument("--builders", type=int, default=4)
    ap.add_argument("--second-builders", type=int, default=2)
    ap.add_argument("--kill-rounds", type=int, default=1)
    ap.add_argument("--corrupt-all", action="store_true", help="every damage case on the used entry too")
    ap.add_argument("--malformed", type=int, default=200)
    ap.add_argument("--validate-batches", type=int, default=4)
    ap.add_argument("--build-sample", type=int, default=4, help="validate-rejected recipes also sent to `build`")
    ap.add_argument("--jobs", type=int, default=2, help="checks run at once (corruption, malformed builds)")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds per process; a build past it counts as stuck")
    ap.add_argument("--seed", type=int, default=int(time.time()))
    a = ap.parse_args()
    rng, t0 = random.Random(a.seed), time.monotonic()
    if a.engines:
        root = a.engines.absolute() / f"reliability-{time.strftime('%Y%m%d-%H%M%S')}"
        root.mkdir(parents=True)
    else:
        root = Path(tempfile.mkdtemp(prefix="trtbuild-reliability-"))
    report: dict[str, Any] = {"seed": a.seed, "args": {k: str(v) for k, v in vars(a).items()}, "root": str(root)}
    try:
        for name, fn in (("concurrency", lambda: concurrency(root, a)), ("kills", lambda: kills(root, a, rng))):
            s = time.monotonic()
            print(f"[{time.monotonic() - t0:6.1f}s] {name} ...", file=sys.stderr, flush=True)
            report[name] = {**fn(), "section_s": round(time.monotonic() - s, 1)}
        # fresh: the kill round's rebuild, never looked up (first use hashes it); used: a flight entry the waiters loaded.
        sources = {}
        if report["kills"]["rounds"][-1]["entry"]:
            sources["fresh"] = (Path(report["kills"]["rounds"][-1]["entry"]), Path(report["kills"]["rounds"][-1]["recipe"]))
        if report["concurrency"]["keys"]["a"]["entry"]:
            sources["used"] = (Path(report["concurrency"]["keys"]["a"]["entry"]), Path(report["concurrency"]["recipes"]["a"]))
        for name, fn in (("corruption", lambda: corruption(root, a, rng, sources)), ("malformed", lambda: malformed(root, a, rng))):
            s = time.monotonic()
            print(f"[{time.monotonic() - t0:6.1f}s] {name} ...", file=sys.stderr, flush=True)
            report[name] = {**fn(), "section_s": round(time.monotonic() - s, 1)}
    finally:
        if not a.engines:
            shutil.rmtree(root, ignore_errors=True)
    report["total_s"] = round(time.monotonic() - t0, 1)
    figs = figures(report)
    report["figures"] = [dict(zip(("section", "figure", "value", "expected", "bad"), f)) for f in figs]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    w = max(len(f[1]) for f in figs)
    print(f"\ntrtbuild reliability round · seed {a.seed} · {report['total_s']:.0f} s · details in {a.out}")
    print(f"{'section':<12} {'figure':<{w}}  {'value':<28} {'expect':<7} ")
    for sec, fig, val, exp, bad in figs:
        print(f"{sec:<12} {fig:<{w}}  {val:<28} {exp:<7} {'BAD' if bad else ''}")
    sys.exit(1 if any(f[4] for f in figs) else 0)


if __name__ == "__main__":
    main()
