"""Real builds of a tiny model on the CPU: recipe → key → store → AOTInductor → runner, and reuse."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import trtbuild
from trtbuild.builder import build
from trtbuild.errors import EngineMissingError
from trtbuild.recipe import load_recipe
from trtbuild.runner import open_session, run_report
from trtbuild.store.digests import file_sha256
from trtbuild.store.local import Store

from .conftest import read_json_line, run_cli, tiny_recipe_doc, write_recipe
from .engine_helpers import eager_greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One engine built once for the module, through the CLI in a real process."""
    root = tmp_path_factory.mktemp("built")
    recipe = write_recipe(root, tiny_recipe_doc(shapes={"max_batch_size": 2, "max_input_len": 16,
                                                        "max_seq_len": 48, "batch_buckets": [1, 2]}))
    store = root / "engines"
    proc = run_cli("build", str(recipe), "--engines", str(store), "--json")
    assert proc.returncode == 0, proc.stderr
    return {"recipe": recipe, "store": store, "build": read_json_line(proc.stdout)}


def test_first_build_is_a_miss_and_publishes_a_complete_entry(built: dict[str, Any]) -> None:
    result = built["build"]
    assert result["engine"]["cache_hit"] is False and result["build_s"] > 0
    entry = Path(result["engine"]["path"])
    assert entry.name == f"tiny-{result['engine']['key'][:16]}"
    assert entry.parent.name == "v1"
    manifest = json.loads((entry / "manifest.json").read_text())
    assert {"weights.safetensors", "engine.json"} <= set(manifest["files"])
    graphs = json.loads((entry / "engine.json").read_text())["graphs"]
    assert set(graphs) == {"prefill", "decode_b1", "decode_b2"}
    for graph in graphs.values():  # the compiled model, unpacked out of its .pt2, is in the entry
        assert graph["so"] in manifest["files"] and graph["so"].endswith(".so")
    assert not list(entry.glob("*.pt2"))
    assert manifest["key_material"]["recipe"]["shapes"]["batch_buckets"] == [1, 2]
    phases = manifest["build"]["phases"]
    assert {"export_s", "compile_s", "load_weights_s"} <= set(phases)
    # the synthetic weights drawn on the way are their own phase, not part of loading the weights
    assert phases["draw_synthetic_weights_s"] > 0 and phases["load_weights_s"] >= 0
    assert not any((built["store"] / "v1" / ".tmp").iterdir()), "the build folder must be gone after publish"
    # the weights were hashed while the graphs compiled; publish took that digest, and it is the file's
    assert result["phases"]["hash_during_build_s"] > 0 and result["phases"]["publish_s"] >= 0
    assert manifest["files"]["weights.safetensors"]["sha256"] == file_sha256(entry / "weights.safetensors")


def test_on_the_cpu_the_prefill_and_the_decode_buckets_share_one_step_program_compiled_once(
        built: dict[str, Any]) -> None:
    """A CPU engine runs its prompts and every decode bucket through one step program of dynamic batch and
    tokens (export.shared_step): one compiled-graph key, compiled for the prefill and copied for the buckets
    (its tokens at every batch: test_engine_tokens_match_the_eager_model)."""
    entry = Path(built["build"]["engine"]["path"])
    graphs = json.loads((entry / "engine.json").read_text())["graphs"]
    assert graphs["prefill"]["digest"] == graphs["decode_b1"]["digest"] == graphs["decode_b2"]["digest"]
    assert graphs["prefill"]["step"] is True and graphs["decode_b1"]["batch"] == "dynamic"
    assert graphs["prefill"]["reused"] is False and graphs["decode_b1"]["reused"] is graphs["decode_b2"]["reused"] is True
    assert graphs["decode_b2"]["compile_s"] < graphs["prefill"]["compile_s"]
    manifest = json.loads((entry / "manifest.json").read_text())
    assert manifest["tactics"]["compile_workers"] == 0  # one program: nothing to hand a fork


def test_the_build_reports_how_each_graphs_compile_divides_between_inductor_and_the_cxx_compiler(
        built: dict[str, Any]) -> None:
    phases = built["build"]["phases"]
    assert phases["compile_cxx_s"] > 0 and phases["compile_inductor_s"] > 0
    graphs = json.loads((Path(built["build"]["engine"]["path"]) / "engine.json").read_text())["graphs"]
    # a graph compiled in a fork is timed in the fork's report; a bucket sharing another's decode graph is a copy
    compiled = [g for g in graphs.values() if not g["reused"]]
    for graph in compiled:  # every graph this build compiled, in its process or a fork: its parts fit in its compile
        assert graph["compile_cxx_s"] > 0 and graph["compile_inductor_s"] > 0
        own = graph["worker"]["compile_s"] if "worker" in graph else graph["compile_s"]
        assert graph["compile_cxx_s"] + graph["compile_inductor_s"] <= own
    assert phases["compile_cxx_s"] == pytest.approx(sum(g["compile_cxx_s"] for g in compiled))


def test_run_in_a_new_process_reuses_the_engine(built: dict[str, Any]) -> None:
    """A restart never rebuilds: the report says cache hit and the store gains no entry."""
    before = sorted(p.name for p in (built["store"] / "v1").iterdir())
    proc = run_cli("run", str(built["recipe"]), "--engines", str(built["store"]), "--json", "--iterations", "2")
    assert proc.returncode == 0, proc.stderr
    report = read_json_line(proc.stdout)
    assert report["engine"]["cache_hit"] is True
    assert report["engine"]["key"] == built["build"]["engine"]["key"]
    assert report["phases"]["build_s"] == 0.0
    assert "compiling" not in proc.stderr and "exporting" not in proc.stderr
    assert sorted(p.name for p in (built["store"] / "v1").iterdir()) == before
    for field in ("lookup_s", "build_s", "load_s", "warmup_s", "prefill_s", "decode_s"):
        assert report["phases"][field] >= 0
    # Importing torch is start-up, reported apart: a lookup of a few files is far below it.
    assert report["phases"]["startup_s"] > report["phases"]["lookup_s"]
    # the load in its parts (the graphs' runners, the weights, the constants), which together are the load
    parts = report["load_parts"]
    assert set(parts) == {"graphs_s", "weights_s", "constants_s"} and all(v > 0 for v in parts.values())
    assert sum(parts.values()) <= report["phases"]["load_s"]
    assert report["ttft_ms"] > 0 and report["tpot_ms"]["p50"] > 0 and report["tokens_per_s"]["decode"] > 0 and report["tokens_per_s"]["end_to_end"] > 0
    assert len(report["output_ids"]) == 1 and len(report["output_ids"][0]) == 8
    assert report["roofline"]["decode_bandwidth_Bps"] > 0 and report["roofline"]["prefill_bandwidth_Bps"] > 0
    # how the steps launched (CUDA graphs, PDL) means nothing on a CPU: the report leaves it out there
    assert "decode_launch" not in report and "prefill_launch" not in report


def _folder(recipe_path: Path, store: Path) -> Path:
    recipe = load_recipe(recipe_path)
    return build(recipe, store, allow_build=False).model.materialize()



def test_a_run_report_sets_the_builds_matmul_timings_against_the_step(built: dict[str, Any], tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Where a build planned the decode matmuls (CUDA), each decode graph's step of matmuls as the selection
    timed them goes into engine.json, and the run report sets it against the measured step. A CPU build
    plans none, so the plan's sum is stood in for; the same recipe with other weights (another seed) builds
    from a copy of the module's store, its compiled graphs from the tactic cache."""
    from trtbuild.backends.torch import decode_kernels
    from trtbuild.measure.report import print_table

    monkeypatch.setattr(decode_kernels, "timed_step_us", lambda record, rows: 100.0 * rows if rows else None)
    monkeypatch.setattr(decode_kernels, "fused_outside", lambda record, rows: ["96x32+gate"] if rows == 2 else [])
    doc = tiny_recipe_doc(shapes={"max_batch_size": 2, "max_input_len": 16, "max_seq_len": 48, "batch_buckets": [1, 2]})
    doc["model"]["seed"] = 1
    recipe = load_recipe(write_recipe(tmp_path, doc))
    store = shutil.copytree(built["store"], tmp_path / "engines")
    outcome = build(recipe, store)
    assert not outcome.cache_hit and outcome.entry.manifest["tactics"]["compiled_graphs_reused"]
    graphs = json.loads((outcome.entry.path / "engine.json").read_text())["graphs"]
    assert [graphs[g].get("matmuls_timed_us") for g in ("prefill", "decode_b1", "decode_b2")] == [None, 100.0, 200.0]
    assert [graphs[g].get("fused_outside") for g in ("prefill", "decode_b1", "decode_b2")] == [None, [], ["96x32+gate"]]
    with open_session(recipe, store, build=False) as session:
        report = run_report(session, batch_size=2, input_len=4, output_len=3, iterations=1)
        assert run_report(session, batch_size=1, input_len=4, output_len=3, iterations=1)["decode_matmuls_timed"] == {
            "graph": "decode_b1", "ms": 0.1, "fused_outside": []}
    assert report["decode_matmuls_timed"] == {"graph": "decode_b2", "ms": 0.2, "fused_outside": ["96x32+gate"]}
    monkeypatch.setenv("COLUMNS", "400")  # one line a row: the table wraps its cells to the terminal
    print_table(report)
    out = capsys.readouterr().out
    assert "decode_b2 matmuls" in out and "0.200 ms" in out and "as the build timed them" in out
    assert "the fusion of 96x32+gate by Inductor's kernels" in out


def test_the_prefill_row_names_the_roof_that_binds_it(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A short prompt's time to first token is bound by reading the weights, not by its FLOPs: at 8B on the
    H200 (2026-12-05), 128 tokens took 5.9 ms, 0.3 PFLOP/s (31% of peak) but 2.6 TB/s (53%). The report says
    so, where FLOP/s alone would call it a third of the way to the roof; 2048 tokens are compute-bound."""
    from trtbuild.backends import Generation
    from trtbuild.measure.report import print_table
    from trtbuild.runner import roofline

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    short = Generation(output_ids=[[1]], prefill_s=5.9e-3, decode_step_s=[], prefill_flops=1.79e12,
                       prefill_bytes=15.0e9)
    roof = roofline(short, 5.9e-3, 4.1e-3, "cuda")
    assert roof["prefill_bound"] == "memory"
    assert roof["prefill_fraction_of_peak_bandwidth"] == pytest.approx(15.0e9 / 5.9e-3 / 4.8e12)
    long = Generation(output_ids=[[1]], prefill_s=49e-3, decode_step_s=[], prefill_flops=29.7e12, prefill_bytes=15.3e9)
    assert roofline(long, 49e-3, 4.1e-3, "cuda")["prefill_bound"] == "compute"
    assert "prefill_bound" not in roofline(short, 5.9e-3, 4.1e-3, "cpu")  # no datasheet to set it against
    monkeypatch.setenv("COLUMNS", "400")
    print_table({"recipe": "r", "backend": "torch", "device": "cuda", "engine": {"key": "0" * 64, "cache_hit": True,
                 "path": "p"}, "shape": {"batch_size": 1, "input_len": 128, "output_len": 2}, "output_ids": [],
                 "phases": {"lookup_s": 0.0, "build_s": 0.0, "load_s": 0.1, "warmup_s": 0.1, "end_to_end_s": 0.5},
                 "ttft_ms": 5.9, "tpot_ms": {"p50": 4.1, "p90": 4.2, "p99": 4.3},
                 "tokens_per_s": {"decode": 243.9, "end_to_end": 4.0},
                 "roofline": roof, "prefill_launch": {"on": True, "replayed": True, "lengths": {"prompt": 100, "graph": 128},
                                                      "shapes": [[1, 128]], "limit": 4, "captures_reserved_mib": 12.0}})
    out = capsys.readouterr().out
    assert "2542.4 GB/s (53.0% of peak) · memory-bound" in out
    assert "replayed (100 tokens padded to 128 rows; graphs kept: 1, their captures reserved 12.0 MiB)" in out


@pytest.mark.parametrize("batch", [1, 2])
def test_engine_tokens_match_the_eager_model(built: dict[str, Any], batch: int) -> None:
    """The compiled prefill + decode packages, sharing one KV cache, give the eager model's greedy tokens."""
    recipe = load_recipe(built["recipe"])
    prompts = [[(7 * i + 3 * r) % 128 for i in range(11)] for r in range(batch)]
    with open_session(recipe, built["store"], build=False) as session:
        got = session.greedy(prompts, 20)
        again = session.greedy(prompts, 20)  # a second generation must not see the first's cache
        # positions 11..29: decode runs in the 24-slot window, then crosses into the 48-slot one
        assert [d.windows for d in session.engine._decoders.values()] == [[24, 48]]
    want = eager_greedy(_folder(built["recipe"], built["store"]), prompts, 20, 48)
    assert got == want
    assert again == want


def test_weights_read_with_threads_give_the_same_tokens(built: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """TRTBUILD_LOAD_THREADS=N loads the engine's weights with the threaded reader: same tokens."""
    from trtbuild.backends.torch import weights_reader

    calls: list[int] = []
    original = weights_reader.read_safetensors

    def spy(path: Path, device: str, threads: int = 8, chunk_bytes: int = 32 << 20) -> dict[str, Any]:
        calls.append(threads)
        return original(path, device, threads, chunk_bytes=4096)  # small chunks: many per tensor

    monkeypatch.setattr(weights_reader, "read_safetensors", spy)
    monkeypatch.setenv("TRTBUILD_LOAD_THREADS", "3")
    recipe = load_recipe(built["recipe"])
    prompts = [[(5 * i + 2) % 128 for i in range(9)]]
    with open_session(recipe, built["store"], build=False) as session:
        got = session.greedy(prompts, 10)
    assert calls == [3]
    assert got == eager_greedy(_folder(built["recipe"], built["store"]), prompts, 10, 48)


def test_a_malformed_prefill_graph_count_is_a_clear_error_naming_the_variable(built: dict[str, Any]) -> None:
    proc = run_cli("run", str(built["recipe"]), "--engines", str(built["store"]), "--iterations", "1",
                   env={"TRTBUILD_PREFILL_GRAPHS": "lots"})
    assert proc.returncode != 0
    assert "TRTBUILD_PREFILL_GRAPHS: expected a number of graphs from 0 to 64, got 'lots'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_batch_padded_to_a_bucket_and_sliced_prompts_stay_correct(built: dict[str, Any]) -> None:
    """A batch of 1 in the batch-2 bucket, and prompts of another length, still match eager."""
    recipe = load_recipe(built["recipe"])
    prompts = [[5, 9, 2, 77, 31]]
    with open_session(recipe, built["store"], build=False) as session:
        engine = session.engine
        assert engine.bucket_for(1) == 1 and engine.bucket_for(2) == 2
        got = session.greedy(prompts, 12)
    assert got == eager_greedy(_folder(built["recipe"], built["store"]), prompts, 12, 48)


def test_a_padded_prompt_gets_its_own_first_token_from_the_prefill_step(built: dict[str, Any]) -> None:
    """What a captured prefill graph hands its package on CUDA (prefill_graphs.py; compiled: test_gpu.py): the
    prompt padded to 16 rows, the padding at position max_seq_len - 1. The prefill step (the model code every
    prefill graph is exported from) answers the unpadded prompt's token. A CPU engine has no prefill graph to
    pad (its prompts run through the step program, unpadded)."""
    import torch

    from trtbuild.models.llama import Step

    from .engine_helpers import _eager_model

    recipe = load_recipe(built["recipe"])
    folder = build(recipe, built["store"], allow_build=False).model.materialize()
    step = Step(_eager_model(folder, 2, 48, torch.float32, "cpu"), from_start=True)
    rows = torch.tensor([0, 1])  # each prompt's cache row
    with torch.no_grad():
        for t in (5, 11):
            prompt = torch.tensor([[(7 * i + 3) % 128 for i in range(t)], [(5 * i + 1) % 128 for i in range(t)]])
            want = step(prompt, torch.arange(t), rows)[0].clone()  # the greedy tokens (logits beside them)
            padded = torch.cat([prompt, torch.full((2, 16 - t), 9)], dim=1)
            positions = torch.cat([torch.arange(t), torch.full((16 - t,), 47)])
            assert torch.equal(step(padded, positions, rows)[0], want)


def test_python_api_opens_a_prebuilt_engine_without_building(built: dict[str, Any]) -> None:
    recipe = trtbuild.load_recipe(built["recipe"])
    with trtbuild.open(recipe, engines=str(built["store"]), build=False) as session:
        ids = session.greedy([[1, 2, 3]], 4)
        assert len(ids[0]) == 4
        assert session.outcome.cache_hit and session.phases["build_s"] == 0.0
        assert session.phases["load_s"] > 0
        report = run_report(session, batch_size=2, input_len=4, output_len=3, iterations=1)
    assert len(report["output_ids"]) == 2


def test_no_build_miss_is_a_clear_error(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, tiny_recipe_doc(name="absent"))
    with pytest.raises(EngineMissingError, match="no engine for recipe 'absent'"):
        build(load_recipe(recipe), tmp_path / "store", allow_build=False)
    proc = run_cli("run", str(recipe), "--engines", str(tmp_path / "store"), "--no-build")
    assert proc.returncode == 1 and proc.stderr.startswith("Error: no engine") and "Traceback" not in proc.stderr
    proc = run_cli("run", str(recipe), "--engines", str(tmp_path / "store"), env={"TRTBUILD_NO_BUILD": "1"})
    assert proc.returncode == 1 and "building is off" in proc.stderr
    assert not list((tmp_path / "store" / "v1").glob("absent-*"))


def test_run_flags_outside_the_engine_shapes_are_refused(built: dict[str, Any]) -> None:
    proc = run_cli("run", str(built["recipe"]), "--engines", str(built["store"]), "--input-len", "40")
    assert proc.returncode == 2 and "--input-len: 40 exceeds shapes.max_input_len 16" in proc.stderr


def test_a_changed_build_field_misses_and_builds_a_second_entry(built: dict[str, Any], tmp_path: Path) -> None:
    """Run defaults and the name are not in the key; the seed (weights) is."""
    doc = tiny_recipe_doc(shapes={"max_batch_size": 2, "max_input_len": 16, "max_seq_len": 48, "batch_buckets": [1, 2]})
    same = write_recipe(tmp_path, {**doc, "name": "renamed", "run": {"batch_size": 2, "input_len": 4, "output_len": 4}},
                        "same.yaml")
    assert build(load_recipe(same), built["store"], allow_build=False).cache_hit
    seeded = {**doc, "model": {**doc["model"], "seed": 1}}
    other = write_recipe(tmp_path, seeded, "other.yaml")
    with pytest.raises(EngineMissingError):
        build(load_recipe(other), built["store"], allow_build=False)


def test_cache_ls_lists_the_entry(built: dict[str, Any]) -> None:
    proc = run_cli("cache", "ls", "--engines", str(built["store"]))
    assert proc.returncode == 0
    assert "tiny" in proc.stdout and built["build"]["engine"]["key"][:16] in proc.stdout
    rows = json.loads(run_cli("cache", "ls", "--engines", str(built["store"]), "--json").stdout)
    assert rows[0]["backend"] == "torch" and rows[0]["size"] > 0


def test_rebuild_and_other_weights_reuse_compiled_graphs_and_stay_correct(built: dict[str, Any],
                                                                          tmp_path: Path) -> None:
    """Deleting an engine keeps the tactic cache: the rebuild copies the compiled graphs instead of
    running Inductor. A recipe that differs only in its weights (seed) reuses them too, and its
    tokens still match the eager model with *its* weights: no weight is baked into a graph."""
    store = shutil.copytree(built["store"], tmp_path / "engines")
    recipe = load_recipe(built["recipe"])
    first = Store(store).find("tiny")
    Store(store).remove(first)
    rebuilt = build(recipe, store)
    assert not rebuilt.cache_hit and rebuilt.key == first.key
    assert rebuilt.entry.manifest["tactics"]["compiled_graphs_reused"] == ["prefill", "decode_b1", "decode_b2"]
    # nothing compiled, nor exported: the graphs are found by what export would read, weights' values aside
    assert rebuilt.phases["compile_cxx_s"] == rebuilt.phases["compile_inductor_s"] == rebuilt.phases["export_s"] == 0
    doc = tiny_recipe_doc(name="seeded", shapes={"max_batch_size": 2, "max_input_len": 16, "max_seq_len": 48,
                                                 "batch_buckets": [1, 2]})
    doc["model"]["seed"] = 7
    other = load_recipe(write_recipe(tmp_path, doc, "seeded.yaml"))
    outcome = build(other, store)
    assert outcome.key != first.key
    assert outcome.entry.manifest["tactics"]["compiled_graphs_reused"] == ["prefill", "decode_b1", "decode_b2"]
    assert outcome.phases["compile_cxx_s"] == outcome.phases["compile_inductor_s"] == outcome.phases["export_s"] == 0
    prompts = [[4, 8, 15, 16, 23, 42]]
    with open_session(other, store, build=False) as session:
        got = session.greedy(prompts, 10)
    assert got == eager_greedy(outcome.model.materialize(), prompts, 10, 48)
    with open_session(recipe, store, build=False) as session:
        assert session.greedy(prompts, 10) != got, "different weights, different tokens"


def test_local_folder_with_tokenizer_runs_a_text_prompt(tmp_path: Path) -> None:
    """A local Hugging Face folder (relative to the recipe) with tokenizer.json: --prompt is encoded,
    and the report shows the decoded output."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from .conftest import make_hf_folder

    folder = make_hf_folder(tmp_path / "model")
    vocab = {f"w{i}": i for i in range(127)} | {"[UNK]": 127}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    doc = tiny_recipe_doc(name="local", model={"source": "./model"})
    recipe = write_recipe(tmp_path, doc)
    proc = run_cli("run", str(recipe), "--prompt", "w1 w2 w3 w4", "--output-len", "5", "--iterations", "1", "--json",
                   cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = read_json_line(proc.stdout)
    assert report["shape"]["input_len"] == 4
    text = report["output_text"][0].split()
    assert len(text) == 5 and all(w in vocab for w in text)
    manifest = json.loads((Path(report["engine"]["path"]) / "manifest.json").read_text())
    identity = manifest["key_material"]["recipe"]["model"]["identity"]
    assert identity["kind"] == "local" and len(identity["sha256"]) == 64



def test_a_process_whose_libstdcxx_is_shadowed_gets_a_clear_error_not_a_crash(built: dict[str, Any]) -> None:
    """The state that segfaulted every compiled graph on the H200 image, made here (tests/test_cxx.py):
    `trtbuild run` must refuse before loading the graph, name the library, and say what to do."""
    import subprocess
    import sys

    from .test_cxx import shadowed

    if shutil.which("gcc") is None or sys.platform != "linux":
        pytest.skip("needs Linux and gcc")
    lib = built["store"].parent / "libshadow.so"
    (built["store"].parent / "shadow.c").write_text("int _ZNSt7__cxx117collateIcE2idE = 0;\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(built["store"].parent / "shadow.c")], check=True)
    code = shadowed(lib) + ("import sys\nfrom trtbuild.cli import main\n"
                            f"sys.argv = ['trtbuild', 'run', {str(built['recipe'])!r}, '--engines', "
                            f"{str(built['store'])!r}, '--no-build']\nmain()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode > 0, (proc.returncode, proc.stderr[-2000:])  # an error exit, not a signal
    assert "libshadow.so" in proc.stderr and "LD_PRELOAD" in proc.stderr
    assert "Traceback" not in proc.stderr



def test_tactics_max_on_the_cpu_builds_an_engine_that_loads_and_matches_eager(tmp_path: Path) -> None:
    """`max` on the CPU once built graphs that could not load: Inductor's C++ GEMM template packs the
    weights into new constants at compile time, and weights are handed in at load. It keeps ATen's
    matmuls there, never rewrites batch-1 matmuls as GEMVs (no coordinate descent), and gives the eager
    model's tokens. (Which GEMM kernels `max` picks and records on CUDA: tests/test_gpu.py.)"""
    doc = tiny_recipe_doc(shapes={"max_batch_size": 1, "max_input_len": 16, "max_seq_len": 32, "batch_buckets": [1]},
                          tactics={"level": "max"})
    recipe = load_recipe(write_recipe(tmp_path, doc))
    outcome = build(recipe, tmp_path / "store")
    configs = outcome.entry.manifest["tactics"]["inductor_configs"]
    assert set(configs) == {"prefill", "decode_b1"}
    decode = configs["decode_b1"]
    assert decode["max_autotune"] is True and decode["coordinate_descent_tuning"] is False
    assert decode["max_autotune_gemm_backends"] == "ATEN"
    # prefill's rows are dynamic: tuned at the example's 4 rows, a template would then run 2048-row prompts
    assert "max_autotune" not in configs["prefill"]
    # trtbuild's decode kernel is Triton (CUDA): a CPU build keeps ATen's matmuls and says so
    assert outcome.entry.manifest["tactics"]["decode_matmuls"] == {"note": "cuBLAS (ATen) for every matmul: a CPU build"}
    assert outcome.entry.manifest["tactics"]["decode_attention"] == {"used": "aten", "note": "aten: a CPU build"}
    assert outcome.entry.manifest["tactics"]["prefill_attention"] == {"used": "sdpa", "note": "sdpa: a CPU build"}
    prompts = [[5, 3, 9, 1, 7, 2]]
    with open_session(recipe, tmp_path / "store", build=False) as session:
        got = session.greedy(prompts, 12)
    assert got == eager_greedy(outcome.model.materialize(), prompts, 12, 32)


def test_decode_kernel_asked_for_on_the_cpu_is_a_clear_error_and_leaves_no_entry(tmp_path: Path) -> None:
    """options.decode_matmul 'kernel' asks for a CUDA kernel: a CPU build refuses with the field named,
    and the store keeps neither an entry nor a half-written build folder."""
    from trtbuild.errors import TrtbuildError

    doc = tiny_recipe_doc(tactics={"level": "default"}, options={"decode_matmul": "kernel"})
    recipe = load_recipe(write_recipe(tmp_path, doc))
    with pytest.raises(TrtbuildError, match="options.decode_matmul: 'kernel' is a CUDA kernel"):
        build(recipe, tmp_path / "store")
    store = Store(tmp_path / "store")
    assert store.entries() == [] and list(store.tmp_dir.iterdir()) == []


@pytest.mark.parametrize("option, message", [
    ({"decode_attention": "kernel"}, "options.decode_attention: 'kernel' cannot serve this build: a CPU build"),
    ({"prefill_attention": "cudnn"}, "options.prefill_attention: 'cudnn' cannot serve a CPU build")])
def test_an_attention_kernel_asked_for_on_the_cpu_is_a_clear_error_and_leaves_no_entry(
        tmp_path: Path, option: dict[str, str], message: str) -> None:
    from trtbuild.errors import TrtbuildError

    recipe = load_recipe(write_recipe(tmp_path, tiny_recipe_doc(options=option)))
    with pytest.raises(TrtbuildError, match=message):
        build(recipe, tmp_path / "store")
    store = Store(tmp_path / "store")
    assert store.entries() == [] and list(store.tmp_dir.iterdir()) == []


@pytest.mark.parametrize("debug", [False, True])
def test_gemm_selections_are_recorded_and_inductors_tables_shown_only_when_debugging(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, debug: bool) -> None:
    """What max-autotune benchmarks goes into the manifest's tactics (here a CPU GEMM template against
    ATen, for a graph whose weight is inside it); Inductor's own tables reach stderr only with
    TRTBUILD_DEBUG=1."""
    import torch

    from trtbuild.backends.torch.backend import record_autotuning

    if debug:
        monkeypatch.setenv("TRTBUILD_DEBUG", "1")
    program = torch.export.export(torch.nn.Linear(64, 32).eval(), (torch.randn(8, 64),))
    tuned: list[dict[str, Any]] = []
    with record_autotuning(tuned):
        torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "m.pt2"),
                                                 inductor_configs={"max_autotune": True, "force_disable_caches": True})
    assert len(tuned) == 1 and tuned[0]["num_candidates"] >= 2
    assert tuned[0]["winner"] == tuned[0]["candidates"][0]["choice"]
    assert ("AUTOTUNE" in capfd.readouterr().err) is debug


def test_compiled_graph_key_ignores_source_locations_but_not_shapes() -> None:
    """The compiled-graph cache is keyed by the exported program's text without the "# File: ...:LINE"
    comments export writes above each node: a checkout in another folder, or an edit that only moves
    lines, reuses identical graphs; a change of shape still changes the key."""
    import torch

    from trtbuild.backends.torch.graph_cache import program_text

    def export(rows: int) -> Any:
        return torch.export.export(torch.nn.Linear(64, 32).eval(), (torch.randn(rows, 64),))

    raw, text = str(export(8)), program_text(export(8))
    assert "# File:" in raw and "# File:" not in text
    assert "f32[8, 64]" in text and "aten.linear" in text
    assert text == program_text(export(8)) != program_text(export(4))


def test_graphs_compiled_in_worker_processes_are_the_serial_builds_graphs(
        built: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With workers, the build compiles the step program while two worker processes compile the paged graphs
    (the paged step and the mixed step) from models of their own with uninitialized weights. Their exports
    must be the build's (a worker checks the key the build computed; the step program's key is the serial
    build's of the same shapes in `built`), they are recorded as compiled, not reused, nothing of the workers' is
    published with the engine, and the tokens are right."""
    from trtbuild.backends.torch import compile_workers

    monkeypatch.setattr(compile_workers, "forks_for", lambda device: False)  # the new processes a CUDA build uses
    monkeypatch.setenv("TRTBUILD_COMPILE_WORKERS", "2")
    doc = tiny_recipe_doc(options={"kv_cache": "paged"}, shapes={"max_batch_size": 2, "max_input_len": 16,
                                                                 "max_seq_len": 48, "batch_buckets": [1, 2]})
    recipe = load_recipe(write_recipe(tmp_path, doc))
    outcome = build(recipe, tmp_path / "store")
    entry = outcome.entry
    assert entry.manifest["tactics"]["compile_workers"] == 2
    assert entry.manifest["tactics"]["compiled_graphs_reused"] == ["decode_b1", "decode_b2"]
    graphs = json.loads((entry.path / "engine.json").read_text())["graphs"]
    assert "worker" not in graphs["prefill"] and "worker" not in graphs["decode_b2"]
    for name in ("paged", "paged_mixed"):
        assert graphs[name]["worker"]["ok"] is True, graphs[name]["worker"]
        assert 0 < graphs[name]["worker"]["compile_s"] < graphs[name]["worker"]["total_s"]
    serial = json.loads((Store(built["store"]).find("tiny").path / "engine.json").read_text())["graphs"]
    assert {n: graphs[n]["digest"] for n in serial} == {n: g["digest"] for n, g in serial.items()}
    assert not any(".workers" in f for f in entry.manifest["files"])
    prompts = [[4, 8, 15, 16, 23, 42]]
    with open_session(recipe, tmp_path / "store", build=False) as session:
        assert session.greedy(prompts, 10) == eager_greedy(outcome.model.materialize(), prompts, 10, 48)


def test_a_worker_whose_export_differs_is_not_trusted_and_the_build_compiles_that_graph_itself(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build hands each worker the cache key it computed; a worker whose own export hashes to
    another key compiles nothing, and the build compiles the graph itself (here the build's keys are
    made to differ from any export's)."""
    from trtbuild.backends.torch import graph_cache

    real = graph_cache.graph_digest
    from trtbuild.backends.torch import compile_workers

    monkeypatch.setattr(graph_cache, "graph_digest", lambda program, configs: real(program, configs)[::-1])
    monkeypatch.setattr(compile_workers, "forks_for", lambda device: False)  # a fork has the build's export
    monkeypatch.setenv("TRTBUILD_COMPILE_WORKERS", "1")
    doc = tiny_recipe_doc(options={"kv_cache": "paged"},
                          shapes={"max_batch_size": 1, "max_input_len": 16, "max_seq_len": 48, "batch_buckets": [1]})
    recipe = load_recipe(write_recipe(tmp_path, doc))
    outcome = build(recipe, tmp_path / "store")
    graphs = json.loads((outcome.entry.path / "engine.json").read_text())["graphs"]
    report = graphs["paged"]["worker"]
    assert report["ok"] is False and "cache key" in report["error"], report
    assert graphs["paged"]["reused"] is False
    prompts = [[1, 2, 3, 5, 8]]
    with open_session(recipe, tmp_path / "store", build=False) as session:
        assert session.greedy(prompts, 6) == eager_greedy(outcome.model.materialize(), prompts, 6, 48)

