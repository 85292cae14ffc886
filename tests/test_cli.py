"""The command line through click's CliRunner (fast) and real processes (what users run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from trtbuild.cli import main

from .conftest import run_cli, tiny_recipe_doc, write_recipe


def test_validate_reports_every_problem_with_exit_2_and_no_traceback(tmp_path: Path, engine_store: Path) -> None:
    doc = tiny_recipe_doc()
    doc["shapes"] = {"max_batch_size": 2, "max_input_len": 64, "max_seq_len": 32, "batch_buckets": [4]}
    doc["precison"] = "fp16"
    bad = write_recipe(tmp_path, doc, "bad.yaml")
    good = write_recipe(tmp_path, tiny_recipe_doc(), "good.yaml")
    result = CliRunner().invoke(main, ["validate", str(good), str(bad)])
    assert result.exit_code == 2
    assert f"{good}: ok" in result.output
    for expected in ("precison: unknown key; did you mean 'precision'?",
                     "shapes.max_input_len: 64 exceeds shapes.max_seq_len 32",
                     "shapes.batch_buckets: bucket 4 exceeds shapes.max_batch_size 2"):
        assert expected in result.output
    assert str(bad) in result.output and "Traceback" not in result.output
    assert not engine_store.exists(), "validation writes nothing"


def test_bad_recipe_in_a_real_process(tmp_path: Path, engine_store: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\nmodel: [unclosed\n")
    for command in ("validate", "build", "run"):
        proc = run_cli(command, str(path))
        assert proc.returncode == 2, command
        assert proc.stderr.startswith(f"Error: {path}: malformed YAML at line") and "Traceback" not in proc.stderr
    assert not engine_store.exists()
    debug = run_cli("build", str(path), env={"TRTBUILD_DEBUG": "1"})
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_missing_model_folder_names_the_field(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, tiny_recipe_doc(model={"source": "./nowhere"}))
    result = CliRunner().invoke(main, ["build", str(recipe)])
    assert result.exit_code == 2 and "model.source: model folder not found" in result.output


def test_unavailable_backend_fails_in_one_line_naming_the_install(tmp_path: Path) -> None:
    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"not really onnx")
    doc = tiny_recipe_doc(backend="tensorrt", precision="fp16", model={"source": "m.onnx"},
                          tactics={"level": "default"})
    recipe = write_recipe(tmp_path, doc)
    proc = run_cli("build", str(recipe))
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "backend 'tensorrt' is unavailable" in lines[0] and "NVIDIA" in lines[0]


def test_doctor_lists_every_backend_and_the_device() -> None:
    proc = run_cli("doctor")
    assert proc.returncode == 0
    assert "torch         available" in proc.stdout
    assert "tensorrt-llm  unavailable" in proc.stdout and "tensorrt      unavailable" in proc.stdout
    assert '"kind": "cpu"' in proc.stdout
    assert "c++:    compiler" in proc.stdout and "first in the global scope" in proc.stdout


def test_cache_commands_on_an_empty_store(engine_store: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(main, ["cache", "ls"]).output.strip() == "no engines"
    shown = runner.invoke(main, ["cache", "show", "nothing"])
    assert shown.exit_code == 2 and "no engine matches 'nothing'" in shown.output
    stats = runner.invoke(main, ["cache", "stats", "--json"])
    assert json.loads(stats.output) == {"hits": 0, "misses": 0, "builds": 0, "build_s": 0.0, "build_s_saved": 0.0,
                                        "entries": 0, "entries_bytes": 0, "quarantined": 0, "quarantine_bytes": 0}
    prune = runner.invoke(main, ["cache", "prune", "--max-size", "lots"])
    assert prune.exit_code == 2 and "--max-size: expected a size" in prune.output


def test_prompt_ids_are_parsed_strictly(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, tiny_recipe_doc())
    result = CliRunner().invoke(main, ["run", str(recipe), "--prompt-ids", "1,x,3"])
    assert result.exit_code == 2 and "--prompt-ids: expected comma-separated integers" in result.output


def test_run_flags_the_engine_cannot_take_are_refused_by_name_before_anything_is_built(tmp_path: Path) -> None:
    """A 0 is refused, not replaced by the recipe's default; every bad flag at once; no store is made."""
    recipe = write_recipe(tmp_path, tiny_recipe_doc())
    store = tmp_path / "engines"
    result = CliRunner().invoke(main, ["run", str(recipe), "--engines", str(store), "--batch-size", "0",
                                       "--output-len", "-1", "--iterations", "0"])
    assert result.exit_code == 2, result.output
    assert ("--batch-size: must be >= 1, got 0; --output-len: must be >= 1, got -1; --iterations: must be >= 1, got 0"
            in result.output)
    result = CliRunner().invoke(main, ["run", str(recipe), "--engines", str(store), "--prompt-ids", "1,2;3,4;5,6"])
    assert result.exit_code == 2 and "--batch-size: 3 exceeds shapes.max_batch_size 2" in result.output
    assert not store.exists()


def test_a_full_disk_while_writing_the_weights_is_a_clear_error_and_leaves_no_entry(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """safetensors reports a full disk as SafetensorError("... (os error 28)"), not OSError: the build
    says what ran out and where, in one line without a traceback, exits non-zero, and the store holds
    neither an entry nor a build folder (an 8B build on the H200 hit this, 2026-12-04)."""
    import safetensors.torch
    from safetensors import SafetensorError

    from trtbuild.store.local import Store

    real = safetensors.torch.save_file

    def full(tensors: Any, path: str, **kwargs: Any) -> None:
        if "/v1/.tmp/" not in path:  # the synthetic model's own checkpoint is written the same way
            return real(tensors, path, **kwargs)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    recipe = write_recipe(tmp_path, tiny_recipe_doc())
    result = CliRunner().invoke(main, ["build", str(recipe), "--engines", str(tmp_path / "engines")])
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    assert "No space left on device while building 'tiny'; nothing was published" in result.output
    store = Store(tmp_path / "engines")
    assert store.entries() == [] and list(store.tmp_dir.iterdir()) == []


def test_stop_reads_escapes_as_printf_does_in_the_readme_and_docs_examples(tmp_path: Path) -> None:
    """The documented `--stop "\\n\\n"` reaches the shell as a backslash and an n; run reads it as a blank line."""
    import re
    import shlex

    from .conftest import REPO

    recipe = write_recipe(tmp_path, tiny_recipe_doc())
    examples = [line for doc in ("README.md", "docs/generation.md")
                for line in (REPO / doc).read_text().splitlines() if line.startswith("trtbuild run") and "--stop" in line]
    assert len(examples) >= 2, "the README and docs/generation.md each show --stop"
    for line in examples:
        argv = shlex.split(re.sub(r"\s+#.*$", "", line))[2:]  # as a shell passes it, less `trtbuild run`
        argv[argv.index("RECIPE")] = str(recipe)
        ctx = main.commands["run"].make_context("run", argv)
        assert ctx.params["stop"] == ("\n\n",), line
    ctx = main.commands["run"].make_context("run", [str(recipe), "--stop", r"a\tb\\n\x41\u00e9\101\q", "--stop", "é"])
    assert ctx.params["stop"] == ("a\tb\\nA\u00e9A\\q", "é")  # an unknown escape stays, as printf leaves it
    result = CliRunner().invoke(main, ["run", str(recipe), "--stop", ""])
    assert result.exit_code == 2 and "--stop" in result.output and "Traceback" not in result.output


def test_cache_stats_counts_a_hit_as_its_entrys_build_time_once_a_process(tmp_path: Path) -> None:
    """Three lookups of one entry in this process and one in another: four hits, which saved the entry's build
    time twice (once a process), not four times."""
    from trtbuild import builder
    from trtbuild.recipe import load_recipe
    from trtbuild.store.local import Store

    recipe_path = write_recipe(tmp_path, tiny_recipe_doc(name="saved"))
    recipe, store = load_recipe(recipe_path), Store(tmp_path / "engines")
    _, _, _, key = builder._resolve(recipe, store, builder._startup(recipe))
    entry = store.entries_dir / f"saved-{key[:16]}"  # a published-looking entry under the recipe's own key
    entry.mkdir(parents=True)
    (entry / "data.bin").write_bytes(b"x" * 10)
    (entry / "manifest.json").write_text(json.dumps({
        "key": key, "name": "saved", "backend": "torch", "precision": "fp32", "verified": True,
        "files": {"data.bin": {"size": 10, "sha256": "0" * 64}}, "build": {"total_s": 40.0}}))
    builder._SAVED_ONCE.discard(key)
    for _ in range(3):
        assert builder.build(recipe, store.root).cache_hit
    assert run_cli("build", str(recipe_path), "--engines", str(store.root), "--json").returncode == 0
    counts = json.loads(CliRunner().invoke(main, ["cache", "stats", "--engines", str(store.root), "--json"]).output)
    assert counts["hits"] == 4 and counts["build_s_saved"] == pytest.approx(80.0), counts
    text = CliRunner().invoke(main, ["cache", "stats", "--engines", str(store.root)]).output
    assert "saved by hits 80.0 s (a hit saves its entry's build time, once a process)" in text


def test_threads_default_to_the_free_cores_and_a_wide_tail_is_called_unstable(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from trtbuild import timing

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (5.2, 0.0, 0.0), raising=False)
    n, why = timing.free_cores()
    assert n == 3 and "8 core(s)" in why and "5.2 busy" in why
    monkeypatch.setattr(os, "getloadavg", lambda: (30.0, 0.0, 0.0), raising=False)
    assert timing.free_cores()[0] == 1  # never none
    # the busy machine's figures: TPOT p50 50 ms, p99 1,480 ms; and a quiet one's
    assert "unstable" in (timing.unstable({"p50": 0.050, "p99": 1.480}) or "")
    assert timing.unstable({"p50": 0.045, "p99": 0.049}) is None
    recipe = write_recipe(tmp_path, tiny_recipe_doc())
    for command in ("run", "serve", "eval", "profile"):
        extra = ["--text", str(recipe)] if command == "eval" else []
        result = CliRunner().invoke(main, [command, str(recipe), *extra, "--threads", "0"])
        assert result.exit_code == 2 and "--threads" in result.output, (command, result.output)


_ENTRY_PROBE = '''
import atexit, sys
{torch}
from trtbuild.cli import entry


class TornDown:
    def __del__(self) -> None:
        sys.__stderr__.write("torn down\\n")


keep = TornDown()
atexit.register(lambda: print("exit handlers ran", flush=True))
sys.argv = ["trtbuild", *sys.argv[1:]]
entry()
'''


@pytest.mark.parametrize("torch_loaded", [True, False])
def test_the_process_entry_skips_the_teardown_once_torch_is_loaded_keeping_status_and_output(
        tmp_path: Path, torch_loaded: bool) -> None:
    """With torch imported, the process ends after the exit handlers without the interpreter tearing its modules
    down (a module's object is never finalized); the status and every line written are the command's. Without
    torch the process exits as any Python program (the object is finalized: the probe can tell)."""
    import subprocess
    import sys

    script = tmp_path / "probe.py"
    script.write_text(_ENTRY_PROBE.format(torch="import torch" if torch_loaded else ""))
    ok = subprocess.run([sys.executable, str(script), "--version"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "version" in ok.stdout and "exit handlers ran" in ok.stdout, ok
    assert ("torn down" in ok.stderr) is not torch_loaded
    bad = subprocess.run([sys.executable, str(script), "build", str(tmp_path / "missing.yaml")], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "Error:" in bad.stderr and "recipe file not found" in bad.stderr, bad
    assert "exit handlers ran" in bad.stdout and ("torn down" in bad.stderr) is not torch_loaded
