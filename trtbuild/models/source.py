"""Where a model's files come from, and what identifies its weights in a key.

- synthetic: the identity is the config and seed (no bytes need hashing); the folder is written
  on first build into the store's `models/` folder, then read by the same loader as any checkpoint.
- local: the identity is a content digest of config.json and the weight files, cached by
  (path, size, mtime, inode) so a restart does not re-read gigabytes.
- hub: the identity is the repo id and the commit the revision resolved to, through huggingface_hub's
  cache (HF_HUB_OFFLINE and local-only resolution respected).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock

from trtbuild.errors import InputError, TrtbuildError
from trtbuild.recipe import ModelSpec
from trtbuild.store.tactics import write_atomic

SYNTHETIC_GENERATOR = 2  # bump when synthetic_checkpoint's output for a (config, seed) changes
# chat_template.jinja: where newer checkpoints keep the chat template (trtbuild/serving/generate.py reads it first)
HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "chat_template.jinja"]
RACY_NS = 2_000_000_000  # files changed more recently than this are not memoized


@dataclass
class ResolvedModel:
    spec: ModelSpec
    identity: dict[str, Any]
    folder: Path | None  # None until materialized (synthetic) or for ONNX files
    _store_models: Path | None = field(default=None, repr=False)
    # seconds `materialize` spent writing a synthetic checkpoint (0 where it was already there): a build's phases
    # report it apart from loading, which a real checkpoint pays alone
    synthesized_s: float = 0.0

    @property
    def digest(self) -> str:
        """The identity's sha256 (canonical JSON): what names the model's own folders in a store."""
        return _digest(self.identity)

    def materialize(self) -> Path:
        """The model as files on disk; writes a synthetic model the first time it is needed."""
        if self.folder is not None and (self.folder / "config.json").is_file():
            return self.folder
        if self.spec.kind != "synthetic" or self._store_models is None:
            if self.spec.kind == "onnx" and self.spec.path is not None:
                return self.spec.path
            raise TrtbuildError(f"model folder {self.folder} is gone")
        from trtbuild.models.checkpoint import write_synthetic

        folder = self._store_models / f"synthetic-{self.digest[:16]}"
        with FileLock(str(folder) + ".lock"):
            if not (folder / "config.json").is_file():
                # named for its writer, so the next build on this host removes it if the writer died
                tmp = folder.with_name(folder.name + f".tmp-{socket.gethostname()}-{os.getpid()}")
                _remove_tree(tmp)
                assert self.spec.config is not None
                t = time.perf_counter()
                write_synthetic(tmp, self.spec.config, self.spec.seed)
                os.replace(tmp, folder)  # published whole, like an engine
                self.synthesized_s = time.perf_counter() - t
        self.folder = folder
        return folder

    def checkpoint(self, dtype: Any) -> tuple[Path, dict[str, Any], Any, dict[str, Any]]:
        """(a folder holding config.json, config.json's contents, the checked config, every weight the config
        needs cast to `dtype`). A synthetic model whose files were not asked for is drawn in memory: its folder
        (in the store's models/) gets config.json alone, which compile workers read, and `materialize` writes
        the weights where files are wanted. Writing an 8B model's 16 GB and reading them back had been a third
        of its build."""
        from trtbuild.models.checkpoint import load_weights, read_config, synthetic_checkpoint, write_config

        if self.spec.kind == "synthetic" and self.folder is None and self._store_models is not None:
            assert self.spec.config is not None
            t = time.perf_counter()
            raw, tensors = synthetic_checkpoint(self.spec.config, self.spec.seed)
            self.synthesized_s = time.perf_counter() - t
            folder = self._store_models / f"synthetic-{self.digest[:16]}.config"
            if not (folder / "config.json").is_file():
                write_config(folder, raw)
            _, cfg = read_config(folder)
            return folder, raw, cfg, {name: t.to(dtype) for name, t in tensors.items()}
        folder = self.materialize()
        raw, cfg = read_config(folder)
        return folder, raw, cfg, load_weights(folder, cfg, dtype)

    @property
    def tokenizer(self) -> Path | None:
        path = self.folder / "tokenizer.json" if self.folder else None
        return path if path and path.is_file() else None


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _remove_tree(path: Path) -> None:
    import shutil

    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)


def resolve(spec: ModelSpec, store_root: Path) -> ResolvedModel:
    """The model's identity for the key, touching as little as possible (no writes, no downloads if cached)."""
    if spec.kind == "synthetic":
        identity = {"kind": "synthetic", "config": spec.config, "seed": spec.seed, "generator": SYNTHETIC_GENERATOR}
        folder = store_root / "models" / f"synthetic-{_digest(identity)[:16]}"
        return ResolvedModel(spec, identity, folder if (folder / "config.json").is_file() else None,
                             _store_models=store_root / "models")
    if spec.kind == "hub":
        folder, commit = _hub_snapshot(spec.source, spec.revision)
        return ResolvedModel(spec, {"kind": "hub", "repo": spec.source, "commit": commit}, folder)
    assert spec.path is not None
    if spec.kind == "onnx":
        return ResolvedModel(spec, {"kind": "onnx", "sha256": _file_digest(spec.path, store_root)}, None)
    from trtbuild.models.checkpoint import weight_files

    files = [spec.path / "config.json", *weight_files(spec.path)]
    index = spec.path / "model.safetensors.index.json"
    if index.is_file():
        files.append(index)
    content = {f.name: _file_digest(f, store_root) for f in files}
    return ResolvedModel(spec, {"kind": "local", "sha256": _digest(content)}, spec.path)


def _file_digest(path: Path, store_root: Path) -> str:
    """sha256 of a file, remembered by (path, size, mtime, ctime, inode) in the store's digest cache.

    ctime is in the stamp because nothing can set it back (`touch -d`, `cp -p` and rsync restore
    mtime). A file changed in the last seconds is hashed but not remembered: timestamps tick coarsely,
    so a write in the same tick as the hash would leave the stamp unchanged (git's "racy clean").
    """
    try:
        st = path.stat()
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror}") from None
    stamp = _digest([str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
    memo = store_root / ".digests" / stamp
    with contextlib.suppress(OSError):
        return memo.read_text().strip()
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror}") from None
    racy = time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) < RACY_NS
    with contextlib.suppress(OSError):  # a read-only store only loses the memo
        if not racy:
            write_atomic(memo, h.hexdigest().encode())
    return h.hexdigest()


def _hub_snapshot(repo: str, revision: str | None) -> tuple[Path, str]:
    """Download (or find in the cache) a snapshot; return its folder and resolved commit."""
    from huggingface_hub import snapshot_download
    from huggingface_hub import errors as hf_errors

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    rev = revision or "main"
    try:
        path = Path(snapshot_download(repo, revision=rev, allow_patterns=HUB_PATTERNS, local_files_only=offline))
    except hf_errors.GatedRepoError:
        raise InputError(f"model.source: {repo} is gated on the Hugging Face hub",
                         hint="accept its licence on the hub and log in with `hf auth login`") from None
    except hf_errors.RepositoryNotFoundError:
        raise InputError(f"model.source: Hugging Face repo {repo} not found (or private)",
                         hint="check the repo id, or log in with `hf auth login`") from None
    except hf_errors.RevisionNotFoundError:
        raise InputError(f"model.revision: {rev!r} not found in Hugging Face repo {repo}") from None
    except (hf_errors.LocalEntryNotFoundError, hf_errors.OfflineModeIsEnabled, OSError) as exc:
        mode = "offline (HF_HUB_OFFLINE is set)" if offline else "the hub could not be reached"
        raise InputError(f"model.source: {repo}@{rev} is not in the Hugging Face cache and {mode}",
                         hint="download it once where the hub is reachable (`hf download "
                         f"{repo}`), or point model.source at a local folder") from exc
    except hf_errors.HfHubHTTPError as exc:
        raise InputError(f"model.source: downloading {repo}@{rev} failed: {exc}",
                         hint="retry; an interrupted download resumes") from None
    return path, path.name
