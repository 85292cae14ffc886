"""The benchmark's handling of its engine store (benchmarks/bench.py): an engine built in a fresh store
for the cold-build measurement moves into the benchmark's own store, published and verified there."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from trtbuild.store import MANIFEST, Store

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench  # noqa: E402


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
