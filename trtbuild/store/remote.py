"""The fleet tier's object store: an S3-compatible bucket behind the local store (push, pull, verify, remove).
fleet.py coordinates hosts over it (leases, the builder's hooks, prune, tactic caches).

Layout under `s3://bucket/prefix/`:

    v1/entries/<key>/manifest.json      the entry; written last, and only if absent (If-None-Match: *)
    v1/entries/<key>/<push>/<file>      its files, under the id of the push that wrote them
    v1/leases/<key>.json                a build in progress: host, pid, start, heartbeat, expiry
    v1/used/<key>/<host>                each host's last pull, so that prune keeps entries in use
    v1/quarantine/<key>/<time>.json     manifests of entries whose objects failed their checksums
    tactics/<backend>/<id>/<file>       tactic caches, merged by file name

The store's discipline, across machines: a reader that sees a manifest sees a complete entry, because
the data objects go first and the manifest last; a push never overwrites another host's objects (each
push writes under its own id) nor its manifest (the conditional write); a pull hashes every file
against the manifest before the entry is published locally with one rename. The lease only avoids two
hosts building the same key at once: correctness never depends on it.

Reachability, credentials and timeouts are `RemoteUnavailable`: the builder degrades to the local store
with one warning line. boto3 is imported only when a remote is asked for (`pip install trtbuild[remote]`).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import functools
import json
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from trtbuild.errors import InputError, TrtbuildError
from trtbuild.store.local import MANIFEST, SCHEMA, Entry, Store
from trtbuild.store.tactics import write_atomic

Progress = Callable[[str], None]

ENV_URL = "TRTBUILD_REMOTE"
ENV_LEASE = "TRTBUILD_REMOTE_LEASE_S"  # a lease's lifetime without a heartbeat; tests shorten it
LEASE_S = 60.0
CONNECT_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 10.0  # small calls (manifests, leases, listings): a stalled remote is given up on in ~30 s
DATA_READ_TIMEOUT_S = 60.0  # a part of a transfer, on a busy server
CHUNK = 32 << 20  # multipart part size and ranged-GET size
TRANSFERS = 8  # requests in flight: more only queued behind one another at the server (2 GB to SeaweedFS, 2 CPUs)
KEY_RE = re.compile(r"[0-9a-f]{64}")
NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]*")
BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
INSTALL_HINT = "pip install trtbuild[remote]"


class RemoteUnavailable(TrtbuildError):
    """The object store cannot be reached, refuses the credentials or timed out."""


class RemoteCorrupt(TrtbuildError):
    """A remote object's bytes differ from the manifest's sha256."""


def configured_url(url: str | None = None) -> str | None:
    """The remote asked for: `--remote URL`, else $TRTBUILD_REMOTE; None when neither is set."""
    return url or os.environ.get(ENV_URL) or None


def parse_url(url: str) -> tuple[str, str]:
    """`s3://bucket/prefix` -> (bucket, prefix without slashes at either end)."""
    if not url.startswith("s3://"):
        raise InputError(f"remote {url!r}: expected s3://bucket/prefix", hint=f"pass --remote or set {ENV_URL}")
    bucket, _, prefix = url[len("s3://"):].partition("/")
    prefix = prefix.strip("/")
    if not BUCKET_RE.fullmatch(bucket):
        raise InputError(f"remote {url!r}: {bucket!r} is not a bucket name (3-63 of a-z, 0-9, '.', '-')")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise InputError(f"remote {url!r}: the prefix may not contain empty, '.' or '..' parts")
    return bucket, prefix


def safe_relpath(rel: str) -> str:
    """A manifest's file name, refused unless it stays inside the entry (no absolute, '..' or backslash)."""
    p = PurePosixPath(rel)
    if not rel or "\\" in rel or "\0" in rel or p.is_absolute() or any(part in ("", ".", "..") for part in rel.split("/")):
        raise RemoteCorrupt(f"remote manifest names a file outside its entry: {rel!r}")
    return rel


def _check_key(key: str) -> str:
    if not KEY_RE.fullmatch(key):
        raise InputError(f"{key!r} is not an engine key (64 hex digits)")
    return key


class PreconditionFailed(Exception):
    """A conditional write lost: the object exists (If-None-Match) or changed (If-Match)."""


class Remote:
    """One `s3://bucket/prefix`, through boto3 with the standard AWS variables, files and profiles."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.bucket, self.prefix = parse_url(url)
        try:
            import boto3
            import botocore.config
            from boto3.s3.transfer import TransferConfig
        except ImportError:
            raise InputError(f"remote {url}: the S3 client is not installed", hint=INSTALL_HINT) from None
        session = boto3.session.Session()
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        def client(attempts: int, read_timeout: float) -> Any:
            config = botocore.config.Config(
                connect_timeout=CONNECT_TIMEOUT_S, read_timeout=read_timeout, max_pool_connections=32,
                retries={"max_attempts": attempts, "mode": "standard"},
                # S3-compatible servers behind an endpoint URL (MinIO, SeaweedFS, Ceph) rarely serve bucket subdomains
                s3={"addressing_style": "path"} if endpoint else None)
            return session.client("s3", region_name=session.region_name or "us-east-1", config=config)

        # Small calls fail fast (an unreachable remote costs seconds, then the local store serves); a part of a
        # multi-GB transfer is worth more tries, since one dropped connection would otherwise lose the whole pull.
        self.client, self.data_client = client(2, READ_TIMEOUT_S), client(5, DATA_READ_TIMEOUT_S)
        self.transfer_config = TransferConfig(multipart_threshold=CHUNK, multipart_chunksize=CHUNK,
                                              max_concurrency=TRANSFERS, use_threads=True)
        self.lease_s = float(os.environ.get(ENV_LEASE, LEASE_S))

    # -- names -----------------------------------------------------------------------------------
    def name(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def entry_prefix(self, key: str) -> str:
        return self.name(SCHEMA, "entries", _check_key(key)) + "/"

    def manifest_name(self, key: str) -> str:
        return self.entry_prefix(key) + MANIFEST

    def lease_name(self, key: str) -> str:
        return self.name(SCHEMA, "leases", _check_key(key) + ".json")

    # -- calls, with the client's errors turned into ours ----------------------------------------
    def _call(self, what: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(Bucket=self.bucket, **kwargs)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "412", "ConditionalRequestConflict") or status == 412:
                raise PreconditionFailed(what) from None
            if code in ("NoSuchKey", "404", "NotFound") or status == 404 and code != "NoSuchBucket":
                return None
            if code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "Forbidden") or status == 403:
                raise RemoteUnavailable(f"remote {self.url} refused the credentials ({code or status}) on {what}",
                                        hint="check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or AWS_PROFILE") from None
            if code == "InvalidRange":  # a ranged GET past the object's end: it is shorter than its manifest says
                raise RemoteCorrupt(f"remote {self.url}: {what}: the object is shorter than the manifest says") from None
            if code == "NoSuchBucket":
                raise RemoteUnavailable(f"remote {self.url}: bucket {self.bucket!r} does not exist",
                                        hint="create it, or fix the URL") from None
            raise RemoteUnavailable(f"remote {self.url}: {what} failed: {code or status} {exc}") from None
        except BotoCoreError as exc:
            raise RemoteUnavailable(f"remote {self.url} unreachable ({type(exc).__name__}: {exc})",
                                    hint="check AWS_ENDPOINT_URL and the network; the local store is used meanwhile") from None

    def head(self, name: str) -> dict[str, Any] | None:
        return self._call(f"HEAD {name}", self.client.head_object, Key=name)  # type: ignore[no-any-return]

    def get_json(self, name: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """(document, response) of a JSON object, or None when absent; the response carries ETag and the server's Date."""
        resp = self._call(f"GET {name}", self.client.get_object, Key=name)
        if resp is None:
            return None
        try:
            doc = json.loads(resp["Body"].read())
        except ValueError:
            raise RemoteCorrupt(f"remote object {name} is not JSON") from None
        return (doc if isinstance(doc, dict) else {}), resp

    def put_json(self, name: str, doc: dict[str, Any] | bytes, *, if_none_match: bool = False,
             if_match: str | None = None) -> str:
        body = doc if isinstance(doc, bytes) else json.dumps(doc, indent=2, sort_keys=True).encode()
        extra: dict[str, Any] = {}
        if if_none_match:
            extra["IfNoneMatch"] = "*"
        if if_match is not None:
            extra["IfMatch"] = if_match
        resp = self._call(f"PUT {name}", self.client.put_object, Key=name, Body=body, **extra)
        return str(resp["ETag"])

    def delete(self, name: str) -> None:
        self._call(f"DELETE {name}", self.client.delete_object, Key=name)

    def list_objects(self, prefix: str, delimiter: str | None = None) -> Iterator[dict[str, Any]]:
        """Objects (and, with a delimiter, {"Prefix": ...} rows for the folders) under `prefix`."""
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Prefix": prefix}
            if delimiter:
                kwargs["Delimiter"] = delimiter
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call(f"LIST {prefix}", self.client.list_objects_v2, **kwargs) or {}
            yield from page.get("Contents", [])
            yield from page.get("CommonPrefixes", [])
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")

    def transfer(self, jobs: list[tuple[str, str, Path]], total: int, on_bytes: Callable[[int], None]) -> None:
        """Run ("up"|"down", object, file) transfers through one manager: parallel, multipart or ranged."""
        from boto3.s3.transfer import ProgressCallbackInvoker, create_transfer_manager
        from botocore.exceptions import BotoCoreError, ClientError
        from s3transfer.exceptions import RetriesExceededError, S3DownloadFailedError, S3UploadFailedError

        manager = create_transfer_manager(self.data_client, self.transfer_config)
        lock = threading.Lock()

        def counted(n: int) -> None:
            with lock:
                on_bytes(n)

        try:
            futures = []
            for direction, name, path in jobs:
                subs = [ProgressCallbackInvoker(counted)]
                if direction == "up":
                    futures.append(manager.upload(str(path), self.bucket, name, subscribers=subs))
                else:
                    futures.append(manager.download(self.bucket, name, str(path), subscribers=subs))
            for f in futures:
                f.result()
        except (BotoCoreError, ClientError, RetriesExceededError, S3DownloadFailedError, S3UploadFailedError) as exc:
            with contextlib.suppress(Exception):
                manager.shutdown(cancel=True)
            # the message of a refused request names its code; anything else is the network or the server
            raise RemoteUnavailable(f"remote {self.url}: transfer failed ({type(exc).__name__}: {exc})") from None
        except BaseException:
            with contextlib.suppress(Exception):
                manager.shutdown(cancel=True)
            raise
        manager.shutdown()

    # -- entries ---------------------------------------------------------------------------------
    def manifest(self, key: str) -> dict[str, Any] | None:
        got = self.get_json(self.manifest_name(key))
        if got is None:
            return None
        doc = got[0]
        if doc.get("key") != key or not isinstance(doc.get("files"), dict) or not NAME_RE.fullmatch(str(doc.get("name", ""))):
            raise RemoteCorrupt(f"remote manifest {self.manifest_name(key)} does not describe key {key[:16]}")
        for rel in doc["files"]:
            safe_relpath(rel)
        return doc

    def keys(self) -> list[str]:
        base = self.name(SCHEMA, "entries") + "/"
        out = []
        for row in self.list_objects(base, delimiter="/"):
            key = row.get("Prefix", "")[len(base):].rstrip("/")
            if KEY_RE.fullmatch(key):
                out.append(key)
        return out

    def entries(self) -> list[dict[str, Any]]:
        """Every remote manifest (entries whose push never finished have none and are not listed)."""
        out = []
        for key in self.keys():
            with contextlib.suppress(RemoteCorrupt):
                if (m := self.manifest(key)) is not None:
                    out.append(m)
        return out

    def find(self, ref: str) -> dict[str, Any]:
        """A remote manifest by recipe name or key prefix (6 characters at least)."""
        matches = [m for m in self.entries() if ref == m["name"] or (len(ref) >= 6 and m["key"].startswith(ref))]
        if not matches:
            raise InputError(f"no engine matches {ref!r} on {self.url}", hint="see `trtbuild cache ls --remote`")
        if len(matches) > 1:
            raise InputError(f"{ref!r} matches several engines on {self.url}: "
                             + ", ".join(f"{m['name']}-{m['key'][:16]}" for m in matches), hint="give the key prefix")
        return matches[0]

    def push(self, entry: Entry, progress: Progress = lambda m: None) -> bool:
        """Upload an entry: data objects under a fresh push id, then the manifest, only if absent. Returns
        False when the remote already had the key (this push's objects are then removed)."""
        key = entry.key
        if self.head(self.manifest_name(key)) is not None:
            return False
        push_id = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        base = self.entry_prefix(key) + push_id + "/"
        files = entry.manifest["files"]
        jobs = [("up", base + safe_relpath(rel), entry.path / rel) for rel in sorted(files)]
        total = sum(int(f["size"]) for f in files.values())
        try:
            self.transfer(jobs, total, _meter(progress, f"pushing {entry.name} to {self.url}", total))
            manifest = {k: v for k, v in entry.manifest.items() if k not in ("verified", "last_used", "pulled")}
            manifest["remote"] = {"objects": push_id, "host": socket.gethostname(), "pushed": time.time()}
            for attempt in (1, 2):
                try:
                    self.put_json(self.manifest_name(key), manifest, if_none_match=True)
                    break
                except PreconditionFailed:
                    # S3 answers 409 to a write racing a delete of the same name: then nothing stands, try again
                    if attempt == 2 or self.head(self.manifest_name(key)) is not None:
                        self.remove_prefix(base)  # another host published this key first: its entry stands
                        return False
            # Verify after write: a server that ignored If-None-Match lets the last writer win; keep objects only then.
            now = self.manifest(key)
            if now is None or now.get("remote", {}).get("objects") != push_id:
                self.remove_prefix(base)
                return False
        except BaseException:
            with contextlib.suppress(Exception):  # best effort: objects without a manifest are invisible anyway
                self.remove_prefix(base)
            raise
        return True

    def pull(self, store: Store, key: str, progress: Progress = lambda m: None) -> Entry | None:
        """Download the entry for `key`, hash every file, publish it in `store` with one rename. None when the
        remote has no such entry; RemoteCorrupt (after one retry of the differing files) when hashes differ."""
        manifest = self.manifest(key)
        if manifest is None:
            return None
        name, files = manifest["name"], manifest["files"]
        base = self.entry_prefix(key) + str(manifest.get("remote", {}).get("objects", "")).strip("/") + "/"
        store.ensure()
        workdir = store.new_workdir(name, key)
        try:
            for rel in files:
                (workdir / safe_relpath(rel)).parent.mkdir(parents=True, exist_ok=True)
            total = sum(int(f["size"]) for f in files.values())
            meter = _locked(_meter(progress, f"pulling {name} from {self.url}", total))
            bad = self._fetch_all(base, workdir, files, meter)
            if bad:  # once more, in case the bytes were damaged on the way rather than at rest
                bad = self._fetch_all(base, workdir, {rel: files[rel] for rel in bad}, lambda n: None)
            if bad:
                raise RemoteCorrupt(f"remote entry {name}-{key[:16]} on {self.url}: " + "; ".join(
                    f"{rel}: {why}" for rel, why in sorted(bad.items())))
            now = time.time()
            local = {**{k: v for k, v in manifest.items() if k != "remote"}, "verified": True, "last_used": now,
                     "pulled": {"from": self.url, "objects": manifest.get("remote", {}).get("objects"), "time": now}}
            write_atomic(workdir / MANIFEST, json.dumps(local, indent=2, sort_keys=True).encode())
            final = store.entry_path(name, key)
            if final.exists():
                store.quarantine(final, "replaced by a pull of the same key")
            os.rename(workdir, final)
        except BaseException:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
            raise
        with contextlib.suppress(RemoteUnavailable):
            self.put_json(self.name(SCHEMA, "used", key, socket.gethostname()), {"time": now, "pid": os.getpid()})
        return Entry(final, local)

    def _fetch_all(self, base: str, workdir: Path, files: dict[str, Any], on_bytes: Callable[[int], None]) -> dict[str, str]:
        """Download `files`, each hashed as its bytes arrive; returns {file: problem} for those that differ."""
        def check(rel: str) -> tuple[str, str | None]:
            size, digest = self._fetch(base + rel, workdir / rel, int(files[rel]["size"]), on_bytes, pool)
            if size != files[rel]["size"]:
                return rel, f"size {size}, manifest says {files[rel]['size']}"
            return rel, None if digest == files[rel]["sha256"] else "sha256 differs from the manifest"

        # Small files side by side; each large one in ranged parts side by side (its own window, one at a time).
        small = sorted(r for r in files if int(files[r]["size"]) <= CHUNK)
        large = sorted((r for r in files if int(files[r]["size"]) > CHUNK), key=lambda r: -int(files[r]["size"]))
        with cf.ThreadPoolExecutor(max_workers=TRANSFERS) as pool:
            results = list(pool.map(check, small)) + [check(r) for r in large]
        return {rel: why for rel, why in results if why is not None}

    def _fetch(self, name: str, dest: Path, size: int, on_bytes: Callable[[int], None],
               pool: cf.ThreadPoolExecutor) -> tuple[int, str]:
        """One object into `dest`: ranged GETs, TRANSFERS ahead, written and hashed in order as they arrive, so the
        hash of a multi-GB file costs no pass of its own. Returns (bytes written, sha256)."""
        import hashlib

        h, written = hashlib.sha256(), 0
        ranges = [(off, min(CHUNK, size - off)) for off in range(0, size, CHUNK)]
        with open(dest, "wb") as f:
            if len(ranges) <= 1:  # in the caller's thread: small files already run side by side
                parts: Iterator[bytes] = iter([self._get_range(name, *ranges[0], on_bytes)] if ranges else [])
            else:
                calls = [functools.partial(self._get_range, name, off, n, on_bytes) for off, n in ranges]
                parts = _ordered(pool, calls, TRANSFERS)
            for data in parts:
                f.write(data)
                h.update(data)
                written += len(data)
        return written, h.hexdigest()

    def _get_range(self, name: str, offset: int, length: int, on_bytes: Callable[[int], None]) -> bytes:
        """Bytes [offset, offset + length) of an object; a connection dropped mid-body is retried (twice)."""
        from botocore.exceptions import BotoCoreError

        for attempt in (1, 2, 3):
            resp = self._call(f"GET {name}", self.data_client.get_object, Key=name,
                              Range=f"bytes={offset}-{offset + length - 1}")
            if resp is None:
                raise RemoteCorrupt(f"remote object {name} is missing")
            try:
                chunks = []
                for chunk in resp["Body"].iter_chunks(1 << 20):
                    chunks.append(chunk)
                    on_bytes(len(chunk))
                return b"".join(chunks)
            except BotoCoreError as exc:
                if attempt == 3:
                    raise RemoteUnavailable(f"remote {self.url}: reading {name} failed ({type(exc).__name__}: {exc})",
                                            hint="check the network; the local store is used meanwhile") from None
        raise AssertionError("unreachable")

    def quarantine(self, key: str, reason: str) -> None:
        """Take a corrupt entry out of view: its manifest is copied to quarantine/, then deleted."""
        got = self.get_json(self.manifest_name(key))
        if got is None:
            return
        doc = {**got[0], "quarantined": {"reason": reason, "host": socket.gethostname(), "time": time.time()}}
        self.put_json(self.name(SCHEMA, "quarantine", key, f"{int(time.time())}-{uuid.uuid4().hex[:6]}.json"), doc)
        self.delete(self.manifest_name(key))

    def verify(self, key: str) -> list[str]:
        """Stream every object of an entry and compare its sha256 with the manifest; the problems found."""
        import hashlib

        manifest = self.manifest(key)
        if manifest is None:
            return ["no manifest"]
        base = self.entry_prefix(key) + str(manifest.get("remote", {}).get("objects", "")) + "/"
        problems = []
        for rel, info in sorted(manifest["files"].items()):
            resp = self._call(f"GET {base + rel}", self.client.get_object, Key=base + rel)
            if resp is None:
                problems.append(f"{rel}: missing")
                continue
            h, size = hashlib.sha256(), 0
            for chunk in resp["Body"].iter_chunks(1 << 20):
                h.update(chunk)
                size += len(chunk)
            if size != info["size"]:
                problems.append(f"{rel}: size {size}, manifest says {info['size']}")
            elif h.hexdigest() != info["sha256"]:
                problems.append(f"{rel}: sha256 differs from the manifest")
        return problems

    def remove(self, key: str) -> None:
        """Manifest first (the entry leaves view at once), then its objects and use marks."""
        self.delete(self.manifest_name(key))
        self.remove_prefix(self.entry_prefix(key))
        self.remove_prefix(self.name(SCHEMA, "used", key) + "/")

    def remove_prefix(self, prefix: str) -> None:
        names = [o["Key"] for o in self.list_objects(prefix) if "Key" in o]
        for i in range(0, len(names), 1000):
            self._call(f"DELETE {prefix}*", self.client.delete_objects,
                       Delete={"Objects": [{"Key": n} for n in names[i:i + 1000]], "Quiet": True})

    def last_used(self, key: str) -> float:
        """The latest of the manifest's write and every host's last pull, in seconds since the epoch."""
        times = [o["LastModified"].timestamp() for o in self.list_objects(self.name(SCHEMA, "used", key) + "/") if "Key" in o]
        head = self.head(self.manifest_name(key))
        if head is not None:
            times.append(head["LastModified"].timestamp())
        return max(times, default=0.0)

def _ordered(pool: cf.ThreadPoolExecutor, calls: Sequence[Callable[[], bytes]], ahead: int) -> Iterator[bytes]:
    """The calls' results in order, with at most `ahead` running or done and not yet taken (bounded memory)."""
    futures: list[cf.Future[bytes]] = []
    try:
        for i in range(len(calls)):
            while len(futures) < len(calls) and len(futures) < i + ahead:
                futures.append(pool.submit(calls[len(futures)]))
            yield futures[i].result()
            futures[i] = cf.Future()  # drop the bytes already written
    finally:
        for f in futures:
            f.cancel()


def _locked(fn: Callable[[int], None]) -> Callable[[int], None]:
    lock = threading.Lock()

    def call(n: int) -> None:
        with lock:
            fn(n)

    return call


def _meter(progress: Progress, what: str, total: int) -> Callable[[int], None]:
    """Byte counts -> a progress line at most every 0.25 s: percent, size, rate."""
    state = {"done": 0, "last": 0.0, "t0": time.perf_counter()}

    def on_bytes(n: int) -> None:
        state["done"] += n
        now = time.perf_counter()
        if now - state["last"] >= 0.25 or state["done"] >= total:
            state["last"] = now
            rate = state["done"] / max(now - state["t0"], 1e-9)
            progress(f"{what}: {state['done'] / max(total, 1):.0%} of {total / 1e9:.2f} GB ({rate / 1e6:.0f} MB/s)")

    return on_bytes
