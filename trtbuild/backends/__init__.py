"""Backends behind one small protocol, in an explicit registry imported lazily.

A backend's module must import without its library (torch, tensorrt, tensorrt_llm): the library is
imported inside `toolchain()`, `build()` and `load()`. A backend whose library is missing is listed
as unavailable with the reason and the install step, and fails only when a recipe chooses it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from trtbuild import registry
from trtbuild.errors import BackendUnavailableError
from trtbuild.registry import REGISTRY  # noqa: F401 (the names `trtbuild doctor` lists)
from trtbuild.backends.sampling import Sampling  # noqa: F401 (part of the Engine protocol below)

if TYPE_CHECKING:
    from trtbuild.models.source import ResolvedModel
    from trtbuild.recipe import Recipe
    from trtbuild.store.tactics import TacticCache


@dataclass
class BuildJob:
    """Everything a backend needs to build: it writes only inside `workdir`."""

    recipe: "Recipe"
    model: "ResolvedModel"
    workdir: Path
    tactics: "TacticCache"
    device: dict[str, Any]
    progress: Callable[[str], None] = lambda message: None
    # a file in `workdir` is written for good: the store may hash it now, while the build goes on
    finished: Callable[[Path], None] = lambda path: None


@dataclass
class BuildOutput:
    """What a backend reports back; `phases` are seconds per build phase, `tactics` a summary."""

    phases: dict[str, float]
    tactics: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # recorded in the manifest as "backend_info"


@dataclass
class Generation:
    """One greedy generation, timed by the backend on its device (synchronized or event-timed)."""

    output_ids: list[list[int]]
    prefill_s: float  # time to first token
    decode_step_s: list[float]  # one entry per generated token after the first
    bytes_per_decode_step: float | None = None  # weights + filled KV cache read per token
    prefill_flops: float | None = None
    prefill_bytes: float | None = None  # weights read once + the prompt's KV written: a short prompt's bound


class Engine(Protocol):
    """A loaded engine. Cheap to construct; device work happens in `__enter__` (Polygraphy's runners).

    `generate` is the timed greedy path (`trtbuild run`, the benchmark). `prefill`, `decode` and `release`
    are the slot API a scheduler drives: the cache has `max_batch_size` rows ("slots"), each holding one
    sequence at its own length. The torch backend implements both; the TensorRT backends only `generate`.
    `generate` uses rows 0..batch-1, so it must not run while slots are in use."""

    device: str
    max_batch_size: int  # number of cache rows ("slots")
    max_input_len: int
    max_seq_len: int
    vocab_size: int

    def __enter__(self) -> "Engine": ...

    def __exit__(self, *exc: object) -> None: ...

    def warmup(self, batch_size: int, input_len: int, output_len: int) -> None: ...

    def generate(self, input_ids: list[list[int]], max_new_tokens: int) -> Generation: ...

    def prefill(self, slot: int, prompt: list[int], sampling: Sampling) -> int:
        """Write the prompt's KV into cache row `slot` (positions 0..len-1); return the first generated token."""
        ...

    def decode(self, slots: list[int], tokens: list[int], positions: list[int], sampling: list[Sampling]) -> list[int]:
        """One decode step for these rows (any subset of slots, any order, each at its own position, the
        position of the token being fed); return the next token of each row. Uses the smallest batch bucket
        that holds len(slots) (CUDA graphs per bucket on GPU)."""
        ...

    def release(self, slot: int) -> None:
        """The row is free (cheap; no device work needed)."""
        ...


class Backend(Protocol):
    name: str
    # Modules besides the backend's own whose source shapes what it builds (its build-time plans, how
    # graphs are compiled and cached): part of the engine key, with the model code (builder.py).
    build_modules: tuple[str, ...]

    def check(self, recipe: "Recipe") -> list[str]:
        """Problems with the recipe's backend-specific fields, as `field.path: message`; no imports."""
        ...

    def toolchain(self) -> dict[str, str]:
        """Exact versions of every library that shapes the engine; raises BackendUnavailableError."""
        ...

    def build(self, job: BuildJob) -> BuildOutput: ...

    def load(self, entry: Path, manifest: dict[str, Any]) -> Engine: ...

    # Optional, looked up with getattr (runner._read_ahead): `preload(entry, manifest) -> list[Path]` starts
    # reading a cached entry onto its device before the framework is imported, a guess that `load` checks,
    # and returns the files it reads. The torch backend has one (backends/weights_preload.py).


def get(name: str) -> Backend:
    """The backend object for `name`; its module is imported now, its library later."""
    backend: Backend = registry.backend(name)
    return backend


def availability(name: str) -> tuple[bool, str]:
    """(available, reason): whether the backend's library imports here, for `trtbuild doctor`."""
    try:
        get(name).toolchain()
    except BackendUnavailableError as exc:
        return False, str(exc)
    return True, "ok"


def unavailable(name: str, reason: str) -> BackendUnavailableError:
    """The one-line error for a backend whose library cannot be imported."""
    return BackendUnavailableError(f"backend '{name}' is unavailable: {reason}", hint=registry.REGISTRY[name].install)
