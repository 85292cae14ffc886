"""The store under concurrency, crashes and corruption, with real processes and real files."""

from __future__ import annotations

import gc
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from trtbuild.backends.torch.backend import TorchAOTIBackend
from trtbuild.builder import build
from trtbuild.recipe import load_recipe
from trtbuild.runner import open_session, run_report
from trtbuild.store.local import Store

from .conftest import REPO, read_json_line, run_cli, tiny_recipe_doc, write_recipe

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One engine, built once; tests work on copies of its store."""
    root = tmp_path_factory.mktemp("published")
    recipe = write_recipe(root, tiny_recipe_doc(name="rel"))
    outcome = build(load_recipe(recipe), root / "engines")
    return {"recipe": recipe, "store": root / "engines", "key": outcome.key, "entry": outcome.entry.path.name}


def _copy_store(published: dict[str, Any], dest: Path) -> Path:
    shutil.copytree(published["store"], dest)
    return dest


def _entry_dirs(store: Path) -> list[str]:
    return sorted(p.name for p in (store / "v1").iterdir() if not p.name.startswith("."))


def test_builders_killed_mid_build_leave_nothing_visible_and_no_stuck_lock(tmp_path: Path) -> None:
    """SIGKILL during export, during compile and between writing files and publishing: no entry
    appears, the lock dies with the process, and the next build proceeds and cleans up."""
    recipe = write_recipe(tmp_path, tiny_recipe_doc(name="crash"))
    store = tmp_path / "engines"
    for point in ("exporting", "compiling", "before_publish"):
        proc = run_cli("build", str(recipe), "--engines", str(store), "--json", env={"TRTBUILD_FAULT": point})
        assert proc.returncode == -9, (point, proc.stderr[-500:])
        assert _entry_dirs(store) == [], point
        assert list((store / "v1" / ".tmp").iterdir()), "the dead builder's folder is left behind"
        miss = run_cli("run", str(recipe), "--engines", str(store), "--no-build")
        assert miss.returncode == 1 and "no engine for recipe 'crash'" in miss.stderr
    proc = run_cli("build", str(recipe), "--engines", str(store), "--json")  # lock free: not stuck
    assert proc.returncode == 0, proc.stderr[-800:]
    assert read_json_line(proc.stdout)["engine"]["cache_hit"] is False
    leftovers = [p.name for p in (store / "v1" / ".tmp").iterdir()]
    assert leftovers == [], f"stale build folders not cleaned: {leftovers}"
    assert len(_entry_dirs(store)) == 1


def test_concurrent_builders_build_once_and_the_others_wait_and_reuse(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, tiny_recipe_doc(name="flight"))
    store = tmp_path / "engines"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "trtbuild", "build", str(recipe), "--engines", str(store), "--json"],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    results = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [r[1][-500:] for r in results]
    reports = [read_json_line(out) for out, _ in results]
    assert sorted(r["engine"]["cache_hit"] for r in reports) == [False, True, True]
    assert len({r["engine"]["key"] for r in reports}) == 1
    waiters = [err for (_, err), rep in zip(results, reports, strict=True) if rep["engine"]["cache_hit"]]
    assert all("waiting for the build of this engine by pid" in err for err in waiters)
    stats = json.loads(run_cli("cache", "stats", "--engines", str(store), "--json").stdout)
    assert stats["builds"] == 1 and stats["hits"] == 2


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupt_entries_are_quarantined_and_rebuilt_or_refused(published: dict[str, Any], tmp_path: Path,
                                                               damage: str) -> None:
    store = _copy_store(published, tmp_path / "engines")
    weights = store / "v1" / published["entry"] / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF  # same size: only a hash finds it
        weights.write_bytes(bytes(data))
    elif damage == "truncate":
        weights.write_bytes(bytes(data[: len(data) // 3]))
    else:
        weights.unlink()
    # The copy has never been used, so its first lookup hashes every file.
    proc = run_cli("run", str(published["recipe"]), "--engines", str(store), "--no-build")
    assert proc.returncode == 1 and "corrupt entry moved to quarantine" in proc.stderr, proc.stderr
    assert "weights.safetensors" in proc.stderr and "Traceback" not in proc.stderr
    assert _entry_dirs(store) == []
    quarantined = list((store / "quarantine").iterdir())
    assert len(quarantined) == 1 and (quarantined[0] / "QUARANTINED").is_file()


def test_after_first_use_sizes_are_checked_on_every_lookup_and_hashes_on_verify(published: dict[str, Any],
                                                                              tmp_path: Path) -> None:
    store = _copy_store(published, tmp_path / "engines")
    recipe = load_recipe(published["recipe"])
    assert build(recipe, store, allow_build=False).cache_hit  # first use: full hash, marks verified
    weights = store / "v1" / published["entry"] / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[100] ^= 0x01
    weights.write_bytes(bytes(data))
    assert build(recipe, store, allow_build=False).cache_hit  # same size: the cheap check passes
    proc = run_cli("cache", "verify", "--all", "--engines", str(store))
    assert proc.returncode == 1 and "CORRUPT" in proc.stdout and "sha256" in proc.stdout
    assert _entry_dirs(store) == []


def test_damage_that_only_the_loader_trips_on_is_found_by_hash_and_quarantined(published: dict[str, Any],
                                                                               tmp_path: Path) -> None:
    """A used entry gets size checks only; a same-size flip in engine.json then reaches the loader. Found
    by the stress round (benchmarks/reliability.py) as a UnicodeDecodeError traceback."""
    store = _copy_store(published, tmp_path / "engines")
    recipe = load_recipe(published["recipe"])
    assert build(recipe, store, allow_build=False).cache_hit  # first use: hashed, marked verified
    spec = store / "v1" / published["entry"] / "engine.json"
    data = bytearray(spec.read_bytes())
    data[len(data) // 2] = 0x91  # not UTF-8, same size
    spec.write_bytes(bytes(data))
    proc = run_cli("run", str(published["recipe"]), "--engines", str(store), "--no-build")
    assert proc.returncode == 1 and "corrupt" in proc.stderr and "engine.json" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and _entry_dirs(store) == []
    assert len(list((store / "quarantine").iterdir())) == 1
    _copy_store(published, tmp_path / "again")
    spec = tmp_path / "again" / "v1" / published["entry"] / "engine.json"
    build(recipe, tmp_path / "again", allow_build=False)
    spec.write_bytes(bytes(data))
    proc = run_cli("run", str(published["recipe"]), "--engines", str(tmp_path / "again"), "--json", "--iterations", "1")
    assert proc.returncode == 0, proc.stderr  # building allowed: quarantined, rebuilt, run
    assert len(list((tmp_path / "again" / "quarantine").iterdir())) == 1


def test_verify_flag_hashes_every_file(published: dict[str, Any], tmp_path: Path) -> None:
    store = _copy_store(published, tmp_path / "engines")
    recipe = load_recipe(published["recipe"])
    build(recipe, store, allow_build=False)
    entry = store / "v1" / published["entry"]
    pkg = entry / json.loads((entry / "engine.json").read_text())["graphs"]["prefill"]["so"]
    data = bytearray(pkg.read_bytes())
    data[-10] ^= 0x01
    pkg.write_bytes(bytes(data))
    proc = run_cli("build", str(published["recipe"]), "--engines", str(store), "--verify", "--json")
    assert proc.returncode == 0
    assert read_json_line(proc.stdout)["engine"]["cache_hit"] is False  # quarantined, then rebuilt
    assert len(list((store / "quarantine").iterdir())) == 1


def test_prune_removes_least_recently_used_and_keeps_pinned_and_in_use(published: dict[str, Any],
                                                                       tmp_path: Path) -> None:
    store_dir = _copy_store(published, tmp_path / "engines")
    src = store_dir / "v1" / published["entry"]
    # Three entries with different last-used times (copies of one engine under other keys).
    for i, age_days in enumerate([40, 20, 1]):
        dest = store_dir / "v1" / f"copy{i}-{str(i) * 16}"
        shutil.copytree(src, dest)
        manifest = json.loads((dest / "manifest.json").read_text())
        manifest.update(key=str(i) * 64, name=f"copy{i}", last_used=manifest["last_used"] - age_days * 86400)
        (dest / "manifest.json").write_text(json.dumps(manifest))
    shutil.rmtree(src)
    store = Store(store_dir)
    dry = run_cli("cache", "prune", "--older-than", "10d", "--dry-run", "--engines", str(store_dir))
    assert "would remove copy0" in dry.stdout and "would remove copy1" in dry.stdout and len(_entry_dirs(store_dir)) == 3
    assert run_cli("cache", "pin", "copy0", "--engines", str(store_dir)).returncode == 0
    with store.in_use("1" * 64):  # a process holds copy1 open
        proc = run_cli("cache", "prune", "--older-than", "10d", "--engines", str(store_dir))
        assert "kept   copy0" in proc.stdout and "(pinned)" in proc.stdout and "(in use)" in proc.stdout
        assert _entry_dirs(store_dir) == sorted(p for p in _entry_dirs(store_dir))
        assert len(_entry_dirs(store_dir)) == 3
        rm = run_cli("cache", "rm", "copy1", "--engines", str(store_dir))
        assert rm.returncode == 1 and "open in a running process" in rm.stderr
    run_cli("cache", "unpin", "copy0", "--engines", str(store_dir))
    size = store.find("copy2").size()
    proc = run_cli("cache", "prune", "--max-size", str(size + 1), "--engines", str(store_dir))
    assert proc.returncode == 0
    assert _entry_dirs(store_dir) == ["copy2-" + "2" * 16], "oldest first until the store fits"


def test_explain_names_the_fields_that_differ(published: dict[str, Any], tmp_path: Path) -> None:
    store = _copy_store(published, tmp_path / "engines")
    hit = json.loads(run_cli("cache", "explain", str(published["recipe"]), "--engines", str(store), "--json").stdout)
    assert hit["hit"] is True
    doc = tiny_recipe_doc(name="rel", precision="bf16")
    other = write_recipe(tmp_path, doc, "other.yaml")
    miss = json.loads(run_cli("cache", "explain", str(other), "--engines", str(store), "--json").stdout)
    assert miss["hit"] is False and miss["nearest"].endswith(published["entry"])
    assert [d["field"] for d in miss["differences"]] == ["recipe.precision"]
    # an Inductor option from the environment is a different engine, and the miss says which field
    tuned = json.loads(run_cli("cache", "explain", str(published["recipe"]), "--engines", str(store), "--json",
                               env={"TORCHINDUCTOR_MAX_AUTOTUNE": "1"}).stdout)
    assert tuned["hit"] is False and tuned["nearest"].endswith(published["entry"])
    assert tuned["differences"] == [{"field": "backend.toolchain.env", "entry": "<absent>",
                                     "recipe": "TORCHINDUCTOR_MAX_AUTOTUNE=1"}]


def test_an_entry_built_elsewhere_is_refused_by_name(published: dict[str, Any], tmp_path: Path) -> None:
    """An entry from another device/toolchain never matches this machine's key, and a fleet node
    told not to build says what the entry was built for and what this machine is."""
    store = _copy_store(published, tmp_path / "engines")
    entry = store / "v1" / published["entry"]
    manifest = json.loads((entry / "manifest.json").read_text())
    km = manifest["key_material"]
    km["device"] = {"kind": "cuda", "name": "NVIDIA H200", "compute_capability": "9.0"}
    km["backend"]["toolchain"] = {"torch": "2.11.0+cu130", "cuda": "13.0", "triton": "3.6.0"}
    manifest["key"] = "f" * 64
    (entry / "manifest.json").write_text(json.dumps(manifest))
    entry.rename(store / "v1" / f"rel-{'f' * 16}")
    proc = run_cli("run", str(published["recipe"]), "--engines", str(store), "--no-build")
    assert proc.returncode == 1
    assert "was built for NVIDIA H200 sm90 with cuda 13.0, torch 2.11.0+cu130, triton 3.6.0; this is CPU" in proc.stderr


def test_unwritable_store_is_a_clear_input_error(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, tiny_recipe_doc(name="ro"))
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the store should be")
    proc = run_cli("build", str(recipe), "--engines", str(blocker / "engines"))
    assert proc.returncode == 2 and "not writable" in proc.stderr and "Traceback" not in proc.stderr


def test_a_run_prefetches_the_most_recently_used_entry_of_its_recipe(published: dict[str, Any], tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Before start-up, `open_session` starts reading the newest entry of the recipe's name (smallest
    file first: the graphs' kernels before the weights); other names and older entries are left alone,
    and TRTBUILD_PREFETCH=0 turns it off."""
    import trtbuild.store.local as store_module

    store_dir = _copy_store(published, tmp_path / "engines")
    src = store_dir / "v1" / published["entry"]
    for i, (name, age_days) in enumerate([("rel", 5), ("other", 0)]):
        dest = store_dir / "v1" / f"{name}-{str(i) * 16}"
        shutil.copytree(src, dest)
        manifest = json.loads((dest / "manifest.json").read_text())
        manifest.update(key=str(i) * 64, name=name, last_used=manifest["last_used"] - age_days * 86400)
        (dest / "manifest.json").write_text(json.dumps(manifest))
    read: list[list[Path]] = []
    monkeypatch.setattr(store_module, "_read_through", lambda files: read.append(files))
    with open_session(load_recipe(published["recipe"]), store_dir, build=False):
        pass
    assert len(read) == 1 and read[0] and all(src in f.parents for f in read[0])
    sizes = [f.stat().st_size for f in read[0]]
    assert sizes == sorted(sizes) and len(set(sizes)) > 1
    # a file the backend reads onto its device itself is not read into the page cache as well
    weights = src / "weights.safetensors"
    monkeypatch.setattr(TorchAOTIBackend, "preload", lambda self, entry, manifest: [entry / "weights.safetensors"])
    with open_session(load_recipe(published["recipe"]), store_dir, build=False):
        pass
    assert len(read) == 2 and weights in read[0] and weights not in read[1] and len(read[1]) == len(read[0]) - 1
    monkeypatch.setenv("TRTBUILD_PREFETCH", "0")
    with open_session(load_recipe(published["recipe"]), store_dir, build=False):
        pass
    assert len(read) == 2


def test_a_run_takes_the_weights_preloaded_from_its_own_entry(published: dict[str, Any], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's loader takes a preload of its own weights file (here read into the host stand-in of
    the GPU's memory, and the CPU engine reading with threads, as a CUDA engine does), says so in the
    run report's load row, and generates what it does when it reads the file itself. The memory goes
    when the session closes."""
    pytest.importorskip("numpy")
    from tests.doubles.host_cuda_driver import HostDriver
    from trtbuild.backends.torch import weights_preload

    store_dir = _copy_store(published, tmp_path / "engines")
    monkeypatch.setenv("TRTBUILD_LOAD_THREADS", "2")
    monkeypatch.setenv("TRTBUILD_PRELOAD", "1")
    recipe = load_recipe(published["recipe"])
    with open_session(recipe, store_dir, build=False) as s:
        want = s.greedy([[1, 2, 3]], 4)
        assert s.engine.load_note == ""  # type: ignore[attr-defined]
    drv = HostDriver()
    assert weights_preload.start(store_dir / "v1" / published["entry"] / "weights.safetensors", 2, driver=drv)
    with open_session(recipe, store_dir, build=False) as s:
        report = run_report(s, batch_size=1, input_len=3, output_len=4, iterations=1)
        assert "during start-up" in report["load_note"] and drv.device
        assert s.greedy([[1, 2, 3]], 4) == want
    assert not drv.device and not drv.misuse  # freed at the session's exit, not left to the runner


def test_closing_a_session_frees_its_weights_and_caches(published: dict[str, Any], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """AOTInductor's runner keeps its user-managed constants alive after it is destroyed (torch 2.13), so
    the engine frees the memory under them itself once its graphs are gone: after the session nothing it
    loaded holds memory. With the threaded reader, a CUDA engine's default; safetensors' loader (the CPU
    default) maps the file, and its tensors' storage cannot be freed from Python (file-backed pages)."""
    import weakref

    monkeypatch.setenv("TRTBUILD_LOAD_THREADS", "2")
    store_dir = _copy_store(published, tmp_path / "engines")
    with open_session(load_recipe(published["recipe"]), store_dir, build=False) as s:
        s.greedy([[1, 2, 3]], 4)
        consts = [weakref.ref(t) for t in s.engine._consts.values()]  # type: ignore[attr-defined]
        assert all(c().untyped_storage().nbytes() > 0 for c in consts)  # type: ignore[union-attr]
    gc.collect()
    alive = [c() for c in consts if c() is not None]
    assert all(t.untyped_storage().nbytes() == 0 for t in alive)


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and text in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                found.append(int(proc.name))
        except OSError:  # ended while we looked
            continue
    return found


def test_compile_workers_end_with_a_killed_build_and_publish_nothing_half_written(tmp_path: Path) -> None:
    """SIGKILL of a build whose workers are compiling: the workers notice within a second or two and
    stop, no entry appears, and the next build (workers again) compiles and publishes normally."""
    import time

    # the paged graphs beside the step program: three programs, so the build forks two
    recipe = write_recipe(tmp_path, tiny_recipe_doc(name="workers", options={"kv_cache": "paged"}, shapes={
        "max_batch_size": 2, "max_input_len": 16, "max_seq_len": 48, "batch_buckets": [1, 2]}))
    store = tmp_path / "engines"
    env = {"TRTBUILD_COMPILE_WORKERS": "2"}
    proc = run_cli("build", str(recipe), "--engines", str(store), env=env | {"TRTBUILD_FAULT": "compiling"})
    assert proc.returncode == -9, proc.stderr[-500:]
    deadline = time.monotonic() + 15
    # a worker process names its spec (inside the store), a fork the build's command line (the store too)
    while _processes_mentioning(str(store)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_mentioning(str(store)) == [], "workers outlived their build"
    assert _entry_dirs(store) == []
    graphs = store / "tactics"
    assert not [p for p in graphs.rglob("COMPLETE") if not (p.parent / p.read_text().strip()).is_file()]
    # what a process killed while copying a graph into the tactic cache leaves: swept by the next build
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    cache = next(graphs.glob("torch/*/"))
    half = cache / "graphs" / f"{'0' * 32}.tmp-{socket.gethostname()}-{dead.stdout.strip()}"
    half.mkdir(parents=True)
    proc = run_cli("build", str(recipe), "--engines", str(store), "--json", env=env)
    assert proc.returncode == 0, proc.stderr[-800:]
    entry = Path(read_json_line(proc.stdout)["engine"]["path"])
    engine = json.loads((entry / "engine.json").read_text())
    # the CPU's prefill and buckets share one step program, which the build compiles; forks the paged graphs
    assert {n: g.get("worker", {}).get("ok") for n, g in engine["graphs"].items()} == {
        "prefill": None, "decode_b1": None, "decode_b2": None, "paged": True, "paged_mixed": True}
    assert not half.exists()
