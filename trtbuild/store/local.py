"""The engine store: hash-keyed entries, atomic publish, per-key locks, integrity checks.

Layout under the root (`--engines`, else `TRTBUILD_ENGINES`, else `$XDG_CACHE_HOME/trtbuild/engines`, i.e.
`~/.cache/trtbuild/engines`: one store per user, found the same way from any working directory):

    CACHEDIR.TAG
    v1/<name>-<key[:16]>/        one engine: the backend's files + manifest.json
    v1/.tmp/                     builds in progress (same filesystem, so publish is one rename)
    v1/.locks/<key>.lock         per-key build locks (OS locks: they die with their process)
    v1/.locks/<key>.use          shared locks held by every process that has the engine open
    pins/<key>                   entries that prune never removes
    stats.jsonl                  one line per hit, miss and build, for `trtbuild cache stats`
    quarantine/                  entries that failed an integrity check, kept for inspection
    tactics/<backend>/<id>/      tactic caches (see tactics.py)
    models/                      synthetic checkpoints written on first build

Correctness never rests on the lock: an entry is visible only once its folder, manifest included,
has been renamed into place, so a lookup sees a whole engine or none. The lock only avoids two
processes building the same key at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from trtbuild.errors import InputError
from trtbuild.store.digests import file_sha256, fsync_file
from trtbuild.store.tactics import write_atomic

SCHEMA = "v1"  # the key schema and layout version; part of every key
MANIFEST = "manifest.json"
CACHEDIR_TAG = b"Signature: 8a477f597d28d172789f06886806bc55\n# trtbuild engine store; see https://bford.info/cachedir/\n"


def canonical_json(obj: Any) -> str:
    """Sorted keys, no whitespace: one byte string per meaning, so equal inputs hash equally."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def key_of(material: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(material).encode()).hexdigest()


def store_origin(engines: str | os.PathLike[str] | None = None) -> tuple[Path, str]:
    """The store's folder and why it is that one: the flag, the environment variable, or the default.

    The default is per user, not per working directory (as Hugging Face's and vLLM's caches are), so a
    server started from another folder finds the engines a build made."""
    if engines:
        return Path(engines).expanduser(), "--engines"
    if env := os.environ.get("TRTBUILD_ENGINES"):
        return Path(env).expanduser(), "TRTBUILD_ENGINES"
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(cache) / "trtbuild" / "engines", "the per-user default"


def default_root(engines: str | os.PathLike[str] | None = None) -> Path:
    return store_origin(engines)[0]


@dataclass(frozen=True)
class Entry:
    path: Path
    manifest: dict[str, Any]

    @property
    def key(self) -> str:
        return self.manifest["key"]

    @property
    def name(self) -> str:
        return self.manifest["name"]

    def size(self) -> int:
        return sum(f["size"] for f in self.manifest["files"].values())


class Store:
    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        where, self.origin = store_origin(root)
        self.root = where.absolute()
        self.entries_dir = self.root / SCHEMA
        self.tmp_dir = self.entries_dir / ".tmp"
        self.locks_dir = self.entries_dir / ".locks"
        self.quarantine_dir = self.root / "quarantine"
        self.tactics_dir = self.root / "tactics"
        self.pins_dir = self.root / "pins"
        self.stats_file = self.root / "stats.jsonl"
        self.quarantined: list[str] = []  # what lookups in this process moved aside, and why

    # -- setup ---------------------------------------------------------------------------------
    def ensure(self) -> None:
        """Create the layout; an unwritable root is the user's to fix, so it is an InputError."""
        try:
            for d in (self.entries_dir, self.tmp_dir, self.locks_dir):
                d.mkdir(parents=True, exist_ok=True)
            tag = self.root / "CACHEDIR.TAG"
            if not tag.exists():
                write_atomic(tag, CACHEDIR_TAG)
            probe = self.tmp_dir / f".probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise InputError(f"engine store {self.root}: not writable: {exc.strerror or exc}",
                             hint="pass --engines DIR or set TRTBUILD_ENGINES to a writable folder") from None

    # -- lookup ----------------------------------------------------------------------------------
    def entry_path(self, name: str, key: str) -> Path:
        return self.entries_dir / f"{name}-{key[:16]}"

    def lookup(self, key: str, *, full_verify: bool = False) -> Entry | None:
        """The published entry for `key`, or None. Any entry whose files fail the size check (or
        the hash check, with `full_verify`) is moved to quarantine and treated as a miss."""
        if not self.entries_dir.is_dir():
            return None
        for path in sorted(self.entries_dir.glob(f"*-{key[:16]}")):
            manifest = read_manifest(path)
            if manifest is None or manifest.get("key") != key:
                if manifest is None and path.is_dir():
                    dest = self.quarantine(path, "manifest missing or unreadable")
                    self.quarantined.append(f"{path.name} (manifest missing or unreadable), moved to {dest}")
                continue
            entry = Entry(path, manifest)
            # Sizes on every lookup (cheap); every hash on the first use after publish or when asked.
            problems = verify(entry, full=full_verify or not manifest.get("verified", False))
            if problems:
                dest = self.quarantine(path, "; ".join(problems))
                self.quarantined.append(f"{path.name} ({'; '.join(problems)}), moved to {dest}")
                continue
            if not manifest.get("verified", False):
                manifest["verified"] = True  # first use after publish checked every hash
            self.touch(entry)
            return entry
        return None

    def touch(self, entry: Entry) -> None:
        entry.manifest["last_used"] = time.time()
        with contextlib.suppress(OSError):  # a read-only store still serves engines
            write_atomic(entry.path / MANIFEST, json.dumps(entry.manifest, indent=2, sort_keys=True).encode())

    def entries(self) -> list[Entry]:
        out = []
        if self.entries_dir.is_dir():
            for path in sorted(self.entries_dir.iterdir()):
                if path.name.startswith("."):
                    continue
                manifest = read_manifest(path)
                if manifest is not None:
                    out.append(Entry(path, manifest))
        return out

    def find(self, ref: str) -> Entry:
        """An entry by key prefix (6 characters or more), recipe name, folder name or path.

        Absent refs are errors; an ambiguous one is an error that lists the candidates."""
        as_path = Path(ref).expanduser()
        if as_path.is_dir() and (as_path / MANIFEST).is_file():
            if (manifest := read_manifest(as_path)) is not None:
                return Entry(as_path.absolute(), manifest)
        name = Path(ref.rstrip("/")).name
        matches = [e for e in self.entries() if name in (e.path.name, e.name) or (len(ref) >= 6 and e.key.startswith(ref))]
        if not matches:
            hint = "a key prefix needs at least 6 characters" if len(ref) < 6 else "see `trtbuild cache ls`"
            raise InputError(f"no engine matches {ref!r} in {self.entries_dir}", hint=hint)
        if len(matches) > 1:
            names = ", ".join(f"{e.path.name} (key {e.key[:16]})" for e in matches)
            raise InputError(f"{ref!r} matches {len(matches)} engines: {names}", hint="give a longer key prefix")
        return matches[0]

    def newest(self, name: str) -> Entry | None:
        """The most recently used entry of recipe `name`: before its key is known (that takes importing the
        framework and finding the device), nearly always the one the key then selects."""
        candidates = [e for e in self.entries() if e.name == name]
        return max(candidates, key=lambda e: e.manifest.get("last_used", 0)) if candidates else None

    def prefetch(self, entry: Entry, skip: tuple[Path, ...] = ()) -> threading.Thread:
        """Start reading `entry`'s files (less `skip`, which its backend is already reading) into the page
        cache, in the background.

        A run imports its framework and initializes the device (seconds on a GPU host) before it
        knows its key, and a cold disk takes about as long again to deliver the weights. The caller
        guesses the entry (`newest`); a wrong guess costs one background read.

        Smallest files first: the compiled graphs and their kernel files (a few MB) are read from disk
        when the first token runs, and behind a 15 GB weight file they would still be cold then (on
        the H200, 2026-12-03, the 8B's first prefill after a restart took 0.84 s cold, 0.19 s warm)."""
        files = sorted((p for p in entry.path.rglob("*") if p.is_file() and p not in skip), key=lambda p: p.stat().st_size)
        thread = threading.Thread(target=_read_through, args=(files,), name="trtbuild-prefetch", daemon=True)
        thread.start()
        return thread

    # -- build side ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, key: str, on_wait: Callable[[str], None] = lambda message: None) -> Iterator[None]:
        """Hold the per-key build lock. An OS lock (flock): a killed holder releases it."""
        self.ensure()
        lock_path = self.locks_dir / f"{key}.lock"
        owner_path = self.locks_dir / f"{key}.owner"
        lock = FileLock(str(lock_path))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            owner = "another process"
            for _ in range(20):  # the holder writes its name just after taking the lock
                with contextlib.suppress(OSError):
                    owner = owner_path.read_text().strip() or owner
                    break
                time.sleep(0.05)
            on_wait(f"waiting for the build of this engine by {owner}")
            lock.acquire()
        try:
            with contextlib.suppress(OSError):
                owner_path.write_text(f"pid {os.getpid()} on {socket.gethostname()}\n")
            yield
        finally:
            with contextlib.suppress(OSError):
                owner_path.unlink()
            lock.release()

    def new_workdir(self, name: str, key: str) -> Path:
        """A fresh folder for one build, on the store's filesystem, named so stale ones can be found."""
        self.clean_stale_workdirs()
        path = self.tmp_dir / f"{name}-{key[:16]}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        path.mkdir(parents=True)
        return path

    def clean_stale_workdirs(self) -> list[Path]:
        """Remove what builders that died on this host left half-written, whatever phase they died in:
        build folders (v1/.tmp/<name>-<key>.<host>.<pid>.<id>), synthetic checkpoints being written
        (models/<name>.tmp-<host>-<pid>) and compiled graphs being copied into a tactic cache
        (tactics/.../<digest>.tmp-<host>-<pid>). None of them is ever visible as a result: each is
        published by one rename, so removing it only reclaims the space."""
        removed: list[Path] = []
        host = socket.gethostname()
        if self.tmp_dir.is_dir():
            for path in self.tmp_dir.iterdir():
                parts = path.name.rsplit(".", 3)
                if len(parts) != 4 or parts[1] != host or not parts[2].isdigit():
                    continue
                if not pid_alive(int(parts[2])):
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
        for folder in (self.root / "models", self.tactics_dir):
            if not folder.is_dir():
                continue
            for path in folder.rglob("*.tmp-*"):
                owner = path.name.rsplit(".tmp-", 1)[1]
                who, _, pid = owner.rpartition("-")
                if path.is_dir() and pid.isdigit() and who in ("", host) and not pid_alive(int(pid)):
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
        return removed

    def publish(self, workdir: Path, name: str, key: str, manifest: dict[str, Any],
                known: dict[str, dict[str, Any]] | None = None) -> Entry:
        """Hash every file, write the manifest last, fsync, and rename the folder into place. `known` holds the
        digests a FileDigests took during the build (those files already flushed), each still matching its file."""
        files = {}
        for f in sorted(p for p in workdir.rglob("*") if p.is_file()):
            rel = f.relative_to(workdir).as_posix()
            if known and rel in known and known[rel]["size"] == f.stat().st_size:
                files[rel] = dict(known[rel])
                continue
            files[rel] = {"size": f.stat().st_size, "sha256": file_sha256(f)}
            fsync_file(f)
        # verified stays False: the first process to use the entry hashes every file once more,
        # which catches what went wrong between this write and that use.
        manifest = {**manifest, "files": files, "verified": False}
        write_atomic(workdir / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode())
        final = self.entry_path(name, key)
        if final.exists():  # left by a crash between rename and nothing else; quarantine, never merge
            self.quarantine(final, "replaced by a new build of the same key")
        os.rename(workdir, final)
        _fsync_dir(self.entries_dir)
        return Entry(final, manifest)

    # -- use, pins, stats ------------------------------------------------------------------------
    @contextlib.contextmanager
    def in_use(self, key: str) -> Iterator[None]:
        """Hold a shared OS lock while an engine is open: prune and rm skip entries held this way."""
        self.locks_dir.mkdir(parents=True, exist_ok=True)
        with open(self.locks_dir / f"{key}.use", "a+b") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def is_in_use(self, key: str) -> bool:
        path = self.locks_dir / f"{key}.use"
        if not path.exists():
            return False
        with open(path, "a+b") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return False

    def pin(self, entry: Entry, pinned: bool = True) -> None:
        path = self.pins_dir / entry.key
        if pinned:
            self.pins_dir.mkdir(parents=True, exist_ok=True)
            path.write_text(entry.path.name + "\n")
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def is_pinned(self, key: str) -> bool:
        return (self.pins_dir / key).exists()

    def record(self, event: str, **fields: Any) -> None:
        """Append one stats line; a single small O_APPEND write, so concurrent writers do not interleave."""
        line = json.dumps({"event": event, "time": time.time(), **fields}, sort_keys=True) + "\n"
        with contextlib.suppress(OSError):
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.stats_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)

    def quarantine(self, path: Path, reason: str) -> Path:
        self.quarantine_dir.mkdir(parents=True, exist_ok=True)
        dest = self.quarantine_dir / f"{path.name}.{int(time.time())}.{uuid.uuid4().hex[:6]}"
        with contextlib.suppress(FileNotFoundError):
            os.rename(path, dest)
            (dest / "QUARANTINED").write_text(reason + "\n")
        return dest

    def quarantined_entries(self) -> list[tuple[Path, int, float]]:
        """(folder, bytes, when moved aside) of every quarantined entry, oldest first."""
        out = []
        if self.quarantine_dir.is_dir():
            for path in self.quarantine_dir.iterdir():
                size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0
                out.append((path, size, path.stat().st_mtime))
        return sorted(out, key=lambda q: q[2])

    def remove_quarantined(self, path: Path) -> None:
        """Delete one quarantined folder (after one rename out of view, as `remove` does)."""
        trash = self.tmp_dir / f".rm-q-{path.name}.{uuid.uuid4().hex[:6]}"
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def remove(self, entry: Entry) -> None:
        """Take an entry out of view with one rename, then delete it."""
        trash = self.tmp_dir / f".rm-{entry.path.name}.{uuid.uuid4().hex[:6]}"
        os.rename(entry.path, trash)
        shutil.rmtree(trash, ignore_errors=True)


def read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "key" in data and "files" in data else None


def verify(entry: Entry, *, full: bool) -> list[str]:
    """Sizes always; sha256 of every file when `full`. Returns the problems found."""
    problems = []
    for rel, info in entry.manifest["files"].items():
        f = entry.path / rel
        try:
            size = f.stat().st_size
        except OSError:
            problems.append(f"{rel}: missing")
            continue
        if size != info["size"]:
            problems.append(f"{rel}: size {size}, manifest says {info['size']}")
        elif full and file_sha256(f) != info["sha256"]:
            problems.append(f"{rel}: sha256 differs from the manifest")
    return problems


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_through(files: list[Path]) -> None:
    """Read files start to end (the kernel keeps them in the page cache); errors are the loader's to report."""
    buf = bytearray(16 << 20)
    for f in files:
        with contextlib.suppress(OSError), open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
