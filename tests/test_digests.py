"""Digests taken during a build: publish reuses them only for files unchanged since they were hashed."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from trtbuild.store import digests as digests_mod
from trtbuild.store import local
from trtbuild.store.digests import FileDigests
from trtbuild.store.local import Store, verify


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_a_file_hashed_during_the_build_is_not_hashed_again_at_publish(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(tmp_path / "engines")
    work = store.new_workdir("tiny", "k" * 64)
    big, small = work / "weights.safetensors", work / "engine.json"
    big.write_bytes(os.urandom(3 << 20))
    digests = FileDigests(work)
    digests.add(big)
    small.write_text("{}")
    known = digests.known()
    assert known == {"weights.safetensors": {"size": 3 << 20, "sha256": _sha(big.read_bytes())}}
    assert digests.seconds > 0

    hashed: list[str] = []
    real = local.file_sha256

    def counting(path: Path, stop: object = None) -> str:
        hashed.append(path.name)
        return real(path)

    monkeypatch.setattr(local, "file_sha256", counting)
    entry = store.publish(work, "tiny", "k" * 64, {"key": "k" * 64, "name": "tiny", "backend": "torch"}, known=known)
    assert hashed == ["engine.json"]  # the weights' digest came from the build
    assert entry.manifest["files"]["weights.safetensors"]["sha256"] == _sha((entry.path / "weights.safetensors").read_bytes())
    monkeypatch.setattr(local, "file_sha256", real)
    assert verify(entry, full=True) == []


def test_a_file_changed_after_it_was_hashed_gets_its_new_digest(tmp_path: Path) -> None:
    store = Store(tmp_path / "engines")
    work = store.new_workdir("tiny", "a" * 64)
    f = work / "weights.safetensors"
    f.write_bytes(b"first")
    digests = FileDigests(work)
    digests.add(f)
    digests.close()  # hashed as "first"
    f.write_bytes(b"second, longer")
    assert digests.known() == {}
    entry = store.publish(work, "tiny", "a" * 64, {"key": "a" * 64, "name": "tiny", "backend": "torch"},
                          known={"weights.safetensors": {"size": 5, "sha256": _sha(b"first")}})
    assert entry.manifest["files"]["weights.safetensors"] == {"size": 14, "sha256": _sha(b"second, longer")}


def test_a_cancelled_digest_stops_at_the_next_chunk_and_leaves_nothing(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digests_mod, "CHUNK", 1 << 10)
    f = tmp_path / "w.bin"
    f.write_bytes(os.urandom(1 << 20))
    digests = FileDigests(tmp_path)
    digests._stop.set()  # as cancel() would, before the thread reads a chunk
    digests.add(f)
    digests.cancel()
    assert digests.known() == {}
    with pytest.raises(InterruptedError):
        digests_mod.file_sha256(f, digests._stop)
