"""A stand-in for `weights_preload.Driver` over host memory, strict where the real driver would fail.

Device and pinned allocations are ctypes buffers; a copy is a memmove, checked to land inside one live
allocation; freeing twice, freeing what was never allocated, or using a destroyed stream is recorded in
`misuse` (the real driver would return an error or corrupt memory). Its methods are exactly the real
driver's (tests/test_weights_preload.py checks), so a preload that calls anything else fails here.
`adopt` gives numpy an `__array_interface__` over an allocation (the real one gives torch a
`__cuda_array_interface__`), which keeps the allocation alive until the last array and tensor on it go.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from typing import Any


class _HostArray:
    """An allocation under numpy's array interface; the array keeps it (and so the allocation) alive."""

    def __init__(self, allocation: Any) -> None:
        self.allocation = allocation
        self.__array_interface__ = {"shape": (allocation.nbytes,), "typestr": "|u1", "data": (allocation.ptr, False),
                                    "version": 3}


class HostDriver:
    def __init__(self, fail_copy_at: int | None = None) -> None:
        self.device: dict[int, Any] = {}
        self.host: dict[int, Any] = {}
        self.streams: set[int] = set()
        self.misuse: list[str] = []
        self.opened: int | None = None
        self.copies = 0
        self.fail_copy_at = fail_copy_at
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def open(self, ordinal: int) -> None:
        self.opened = ordinal

    def make_current(self) -> None:
        if self.opened is None:
            self.misuse.append("make_current before open")

    def _new(self, table: dict[int, Any], nbytes: int) -> int:
        buf = ctypes.create_string_buffer(max(nbytes, 1))
        with self._lock:
            table[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def _drop(self, table: dict[int, Any], ptr: int, what: str) -> None:
        with self._lock:
            if table.pop(ptr, None) is None:
                self.misuse.append(f"{what} of {ptr:#x}, not allocated")

    def alloc(self, nbytes: int) -> int:
        if self.opened is None or nbytes <= 0:
            self.misuse.append(f"alloc({nbytes}) {'before open' if self.opened is None else 'of nothing'}")
        return self._new(self.device, nbytes)

    def free(self, ptr: int) -> None:
        self._drop(self.device, ptr, "free")

    def alloc_host(self, nbytes: int) -> int:
        return self._new(self.host, nbytes)

    def free_host(self, ptr: int) -> None:
        self._drop(self.host, ptr, "free_host")

    def stream(self) -> int:
        with self._lock:
            s = next(self._ids)
            self.streams.add(s)
        return s

    def destroy_stream(self, stream: int) -> None:
        with self._lock:
            if stream not in self.streams:
                self.misuse.append(f"destroy of stream {stream}, not created")
            self.streams.discard(stream)

    def copy_to_device(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        with self._lock:
            self.copies += 1
            if self.fail_copy_at is not None and self.copies >= self.fail_copy_at:
                raise RuntimeError("cuMemcpyHtoDAsync_v2 failed (CUresult 700)")
            if stream not in self.streams:
                self.misuse.append(f"copy on stream {stream}, not created")
            into = [p for p, b in self.device.items() if p <= dst and dst + nbytes <= p + len(b)]
            from_ = [p for p, b in self.host.items() if p <= src and src + nbytes <= p + len(b)]
            if not into or not from_:
                self.misuse.append(f"copy of {nbytes} bytes outside {'a device' if not into else 'a pinned'} allocation")
                return
        ctypes.memmove(dst, src, nbytes)

    def synchronize(self, stream: int) -> None:
        if stream not in self.streams:
            self.misuse.append(f"synchronize of stream {stream}, not created")

    def adopt(self, allocation: Any) -> Any:
        import numpy as np

        return np.asarray(_HostArray(allocation))

    @staticmethod
    def torch_device(ordinal: int) -> str:
        return "cpu"
