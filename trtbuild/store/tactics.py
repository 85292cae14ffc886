"""Tactic caches: what kernel benchmarking measured, kept per (backend, device, toolchain).

A tactic cache outlives engines: deleting an engine keeps what was measured, so its rebuild (or a
build of another recipe with the same shapes) skips the benchmarking. Backends that keep one file
(TensorRT's timing cache) merge into it under `locked()`; Inductor manages its own folder of
content-addressed files, which concurrent builds can share without a merge.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock


@dataclass(frozen=True)
class TacticCache:
    """One folder of tactic measurements for one backend on one device and toolchain."""

    path: Path
    identity: dict[str, Any]

    @classmethod
    def for_build(cls, root: Path, backend: str, device: dict[str, Any], toolchain: dict[str, Any]) -> "TacticCache":
        identity = {"backend": backend, "device": device, "toolchain": toolchain}
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
        path = root / backend / digest
        path.mkdir(parents=True, exist_ok=True)
        identity_file = path / "identity.json"
        if not identity_file.exists():
            write_atomic(identity_file, json.dumps(identity, indent=2, sort_keys=True).encode())
        return cls(path=path, identity=identity)

    @contextlib.contextmanager
    def locked(self, timeout: float = 600.0) -> Iterator[Path]:
        """Hold the cache's lock for a read-merge-write of a single-file cache."""
        with FileLock(str(self.path / ".lock"), timeout=timeout):
            yield self.path


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, fsync, then rename over it: readers see old or new, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
