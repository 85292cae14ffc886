"""The fleet tier's coordination: build leases across hosts, the builder's read-through and write-through
hooks, remote pruning, and tactic caches shared through the remote (remote.py moves the bytes).

    local miss ─▶ remote manifest? ─ yes ─▶ pull (hash every file) ─▶ publish locally ─▶ load
                        │ no
                 lease free (or expired)? ─ yes ─▶ build ─▶ publish ─▶ push (objects, then manifest) ─▶ release
                        │ no: another host is building
                 wait for its manifest, then pull (or take the lease when it expires)

A lease is an object `v1/leases/<key>.json` (host, pid, start, heartbeat, expiry) written with If-None-Match
and refreshed with If-Match; its age is read from the server's own clock (Date - Last-Modified), so hosts with
skewed clocks agree on expiry. Correctness never depends on it: the manifest's conditional write and every
pull's hashes do.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from trtbuild.errors import TrtbuildError
from trtbuild.store.remote import (PreconditionFailed, Progress, Remote, RemoteCorrupt, RemoteUnavailable, configured_url,
                             safe_relpath)
from trtbuild.store.local import Entry, Store

IN_USE_S = 3600.0  # an entry pulled this recently is in use: prune keeps it
ORPHAN_S = 86400.0  # objects of a push that never wrote its manifest are removed by prune after this


def _warn(message: str, _seen: set[str] = set()) -> None:  # noqa: B006 - one line per message per process
    if message not in _seen:
        _seen.add(message)
        sys.stderr.write(f"trtbuild: warning: {message}\n")
        sys.stderr.flush()


@dataclass
class Lease:
    """A held build lease, refreshed by a heartbeat thread until released."""

    remote: Remote
    key: str
    etag: str
    body: dict[str, Any]
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> "Lease":
        self._thread = threading.Thread(target=self._beat, name="trtbuild-lease", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        ttl = self.body["ttl_s"]
        while not self._stop.wait(ttl / 4):
            self.body["heartbeat"] = time.time()
            self.body["expires"] = self.body["heartbeat"] + ttl
            try:
                self.etag = self.remote.put_json(self.remote.lease_name(self.key), self.body, if_match=self.etag)
            except (RemoteUnavailable, PreconditionFailed):
                return  # taken over or unreachable: the build goes on, its conditional manifest write decides

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with contextlib.suppress(RemoteUnavailable):
            head = self.remote.head(self.remote.lease_name(self.key))
            if head is not None and head["ETag"] == self.etag:  # never delete a lease another host took over
                self.remote.delete(self.remote.lease_name(self.key))


def lease_state(remote: Remote, key: str) -> tuple[dict[str, Any], str, float] | None:
    """(lease, its ETag, its age by the server's own clock) or None when no host holds one."""
    got = remote.get_json(remote.lease_name(key))
    if got is None:
        return None
    doc, resp = got
    served = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    now = (dt.datetime.strptime(served, "%a, %d %b %Y %H:%M:%S %Z").replace(tzinfo=dt.timezone.utc).timestamp()
           if served else time.time())
    return doc, str(resp["ETag"]), now - resp["LastModified"].timestamp()


def try_lease(remote: Remote, key: str) -> Lease | None:
    """Take the build lease for `key`: a new one, or one whose holder stopped its heartbeat."""
    now = time.time()
    body = {"host": socket.gethostname(), "pid": os.getpid(), "start": now, "heartbeat": now,
            "expires": now + remote.lease_s, "ttl_s": remote.lease_s}
    try:
        return Lease(remote, key, remote.put_json(remote.lease_name(key), body, if_none_match=True), body).start()
    except PreconditionFailed:
        pass
    state = lease_state(remote, key)
    if state is None or state[2] <= float(state[0].get("ttl_s", remote.lease_s)):
        return None
    try:  # expired: replace it, only if nobody else did first
        return Lease(remote, key, remote.put_json(remote.lease_name(key), body, if_match=state[1]), body).start()
    except PreconditionFailed:
        return None


@dataclass
class PrunePlan:
    """What `cache prune --remote` removes and keeps, and the remote's size before and after."""

    remove: list[dict[str, Any]] = field(default_factory=list)
    kept: list[tuple[dict[str, Any], str]] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    size_before: int = 0
    size_after: int = 0


def _entry_size(manifest: dict[str, Any]) -> int:
    return sum(int(f.get("size", 0)) for f in manifest.get("files", {}).values())


def plan_prune(remote: Remote, max_size: int | None, older_than: float | None) -> PrunePlan:
    """What `cache prune --remote` removes: least recently used entries first, never one under a live lease
    or pulled within IN_USE_S; and the objects of pushes that never wrote their manifest (after ORPHAN_S)."""
    now = time.time()
    plan = PrunePlan()
    rows = []
    for m in remote.entries():
        lease = lease_state(remote, m["key"])
        held = lease is not None and lease[2] <= float(lease[0].get("ttl_s", remote.lease_s))
        rows.append((m, remote.last_used(m["key"]), held))
    rows.sort(key=lambda r: r[1])
    total = plan.size_before = sum(_entry_size(m) for m, _, _ in rows)
    for m, used, held in rows:
        if not ((older_than is not None and now - used > older_than) or (max_size is not None and total > max_size)):
            continue
        if held:
            plan.kept.append((m, "a build lease is held on it"))
        elif now - used < IN_USE_S:
            plan.kept.append((m, f"pulled or pushed within the last {IN_USE_S / 3600:.0f} h"))
        else:
            plan.remove.append(m)
            total -= _entry_size(m)
    plan.size_after = total
    live = {m["key"]: str(m.get("remote", {}).get("objects", "")) for m, _, _ in rows}
    for key in remote.keys():
        newest: dict[str, float] = {}
        for o in remote.list_objects(remote.entry_prefix(key)):
            rel = o["Key"][len(remote.entry_prefix(key)):]
            if "/" in rel:  # <push id>/<file>
                push = rel.split("/", 1)[0]
                newest[push] = max(newest.get(push, 0.0), o["LastModified"].timestamp())
        plan.orphans += [remote.entry_prefix(key) + push + "/" for push, t in newest.items()
                         if push != live.get(key) and now - t > ORPHAN_S]
    return plan


# -- the builder's hooks ---------------------------------------------------------------------------
@dataclass
class Fleet:
    """What the remote tier did for one lookup: the entry it pulled, or the lease to build under."""

    remote: Remote | None
    entry: Entry | None = None
    lease: Lease | None = None
    pull_s: float = 0.0
    push_s: float = 0.0
    warning: str | None = None
    tactics: str | None = None  # the build's tactic-cache folder (`<backend>/<id>`), shared through the remote
    store: Store | None = None

    def report(self, tier: str) -> dict[str, Any]:
        if self.remote is None and self.warning is None:
            return {"tier": tier}
        return {"tier": tier, "url": self.remote.url if self.remote else None, "pull_s": self.pull_s,
                "push_s": self.push_s, "warning": self.warning}

    def degrade(self, exc: TrtbuildError, allow_build: bool) -> None:
        self.warning = f"{exc}; " + ("using the local store only" if allow_build else "nothing pulled")
        if allow_build:
            _warn(self.warning)
        self.remote = None

    def write_through(self, entry: Entry | None, progress: Progress = lambda m: None) -> None:
        """Push a fresh build (None: a failed one, nothing to push), then release the lease; a failing remote
        costs a warning, never the build."""
        try:
            if self.remote is not None and entry is not None:
                t = time.perf_counter()
                self.remote.push(entry, progress)
                self.push_s = time.perf_counter() - t
                if self.tactics:  # what this build measured, for the next host's first build on this device
                    assert self.store is not None
                    push_tactics(self.remote, self.store, self.tactics)
        except (RemoteUnavailable, RemoteCorrupt) as exc:
            self.warning = f"{exc}; the engine was built and kept locally, not pushed"
            _warn(self.warning)
        finally:
            if self.lease is not None:
                self.lease.release()


def read_through(url: str | None, store: Store, key: str, *, allow_build: bool,
                 progress: Progress = lambda m: None, tactics: str | None = None) -> Fleet:
    """On a local miss: pull the key if the remote holds it; if another host is building it, wait for its
    manifest and pull; else take the build lease (when building is allowed). Never raises for the remote's
    faults: they become one warning line and a Fleet without a remote."""
    url = configured_url(url)
    if url is None:
        return Fleet(None)
    fleet = Fleet(Remote(url))  # a bad URL or a missing client is the user's to fix: InputError, not a warning
    remote = fleet.remote
    assert remote is not None
    waited = False
    try:
        while True:
            t = time.perf_counter()
            try:
                fleet.entry = remote.pull(store, key, progress)
            except RemoteCorrupt as exc:
                _warn(f"{exc}; not loaded, moved to quarantine on the remote" + ("; building it here" if allow_build else ""))
                fleet.warning = str(exc)
                remote.quarantine(key, str(exc))
                fleet.entry = None
            if fleet.entry is not None:
                fleet.pull_s = time.perf_counter() - t
                return fleet
            if allow_build and (lease := try_lease(remote, key)) is not None:
                fleet.lease, fleet.tactics, fleet.store = lease, tactics, store
                if tactics:  # another host's timings for this device and toolchain make this build shorter
                    progress(f"pulling tactic caches from {remote.url}")
                    try:
                        pull_tactics(remote, store, tactics)
                    except (RemoteUnavailable, RemoteCorrupt) as exc:
                        _warn(f"{exc}; building without the remote's tactic caches")
                return fleet
            state = lease_state(remote, key)
            if state is None and not allow_build:
                return fleet  # nothing remote, nobody building it
            if state is not None and state[2] > float(state[0].get("ttl_s", remote.lease_s)) and not allow_build:
                return fleet  # its builder stopped: a --no-build host has nothing to wait for
            if state is not None and not waited:
                doc = state[0]
                progress(f"waiting for the build of this engine by pid {doc.get('pid')} on {doc.get('host')} "
                         f"(lease on {remote.url})")
                waited = True
            time.sleep(min(2.0, remote.lease_s / 4))
    except RemoteUnavailable as exc:
        fleet.degrade(exc, allow_build)
        return fleet


# -- tactic caches ---------------------------------------------------------------------------------
def push_tactics(remote: Remote, store: Store, only: str | None = None) -> int:
    """Upload the tactic files the remote lacks (all, or those of one `<backend>/<id>` folder); returns how many.
    Files are merged by name (Inductor's are content-addressed, so equal names mean equal contents)."""
    base = remote.name("tactics") + "/"
    have = {o["Key"] for o in remote.list_objects(base + _folder(only)) if "Key" in o}
    jobs = []
    root = store.tactics_dir / _folder(only)
    if root.is_dir():
        for f in sorted(root.rglob("*")):
            rel = f.relative_to(store.tactics_dir).as_posix()
            if f.is_file() and not f.name.startswith(".") and base + rel not in have:
                jobs.append(("up", base + rel, f))
    remote.transfer(jobs, 0, lambda n: None)
    return len(jobs)


def pull_tactics(remote: Remote, store: Store, only: str | None = None) -> int:
    """Download the tactic files this store lacks (all, or those of one `<backend>/<id>` folder), each into a
    temporary name then renamed; returns how many."""
    base = remote.name("tactics") + "/"
    jobs = []
    for o in remote.list_objects(base + _folder(only)):
        rel = o.get("Key", "")[len(base):]
        if not rel:
            continue
        dest = store.tactics_dir / safe_relpath(rel)
        if not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            jobs.append(("down", o["Key"], dest))
    remote.transfer(jobs, 0, lambda n: None)  # s3transfer downloads to a temporary name and renames
    return len(jobs)


def _folder(only: str | None) -> str:
    return safe_relpath(only.strip("/")) + "/" if only else ""
