"""The compiled-graph cache: AOTInductor's output for one exported program, kept in the tactic cache.

Weights are not inside a compiled graph (they are runtime constants, never folded), so what Inductor
makes of a graph depends only on the exported program (operations, shapes, dtypes, strides, literals
such as rms_norm_eps), the Inductor options, the sources of trtbuild's own kernels it calls, and the
toolchain and device the tactic cache is already keyed by. Its key is a digest of exactly those; a
rebuild, another recipe of the same architecture with other weights, or a compile worker's result is
then a copy instead of minutes of Inductor.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import socket
import warnings
from pathlib import Path
from typing import Any

from trtbuild.backends.torch import decode_kernels
from trtbuild.backends.torch.cxx import overlapped_objects
from trtbuild.backends.torch.inductor import compile_parts
from trtbuild.errors import TrtbuildError

def program_text(program: Any) -> str:
    """An exported program as text for the compiled-graph cache's key: its operations, shapes, dtypes,
    strides, literals and signature, without the source-location comments export adds to each node.
    Those name the file and line of the model code that made the node, so a trtbuild installed in another
    folder, or an edit that only moved lines, would otherwise miss a cache of identical graphs."""
    return "\n".join(line for line in str(program).splitlines() if line.strip() and not line.lstrip().startswith("#"))


def graph_digest(program: Any, configs: dict[str, Any]) -> str:
    """The compiled-graph cache's key for one exported program compiled with `configs`."""
    text = program_text(program)
    text += decode_kernels.sources_called(text)
    return hashlib.sha256((text + "\0" + json.dumps(configs, sort_keys=True, default=str)).encode()).hexdigest()


@functools.cache
def package_sources() -> str:
    """A digest of every Python source of trtbuild: any code change may change what export makes of a model
    (the model, its kernels, the routing), so an architecture key made before export must change with it."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def architecture_key(name: str, configs: dict[str, Any], material: dict[str, Any]) -> str:
    """The key of one graph before it is exported: the graph's name and Inductor options, and `material`,
    everything the export reads besides the weights' values (the model config, the engine's shapes, every
    tensor's name, shape and dtype, the build's kernel plans), with trtbuild's own sources."""
    text = json.dumps({"graph": name, "configs": configs, "model": material, "sources": package_sources()},
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _export_record(tactics: Path, architecture: str) -> Path:
    return tactics / "graphs" / "exports" / f"{architecture[:32]}.json"


def known_export(tactics: Path, architecture: str) -> dict[str, Any] | None:
    """The record of a graph an earlier build exported and compiled from the same architecture, if its compiled
    graph is still in the cache: the build copies it without exporting (a new checkpoint of the same model)."""
    try:
        record = json.loads(_export_record(tactics, architecture).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not cached(tactics, str(record.get("digest", ""))).is_file():
        return None
    return record


def export_record(graph: dict[str, Any]) -> dict[str, Any]:
    """What export gave a graph besides its program (batch, window, kernels routed, the compiled-graph key):
    kept beside the compiled graph, so that a build finding it by its architecture key has the same record."""
    return {k: v for k, v in graph.items() if k not in ("program", "export_s")}


def remember_export(tactics: Path, architecture: str, record: dict[str, Any]) -> None:
    """Keep an `export_record` under its architecture key (written whole, then renamed)."""
    path = _export_record(tactics, architecture)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}{_TMP}{socket.gethostname()}-{os.getpid()}")
    tmp.write_text(json.dumps(record, sort_keys=True))
    os.replace(tmp, path)


_TMP = ".tmp-"  # <digest>.tmp-<host>-<pid>: a compiled graph being copied into the tactic cache
# where a compile's seconds went (inductor.compile_parts), as `compile_or_reuse` adds them to a graph's record: a
# worker's or a fork's report carries them back to the build under the same names
COMPILE_PARTS = ("compile_inductor_s", "compile_cxx_s", "compile_timers")


def sweep_half_copied(tactics: Path) -> None:
    """Remove the graphs a build or worker on this host was copying into the cache when it was killed."""
    from trtbuild.store.local import pid_alive

    host = socket.gethostname()
    graphs = tactics / "graphs"
    for path in graphs.iterdir() if graphs.is_dir() else []:
        owner, _, pid = path.name.partition(_TMP)[2].rpartition("-")
        if owner == host and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def cached(tactics: Path, digest: str) -> Path:
    """The marker file of the compiled graph with key `digest`; it exists once the graph is complete."""
    return tactics / "graphs" / digest[:32] / "COMPLETE"


def compile_or_reuse(graph: dict[str, Any], name: str, configs: dict[str, Any], digest: str, tactics: Path,
                     workdir: Path) -> bool:
    """Compile one exported graph into `workdir/<name>/`, or copy the compiled folder that an
    earlier build left in the tactic cache for exactly this graph (`digest`). True when reused."""
    import torch

    folder = cached(tactics, digest).parent
    dest = workdir / name
    if (folder / "COMPLETE").is_file():
        shutil.copytree(folder, dest, ignore=shutil.ignore_patterns("COMPLETE"))
        so_name = (folder / "COMPLETE").read_text().strip()
        graph["so"] = f"{name}/{so_name}"
        return True
    if "program" not in graph:  # found by its architecture key, and removed from the cache since (a prune)
        raise TrtbuildError(f"{name}: the compiled graph {digest[:12]} left the tactic cache during the build",
                            hint="build again")
    package = workdir / f"{name}.pt2"
    workdir.mkdir(parents=True, exist_ok=True)
    # A copy: aoti_compile_and_package adds its own keys to the dict it is given, which would
    # change the digest of every later graph compiled with the same options.
    parts: dict[str, float] = {}
    with warnings.catch_warnings(), compile_parts(parts), overlapped_objects():
        # torch 2.13 warns about its own pickling of the program's tree specs (copyreg calls a deprecated
        # isinstance check) once per graph; nothing a user can act on, so it is kept out of the build's output
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        torch._inductor.aoti_compile_and_package(graph["program"], package_path=str(package),
                                                 inductor_configs=dict(configs))
    graph["so"] = extract_model(package, dest)
    graph.update({f"compile_{k}": v for k, v in parts.items()})
    # Publish into the tactic cache the way the store publishes engines: a private folder, then one
    # rename; a concurrent builder that lost the race just keeps its own copy.
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f"{folder.name}{_TMP}{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(dest, tmp)
    (tmp / "COMPLETE").write_text(graph["so"].split("/", 1)[1] + "\n")
    try:
        os.rename(tmp, folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return False


def extract_model(package: Path, dest: Path) -> str:
    """Unpack the compiled model (the wrapper .so, its cubins and metadata) out of the .pt2 and
    drop the archive: the runtime loads the .so directly, never through the package's C++ zip
    reader, which segfaults on the H200 image (torch 2.11) for every package; and a restart then
    unpacks nothing. Generated C++ sources are not needed to run and are left out."""
    import zipfile

    dest.mkdir()
    so = None
    with zipfile.ZipFile(package) as archive:
        for info in archive.infolist():
            parts = info.filename.split("/")
            if len(parts) < 5 or parts[1:4] != ["data", "aotinductor", "model"] or info.is_dir():
                continue
            if info.filename.endswith(".cpp"):
                continue
            target = dest / "/".join(parts[4:])
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
            if target.name.endswith(".wrapper.so") or (target.suffix == ".so" and so is None):
                so = target
    package.unlink()
    if so is None:
        raise TrtbuildError(f"{package}: AOTInductor wrote no compiled model (.so) into the package")
    return so.relative_to(dest.parent).as_posix()
