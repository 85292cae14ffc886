"""What both TensorRT-based backends share: a logger that keeps TensorRT's messages, the timing cache
kept in the tactic store, and the reading of deserialization failures.

Nothing here imports tensorrt at module level; callers pass the imported module in.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from trtbuild.backends import unavailable
from trtbuild.store.tactics import TacticCache, write_atomic

TIMING_CACHE = "timing.cache"


# Defined with the other user-facing errors so that the runner can catch it without importing a backend.
from trtbuild.errors import IncompatibleEngineError  # noqa: E402,F401


def capturing_logger(trt: Any) -> Any:
    """A trt.ILogger that keeps every message: TensorRT reports why a call failed only to its logger."""

    class CapturingLogger(trt.ILogger):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.messages: list[tuple[int, str]] = []

        def log(self, severity: Any, msg: str) -> None:
            self.messages.append((int(severity), msg))

        def errors(self, since: int = 0) -> list[str]:
            error = int(trt.ILogger.ERROR)
            return [m for sev, m in self.messages[since:] if sev <= error]

    return CapturingLogger()


def classify_deserialize_failure(messages: list[str]) -> IncompatibleEngineError:
    """Name the cause from the logger's text (the substrings users' reports show for each cause)."""
    text = "\n".join(messages)
    if "Version tag does not match" in text or "not compatible with this version of TensorRT" in text:
        return IncompatibleEngineError("version_mismatch", "the engine was built by another TensorRT version: "
                                       + _first(messages, ("Version tag", "version of TensorRT")))
    if "incompatible device" in text or "expecting compute" in text:
        return IncompatibleEngineError("device_mismatch", "the engine was built for another GPU: "
                                       + _first(messages, ("incompatible device", "expecting compute")))
    if "Magic tag does not match" in text:
        return IncompatibleEngineError("not_a_plan", "the engine file is not a TensorRT plan (wrong or damaged bytes)")
    return IncompatibleEngineError("unknown", "TensorRT could not deserialize the engine: "
                                   + ("; ".join(messages[-3:]) or "no message from TensorRT"))


def _first(messages: list[str], needles: tuple[str, ...]) -> str:
    return next((m for m in messages if any(n in m for n in needles)), messages[-1] if messages else "")


def read_snapshot(tactics: TacticCache) -> bytes:
    """The store's timing cache as it is now (empty if none); read under the lock, so never half-written."""
    path = tactics.path / TIMING_CACHE
    with tactics.locked():
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return b""


def load_into(config: Any, logger: Any, blob: bytes) -> dict[str, Any]:
    """Give the builder config the store's cache, strictly (ignore_mismatch=False); a cache from
    another device or TensorRT is replaced by an empty one rather than trusted (NVIDIA/TensorRT#2144)."""
    mark = len(logger.messages)
    cache = config.create_timing_cache(blob)
    rejected = cache is None or bool(logger.errors(mark))
    if not rejected and config.set_timing_cache(cache, False):
        return {"loaded_bytes": len(blob), "used_store_cache": bool(blob)}
    config.set_timing_cache(config.create_timing_cache(b""), False)
    return {"loaded_bytes": len(blob), "used_store_cache": False,
            "note": "the store's timing cache was rejected by TensorRT; this build started from an empty one"}


def merge_back(config: Any, logger: Any, tactics: TacticCache, built: Any) -> dict[str, Any]:
    """Combine what this build measured with the store's cache as it is *now* (another build may have
    merged since we read it), under the lock, and write the result atomically (Polygraphy's pattern)."""
    if built is None:
        return {"merged": False, "note": "the build kept no timing cache"}
    path = tactics.path / TIMING_CACHE
    with tactics.locked():
        try:
            current = path.read_bytes()
        except FileNotFoundError:
            current = b""
        summary: dict[str, Any] = {"path": str(path), "merged": True}
        if current:
            mark = len(logger.messages)
            on_disk = config.create_timing_cache(current)
            if on_disk is None or logger.errors(mark) or not built.combine(on_disk, False):
                # Not ours to merge with (damaged, or another device/TensorRT): keep it aside, never drop it.
                aside = path.with_name(f"{TIMING_CACHE}.rejected-{int(time.time())}")
                path.rename(aside)
                summary["set_aside"] = str(aside)
        data = bytes(memoryview(built.serialize()))
        write_atomic(path, data)
        summary["bytes"] = len(data)
    return summary


def major_version(trt_module: Any) -> int:
    return int(str(trt_module.__version__).split(".")[0])


def plan_path(entry: Path) -> Path:
    return entry / "engine.plan"


def import_tensorrt() -> Any:
    """The full tensorrt package (with its builder), or the one-line unavailable error."""
    try:
        import tensorrt
    except ImportError as exc:
        raise unavailable("tensorrt", f"the tensorrt Python package cannot be imported ({exc})") from None
    if not hasattr(tensorrt, "Builder"):  # tensorrt_lean / tensorrt_dispatch have no builder
        raise unavailable("tensorrt", f"the installed tensorrt {tensorrt.__version__} is a runtime-only package")
    return tensorrt
