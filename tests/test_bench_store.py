"""The benchmark's handling of its engine store and of being cut off (benchmarks/bench.py): an engine built
in a fresh store for the cold-build measurement moves into the benchmark's own store, published and
verified there; a run ended by SIGTERM reports what it measured and leaves no half-built engine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from trtbuild.store.local import MANIFEST, Store

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench  # noqa: E402
import restart  # noqa: E402
import peers  # noqa: E402


def _published(store: Store, key: str) -> Path:
    store.ensure()
    work = store.new_workdir("tiny", key)
    (work / "weights.safetensors").write_bytes(b"w" * 1000)
    (work / "graphs").mkdir()
    (work / "graphs" / "decode.so").write_bytes(b"so")
    return store.publish(work, "tiny", key, {"key": key, "name": "tiny", "backend": "torch"}).path


def test_an_engine_built_in_a_fresh_store_moves_into_the_main_one_and_verifies_there(tmp_path: Path) -> None:
    key = "ab" * 32
    src, dst = Store(tmp_path / "fresh"), Store(tmp_path / "main")
    old = _published(src, key)
    entry = bench.adopt(src, dst, key)
    assert entry is not None and entry.path.parent == dst.entries_dir
    assert not old.exists() and src.lookup(key) is None
    # the lookup hashes every file against the new manifest (verified is False after a publish)
    assert json.loads((entry.path / MANIFEST).read_text())["verified"] is False
    found = dst.lookup(key)
    assert found is not None and found.manifest["backend"] == "torch"
    assert sorted(found.manifest["files"]) == ["graphs/decode.so", "weights.safetensors"]
    assert list(dst.tmp_dir.iterdir()) == []  # the workdir was renamed into place, nothing left behind


def test_adopt_leaves_both_stores_alone_when_the_main_one_has_the_engine(tmp_path: Path) -> None:
    key = "cd" * 32
    src, dst = Store(tmp_path / "fresh"), Store(tmp_path / "main")
    old, kept = _published(src, key), _published(dst, key)
    assert bench.adopt(src, dst, key) is None
    assert old.is_dir() and kept.is_dir()
    assert bench.adopt(Store(tmp_path / "empty"), dst, "ef" * 32) is None


def test_a_benchmark_cut_off_by_sigterm_prints_what_it_measured_and_leaves_no_half_built_engine(tmp_path: Path) -> None:
    """What a device call's time limit does (`timeout` sends SIGTERM): the benchmark stops where it is, in
    the middle of a build here, prints its table of what it measured, keeps bench.json, exits 143, and the
    engine store holds no entry and no build folder."""
    import signal
    import subprocess

    from .conftest import tiny_recipe_doc, write_recipe

    recipe = write_recipe(tmp_path, tiny_recipe_doc())
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen(
        [sys.executable, str(root / "benchmarks" / "bench.py"), str(recipe), "--device", "cpu", "--quick",
         "--sections", "variants", "--variants", "eager", "--engines", str(tmp_path / "engines"),
         "--out", str(tmp_path / "out")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:  # the build has started once it reports its first export
        seen.append(line)
        if "exporting" in line:
            break
    proc.send_signal(signal.SIGTERM)
    out = "".join(seen) + proc.communicate(timeout=300)[0]
    assert proc.returncode == 143, out[-2000:]
    assert "[bench] SIGTERM: the run was cut off" in out
    assert "tiny: no variant measured (cut off before them)" in out
    report = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert report["stopped"].startswith("SIGTERM") and "ceilings" in report
    store = Store(tmp_path / "engines")
    assert store.entries() == [] and list(store.tmp_dir.iterdir()) == []


@pytest.mark.slow
def test_the_no_pdl_no_prefill_graphs_and_again_variants_measure_the_engine_entry_itself_and_keep_it(
        tmp_path: Path) -> None:
    """engine@no-pdl is the recipe's own engine (a cache hit, no build) with its decode graphs captured
    serialized: measured after `engine`, it says so in its launch record. engine@again measures the same
    engine once more, last (the run's drift), and is no peer to beat. engine@no-prefill-graphs turns the captured
    prefill graphs off and says so (the default engine on a CPU has none either: no CUDA device). The shared entry stays in the store
    (the other engine@ variants' entries are deleted once measured). The recipe takes prompts
    of at most 16 tokens: the plan's longer prefill lengths are skipped for every variant, and said so,
    where they used to fail each variant's whole row."""
    import subprocess

    from .conftest import tiny_recipe_doc, write_recipe

    recipe = write_recipe(tmp_path, tiny_recipe_doc())  # max_input_len 16; the quick plan's lengths 8, 32, 64
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "bench.py"), str(recipe), "--device", "cpu", "--quick",
         "--sections", "variants", "--variants", "engine,engine@no-pdl,engine@no-prefill-graphs,engine@again",
         "--engines", str(tmp_path / "engines"),
         "--out", str(tmp_path / "out")], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = next(iter(json.loads((tmp_path / "out" / "bench.json").read_text())["recipes"].values()))
    variants = rec["variants"]
    assert variants["engine"]["decode"] and variants["engine@no-pdl"]["decode"]
    assert all(v["complete"] and list(v["prefill"]) == ["8"] for v in variants.values())
    assert rec["prefill_lengths_skipped"].startswith("prompt lengths 32, 64 exceed the recipe's max_input_len 16")
    assert rec["prefill_lengths_skipped"] in proc.stdout
    assert {r["why"] for r in variants["engine"]["launch"].values()} == {"CPU"}
    assert {r["why"] for r in variants["engine@no-pdl"]["launch"].values()} == {"TRTBUILD_PDL=0"}
    assert variants["engine@again"]["decode"] and "the run's drift" in variants["engine@again"]["label"]
    assert variants["engine@no-prefill-graphs"]["prefill_launch"] == {"on": False, "why": "off (TRTBUILD_PREFILL_GRAPHS=0)"}
    assert variants["engine"]["prefill_launch"] == {"on": False, "why": "no CUDA device"}
    assert {r["why"] for r in variants["engine@again"]["launch"].values()} == {"CPU"}
    assert "ahead of every peer in the same run: no peer measured" in proc.stdout
    assert len(Store(tmp_path / "engines").entries()) == 1


def test_a_variant_engine_is_deleted_once_measured_and_the_store_stays_whole(tmp_path: Path) -> None:
    """engine@ variants are deleted after their measurement (three 8B engines filled the H200 machine's
    disk): the entry is gone from the store, another entry stays, and nothing is left in its tmp folder."""
    from types import SimpleNamespace

    store = Store(tmp_path / "engines")
    gone, kept = _published(store, "12" * 32), _published(store, "34" * 32)
    entry = store.lookup("12" * 32)
    assert entry is not None
    peer = SimpleNamespace(engines=str(store.root), session=SimpleNamespace(outcome=SimpleNamespace(entry=entry)))
    note = bench.discard_engine(peer)
    assert gone.name in note and not gone.exists() and store.lookup("12" * 32) is None
    assert kept.is_dir() and store.lookup("34" * 32) is not None
    assert list(store.tmp_dir.iterdir()) == []


def test_a_peer_cut_off_while_compiling_its_second_batch_keeps_its_prefill_rows() -> None:
    """A peer measures decode at the smallest batch, then every prefill length, then the other batches;
    what finished before it stops (here: an error in its first batch-8 generation, as a call's time
    limit stops a compile) is kept, figure by figure."""

    class Peer:
        label = "fake"

        def __init__(self) -> None:
            self.calls: list[tuple[int, int]] = []

        def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[float]]:
            self.calls.append((len(prompts), len(prompts[0])))
            if len(prompts) == 8:
                raise TimeoutError("still autotuning")
            return 0.001 * len(prompts[0]), [0.002] * (new_tokens - 1)

    peer, out, saves = Peer(), {}, []
    try:
        bench.measure_peer(peer, bench.QUICK, [8, 1], 256, out, lambda: saves.append(sorted(out["prefill"])))
    except TimeoutError:
        pass
    assert sorted(out["decode"]) == ["1"]
    assert sorted(out["prefill"], key=int) == [str(t) for t in bench.QUICK.prefill_lens]
    assert out["prefill"]["64"]["p50"] == 0.064
    assert out["complete"] is False
    assert len(saves) == 1 + len(bench.QUICK.prefill_lens)  # saved after each figure
    assert peer.calls[0][0] == 1 and peer.calls[-1][0] == 8  # batch 1 first, batch 8 last


def test_decode_steps_are_also_summarized_by_position_so_a_slow_stretch_is_told_from_a_random_tail() -> None:
    """Each generation's later positions run slower here: the medians by quarter of the positions show the
    rise, in order, where the p90 alone would look like noise; the table prints them under the variant."""

    class Peer:
        label = "fake"

        def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[float]]:
            return 0.001, [0.002 if i < (new_tokens - 1) // 2 else 0.003 for i in range(new_tokens - 1)]

    out: dict = {}
    bench.measure_peer(Peer(), bench.QUICK, [1], 256, out, lambda: None)
    d = out["decode"]["1"]
    assert d["p50_by_position"] == [0.002, 0.002, 0.003, 0.003] and d["p90"] == 0.003
    half = (bench.QUICK.new_tokens - 1) // 2
    assert d["p50_each_position"] == [0.002] * half + [0.003] * (bench.QUICK.new_tokens - 1 - half)
    assert bench.by_position([[1.0, 2.0, 3.0], [5.0, 6.0]], parts=2) == [3.0, 4.0]  # the shortest sets the bounds
    rec = {"recipe": "r", "precision": "bf16", "floors": {"decode_s": {"1": 0.001}, "prefill_s": {}},
           "variants": {"engine": out | {"notes": []}}}
    lines = peers._variant_lines(rec, {"plan": {"prompt_len": 8}})
    by_quarter = "    engine decode p50 ms by quarter of the generated positions, first to last: "
    assert by_quarter + "b1 2.000 / 2.000 / 3.000 / 3.000" in lines


def test_the_restart_ab_turns_the_preload_off_and_on_by_name_and_runs_each_extra_thread_count(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """measure_restart's readers, with the new processes and reads stood in for: the threaded row runs with
    the preload off by name (it is the default now), the preloaded row with it on, each --preload-threads
    count once more in each round, and the report keeps them apart."""
    import argparse

    entry = tmp_path / "entry"
    entry.mkdir()
    (entry / "weights.safetensors").write_bytes(b"w" * 100)
    envs: list[dict[str, str]] = []

    def fake_child(kind: str, recipe_path: str, engines: str, extra: list[str], env: dict[str, str] | None = None) -> dict:
        if kind == "startup":
            return {"t_spawn": 0.0, "t_ready": 3.0}
        envs.append(dict(env or {}))
        return {"t_spawn": 0.0, "t_first_token": 4.0 + len(envs) / 10, "phases": {}, "load_note": ""}

    floor = {"s": 1.0, "bytes": 100, "Bps": 100.0}
    monkeypatch.setattr(restart, "child", fake_child)
    monkeypatch.setattr(restart, "drop_page_cache", lambda files: "dropped")
    monkeypatch.setattr(restart, "read_to_device", lambda files, device: dict(floor))
    monkeypatch.setattr(restart, "read_with_threads", lambda files, device, threads: dict(floor, threads=threads))
    ctx = {"entry": entry, "device": "cuda", "plan": argparse.Namespace(prompt_len=8)}
    args = argparse.Namespace(load_threads=8, preload_threads=[2, 8], restart_repeats=3, recipe_path="r.yaml", engines="e")
    out = restart.measure_restart(ctx, args)
    one_round = [{"TRTBUILD_LOAD_THREADS": "0"}, {"TRTBUILD_LOAD_THREADS": "8", "TRTBUILD_PRELOAD": "0"},
                 {"TRTBUILD_LOAD_THREADS": "8", "TRTBUILD_PRELOAD": "1"}, {"TRTBUILD_LOAD_THREADS": "2", "TRTBUILD_PRELOAD": "1"}]
    # cold once each, then warm three times each; 8 threads is the preloaded row itself, not run twice
    assert envs == one_round + [env for env in one_round for _ in range(3)]
    for cache in ("cold", "warm"):
        assert list(out[cache]["engine_preload_by_threads"]) == ["2"]
        assert out[cache]["engine_preload_by_threads"]["2"]["ratio_to_floor"] > out[cache]["ratio_to_floor_load_threads_preload"]
    # warm: the median of three (the fake's times grow by 0.1 s a call), every sample kept
    warm = out["warm"]["engine_load_threads"]
    assert warm["samples_s"] == pytest.approx([4.8, 4.9, 5.0]) and warm["start_to_first_token_s"] == pytest.approx(4.9)
    assert "samples_s" not in out["cold"]["engine_load_threads"]


def test_a_failed_restart_is_never_averaged_away() -> None:
    ok = [{"start_to_first_token_s": s} for s in (5.0, 4.0)]
    assert restart._median_run(ok + [{"error": "child crashed"}]) == {"error": "child crashed"}
    assert restart._median_run(ok) == {"start_to_first_token_s": 4.0, "samples_s": [5.0, 4.0]}


def test_a_short_prompts_floor_is_the_time_to_read_the_weights_and_a_long_ones_its_flops() -> None:
    """At Llama-3.1-8B's dimensions and the H200's measured rates (2026-12-05), 128 tokens are bound by reading
    15 GB of weights (3.5 ms), not by their 1.8 TFLOP (2.3 ms); 2048 tokens by their FLOPs. The table says
    which, so a prefill-128 ratio is read against the right roof."""
    import yaml

    from trtbuild.models.llama import LlamaConfig

    config = yaml.safe_load((Path(__file__).parents[1] / "recipes" / "llama-3.1-8b.yaml").read_text())["model"]["config"]
    cfg = LlamaConfig.from_hf(config)
    ceilings = {"matmul_flops_per_s": 780.7e12, "copy_Bps": 4.255e12}
    fl = bench.prefill_floors(cfg, 2, [128, 2048], ceilings)
    assert fl["prefill_bound"] == {"128": "memory", "2048": "compute"}
    assert fl["prefill_s"]["128"] == pytest.approx(fl["prefill_bytes"]["128"] / 4.255e12)
    assert 3.4e-3 < fl["prefill_s"]["128"] < 3.6e-3
    assert fl["prefill_s"]["2048"] == pytest.approx(fl["prefill_flops"]["2048"] / 780.7e12)
    rec = {"recipe": "r", "precision": "bf16", "floors": {"decode_s": {"1": 0.001}, **fl}, "variants": {}}
    lines = peers._variant_lines(rec, {"plan": {"prompt_len": 8}})
    assert any(line.endswith("128 memory-bound, 2048 compute-bound") for line in lines)
