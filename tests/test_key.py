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
from trtbuild.backends.torch_aoti import TorchAOTIBackend
from trtbuild.models.source import resolve
from trtbuild.recipe import load_recipe
from trtbuild.store import canonical_json, key_of

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
    compiling and caching) is hashed into the key: before the tenth session only the backend's own
    module was, so a change to, say, how decode kernels are chosen would have reused engines built
    the old way. Runtime-only modules, imported lazily by load(), stay out."""
    import ast
    import importlib.util

    from trtbuild.backends import REGISTRY

    reg = REGISTRY[backend]
    module = importlib.import_module(reg.module)
    instance = getattr(module, reg.cls)()
    tree = ast.parse(Path(module.__file__ or "").read_text())
    imported = {f"trtbuild.backends.{a.name}" for node in tree.body if isinstance(node, ast.ImportFrom)
                and node.module == "trtbuild.backends" for a in node.names}
    submodules = {m for m in imported if importlib.util.find_spec(m) is not None}
    files = {f.name for f in build_mod.engine_code_files(instance)}
    assert submodules and {m.rsplit(".", 1)[1] + ".py" for m in submodules} <= files
    assert {"llama.py", Path(module.__file__ or "").name} <= files
    assert not {"torch_runtime.py", "weights_reader.py", "trt_runtime.py"} & files


def test_the_inductor_pdl_switch_is_in_the_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TRTBUILD_INDUCTOR_PDL=0 compiles Inductor's decode kernels without the PDL wait, a different
    engine: on the H200 (2026-12-04, call 39) a build with it got the key of the build without, so the
    second of the two would have loaded the first's engine. The backend's toolchain now records it."""
    monkeypatch.delenv("TRTBUILD_INDUCTOR_PDL", raising=False)
    plain = TorchAOTIBackend().toolchain()
    monkeypatch.setenv("TRTBUILD_INDUCTOR_PDL", "0")
    switched = TorchAOTIBackend().toolchain()
    assert switched == plain | {"inductor_pdl": "off (TRTBUILD_INDUCTOR_PDL=0)"}
    monkeypatch.setattr(build_mod.fingerprint, "device", lambda: FIXED_DEVICE)
    monkeypatch.setattr(build_mod, "engine_code_digest", lambda backend: "<engine code digest>")
    recipe = load_recipe(write_recipe(tmp_path, tiny_recipe_doc()))
    model = resolve(recipe.model, tmp_path)
    keys = {key_of(build_mod.key_material(recipe, model, TorchAOTIBackend(), t)) for t in (plain, switched)}
    assert len(keys) == 2
