"""Where a model's files come from and what identifies its weights: synthetic, local and hub sources."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TINY_CONFIG, make_hf_folder, tiny_recipe_doc, write_recipe
from trtbuild.errors import InputError, TrtbuildError
from trtbuild.models import checkpoint, source
from trtbuild.models.source import ResolvedModel, resolve
from trtbuild.recipe import ModelSpec, load_recipe

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def synthetic(config: dict[str, Any] | None = None, seed: int = 0) -> ModelSpec:
    return ModelSpec(source="synthetic", kind="synthetic", path=None, config=dict(config or TINY_CONFIG), seed=seed)


def local(folder: Path) -> ModelSpec:
    return ModelSpec(source=str(folder), kind="local", path=folder.resolve())


def hub(repo: str, revision: str | None = None) -> ModelSpec:
    return ModelSpec(source=repo, kind="hub", path=None, revision=revision)


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


# -- synthetic ----------------------------------------------------------------------------------------


def test_synthetic_identity_is_config_and_seed_and_touches_no_files(engine_store: Path) -> None:
    resolved = resolve(synthetic(), engine_store)
    assert resolved.identity == {"kind": "synthetic", "config": TINY_CONFIG, "seed": 0,
                                 "generator": source.SYNTHETIC_GENERATOR}
    assert resolved.folder is None
    assert not engine_store.exists()


def test_synthetic_identity_changes_with_config_and_seed(engine_store: Path) -> None:
    base = resolve(synthetic(), engine_store).identity
    assert resolve(synthetic(seed=1), engine_store).identity != base
    assert resolve(synthetic({**TINY_CONFIG, "vocab_size": 256}), engine_store).identity != base
    assert resolve(synthetic(), engine_store).identity == base


def test_materialize_writes_a_checkpoint_once_into_the_store(engine_store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    real = checkpoint.write_synthetic

    def counting(folder: Path, config: dict[str, Any], seed: int) -> None:
        calls.append(folder)
        real(folder, config, seed)

    monkeypatch.setattr(checkpoint, "write_synthetic", counting)
    folder = resolve(synthetic(seed=7), engine_store).materialize()
    assert folder.parent == engine_store / "models" and folder.name.startswith("synthetic-")
    assert {p.name for p in folder.iterdir()} == {"config.json", "model.safetensors"}
    raw, _ = checkpoint.read_config(folder)
    assert raw["vocab_size"] == TINY_CONFIG["vocab_size"]
    # no temporary folder left beside it
    assert [p.name for p in (engine_store / "models").iterdir() if p.is_dir()] == [folder.name]

    again = resolve(synthetic(seed=7), engine_store)
    assert again.folder == folder  # found without writing
    assert again.materialize() == folder
    assert len(calls) == 1


def test_materialized_weights_are_those_of_the_seed(engine_store: Path, tmp_path: Path) -> None:
    folder = resolve(synthetic(seed=3), engine_store).materialize()
    reference = make_hf_folder(tmp_path / "ref", seed=3)
    assert (folder / "model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()


def test_a_synthetic_checkpoint_is_drawn_in_memory_with_the_numbers_its_files_would_hold(engine_store: Path) -> None:
    """A build reads a synthetic model's weights from memory, writing config.json alone; the files, written
    where asked for, hold the same numbers; a tensor's numbers depend on the seed and its name, not on which
    other tensors the config has."""
    import torch
    from safetensors.torch import load_file

    resolved = resolve(synthetic({**TINY_CONFIG, "torch_dtype": "bfloat16"}, seed=5), engine_store)
    folder, raw, cfg, tensors = resolved.checkpoint(torch.float32)
    assert (folder / "config.json").is_file() and not list(engine_store.rglob("*.safetensors"))
    assert cfg.num_layers == TINY_CONFIG["num_hidden_layers"] and raw["torch_dtype"] == "bfloat16"
    assert resolved.synthesized_s > 0 and {t.dtype for t in tensors.values()} == {torch.float32}
    stored = load_file(str(resolved.materialize() / "model.safetensors"))
    assert stored.keys() == tensors.keys()
    assert all(torch.equal(stored[k].float(), tensors[k]) and stored[k].dtype == torch.bfloat16 for k in stored)
    _, deeper = checkpoint.synthetic_checkpoint({**TINY_CONFIG, "num_hidden_layers": 3}, 5)
    _, again = checkpoint.synthetic_checkpoint(TINY_CONFIG, 5)
    assert all(torch.equal(deeper[k], again[k]) for k in again)


def test_different_seeds_materialize_into_different_folders(engine_store: Path) -> None:
    a = resolve(synthetic(seed=0), engine_store).materialize()
    b = resolve(synthetic(seed=1), engine_store).materialize()
    assert a != b and (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()


def test_materialize_when_the_folder_has_gone(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "m")
    resolved = resolve(local(folder), tmp_path / "store")
    shutil.rmtree(folder)
    with pytest.raises(TrtbuildError, match="is gone"):
        resolved.materialize()


# -- local --------------------------------------------------------------------------------------------


def test_local_identity_is_a_content_digest(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "m")
    resolved = resolve(local(folder), tmp_path / "store")
    assert resolved.identity["kind"] == "local" and len(resolved.identity["sha256"]) == 64
    assert set(resolved.identity) == {"kind", "sha256"}
    assert resolved.folder == folder.resolve()
    assert resolved.materialize() == folder.resolve()


def test_local_identity_does_not_depend_on_the_path(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "a" / "model")
    copy = tmp_path / "elsewhere" / "renamed"
    shutil.copytree(folder, copy)
    store = tmp_path / "store"
    assert resolve(local(folder), store).identity == resolve(local(copy), store).identity


def test_local_identity_matches_for_the_same_seed_written_twice(tmp_path: Path) -> None:
    store = tmp_path / "store"
    a = resolve(local(make_hf_folder(tmp_path / "a", seed=4)), store).identity
    b = resolve(local(make_hf_folder(tmp_path / "b", seed=4)), store).identity
    c = resolve(local(make_hf_folder(tmp_path / "c", seed=5)), store).identity
    assert a == b != c


def _flip_last_byte(path: Path) -> None:
    """Change one byte in place: same inode, same size."""
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))


def test_local_identity_changes_when_a_weight_byte_changes(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "m")
    store = tmp_path / "store"
    before = resolve(local(folder), store).identity
    _flip_last_byte(folder / "model.safetensors")  # at once: within the timestamps' resolution
    assert resolve(local(folder), store).identity != before


def test_local_identity_changes_even_when_mtime_is_restored(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "m")
    weights = folder / "model.safetensors"
    old = 1_600_000_000_000_000_000
    os.utime(weights, ns=(old, old))  # an old file, so its digest is remembered
    store = tmp_path / "store"
    before = resolve(local(folder), store).identity
    _flip_last_byte(weights)
    os.utime(weights, ns=(old, old))  # as `cp -p` or rsync would leave it
    assert resolve(local(folder), store).identity != before


def test_local_identity_covers_config_json(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "m")
    store = tmp_path / "store"
    before = resolve(local(folder), store).identity
    (folder / "config.json").write_text((folder / "config.json").read_text().replace('"rms_norm_eps": 1e-05',
                                                                                      '"rms_norm_eps": 1e-06'))
    assert resolve(local(folder), store).identity != before


def test_a_freshly_written_file_is_hashed_but_not_remembered(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "m")
    store = tmp_path / "store"
    resolve(local(folder), store)
    assert files_under(store / ".digests") == []


def test_remembered_digests_are_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source, "RACY_NS", -(10**19), raising=False)  # treat every file as old enough to remember
    folder = make_hf_folder(tmp_path / "m")
    store = tmp_path / "store"
    first = resolve(local(folder), store).identity
    memos = files_under(store / ".digests")
    assert len(memos) == 2  # config.json and model.safetensors
    assert resolve(local(folder), store).identity == first
    for memo in memos:  # a restart reads the memo, not the file
        memo.write_text("0" * 64)
    assert resolve(local(folder), store).identity != first


def test_local_folder_without_weights(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(InputError, match="no \\*.safetensors weight files"):
        resolve(local(folder), tmp_path / "store")


def test_local_recipe_resolves_through_the_recipe_folder(tmp_path: Path, engine_store: Path) -> None:
    make_hf_folder(tmp_path / "models" / "tiny")
    recipe = load_recipe(write_recipe(tmp_path / "recipes", tiny_recipe_doc(model={"source": "../models/tiny"})))
    resolved = resolve(recipe.model, engine_store)
    assert resolved.folder == (tmp_path / "models" / "tiny").resolve()


def test_tokenizer_is_found_beside_the_weights(tmp_path: Path) -> None:
    folder = make_hf_folder(tmp_path / "m")
    resolved = resolve(local(folder), tmp_path / "store")
    assert resolved.tokenizer is None
    (folder / "tokenizer.json").write_text("{}")
    assert resolved.tokenizer == folder.resolve() / "tokenizer.json"


# -- hub ----------------------------------------------------------------------------------------------


@pytest.fixture
def hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline Hugging Face cache in tmp. huggingface_hub reads HF_HUB_CACHE into its constants at
    import time (transformers may have imported it already), so the constant is patched as well."""
    import huggingface_hub.constants as constants

    home = tmp_path / "hf-home"
    cache = home / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def lay_out_snapshot(cache: Path, repo: str, commit: str, refs: tuple[str, ...] = ("main",), seed: int = 0) -> Path:
    """The layout huggingface_hub writes: models--org--name/{refs/<ref>, snapshots/<commit>/...}."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = make_hf_folder(root / "snapshots" / commit, seed=seed)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


def test_hub_identity_is_repo_and_resolved_commit(hf_cache: Path, engine_store: Path) -> None:
    snapshot = lay_out_snapshot(hf_cache, "org/tiny", COMMIT)
    resolved = resolve(hub("org/tiny"), engine_store)
    assert resolved.identity == {"kind": "hub", "repo": "org/tiny", "commit": COMMIT}
    assert Path(resolved.folder or "").resolve() == snapshot.resolve()
    _, cfg = checkpoint.read_config(resolved.materialize())
    assert cfg.vocab_size == TINY_CONFIG["vocab_size"]


def test_hub_revision_as_a_commit(hf_cache: Path, engine_store: Path) -> None:
    lay_out_snapshot(hf_cache, "org/tiny", COMMIT)
    lay_out_snapshot(hf_cache, "org/tiny", OTHER_COMMIT, refs=(), seed=1)  # cached, but no branch points at it
    assert resolve(hub("org/tiny", OTHER_COMMIT), engine_store).identity["commit"] == OTHER_COMMIT
    assert resolve(hub("org/tiny", COMMIT), engine_store).identity["commit"] == COMMIT
    assert resolve(hub("org/tiny"), engine_store).identity["commit"] == COMMIT


def test_hub_revision_as_a_tag(hf_cache: Path, engine_store: Path) -> None:
    lay_out_snapshot(hf_cache, "org/tiny", COMMIT)
    lay_out_snapshot(hf_cache, "org/tiny", OTHER_COMMIT, refs=("v2",), seed=1)
    resolved = resolve(hub("org/tiny", "v2"), engine_store)
    assert resolved.identity == {"kind": "hub", "repo": "org/tiny", "commit": OTHER_COMMIT}


def test_hub_identity_follows_the_branch(hf_cache: Path, engine_store: Path) -> None:
    lay_out_snapshot(hf_cache, "org/tiny", COMMIT)
    before = resolve(hub("org/tiny"), engine_store).identity
    lay_out_snapshot(hf_cache, "org/tiny", OTHER_COMMIT, seed=1)  # main moved on
    after = resolve(hub("org/tiny"), engine_store).identity
    assert before["commit"] == COMMIT and after["commit"] == OTHER_COMMIT


def test_hub_recipe_resolves_offline(hf_cache: Path, engine_store: Path, tmp_path: Path) -> None:
    lay_out_snapshot(hf_cache, "org/tiny", COMMIT)
    recipe = load_recipe(write_recipe(tmp_path / "r", tiny_recipe_doc(model={"source": "org/tiny"})))
    assert recipe.model.kind == "hub"
    assert resolve(recipe.model, engine_store).identity["commit"] == COMMIT


def test_hub_repo_missing_offline_names_the_repo_and_what_to_do(hf_cache: Path, engine_store: Path) -> None:
    lay_out_snapshot(hf_cache, "org/tiny", COMMIT)
    with pytest.raises(InputError) as info:
        resolve(hub("org/absent"), engine_store)
    err = info.value
    assert err.exit_code == 2
    assert "org/absent" in err.message and "offline" in err.message
    assert err.hint is not None and "hf download org/absent" in err.hint and "local folder" in err.hint


def test_hub_revision_missing_offline(hf_cache: Path, engine_store: Path) -> None:
    lay_out_snapshot(hf_cache, "org/tiny", COMMIT)
    with pytest.raises(InputError) as info:
        resolve(hub("org/tiny", "v9"), engine_store)
    assert "org/tiny@v9" in info.value.message and "offline" in info.value.message


def test_hub_resolution_writes_nothing(hf_cache: Path, engine_store: Path) -> None:
    lay_out_snapshot(hf_cache, "org/tiny", COMMIT)
    before = files_under(hf_cache)
    resolve(hub("org/tiny"), engine_store)
    assert files_under(hf_cache) == before
    assert files_under(engine_store) == []


def test_resolved_model_reports_its_spec(engine_store: Path) -> None:
    spec = synthetic()
    resolved = resolve(spec, engine_store)
    assert isinstance(resolved, ResolvedModel) and resolved.spec is spec
