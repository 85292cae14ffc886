"""What a new user meets first: where the store is, what the report and the cache commands say, and
which inputs are refused before anything runs."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from trtbuild.cli import main
from trtbuild.recipe import load_recipe
from trtbuild.store.local import Store, store_origin

from .conftest import REPO, TINY_CONFIG, make_hf_folder, read_json_line, run_cli, tiny_recipe_doc, write_recipe


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _fake_entry(store: Path, name: str, key: str, size: int = 10) -> Path:
    """A published-looking entry: its folder and a manifest naming one file."""
    path = store / "v1" / f"{name}-{key[:16]}"
    path.mkdir(parents=True)
    (path / "data.bin").write_bytes(b"x" * size)
    manifest = {"key": key, "name": name, "backend": "torch", "precision": "fp32", "created": time.time(),
                "last_used": time.time(), "files": {"data.bin": {"size": size, "sha256": "0" * 64}},
                "key_material": {"recipe": {"shapes": {"max_batch_size": 1}}, "device": {"kind": "cpu"},
                                 "backend": {"toolchain": {"torch": "2.13.0"}}},
                "build": {"total_s": 1.5, "phases": {"export_s": 0.5}, "host": {"hostname": "h"}}}
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


# -- the store's location -------------------------------------------------------------------------
def test_the_default_store_is_per_user_and_every_command_says_which_and_why(monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    monkeypatch.delenv("TRTBUILD_ENGINES")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    where, why = store_origin()
    assert where == tmp_path / "xdg" / "trtbuild" / "engines" and why == "the per-user default"
    for cwd in (tmp_path, REPO):  # the same store from any working directory
        monkeypatch.chdir(cwd)
        assert Store().root == where
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert store_origin()[0] == Path("~/.cache/trtbuild/engines").expanduser()
    monkeypatch.setenv("TRTBUILD_ENGINES", str(tmp_path / "env"))
    assert store_origin() == (tmp_path / "env", "TRTBUILD_ENGINES")
    assert store_origin(str(tmp_path / "flag")) == (tmp_path / "flag", "--engines")
    out = CliRunner().invoke(main, ["doctor"]).output
    assert f"store: {tmp_path / 'env'} (TRTBUILD_ENGINES)" in out


def test_a_builder_that_died_in_any_phase_leaves_nothing_after_the_next_build_starts(engine_store: Path) -> None:
    store = Store(engine_store)
    store.ensure()
    host, dead = socket.gethostname(), _dead_pid()
    left = [engine_store / "models" / f"synthetic-0123456789abcdef.tmp-{host}-{dead}",  # writing a checkpoint
            engine_store / "models" / f"synthetic-fedcba9876543210.tmp-{dead}",  # the older name, no host
            engine_store / "tactics" / "torch" / "abc" / "graphs" / f"d1g35t.tmp-{host}-{dead}",  # copying a graph
            store.tmp_dir / f"tiny-0123456789abcdef.{host}.{dead}.1a2b3c4d"]  # building
    alive = engine_store / "models" / f"synthetic-aaaaaaaaaaaaaaaa.tmp-{host}-{os.getpid()}"
    other_host = engine_store / "models" / f"synthetic-bbbbbbbbbbbbbbbb.tmp-elsewhere-{dead}"
    for path in [*left, alive, other_host]:
        path.mkdir(parents=True)
        (path / "part").write_bytes(b"half")
    workdir = store.new_workdir("tiny", "f" * 64)  # what every build does first
    assert workdir.is_dir()
    assert [p for p in left if p.exists()] == []
    assert alive.exists() and other_host.exists()  # a live writer, or another host's on a shared disk


# -- recipes and run flags --------------------------------------------------------------------------
def test_defaults_the_user_did_not_write_fit_the_recipe_shapes(tmp_path: Path) -> None:
    doc = tiny_recipe_doc(shapes={"max_batch_size": 1, "max_input_len": 16, "max_seq_len": 32})
    del doc["run"]
    recipe = load_recipe(write_recipe(tmp_path, doc))
    assert recipe.run.input_len + recipe.run.output_len <= 32 and recipe.run.input_len <= 16
    doc["run"] = {"input_len": 16, "output_len": 32}  # written by the user: still refused, by name
    result = CliRunner().invoke(main, ["validate", str(write_recipe(tmp_path, doc, "written.yaml"))])
    assert result.exit_code == 2 and "run.output_len" in result.output and "the default" not in result.output


@pytest.mark.parametrize(("flags", "message"), [
    (["--batch-size", "2", "--prompt-ids", "1,2,3"], "--batch-size 2 but --prompt-ids has 1 row(s)"),
    (["--input-len", "4", "--prompt-ids", "1,2,3"], "--input-len 4 but --prompt-ids rows have 3 tokens"),
    (["--prompt-ids", ",".join(["1"] * 20)], "--prompt-ids: the prompt is 20 tokens, more than shapes.max_input_len 16"),
])
def test_prompt_flags_that_disagree_are_refused_before_anything_is_built(tmp_path: Path, engine_store: Path,
                                                                        flags: list[str], message: str) -> None:
    recipe = write_recipe(tmp_path, tiny_recipe_doc())
    result = CliRunner().invoke(main, ["run", str(recipe), *flags])
    assert result.exit_code == 2 and message in result.output, result.output
    assert not (engine_store / "v1").exists()


def test_validate_reads_a_local_folder_as_run_would(tmp_path: Path) -> None:
    """A truncated config, an unsupported model_type and a layer count the weights do not have: each
    refused by `validate`, naming the file and the field, from the config and the weights' headers."""
    cases: dict[str, str] = {}
    folder = make_hf_folder(tmp_path / "truncated")
    (folder / "config.json").write_text((folder / "config.json").read_text()[:40])
    cases["truncated"] = "config.json: not valid JSON (truncated?)"
    folder = make_hf_folder(tmp_path / "gpt2")
    (folder / "config.json").write_text(json.dumps({**TINY_CONFIG, "model_type": "gpt2"}))
    cases["gpt2"] = "model_type: 'gpt2' is not supported"
    folder = make_hf_folder(tmp_path / "layers")
    (folder / "config.json").write_text(json.dumps({**TINY_CONFIG, "num_hidden_layers": 3}))
    cases["layers"] = "num_hidden_layers: 3, but the weights hold 2 layers"
    folder = make_hf_folder(tmp_path / "fine")
    for name, expected in [*cases.items(), ("fine", "ok (tiny")]:
        doc = tiny_recipe_doc(model={"source": f"./{name}"})
        result = CliRunner().invoke(main, ["validate", str(write_recipe(tmp_path, doc, f"{name}.yaml"))])
        assert expected in result.output, (name, result.output)
        assert result.exit_code == (0 if name == "fine" else 2)
        assert "Traceback" not in result.output


def test_validate_reports_every_problem_of_a_local_folder_at_once(tmp_path: Path) -> None:
    """A yarn rope_scaling and a hidden_size the weights disagree with: both in one run, as a recipe's are."""
    folder = make_hf_folder(tmp_path / "model")
    (folder / "config.json").write_text(json.dumps({**TINY_CONFIG, "hidden_size": 64, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}))
    doc = tiny_recipe_doc(model={"source": "./model"})
    result = CliRunner().invoke(main, ["validate", str(write_recipe(tmp_path, doc))])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "rope_scaling" in result.output and "yarn" in result.output, result.output
    assert re.search(r"tensor model\.\S+ has shape \(\d+, 32\), config\.json implies \(\d+, 64\)", result.output)
    assert "problems in the model folder" in result.output


# -- cache commands ---------------------------------------------------------------------------------
def test_cache_show_takes_a_key_prefix_a_name_or_the_path_run_prints(engine_store: Path) -> None:
    a = _fake_entry(engine_store, "alpha", "abcdef01" + "1" * 56)
    _fake_entry(engine_store, "beta", "abcdef02" + "2" * 56)
    cli = CliRunner()
    for ref in ("abcdef01", "alpha", str(a), f"{a}/", a.name):
        result = cli.invoke(main, ["cache", "show", ref])
        assert result.exit_code == 0 and "alpha-abcdef0111111111" in result.output, (ref, result.output)
        assert "key_material" not in result.output and len(result.output.splitlines()) < 25  # a summary
    as_json = cli.invoke(main, ["cache", "show", "alpha", "--json"])
    assert json.loads(as_json.output)["name"] == "alpha"
    ambiguous = cli.invoke(main, ["cache", "show", "abcdef"])
    assert ambiguous.exit_code == 2 and "matches 2 engines" in ambiguous.output
    assert "alpha-abcdef0111111111" in ambiguous.output and "beta-abcdef0222222222" in ambiguous.output
    short = cli.invoke(main, ["cache", "show", "abcde"])
    assert short.exit_code == 2 and "at least 6 characters" in short.output


def test_cache_ls_shows_pins(engine_store: Path) -> None:
    _fake_entry(engine_store, "alpha", "a" * 64)
    _fake_entry(engine_store, "beta", "b" * 64)
    cli = CliRunner()
    assert cli.invoke(main, ["cache", "pin", "alpha"]).exit_code == 0
    rows = {r["name"]: r["pinned"] for r in json.loads(cli.invoke(main, ["cache", "ls", "--json"]).output)}
    assert rows == {"alpha": True, "beta": False}
    table = cli.invoke(main, ["cache", "ls"]).output.splitlines()
    assert "PINNED" in table[0] and " yes " in next(line for line in table if line.startswith("alpha"))


def test_quarantine_is_counted_and_the_stats_hint_removes_it(engine_store: Path) -> None:
    """The command `cache stats` names removes the quarantine; any prune removes it first, however generous its
    limits, and `--quarantine` alone leaves the engines."""
    store = Store(engine_store)
    store.ensure()
    old = store.quarantine(_fake_entry(engine_store, "old", "1" * 64, size=3000), "sha256 differs")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    new = store.quarantine(_fake_entry(engine_store, "new", "2" * 64, size=2000), "size differs")
    kept = _fake_entry(engine_store, "kept", "3" * 64)
    cli = CliRunner()
    stats = json.loads(cli.invoke(main, ["cache", "stats", "--json"]).output)
    assert stats["quarantined"] == 2 and stats["quarantine_bytes"] >= 5000
    out = cli.invoke(main, ["cache", "stats"]).output
    hint = re.search(r"`trtbuild (cache prune[^`]*)` removes them", out)
    assert "quarantined 2" in out and hint, out
    dry = cli.invoke(main, [*hint.group(1).split(), "--dry-run"])
    assert dry.exit_code == 0 and dry.output.index(old.name) < dry.output.index(new.name), dry.output
    result = cli.invoke(main, hint.group(1).split())
    assert result.exit_code == 0 and f"removed quarantine/{old.name}" in result.output, result.output
    assert not old.exists() and not new.exists() and kept.exists()
    again = store.quarantine(_fake_entry(engine_store, "again", "4" * 64), "sha256 differs")
    for limits in (["--max-size", "100G"], ["--older-than", "30d"]):
        result = cli.invoke(main, ["cache", "prune", *limits])
        assert result.exit_code == 0 and not again.exists() and kept.exists(), result.output
        again = store.quarantine(_fake_entry(engine_store, "again", "4" * 64), "sha256 differs")
    bare = cli.invoke(main, ["cache", "prune"])
    assert bare.exit_code == 2 and "--quarantine" in bare.output and again.exists()


def test_doctor_imports_every_declared_dependency_and_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib import metadata

    declared = metadata.requires("trtbuild") or []
    assert any(r.startswith("numpy") for r in declared)  # safetensors' writer needs it: a build crashed without
    monkeypatch.setattr(metadata, "requires", lambda dist: [*declared, "surely-not-installed-dist>=1"])
    result = CliRunner().invoke(main, ["doctor"])
    assert result.exit_code == 1 and "dependency surely-not-installed-dist: not installed" in result.output


def test_every_command_the_readme_shows_exists() -> None:
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh|console|shell)?\n(.*?)```", text, re.S)
    lines = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    commands = [line.split()[1:] for line in lines if line.startswith("trtbuild ")]
    assert commands, "the README shows no trtbuild command"
    for words in commands:
        group: Any = main
        path = [w for w in words if not w.startswith("-")]
        for word in path:
            sub = getattr(group, "commands", {}).get(word)
            if sub is None:
                break
            group = sub
        assert group is not main, f"`trtbuild {' '.join(words)}` in the README is not a command"
        if hasattr(group, "commands"):
            raise AssertionError(f"`trtbuild {' '.join(words)}` names a group, not a command")


# -- real builds -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("newcomer")
    doc = tiny_recipe_doc(name="nc")
    doc["model"]["config"]["tie_word_embeddings"] = True  # the LM head is the embedding: read once a step
    recipe = write_recipe(root, doc)
    store = root / "engines"
    proc = run_cli("build", str(recipe), "--engines", str(store), "--json")
    assert proc.returncode == 0, proc.stderr
    return {"recipe": recipe, "store": store, "build": read_json_line(proc.stdout)}


@pytest.mark.slow
def test_the_report_agrees_with_a_stopwatch_and_shows_no_gpu_rows_on_a_cpu(engine: dict[str, Any]) -> None:
    args = ["run", str(engine["recipe"]), "--engines", str(engine["store"]), "--iterations", "2", "--batch-size", "2"]
    report = read_json_line(run_cli(*args, "--json").stdout)
    b, out, phases = report["shape"]["batch_size"], report["shape"]["output_len"], report["phases"]
    assert report["tokens_per_s"]["decode"] == pytest.approx(b * (out - 1) / phases["decode_s"])
    assert report["tokens_per_s"]["end_to_end"] == pytest.approx(b * out / phases["end_to_end_s"])
    assert report["tokens_per_s"]["end_to_end"] < report["tokens_per_s"]["decode"] * out / (out - 1) + 1e-9
    assert "prefill_launch" not in report and "decode_launch" not in report
    assert report["engine"]["store"].startswith(f"{engine['store']} (--engines)")
    text = run_cli(*args).stdout
    assert "prefill launch" not in text and "launch" not in text and "tok/s end to end" in text


@pytest.mark.slow
def test_a_cpu_run_says_its_threads_and_prints_no_rate_without_its_ceiling(engine: dict[str, Any]) -> None:
    args = ["run", str(engine["recipe"]), "--engines", str(engine["store"]), "--iterations", "2"]
    report = read_json_line(run_cli(*args, "--threads", "1", "--json").stdout)
    assert report["threads"] == {"threads": 1, "why": "--threads"} and "unstable" in report
    default = read_json_line(run_cli(*args, "--json").stdout)["threads"]
    assert 1 <= default["threads"] <= len(os.sched_getaffinity(0)) and "busy" in default["why"]
    text = run_cli(*args, "--threads", "1", env={"COLUMNS": "400"}).stdout
    assert "threads: 1 (--threads)" in text
    assert "GB/s" not in text and "FLOP/s" not in text, text  # a CPU has no ceiling in the run report


@pytest.mark.slow
def test_a_corrupt_entry_found_by_verify_is_reported_quarantined_and_rebuilt(engine: dict[str, Any],
                                                                            tmp_path: Path) -> None:
    store = tmp_path / "engines"
    shutil.copytree(engine["store"], store)
    weights = Path(engine["build"]["engine"]["path"].replace(str(engine["store"]), str(store))) / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    proc = run_cli("run", str(engine["recipe"]), "--engines", str(store), "--verify", "--iterations", "1",
                   env={"COLUMNS": "400"})  # the table's note unwrapped
    assert proc.returncode == 0, proc.stderr
    out = " ".join((proc.stdout + proc.stderr).split())
    assert "the entry was corrupt" in out and "sha256 differs" in out and str(store / "quarantine") in out
    assert "rebuilt" in out and "copied from the tactic cache" in out


@pytest.mark.slow
def test_explain_exits_0_on_a_hit_and_1_on_a_miss(engine: dict[str, Any], tmp_path: Path) -> None:
    hit = run_cli("cache", "explain", str(engine["recipe"]), "--engines", str(engine["store"]))
    assert hit.returncode == 0 and hit.stdout.startswith("hit:")
    miss = run_cli("cache", "explain", str(engine["recipe"]), "--engines", str(tmp_path / "empty"), "--json")
    assert miss.returncode == 1 and json.loads(miss.stdout)["hit"] is False


@pytest.mark.slow
def test_the_readme_python_example_runs(tmp_path: Path) -> None:
    """The README's Python example, run as written from the checkout, in a new process."""
    text = (REPO / "README.md").read_text()
    example = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    env = {**os.environ, "TRTBUILD_ENGINES": str(tmp_path / "engines")}
    proc = subprocess.run([sys.executable, "-c", example], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "engines" / "v1").is_dir()


@pytest.mark.slow
def test_a_tied_lm_head_is_counted_once_in_the_bytes_a_step_reads(engine: dict[str, Any]) -> None:
    from safetensors import safe_open

    from trtbuild.runner import open_session

    path = Path(engine["build"]["engine"]["path"]) / "weights.safetensors"
    with safe_open(str(path), "pt") as f:  # every stored tensor is read once a step, the table as the LM head
        stored = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
    with open_session(load_recipe(engine["recipe"]), engine["store"], build=False) as session:
        assert session.engine.weight_bytes == stored


@pytest.mark.slow
def test_an_api_build_prints_none_of_the_frameworks_noise(tmp_path: Path) -> None:
    """tiny-llama built through the Python API, with one row and one bucket (sizes export takes as static), in a
    new process as a user's script runs: nothing on stderr, no Python warning raised."""
    script = """
import sys, warnings, yaml, trtbuild
doc = yaml.safe_load(open("recipes/tiny-llama.yaml"))
doc["shapes"].update(max_batch_size=1, batch_buckets=[1])
doc["run"]["batch_size"] = 1
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    outcome = trtbuild.build(doc, sys.argv[1])
assert not outcome.cache_hit
print("\\n".join(f"{w.category.__name__}: {w.message}" for w in caught))
"""
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "engines")], cwd=REPO, capture_output=True,
                          text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr
    assert proc.stdout.strip() == "", proc.stdout
