"""Reading a safetensors file into device memory with several threads at once.

safetensors' `load_file(device="cuda")` moves one tensor at a time, on one thread, from the
memory-mapped file: on the H200 host (2026-12-03) that took the 8B engine's 15 GB about 2.9 s from a
warm page cache and 7 s cold, the largest part of a restart. Here each thread reads its own
contiguous range of the file with `preadv` (no GIL held, the kernel's read-ahead sees one sequential
stream per thread) into its own pinned staging buffers, and copies them to the destination tensors
on its own CUDA stream while it reads the next chunk. On the CPU the bytes are read straight into the destination tensors.

The default for CUDA engines (8 threads; `TRTBUILD_LOAD_THREADS=N` sets the count, 0 keeps `load_file`):
on the H200 (2026-12-04) 8 threads took the 8B load from 3.08 to 1.01 s warm and 8.03 to 6.75 s cold,
and its GPU test found the same tensors as `load_file`.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trtbuild.errors import InputError, TrtbuildError

DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
          "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
          "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}

ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
            "F8_E4M3": 1, "F8_E5M2": 1}

Job = tuple[int, int, Any, int]  # (file offset, bytes, destination, offset in the destination)


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's place in a safetensors file, as its header gives it and checked against the file."""

    name: str
    dtype: str  # the safetensors name (BF16)
    shape: list[int]
    offset: int  # of its first byte in the file
    nbytes: int

    def jobs(self, chunk_bytes: int, dest: Any) -> list[Job]:
        """Its bytes as reads of at most `chunk_bytes` into `dest` (a byte view or a device address)."""
        return [(self.offset + at, min(chunk_bytes, self.nbytes - at), dest, at) for at in range(0, self.nbytes, chunk_bytes)]


def entries(path: Path) -> list[TensorEntry]:
    """Every tensor of a safetensors file, its header checked against the file's size; no torch needed
    (the preload reads it before torch is imported). Raises TrtbuildError naming the file."""
    head, data_start = header(path)
    size = path.stat().st_size
    out = []
    for name, info in head.items():
        if name == "__metadata__":
            continue
        try:
            itemsize = ITEMSIZE[info["dtype"]]
            begin, end = (int(x) for x in info["data_offsets"])
            shape = [int(d) for d in info["shape"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise TrtbuildError(f"{path}: tensor {name!r}: unreadable header entry ({exc})") from exc
        if end - begin != math.prod(shape) * itemsize or data_start + end > size:
            raise TrtbuildError(f"{path}: tensor {name!r}: its bytes [{begin}, {end}) do not match its shape "
                                f"or lie past the end of the file ({size} bytes)", hint="rebuild the engine")
        out.append(TensorEntry(name, info["dtype"], shape, data_start + begin, end - begin))
    return out


def read_safetensors(path: Path, device: str, threads: int = 8, chunk_bytes: int = 32 << 20) -> dict[str, Any]:
    """Every tensor of a safetensors file, on `device`. Raises TrtbuildError naming the file when its
    header is unreadable or its data is shorter than the header says."""
    import torch

    tensors: dict[str, Any] = {}
    jobs: list[Job] = []
    for e in entries(path):
        t = tensors[e.name] = torch.empty(e.shape, dtype=torch_dtype(e.dtype), device=device)
        if e.nbytes:
            jobs += e.jobs(chunk_bytes, t.view(-1).view(torch.uint8))
    groups = contiguous_groups(jobs, max(1, threads))
    cuda = device.startswith("cuda")
    with ThreadPoolExecutor(max_workers=len(groups) or 1, thread_name_prefix="trtbuild-load") as pool:
        done = [pool.submit(_read_group_cuda, path, g, device, chunk_bytes) if cuda else pool.submit(_read_group, path, g)
                for g in groups]
        for d in done:
            d.result()  # re-raises a reader's error here
    return tensors


def torch_dtype(name: str) -> Any:
    """The torch dtype of a safetensors dtype name (KeyError for one trtbuild never writes)."""
    import torch

    return getattr(torch, DTYPES[name])


def header(path: Path) -> tuple[dict[str, Any], int]:
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or n > path.stat().st_size - 8:
                raise ValueError(f"header length {n} does not fit the file")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, ValueError) as exc:
        raise TrtbuildError(f"{path}: not a readable safetensors file ({exc})", hint="rebuild the engine") from exc
    return header, 8 + n


def contiguous_groups(jobs: list[Job], n: int) -> list[list[Job]]:
    """Split jobs (in file order) into at most n runs of about equal bytes: one sequential range per thread."""
    jobs = sorted(jobs, key=lambda j: j[0])
    total = sum(j[1] for j in jobs)
    groups: list[list[Job]] = [[]]
    acc = 0
    for job in jobs:
        if acc >= total * len(groups) / n and len(groups) < n:
            groups.append([])
        groups[-1].append(job)
        acc += job[1]
    return [g for g in groups if g]


def pread_into(fd: int, view: memoryview, offset: int, path: Path) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise TrtbuildError(f"{path}: ended early, at byte {offset + got}", hint="rebuild the engine")
        got += n


def host_bytes(address: int, n: int) -> memoryview:
    """n writable bytes of host memory at `address`. For a CPU tensor, instead of `.numpy()`, which would
    make its storage unresizable for good: the engine frees its weights by resizing their storage to
    nothing (torch_runtime.TorchEngine.__exit__)."""
    return memoryview((ctypes.c_char * n).from_address(address)).cast("B")


def open_sequential(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    return fd


def _read_group(path: Path, jobs: list[Job]) -> None:
    """CPU: straight into the destination tensors' memory."""
    fd = open_sequential(path)
    try:
        for offset, n, flat, at in jobs:
            pread_into(fd, host_bytes(flat.data_ptr() + at, n), offset, path)
    finally:
        os.close(fd)


def _read_group_cuda(path: Path, jobs: list[Job], device: str, chunk_bytes: int) -> None:
    """GPU: read into one of two pinned buffers while the other's copy to the device runs on this
    thread's stream; a buffer is reused only after its copy has finished."""
    import torch

    fd = open_sequential(path)
    try:
        with torch.cuda.device(device):
            stream = torch.cuda.Stream()
            staging: list[Any] = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            copied: list[Any] = [None, None]
            for i, (offset, n, flat, at) in enumerate(jobs):
                k = i % 2
                if copied[k] is not None:
                    copied[k].synchronize()
                pread_into(fd, memoryview(staging[k].numpy())[:n], offset, path)
                with torch.cuda.stream(stream):
                    flat[at:at + n].copy_(staging[k][:n], non_blocking=True)
                    copied[k] = torch.cuda.Event()
                    copied[k].record(stream)
            stream.synchronize()
    finally:
        os.close(fd)


DEFAULT_LOAD_THREADS = 8  # what the H200 measurements used (RESULTS.md, H200)


def load_threads(device: str) -> int:
    """How many threads read the weights (weights_reader.py); 0 = safetensors' own loader.

    TRTBUILD_LOAD_THREADS=N sets it; unset, a CUDA engine reads with 8 threads (on the H200 the 8B
    load took 1.01 s against safetensors' 3.08 s warm, 6.75 against 8.03 s cold, and its GPU test
    found the same tensors) and a CPU one with safetensors' loader (not measured against it there)."""
    raw = os.environ.get("TRTBUILD_LOAD_THREADS", "").strip()
    if not raw:
        return DEFAULT_LOAD_THREADS if device.startswith("cuda") else 0
    if not raw.isdigit() or int(raw) > 64:
        raise InputError(f"TRTBUILD_LOAD_THREADS: expected a number of threads from 0 to 64, got {raw!r}")
    return int(raw)
