"""Reading a cached engine's weights onto the GPU while the process is still importing torch.

Why: a restart of the 8B engine from a warm page cache spent 4.0-4.7 s starting up (mostly importing
torch, on one core) and then 1.31 s loading the weights, against 0.60 s to read them (H200, 2026-12-04).
The read needs no torch: the CUDA driver's own API (libcuda, which ships with the driver and
loads in milliseconds) can allocate device memory and copy into it. So before torch is imported,
`runner.open_session` lets the backend start this module on the entry the store guesses the key will
select (the newest of the recipe's name), and other cores read its weights.safetensors into device
memory the way the threaded reader does (weights_reader.py: each thread a contiguous range of the
file, two pinned staging buffers, its own streams) while the main thread imports torch.

A guess, never trusted: the engine's loader `take`s the tensors only for the file it is about to read
(the same path, and the same device, inode, size and modification time: a rebuilt entry at the same
path is another file), only if the read completed, and only for the one device it was read to; in any
other case they are freed and the loader reads as before. A build frees them first (`discard`), so a
wrong guess never holds device memory through a build. torch adopts each allocation through
`__cuda_array_interface__` without a copy: the memory stays the driver's, freed by the engine at its exit
(`Preloaded.free`) or else when its last tensor goes. The preload and torch share the device's primary
context, the one the CUDA runtime under torch uses.

On by default for CUDA engines since it ran on GPUs (2026-12-05): its GPU tests passed on the H100
(tensors equal to safetensors' loader, the memory back after `free`, a restart taking its preloaded
weights with the same tokens) and its tensors matched on the H200, where a cold 8B restart went from
12.51 to 10.19 s to the first token (1.04x the read itself) and a warm one stayed level (5.38 / 5.34 s:
the read slows the import it overlaps). TRTBUILD_PRELOAD=0 turns it off (TRTBUILD_PREFETCH=0 turns off
every read-ahead). Its ctypes calls are checked against cuda.h (tests/cuda_header.py): a call the real
driver took differently would not fall back, it would end the process.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trtbuild.backends.torch.weights_reader import (Job, TensorEntry, contiguous_groups, entries, host_bytes, open_sequential,
                                              pread_into)

CHUNK = 64 << 20  # fewer, larger chunks than the loader's: each one takes the GIL from the import a few times


class Driver:
    """The CUDA driver calls the preload makes, through ctypes. Every 64-bit value is passed typed (ctypes
    would pass a bare int as a 32-bit C int)."""

    def __init__(self, lib: Any = None) -> None:
        self.lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
        self.ctx: int | None = None

    def _call(self, name: str, *args: Any) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} failed (CUresult {rc})")

    def open(self, ordinal: int) -> None:
        """Initialize the driver and retain device `ordinal`'s primary context (the one torch will use),
        current on the calling thread. Never released: the adopted memory lives in it."""
        self._call("cuInit", ctypes.c_uint(0))
        dev = ctypes.c_int()
        self._call("cuDeviceGet", ctypes.byref(dev), ctypes.c_int(ordinal))
        ctx = ctypes.c_void_p()
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        self.ctx = ctx.value
        self.make_current()

    def make_current(self) -> None:
        self._call("cuCtxSetCurrent", ctypes.c_void_p(self.ctx))

    def alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_uint64()
        self._call("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(nbytes))
        return ptr.value

    def free(self, ptr: int) -> None:
        self.make_current()  # a tensor's last reference may go on any thread
        self._call("cuMemFree_v2", ctypes.c_uint64(ptr))

    def alloc_host(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self._call("cuMemHostAlloc", ctypes.byref(ptr), ctypes.c_size_t(nbytes), ctypes.c_uint(0))
        assert ptr.value is not None
        return ptr.value

    def free_host(self, ptr: int) -> None:
        self._call("cuMemFreeHost", ctypes.c_void_p(ptr))

    def stream(self) -> int:
        s = ctypes.c_void_p()
        self._call("cuStreamCreate", ctypes.byref(s), ctypes.c_uint(1))  # CU_STREAM_NON_BLOCKING
        assert s.value is not None
        return s.value

    def destroy_stream(self, stream: int) -> None:
        self._call("cuStreamDestroy_v2", ctypes.c_void_p(stream))

    def copy_to_device(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._call("cuMemcpyHtoDAsync_v2", ctypes.c_uint64(dst), ctypes.c_void_p(src), ctypes.c_size_t(nbytes),
                   ctypes.c_void_p(stream))

    def synchronize(self, stream: int) -> None:
        self._call("cuStreamSynchronize", ctypes.c_void_p(stream))

    def adopt(self, allocation: "Allocation") -> Any:
        """What torch.as_tensor takes to make a uint8 tensor of `allocation` without a copy."""
        return _CudaArray(allocation)

    @staticmethod
    def torch_device(ordinal: int) -> str:
        """The torch device that device `ordinal` is (both count the devices CUDA_VISIBLE_DEVICES leaves)."""
        return f"cuda:{ordinal}"


class Allocation:
    """One device allocation of the preload, freed once: by `free` (the engine's exit), or else when the
    last reference to it goes."""

    def __init__(self, driver: Any, ptr: int, nbytes: int) -> None:
        self.driver, self.ptr, self.nbytes = driver, ptr, nbytes

    def free(self) -> None:
        ptr, self.ptr = self.ptr, 0
        if ptr:
            self.driver.free(ptr)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the driver may be gone; so is the process
            self.free()


class _CudaArray:
    """An allocation as torch adopts it: torch holds this object (and so the allocation) until its last
    tensor on the memory is freed."""

    def __init__(self, allocation: Allocation) -> None:
        self.allocation = allocation

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        a = self.allocation
        return {"shape": (a.nbytes,), "typestr": "|u1", "data": (a.ptr, False), "version": 2}


def _identity(path: Path) -> tuple[int, int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


@dataclass
class Preload:
    """One file being read onto device `ordinal` in the background (`start`)."""

    path: Path
    driver: Any
    threads: int
    ordinal: int = 0
    chunk: int = CHUNK
    identity: tuple[int, int, int, int] | None = None
    tensors: list[tuple[TensorEntry, int]] = field(default_factory=list)  # each with its device address (0: empty)
    error: BaseException | None = None
    seconds: float | None = None
    # set by whoever gives the read up: its threads stop at their next chunk, so a wrong guess never holds
    # a build (or the process's exit) for the rest of a 15 GB read
    cancelled: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def begin(self) -> None:
        self.identity = _identity(self.path)
        self._thread = threading.Thread(target=self._run, name="trtbuild-preload", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def release(self) -> None:
        """Free every allocation not yet adopted (after `wait`)."""
        for _, ptr in self.tensors:
            if ptr:
                with contextlib.suppress(Exception):
                    self.driver.free(ptr)
        self.tensors = []

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            found = entries(self.path)
            self.driver.open(self.ordinal)
            jobs: list[Job] = []  # into device addresses
            for e in found:
                self.tensors.append((e, self.driver.alloc(e.nbytes) if e.nbytes else 0))
                jobs += e.jobs(self.chunk, self.tensors[-1][1])
            # daemon threads, not an executor's: a process that exits early (its engine not found) must
            # not wait at exit for a read nobody will use
            errors: list[BaseException] = []
            workers = [threading.Thread(target=self._read_group, args=(g, errors), daemon=True, name="trtbuild-preload")
                       for g in contiguous_groups(jobs, max(1, self.threads))]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            if errors:
                raise errors[0]
        except BaseException as e:  # the loader reads the file itself and reports what is wrong with it
            self.error = e
            self.release()
        self.seconds = time.perf_counter() - t0

    def _read_group(self, jobs: list[Job], errors: list[BaseException]) -> None:
        try:
            self._copy_group(jobs)
        except BaseException as e:
            errors.append(e)

    def _copy_group(self, jobs: list[Job]) -> None:
        """Read into one pinned buffer while the other's copy runs on its own stream; a buffer is refilled
        only after its stream has finished the copy out of it."""
        drv = self.driver
        drv.make_current()
        fd = open_sequential(self.path)
        staging: list[int] = []
        streams: list[int] = []
        try:
            staging = [drv.alloc_host(max(n for _, n, _, _ in jobs)) for _ in range(2)]  # pinning takes time: no more
            streams = [drv.stream() for _ in range(2)]
            for i, (offset, n, ptr, at) in enumerate(jobs):
                if self.cancelled.is_set():
                    raise _Cancelled(self.path)
                k = i % 2
                drv.synchronize(streams[k])
                pread_into(fd, host_bytes(staging[k], n), offset, self.path)
                drv.copy_to_device(ptr + at, staging[k], n, streams[k])
        finally:
            for s in streams:  # no copy may still read a staging buffer when it is freed
                with contextlib.suppress(Exception):
                    drv.synchronize(s)
                with contextlib.suppress(Exception):
                    drv.destroy_stream(s)
            for buf in staging:
                with contextlib.suppress(Exception):
                    drv.free_host(buf)
            os.close(fd)


class _Cancelled(Exception):
    """The read was given up (`discard`, a preload of another file, the process's exit)."""


_pending: Preload | None = None
_lock = threading.Lock()


def start_for(entry: Path) -> list[Path]:
    """Start reading a cached CUDA engine's weights (a guess of the entry `TorchEngine` will load), with
    the threads its loader would use; the files it reads. Never raises: whatever stops it, the loader
    reads as before and reports what is wrong."""
    from trtbuild.backends.torch.weights_reader import load_threads
    from trtbuild.errors import TrtbuildError

    weights = entry / "weights.safetensors"
    try:
        cuda = json.loads((entry / "engine.json").read_text()).get("device") == "cuda"
        threads = load_threads("cuda") if cuda else 0
    except (OSError, ValueError, TrtbuildError):  # unreadable spec, TRTBUILD_LOAD_THREADS malformed
        return []
    return [weights] if threads and start(weights, threads) else []


def start(path: Path, threads: int, driver: Any = None, chunk: int = CHUNK) -> bool:
    """Begin reading `path` onto the first GPU in the background; False where it cannot (turned off, no
    threads, no file, no CUDA driver) or one is already under way."""
    global _pending
    if os.environ.get("TRTBUILD_PRELOAD", "1") == "0" or threads <= 0 or not path.is_file():
        return False
    with _lock:
        if _pending is not None:
            return False
        try:
            drv = driver if driver is not None else Driver()
        except OSError:  # no libcuda: a CPU-only host
            return False
        _pending = Preload(path, drv, threads, chunk=chunk)
        _pending.begin()
    return True


def _claim(keep: Path | None = None) -> tuple[Preload | None, float]:
    """The pending preload, once its read is over, and the seconds spent waiting for that. A preload of any
    file but `keep` is given up first, so the wait is for the chunks already under way, not the file."""
    global _pending
    with _lock:
        pre, _pending = _pending, None
    t = time.perf_counter()
    if pre is not None:
        if keep is None or pre.path != keep or pre.identity != _identity(keep):  # (a replaced file is another)
            pre.cancelled.set()
        pre.wait()
    return pre, time.perf_counter() - t


def discard() -> None:
    """Give up and free a preload nobody will take (a build is about to need the device memory)."""
    pre, _ = _claim()
    if pre is not None:
        pre.release()


def _abandon() -> None:
    """At exit (an error before the engine was loaded, say): stop the read and free its memory before the
    interpreter and the CUDA driver shut down under threads still copying."""
    with contextlib.suppress(Exception):
        discard()


atexit.register(_abandon)


@dataclass
class Preloaded:
    """What `take` hands the loader: the tensors, the seconds their read took, and the allocations under
    them, which `free` releases (once nothing will run on the tensors again)."""

    tensors: dict[str, Any]
    seconds: float
    allocations: list[Allocation]
    waited_s: float = 0.0  # how long the loader waited for the read to end (a cold disk outlasting start-up)

    def free(self) -> None:
        for a in self.allocations:
            a.free()


def take(path: Path, device: str) -> Preloaded | None:
    """The preloaded tensors of `path` on `device`, if a preload of that very file completed; else None
    (and whatever was preloaded is freed)."""
    pre, waited = _claim(keep=path)
    if pre is None:
        return None
    if (pre.error is not None or pre.path != path or pre.identity != _identity(path)
            or device != pre.driver.torch_device(pre.ordinal)):
        pre.release()
        return None
    import torch

    from trtbuild.backends.torch.weights_reader import torch_dtype

    # Every allocation gets its owner first: whatever happens below, each is freed exactly once.
    owned = [(e, Allocation(pre.driver, ptr, e.nbytes) if ptr else None) for e, ptr in pre.tensors]
    pre.tensors = []
    allocations = [a for _, a in owned if a is not None]
    tensors: dict[str, Any] = {}
    try:
        for e, allocation in owned:
            dtype = torch_dtype(e.dtype)
            if allocation is None:
                tensors[e.name] = torch.empty(e.shape, dtype=dtype, device=device)
            else:
                tensors[e.name] = torch.as_tensor(pre.driver.adopt(allocation), device=device).view(dtype).view(e.shape)
    except Exception:  # torch reads the array interface with numpy's help, which a process may lack
        tensors.clear()
        for a in allocations:
            a.free()
        return None
    assert pre.seconds is not None
    return Preloaded(tensors, pre.seconds, allocations, waited)
