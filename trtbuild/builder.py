"""The one place recipe, store and backend meet: key → hit, or lock → build → publish.

    key material = recipe build fields + weights identity + backend toolchain + device + schema
    lookup(key) ─ hit ─▶ Entry
        │ miss
    lock(key) ▶ lookup again (another process may have built it) ▶ backend.build(workdir) ▶ publish
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib
import logging
import os
import signal
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trtbuild import backends
from trtbuild.store import fingerprint
from trtbuild.version import __version__
from trtbuild.backends import BuildJob
from trtbuild.errors import EngineMissingError, InputError
from trtbuild.models.source import ResolvedModel, resolve
from trtbuild.recipe import Recipe
from trtbuild.store.digests import FileDigests
from trtbuild.store.fleet import read_through
from trtbuild.store.remote import configured_url
from trtbuild.store.local import SCHEMA, Entry, Store, key_of
from trtbuild.store.tactics import TacticCache
from trtbuild.timing import apply_threads

Progress = Callable[[str], None]


@dataclass
class BuildOutcome:
    entry: Entry
    cache_hit: bool
    lookup_s: float
    build_s: float
    model: ResolvedModel
    waited_for: str | None = None
    phases: dict[str, float] = field(default_factory=dict)
    startup_s: float = 0.0  # importing the backend's framework and finding the device; not in lookup_s
    quarantined: list[str] = field(default_factory=list)  # corrupt entries this lookup moved aside, and where
    reused: list[str] = field(default_factory=list)  # what a build took from the tactic cache (compiled graphs)
    store: str = ""  # the store's folder and why it is that one (flag, variable or default)
    fleet: dict[str, Any] = field(default_factory=dict)  # the remote tier: which tier served, pull/push s, a warning

    @property
    def key(self) -> str:
        return self.entry.key


def no_build_from_env() -> bool:
    return os.environ.get("TRTBUILD_NO_BUILD", "").lower() in ("1", "true", "yes", "on")


def engine_code_files(backend: backends.Backend) -> list[Path]:
    """The source files that shape what a backend builds: the model and kernel code, the backend's module and the
    modules it names in `build_modules` (its build-time plans, graph compiling and caching)."""
    root = Path(__file__).parent
    modules = [type(backend).__module__, *getattr(backend, "build_modules", ())]
    code = sorted((root / "models").glob("*.py")) + sorted((root / "kernels").glob("*.py"))
    return code + [Path(importlib.import_module(m).__file__ or "") for m in modules]


def engine_code_digest(backend: backends.Backend) -> str:
    """A digest of `engine_code_files`: upgrading trtbuild to code that builds a different engine must
    not reuse the old one. Runtime-only code is kept in other modules so that changing it does not
    invalidate engines."""
    h = hashlib.sha256()
    for f in engine_code_files(backend):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def key_material(recipe: Recipe, model: ResolvedModel, backend: backends.Backend,
                 toolchain: dict[str, str]) -> dict[str, Any]:
    """Everything that changes the engine. Built from the whole recipe minus a short exclusion list."""
    build_doc = recipe.build_document()
    build_doc["model"]["identity"] = model.identity
    return {
        "schema": SCHEMA,
        "recipe": build_doc,
        "backend": {"name": recipe.backend, "toolchain": toolchain},
        "device": fingerprint.device(),
        "trtbuild": {"engine_code": engine_code_digest(backend)},
    }


def fault_point(name: str) -> None:
    """Test hook: `TRTBUILD_FAULT=<name>` kills this process with SIGKILL here, as a crash or an
    OOM killer would, so tests can check what a dead builder leaves behind. Off unless set."""
    if os.environ.get("TRTBUILD_FAULT") == name:
        os.kill(os.getpid(), signal.SIGKILL)


def _startup(recipe: Recipe) -> dict[str, str]:
    """Import the backend's framework and find the device: the toolchain for the key."""
    toolchain = backends.get(recipe.backend).toolchain()  # raises BackendUnavailableError naming the install step
    apply_threads()  # the threads a command chose (--threads), now that the framework is imported
    fingerprint.device()  # cached for key_material
    return toolchain


def _resolve(recipe: Recipe, store: Store,
             toolchain: dict[str, str]) -> tuple[backends.Backend, ResolvedModel, dict[str, Any], str]:
    backend = backends.get(recipe.backend)
    model = resolve(recipe.model, store.root)
    material = key_material(recipe, model, backend, toolchain)
    return backend, model, material, key_of(material)


# Keys whose hit has already been counted as saving their build in this process: a session, an eval against a
# second recipe or a test that looks the same engine up again saves nothing more than the first lookup did.
_SAVED_ONCE: set[str] = set()


def _record_hit(store: Store, entry: Entry, name: str, *, waited: bool) -> None:
    """A hit in the event log, with the build seconds it really saved: the entry's own build time, at most once a
    process, and none when this process waited for another one's build of it (it spent that time waiting)."""
    first = entry.key not in _SAVED_ONCE and not waited
    _SAVED_ONCE.add(entry.key)
    saved = float(entry.manifest.get("build", {}).get("total_s") or 0.0) if first else 0.0
    store.record("hit", key=entry.key, name=name, saved_s=saved)


def build(recipe: Recipe, engines: str | os.PathLike[str] | None = None, *, allow_build: bool = True,
          full_verify: bool = False, progress: Progress = lambda message: None,
          remote: str | None = None) -> BuildOutcome:
    """The engine for `recipe`: a cache hit, a pull from the remote tier (`remote` or $TRTBUILD_REMOTE), or a
    build published atomically (and pushed). Raises EngineMissingError on a miss when building is not allowed."""
    t0 = time.perf_counter()
    store = Store(engines)
    # Start-up (importing torch, initializing the device: seconds on a GPU host) is reported on its own,
    # so `lookup` is what the store costs.
    toolchain = _startup(recipe)
    startup_s = time.perf_counter() - t0
    backend, model, material, key = _resolve(recipe, store, toolchain)
    entry = store.lookup(key, full_verify=full_verify)
    lookup_s = time.perf_counter() - t0 - startup_s
    where = f"{store.root} ({store.origin})"
    if entry is not None:
        _record_hit(store, entry, recipe.name, waited=False)
        return BuildOutcome(entry, True, lookup_s, 0.0, model, startup_s=startup_s, store=where)
    if store.quarantined:
        progress(f"corrupt entry {store.quarantined[-1]}; building it again")
    store.record("miss", key=key, name=recipe.name)
    fleet_url = configured_url(remote)
    if not allow_build and fleet_url is None:
        raise _missing(recipe, store, material, key)
    waited: list[str] = []

    def on_wait(message: str) -> None:
        waited.append(message)
        progress(message)

    with store.lock(key, on_wait=on_wait):
        entry = store.lookup(key, full_verify=full_verify)  # the holder we waited for may have published it
        if entry is not None:
            _record_hit(store, entry, recipe.name, waited=bool(waited))
            return BuildOutcome(entry, True, lookup_s, 0.0, model, waited_for=waited[0] if waited else None,
                                startup_s=startup_s, quarantined=list(store.quarantined), store=where)
        # The remote tier (store/fleet.py): pull, or wait for another host's build, or take the lease to build (with
        # the tactic caches other hosts measured on this device and toolchain).
        tactics = (TacticCache.for_build(store.tactics_dir, recipe.backend, material["device"],
                                         material["backend"]["toolchain"]).path.relative_to(store.tactics_dir).as_posix()
                   if fleet_url and allow_build else None)
        fleet = read_through(fleet_url, store, key, allow_build=allow_build, progress=progress, tactics=tactics)
        if fleet.entry is not None:
            store.record("pull", key=key, name=recipe.name, pull_s=fleet.pull_s)
            return BuildOutcome(fleet.entry, True, lookup_s, 0.0, model, startup_s=startup_s, store=where,
                                fleet=fleet.report("remote"))
        if not allow_build:
            raise _missing(recipe, store, material, key, remote_note=fleet.warning or f"not on {fleet_url} either")
        try:
            outcome = _build_locked(recipe, store, backend, model, material, key, progress)
        except BaseException:
            fleet.write_through(None)  # releases the lease only
            raise
        fleet.write_through(outcome.entry, progress)
        outcome.fleet = fleet.report("built")
        outcome.lookup_s, outcome.startup_s, outcome.store = lookup_s, startup_s, where
        outcome.quarantined = list(store.quarantined)
        return outcome


@contextlib.contextmanager
def framework_quiet() -> Iterator[None]:
    """The framework's own warnings and log lines (torch's deprecations, its notes on its own internals) kept
    from a build's output: a user who wrote a valid recipe has nothing to act on in them, and the CLI and the
    Python API should print the same. TRTBUILD_DEBUG=1 lets them through."""
    if os.environ.get("TRTBUILD_DEBUG") == "1":
        yield
        return
    loggers = [logging.getLogger(name) for name in ("torch", "triton")]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        for module in (r"torch(\.|$)", r"triton(\.|$)"):
            warnings.filterwarnings("ignore", module=module)
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


def _build_locked(recipe: Recipe, store: Store, backend: backends.Backend, model: ResolvedModel,
                  material: dict[str, Any], key: str, progress: Progress) -> BuildOutcome:
    fault_point("build_start")

    def progress_with_faults(message: str) -> None:
        progress(message)
        fault_point(message.split()[0])  # "exporting ...", "compiling ..."

    t_build = time.perf_counter()
    workdir = store.new_workdir(recipe.name, key)
    digests = FileDigests(workdir)  # the files the backend calls final are hashed while it goes on
    try:
        tactics = TacticCache.for_build(store.tactics_dir, recipe.backend, material["device"],
                                        material["backend"]["toolchain"])
        job = BuildJob(recipe=recipe, model=model, workdir=workdir, tactics=tactics,
                       device=material["device"], progress=progress_with_faults, finished=digests.add)
        with framework_quiet():
            output = backend.build(job)
        fault_point("before_publish")
        build_s = time.perf_counter() - t_build
        now = time.time()
        manifest = {
            "key": key,
            "key_material": material,
            "name": recipe.name,
            "backend": recipe.backend,
            "precision": recipe.precision,
            "recipe_file": str(recipe.path) if recipe.path else None,
            "model_source": recipe.model.source,
            "build": {"total_s": build_s, "phases": output.phases, "host": fingerprint.host()},
            "tactics": output.tactics,
            "backend_info": output.extra,
            "created": now,
            "last_used": now,
            "trtbuild_version": __version__,
        }
        t_publish = time.perf_counter()
        entry = store.publish(workdir, recipe.name, key, manifest, known=digests.known())
        publish_s = time.perf_counter() - t_publish
    except OSError as exc:
        digests.cancel()
        shutil.rmtree(workdir, ignore_errors=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
            raise InputError(f"engine store {store.root}: {exc.strerror} while building '{recipe.name}'; "
                             "nothing was published", hint="free space or pass --engines DIR on a larger, "
                             "writable disk") from None
        raise
    except BaseException:
        digests.cancel()
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    # what the user waited for includes publishing (the manifest's total_s, written before it, does not)
    build_s += publish_s
    store.record("build", key=key, name=recipe.name, build_s=build_s)
    reused = list(output.tactics.get("compiled_graphs_reused", [])) if isinstance(output.tactics, dict) else []
    phases = dict(output.phases) | {"publish_s": publish_s}
    if digests.seconds:
        phases["hash_during_build_s"] = digests.seconds  # overlapped the phases after the weights were written
    return BuildOutcome(entry, False, 0.0, build_s, model, phases=phases, reused=reused)


def _missing(recipe: Recipe, store: Store, material: dict[str, Any], key: str,
             remote_note: str | None = None) -> EngineMissingError:
    """Why there is no engine, in the words a fleet operator needs: corrupt, incompatible, or absent."""
    from trtbuild.store.housekeeping import incompatibility

    where = f"no engine for recipe '{recipe.name}' (key {key[:16]}) in {store.entries_dir}"
    reasons = []
    if store.quarantined:
        reasons.append(f"corrupt entry moved to quarantine: {store.quarantined[-1]}")
    other = incompatibility(material, store.entries())
    if other:
        reasons.append(other)
    if remote_note:
        reasons.append(remote_note)
    return EngineMissingError(where + "".join(f"; {r}" for r in reasons),
                              hint="building is off (--no-build / TRTBUILD_NO_BUILD); build it first with "
                              f"`trtbuild build {recipe.path or recipe.name}` on this kind of machine")


def explain(recipe: Recipe, engines: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Hit or miss, without building; on a miss, the key-material fields that differ from the
    nearest existing entry."""
    from trtbuild.store.housekeeping import nearest

    store = Store(engines)
    _, _, material, key = _resolve(recipe, store, _startup(recipe))
    entry = store.lookup(key)
    if entry is not None:
        return {"hit": True, "key": key, "entry": str(entry.path)}
    near = nearest(material, store.entries(), recipe.name)
    result: dict[str, Any] = {"hit": False, "key": key, "nearest": None, "differences": []}
    if near is not None:
        result["nearest"] = str(near[0].path)
        result["differences"] = [{"field": f, "entry": a, "recipe": b} for f, a, b in near[1]]
    return result
