"""The key material has a golden file: any change to what goes into a key fails here, loudly.

If a change to the key is intended, bump the store's SCHEMA (old engines must stop matching) and
regenerate tests/golden/key_material.json by running this file with TRTBUILD_UPDATE_GOLDEN=1.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import trtbuild.builder as build_mod
from trtbuild.backends.torch.backend import TorchAOTIBackend
from trtbuild.models.source import resolve
from trtbuild.recipe import load_recipe
from trtbuild.store.local import canonical_json, key_of

from .conftest import REPO, tiny_recipe_doc, write_recipe

GOLDEN = Path(__file__).parent / "golden" / "key_material.json"
FIXED_DEVICE = {"kind": "cpu", "arch": "x86_64", "isa": ["avx2", "fma"]}
FIXED_TOOLCHAIN = {"torch": "2.13.0+cpu"}


def _material(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **overrides: object) -> dict:
    monkeypatch.setattr(build_mod.fingerprint, "device", lambda: FIXED_DEVICE)
    monkeypatch.setattr(build_mod, "engine_code_digest", lambda backend: "<engine code digest>")
    recipe = load_recipe(write_recipe(tmp_path, tiny_recipe_doc(**overrides)))
    return build_mod.key_material(recipe, resolve(recipe.model, tmp_path), TorchAOTIBackend(), FIXED_TOOLCHAIN)


def test_key_material_matches_the_golden_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    material = _material(tmp_path, monkeypatch)
    if os.environ.get("TRTBUILD_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(material, indent=2, sort_keys=True) + "\n")
    golden = json.loads(GOLDEN.read_text())
    assert material == golden
    assert key_of(material) == key_of(golden)


def test_key_is_sha256_of_canonical_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    material = _material(tmp_path, monkeypatch)
    text = canonical_json(material)
    assert text == json.dumps(material, sort_keys=True, separators=(",", ":"))
    assert key_of(material) == hashlib.sha256(text.encode()).hexdigest()


def test_run_defaults_and_name_stay_out_of_the_key_and_build_fields_go_in(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    base = key_of(_material(tmp_path / "a", monkeypatch))
    assert key_of(_material(tmp_path / "b", monkeypatch, name="other",
                            run={"batch_size": 2, "input_len": 3, "output_len": 4})) == base
    for change in ({"precision": "bf16"}, {"tactics": {"level": "max"}},
                   {"shapes": {"max_batch_size": 2, "max_input_len": 16, "max_seq_len": 40, "batch_buckets": [2]}}):
        assert key_of(_material(tmp_path / str(len(str(change))), monkeypatch, **change)) != base, change


def test_the_engine_code_digest_covers_the_model_and_build_code() -> None:
    digest = build_mod.engine_code_digest(TorchAOTIBackend())
    assert len(digest) == 64
    assert REPO.joinpath("trtbuild", "models", "llama.py").is_file()


@pytest.mark.parametrize("backend", ["torch", "tensorrt", "tensorrt-llm"])
def test_every_module_a_backend_builds_with_is_in_the_engine_key(backend: str) -> None:
    """Each trtbuild.backends module a backend imports at its top level (its build-time plans, graph
    compiling and caching) is hashed into the key: when only the backend's own
    module was, so a change to, say, how decode kernels are chosen would have reused engines built
    the old way. Runtime-only modules, imported lazily by load(), stay out."""
    import ast
    import importlib.util

    from trtbuild.backends import REGISTRY

    reg = REGISTRY[backend]
    module = importlib.import_module(reg.module)
    instance = getattr(module, reg.cls)()
    tree = ast.parse(Path(module.__file__ or "").read_text())
    package = module.__name__.rsplit(".", 1)[0]  # the backend's own package: trtbuild.backends.torch, ...
    imported = {f"{package}.{a.name}" for node in tree.body if isinstance(node, ast.ImportFrom)
                and node.module == package for a in node.names}
    imported |= {node.module for node in tree.body if isinstance(node, ast.ImportFrom)
                 and (node.module or "").startswith(package + ".")}
    submodules = {m for m in imported if importlib.util.find_spec(m) is not None}
    files = {f.name for f in build_mod.engine_code_files(instance)}
    assert submodules and {m.rsplit(".", 1)[1] + ".py" for m in submodules} <= files
    assert {"llama.py", Path(module.__file__ or "").name} <= files
    assert not {"runtime.py", "weights_reader.py", "weights_preload.py"} & files


@pytest.mark.parametrize(("name", "value", "counts"), [
    ("TRTBUILD_INDUCTOR_PDL", "0", True), ("TORCHINDUCTOR_MAX_AUTOTUNE", "1", True), ("TRITON_F32_DEFAULT", "ieee", True),
    ("TORCHINDUCTOR_CACHE_DIR", "/elsewhere", False), ("TRITON_CACHE_DIR", "/elsewhere", False),
    ("TORCHINDUCTOR_COMPILE_THREADS", "3", False)])
def test_environment_that_changes_what_compiles_is_in_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              name: str, value: str, counts: bool) -> None:
    """Inductor and Triton read options from the environment, and TRTBUILD_INDUCTOR_PDL=0 leaves the PDL wait
    out of Inductor's decode kernels: each is a different engine. On the H200 (2026-12-04) a build
    with TRTBUILD_INDUCTOR_PDL=0 got the key of the build without, so the second of the two would have
    loaded the first's engine. Cache folders and thread counts change nothing compiled and stay out."""
    for k in [k for k in os.environ if k.startswith(("TORCHINDUCTOR_", "TRITON_", "TRTBUILD_INDUCTOR"))]:
        monkeypatch.delenv(k)
    plain = TorchAOTIBackend().toolchain()
    monkeypatch.setenv(name, value)
    changed = TorchAOTIBackend().toolchain()
    assert changed == (plain | {"env": f"{name}={value}"} if counts else plain)
    monkeypatch.setattr(build_mod.fingerprint, "device", lambda: FIXED_DEVICE)
    monkeypatch.setattr(build_mod, "engine_code_digest", lambda backend: "<engine code digest>")
    recipe = load_recipe(write_recipe(tmp_path, tiny_recipe_doc()))
    model = resolve(recipe.model, tmp_path)
    keys = {key_of(build_mod.key_material(recipe, model, TorchAOTIBackend(), t)) for t in (plain, changed)}
    assert len(keys) == (2 if counts else 1)
