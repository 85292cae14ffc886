"""Who builds and runs: the device and the toolchain, as plain data for keys and manifests.

The device part goes into every key (an engine is compiled for one GPU architecture or one CPU ISA);
driver and host details are recorded in manifests only, since they do not change what is built. The
environment that changes what Inductor and Triton compile (compile_environment) goes into the torch
backend's toolchain, and so into its keys.
"""

from __future__ import annotations

import functools
import os
import platform
import socket
import sys
from typing import Any

# CPU features that change the code Inductor's C++ backend generates (vector width, AMX tiles, FMA).
_ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
              "avx512_fp16", "avx512_vnni", "amx_bf16", "amx_fp16", "amx_int8", "amx_tile",
              "asimd", "asimdhp", "sve", "sve2", "bf16", "i8mm")


@functools.cache
def cpu_isa() -> tuple[str, ...]:
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags.update(line.split(":", 1)[1].split())
    except OSError:
        pass
    return tuple(flag for flag in _ISA_FLAGS if flag in flags)


@functools.cache
def device() -> dict[str, Any]:
    """The device engines are built for here: the first CUDA GPU if there is one, else the CPU."""
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        return {"kind": "cuda", "name": torch.cuda.get_device_name(0), "compute_capability": f"{major}.{minor}"}
    return {"kind": "cpu", "arch": platform.machine(), "isa": list(cpu_isa())}


def describe(dev: dict[str, Any], toolchain: dict[str, Any]) -> str:
    """'NVIDIA H200 sm90 with torch 2.11.0' — the words the compatibility gate uses."""
    if dev.get("kind") == "cuda":
        where = f"{dev.get('name')} sm{str(dev.get('compute_capability', '?')).replace('.', '')}"
    else:
        where = f"CPU {dev.get('arch')} ({'+'.join(dev.get('isa', [])[-2:]) or 'base ISA'})"
    tools = ", ".join(f"{k} {v}" for k, v in sorted(toolchain.items()) if v)
    return f"{where} with {tools}" if tools else where


@functools.cache
def host() -> dict[str, Any]:
    """Recorded in manifests, never keyed: who built it and with what driver."""
    info: dict[str, Any] = {"hostname": socket.gethostname(), "python": sys.version.split()[0],
                            "platform": platform.platform()}
    try:
        import torch

        if torch.cuda.is_available():
            info["cuda_driver"] = _driver_version()
    except Exception:  # a manifest note only; never fail a build for it
        pass
    return info


def _driver_version() -> str | None:
    try:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        lib.cuDriverGetVersion(ctypes.byref(version))
        return f"{version.value // 1000}.{(version.value % 1000) // 10}"
    except OSError:
        return None


# Environment variables that only say where caches and logs go, or how many threads compile: they never
# change a compiled graph, and the build sets the cache folders itself (inductor.inductor_caches).
_ENV_NEUTRAL_SUFFIXES = ("_DIR", "_HOME", "_PATH", "_LOGPATH", "_OUTPUT")
_ENV_NEUTRAL = {"TORCHINDUCTOR_COMPILE_THREADS", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE",
                "TORCHINDUCTOR_FORCE_DISABLE_CACHES", "TRITON_PRINT_AUTOTUNING", "TRITON_INTERPRET"}


def compile_environment() -> dict[str, str]:
    """The environment variables that may change a compiled graph: Inductor's (TORCHINDUCTOR_*: it reads
    scores of its options from them, max-autotune and fast math among them), Triton's (TRITON_*) and
    trtbuild's own TRTBUILD_INDUCTOR_PDL, less those that only place caches and logs. Unknown names count:
    a needless rebuild costs minutes, a stale engine is wrong. (TRITON_INTERPRET runs kernels in Python
    and never reaches a compiled graph.)"""
    return {k: v for k, v in os.environ.items()
            if (k.startswith(("TORCHINDUCTOR_", "TRITON_")) or k == "TRTBUILD_INDUCTOR_PDL")
            and k not in _ENV_NEUTRAL and not k.endswith(_ENV_NEUTRAL_SUFFIXES)}
