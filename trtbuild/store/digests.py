"""File digests for a build's manifest, taken while the build goes on.

Publishing hashes every file of an entry and flushes it to disk. For an 8B engine that is 16 GB read back
and hashed after the build has finished (~10 s at the 1.5 GB/s one core hashes), plus the flush. A backend
that knows a file is final (its weights, written before matmul selection and compile) says so through
`BuildJob.finished`; a background thread then hashes and flushes it while the build's longer phases run.
Publish takes a digest from here only while the file's size and modification time are those it had when it
was hashed, and hashes anything else itself, so a file changed afterwards is never published under an old
digest. hashlib and os.fsync release the GIL, so the thread takes no time from the build's Python.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from pathlib import Path

CHUNK = 1 << 24


def file_sha256(path: Path, stop: threading.Event | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            if stop is not None and stop.is_set():
                raise InterruptedError(f"{path}: hashing stopped")
            h.update(chunk)
    return h.hexdigest()


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


class FileDigests:
    """Hashes and flushes the files it is given, one at a time, in a daemon thread.

    `add(path)` queues a file of `root` that will not change again; `known()` waits for the queue and returns
    {relative path: {"size", "sha256"}} for the files still as they were hashed. A file that vanished or
    could not be read is left out (publish then hashes it, or finds it gone)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._todo: queue.Queue[Path | None] = queue.Queue()
        self._done: dict[str, tuple[tuple[int, int], str]] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.seconds = 0.0  # the thread's busy time, reported as a build phase that overlapped others

    def add(self, path: Path) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="trtbuild-digests", daemon=True)
            self._thread.start()
        self._todo.put(Path(path))

    def _run(self) -> None:
        while (path := self._todo.get()) is not None:
            t = time.perf_counter()
            try:
                before = _stamp(path)
                digest = file_sha256(path, self._stop)
                fsync_file(path)
                if _stamp(path) == before:
                    self._done[path.relative_to(self.root).as_posix()] = (before, digest)
            except (OSError, ValueError):  # removed with a failed build, or outside root: publish decides
                pass
            self.seconds += time.perf_counter() - t

    def close(self) -> None:
        """Let the thread finish what it was given, and end it."""
        if self._thread is not None:
            self._todo.put(None)
            self._thread.join()
            self._thread = None

    def cancel(self) -> None:
        """A failed build: stop hashing at the next chunk and drop what was taken (its folder is removed)."""
        self._stop.set()
        self.close()
        self._done.clear()

    def known(self) -> dict[str, dict[str, int | str]]:
        self.close()
        out: dict[str, dict[str, int | str]] = {}
        for rel, (stamp, digest) in self._done.items():
            try:
                if _stamp(self.root / rel) == stamp:
                    out[rel] = {"size": stamp[0], "sha256": digest}
            except OSError:
                pass
        return out
