"""backends/weights_preload.py on the CPU, through a strict host-memory stand-in for the CUDA driver
(tests/doubles/host_cuda_driver.py): the tensors the file holds when the guess was right; nothing taken,
and everything freed, when it was wrong, the file changed, or the read failed."""

from __future__ import annotations

import ctypes
import gc
import inspect
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests import cuda_header
from tests.doubles.host_cuda_driver import HostDriver
from trtbuild.backends.torch import weights_preload
from trtbuild.backends.torch.backend import TorchAOTIBackend

np = pytest.importorskip("numpy")  # the stand-in hands its memory to torch through numpy's array interface


_discard = weights_preload.discard  # the real one, whatever a test patched in its place


@pytest.fixture(autouse=True)
def no_pending(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.delenv("TRTBUILD_PRELOAD", raising=False)  # the default: on
    yield
    _discard()  # a test that leaves one must not hand it to the next


def _all_freed(drv: HostDriver) -> bool:
    gc.collect()
    return not drv.device and not drv.host and not drv.streams and not drv.misuse


@pytest.mark.parametrize("threads", [1, 3])
def test_a_preload_gives_the_tensors_the_file_holds_and_frees_them_with_the_last_tensor(weights: Path,
                                                                                       threads: int) -> None:
    drv = HostDriver()
    assert weights_preload.start(weights, threads, driver=drv, chunk=4096)
    got = weights_preload.take(weights, "cpu")
    assert got is not None
    tensors = got.tensors
    want = load_file(str(weights))
    assert tensors.keys() == want.keys() and got.seconds > 0
    for name, t in want.items():
        assert tensors[name].dtype == t.dtype and tensors[name].shape == t.shape, name
        assert torch.equal(tensors[name], t), name
    assert drv.copies > 20 and len(drv.device) == 5  # one allocation per non-empty tensor, none for the empty one
    assert not drv.host and not drv.streams and not drv.misuse  # staging and streams gone once the read is done
    del tensors, got
    assert _all_freed(drv)
    assert weights_preload.take(weights, "cpu") is None  # taken once


def test_freeing_what_was_taken_frees_it_once_though_its_tensors_live_on(weights: Path) -> None:
    """The engine frees the preloaded memory at exit, while the runner may still hold its tensors (torch
    2.13's AOTInductor runner keeps its user-managed constants alive): once, not again when they go."""
    drv = HostDriver()
    assert weights_preload.start(weights, 2, driver=drv)
    got = weights_preload.take(weights, "cpu")
    assert got is not None and len(drv.device) == 5
    got.free()
    assert not drv.device
    got.free()
    del got
    assert _all_freed(drv)  # no second free of any allocation (misuse empty)


def test_a_preload_of_another_file_or_of_a_replaced_one_is_freed_and_not_taken(weights: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.safetensors"
    other.write_bytes(weights.read_bytes())
    drv = HostDriver()
    assert weights_preload.start(weights, 2, driver=drv, chunk=4096)
    assert weights_preload.take(other, "cpu") is None
    assert _all_freed(drv)

    drv = HostDriver()
    assert weights_preload.start(weights, 2, driver=drv, chunk=4096)
    weights_preload._pending.wait()  # type: ignore[union-attr]  # the read is done; then the entry is rebuilt
    os.replace(other, weights)  # same path and bytes, another file: a rebuild at the same key
    assert weights_preload.take(weights, "cpu") is None
    assert _all_freed(drv)


def test_a_preload_for_another_device_is_not_taken(weights: Path) -> None:
    drv = HostDriver()
    assert weights_preload.start(weights, 2, driver=drv)
    assert weights_preload.take(weights, "cuda:1") is None
    assert _all_freed(drv)


@pytest.mark.parametrize("damage", ["truncated", "copy fails"])
def test_a_preload_that_fails_frees_everything_and_leaves_the_read_to_the_loader(weights: Path, damage: str) -> None:
    if damage == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[:len(data) - 100])
    drv = HostDriver(fail_copy_at=3 if damage == "copy fails" else None)
    assert weights_preload.start(weights, 2, driver=drv, chunk=4096)
    assert weights_preload.take(weights, "cpu") is None
    assert _all_freed(drv)


def test_a_preload_torch_cannot_adopt_is_freed_and_not_taken(weights: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch reads `__cuda_array_interface__` with numpy's help; without it (or any other refusal) the
    loader reads the file itself."""
    drv = HostDriver()
    assert weights_preload.start(weights, 2, driver=drv)
    monkeypatch.setattr(torch, "as_tensor", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("Numpy is not available")))
    assert weights_preload.take(weights, "cpu") is None
    assert _all_freed(drv)


def test_a_build_discards_the_preload_and_a_second_start_waits_for_the_first(weights: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    drv = HostDriver()
    assert weights_preload.start(weights, 2, driver=drv)
    assert not weights_preload.start(weights, 2, driver=HostDriver())  # one at a time
    weights_preload.discard()
    assert _all_freed(drv) and weights_preload.take(weights, "cpu") is None
    assert not weights_preload.start(weights, 0, driver=HostDriver())
    assert not weights_preload.start(weights.with_name("missing.safetensors"), 2, driver=HostDriver())
    monkeypatch.setenv("TRTBUILD_PRELOAD", "0")  # turned off
    assert not weights_preload.start(weights, 2, driver=HostDriver())
    monkeypatch.delenv("TRTBUILD_PRELOAD")  # the default: on
    assert weights_preload.start(weights, 2, driver=HostDriver())
    weights_preload.discard()


def test_the_stand_in_has_exactly_the_real_drivers_methods() -> None:
    def methods(cls: type) -> set[str]:
        return {n for n, f in inspect.getmembers(cls, callable) if not n.startswith("_")}

    assert methods(HostDriver) == methods(weights_preload.Driver)


class _Lib:
    """libcuda as ctypes sees it: records each call's arguments; writes a 64-bit handle through each
    pointer argument, as the driver does."""

    HANDLE = 0x7F00_1234_5678

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> int:
            self.calls.append((name, args))
            for a in args:
                target = getattr(a, "_obj", None)  # ctypes.byref(x)
                if isinstance(target, ctypes.c_uint64 | ctypes.c_void_p):
                    target.value = self.HANDLE
            return 0
        return call


def test_the_driver_passes_handles_and_sizes_as_64_bit_values() -> None:
    """ctypes passes a bare Python int as a 32-bit C int: every pointer, handle and size must go typed,
    or an allocation above 4 GB (or a 6 GB copy) would be cut short."""
    lib = _Lib()
    drv = weights_preload.Driver(lib)
    drv.open(0)
    ptr = drv.alloc(6 << 30)
    host = drv.alloc_host(64 << 20)
    stream = drv.stream()
    drv.copy_to_device(ptr + (5 << 30), host, 64 << 20, stream)
    drv.synchronize(stream)
    drv.free(ptr)
    names = [n for n, _ in lib.calls]
    assert names[:4] == ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxSetCurrent"]
    assert ptr == host == stream == _Lib.HANDLE
    for name, args in lib.calls:
        assert not any(type(a) is int for a in args), (name, args)
    copy = dict(lib.calls)["cuMemcpyHtoDAsync_v2"]
    assert copy[0].value == _Lib.HANDLE + (5 << 30) and copy[2].value == 64 << 20
    assert dict(lib.calls)["cuMemAlloc_v2"][1].value == 6 << 30


def test_a_failing_driver_call_names_itself() -> None:
    lib = _Lib()
    lib.cuInit = lambda *args: 100  # CUDA_ERROR_NO_DEVICE
    with pytest.raises(RuntimeError, match=r"cuInit failed \(CUresult 100\)"):
        weights_preload.Driver(lib).open(0)


def _entry(tmp_path: Path, device: str) -> Path:
    entry = tmp_path / "entry"
    entry.mkdir()
    (entry / "engine.json").write_text(f'{{"device": "{device}"}}')
    (entry / "weights.safetensors").write_bytes(b"")
    return entry


@pytest.mark.parametrize(("device", "env", "expected"), [("cuda", {}, True), ("cpu", {}, False),
                                                         ("cuda", {"TRTBUILD_LOAD_THREADS": "0"}, False),
                                                         ("cuda", {"TRTBUILD_LOAD_THREADS": "lots"}, False)])
def test_the_torch_backend_preloads_a_cuda_engines_weights_with_the_loaders_threads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str, env: dict[str, str], expected: bool) -> None:
    """A CUDA entry's weights with the threads the loader would use; never a CPU entry's, nor with the
    threaded reader off (safetensors' loader then reads), nor with a malformed thread count (the loader
    reports it)."""
    started: list[tuple[Path, int]] = []
    monkeypatch.setattr(weights_preload, "start", lambda path, threads: started.append((path, threads)) or True)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    entry = _entry(tmp_path, device)
    files = TorchAOTIBackend().preload(entry, {})
    assert files == ([entry / "weights.safetensors"] if expected else [])
    assert started == ([(entry / "weights.safetensors", 8)] if expected else [])


def test_a_torch_build_frees_a_pending_preload_before_anything_else(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    """A run whose guess was another entry goes on to build: the guessed weights must not hold device
    memory through the build."""
    from trtbuild.backends import BuildJob

    class Discarded(Exception):
        pass

    def discard() -> None:
        raise Discarded

    monkeypatch.setattr(weights_preload, "discard", discard)
    job = BuildJob(recipe=None, model=None, workdir=tmp_path, tactics=None, device={"kind": "cuda"})  # type: ignore[arg-type]
    with pytest.raises(Discarded):
        TorchAOTIBackend().build(job)


def test_the_loader_is_told_how_long_it_waited_for_a_read_still_under_way(weights: Path) -> None:
    """A read that outlasts start-up (a cold disk) makes the loader wait; the load row says how long."""
    import time

    class SlowDriver(HostDriver):
        def open(self, ordinal: int) -> None:
            time.sleep(0.2)
            super().open(ordinal)

    drv = SlowDriver()
    assert weights_preload.start(weights, 2, driver=drv)
    got = weights_preload.take(weights, "cpu")
    assert got is not None and 0.15 < got.waited_s <= got.seconds + 0.05
    got.free()
    del got
    assert _all_freed(drv)


@pytest.mark.parametrize("header", cuda_header.headers(), ids=lambda p: str(p.parent))
def test_every_driver_call_matches_its_prototype_in_cuda_h(header: Path) -> None:
    """The stand-in cannot see how ctypes hands an argument to libcuda: a wrong width or a missing level of
    pointer would not fall back on a GPU, it would corrupt memory or end the process. So every call the
    preload makes is checked against cuda.h, as a C compiler reads it: the symbol a C caller links (the
    `_v2` of a versioned call), the number of arguments, each one's width and signedness, and which are
    pointers to what (a handle written through `byref` must be the pointee's type)."""
    lib = _Lib()
    drv = weights_preload.Driver(lib)
    drv.open(0)
    ptr = drv.alloc(1 << 20)
    host = drv.alloc_host(1 << 20)
    stream = drv.stream()
    drv.copy_to_device(ptr, host, 1 << 20, stream)
    drv.synchronize(stream)
    drv.destroy_stream(stream)
    drv.free_host(host)
    drv.free(ptr)
    called = {name for name, _ in lib.calls}
    assert called == set(re.findall(r'"(cu[A-Z]\w*)"', Path(weights_preload.__file__).read_text()))  # all of them
    cuda_header.Header(header).check(lib.calls, structs={})


class _SlowCopies(HostDriver):
    """Each copy takes 10 ms: a read of many small chunks outlasts whatever gives it up."""

    def copy_to_device(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        import time

        time.sleep(0.01)
        super().copy_to_device(dst, src, nbytes, stream)


def _chunks(path: Path, chunk: int) -> int:
    return sum(-(-e.nbytes // chunk) for e in weights_preload.entries(path))


def test_a_build_gives_a_read_under_way_up_rather_than_waiting_for_the_rest_of_it(weights: Path) -> None:
    drv = _SlowCopies()
    assert weights_preload.start(weights, 1, driver=drv, chunk=1024)
    assert _chunks(weights, 1024) >= 150  # 1.5 s of copies if the read went on
    weights_preload.discard()
    assert drv.copies < 20 and _all_freed(drv), drv.copies


def test_a_preload_of_another_file_is_given_up_not_read_to_the_end(weights: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.safetensors"
    other.write_bytes(weights.read_bytes())
    drv = _SlowCopies()
    assert weights_preload.start(weights, 1, driver=drv, chunk=1024)
    assert weights_preload.take(other, "cpu") is None
    assert drv.copies < 20 and _all_freed(drv), drv.copies


def test_a_process_that_exits_with_a_read_under_way_stops_it_and_frees_its_memory(weights: Path, tmp_path: Path) -> None:
    """The exit path for real, in a new process: an error before the engine is loaded (here: the script just
    ends) must not leave threads copying while the interpreter, and on a GPU the driver, shut down."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import atexit, os, sys
        sys.path[:0] = [{str(Path(__file__).resolve().parents[1])!r}]
        os.environ["TRTBUILD_PRELOAD"] = "1"
        from tests.doubles.host_cuda_driver import HostDriver  # (this test module would import weights_preload)

        class _SlowCopies(HostDriver):
            def copy_to_device(self, *args):
                __import__("time").sleep(0.01)
                super().copy_to_device(*args)

        drv = _SlowCopies()
        # registered before weights_preload's own handler, so it runs after it (atexit runs last-in first-out)
        atexit.register(lambda: print("copies", drv.copies, "left", len(drv.device) + len(drv.host) + len(drv.streams),
                                      "misuse", len(drv.misuse), flush=True))
        from trtbuild.backends.torch import weights_preload
        assert weights_preload.start(__import__("pathlib").Path({str(weights)!r}), 1, driver=drv, chunk=1024)
        import time
        while drv.copies < 2:  # the read is under way when the process ends
            time.sleep(0.005)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    words = out.stdout.split()
    assert words[0] == "copies" and int(words[1]) < 20 and words[2:] == ["left", "0", "misuse", "0"], out.stdout
