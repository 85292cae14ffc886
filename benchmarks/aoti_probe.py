"""Place the AOTInductor load crash on a device image: compile tiny packages, then load each in a
fresh process in every way torch offers, and print one line per way (rc, last words).

    python3 benchmarks/aoti_probe.py [--dir /tmp/aoti-probe]

Diagnostic only (benchmarks/AOTI_LOAD_NOTES.md); trtbuild does not import it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

COMPILE = r"""
import sys, torch
d = sys.argv[1]
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        self.register_buffer("cache", torch.zeros(4, 64))
    def forward(self, x, i):
        self.cache.index_copy_(0, i, x)
        return self.lin(self.cache).sum(0, keepdim=True)
m = M().cuda()
args = (torch.randn(1, 64, device="cuda"), torch.tensor([1], device="cuda"))
ep = torch.export.export(m, args)
torch._inductor.aoti_compile_and_package(ep, package_path=f"{d}/default.pt2")
torch._inductor.aoti_compile_and_package(ep, package_path=f"{d}/external.pt2",
    inductor_configs={"aot_inductor.package_constants_in_so": False, "always_keep_tensor_constants": True})
torch.save({k: v.cpu() for k, v in m.state_dict().items()}, f"{d}/state.pt")
print("compiled", flush=True)
"""

# A C-level backtrace on SIGSEGV (faulthandler shows only Python frames).
BACKTRACE = r"""
import ctypes, signal
_libc = ctypes.CDLL(None)
_buf = (ctypes.c_void_p * 64)()
_H = ctypes.CFUNCTYPE(None, ctypes.c_int)
def _on_segv(sig):
    n = _libc.backtrace(_buf, 64)
    _libc.backtrace_symbols_fd(_buf, n, 2)
    _libc._exit(139)
_handler = _H(_on_segv)
_libc.signal(signal.SIGSEGV, _handler)
"""

WAYS: dict[str, str] = {
    "zip listing (python zipfile)": "import zipfile; print(len(zipfile.ZipFile(P).namelist()))",
    "PyTorchFileReader records": "import torch; print(len(torch._C.PyTorchFileReader(P).get_all_records()))",
    "load_metadata_from_package": "import torch; print(torch._C._aoti.AOTIModelPackageLoader.load_metadata_from_package(P, 'model'))",
    "aoti_load_package": "import torch; m = torch._inductor.aoti_load_package(P); print(m(*ARGS).shape)",
    "aoti_load_package single-threaded": "import torch; m = torch._inductor.aoti_load_package(P, run_single_threaded=True); print(m(*ARGS).shape)",
    "aoti_load_package from /dev/shm": "import torch, shutil; shutil.copy(P, '/dev/shm/p.pt2'); m = torch._inductor.aoti_load_package('/dev/shm/p.pt2'); print(m(*ARGS).shape)",
    "dlopen the .so": "import ctypes; ctypes.CDLL(SO); print('dlopen ok')",
    "runner(4) no cuda init": "import torch; r = torch._C._aoti.AOTIModelContainerRunnerCuda(SO, 1, 'cuda', CUBIN); print(r.get_constant_names_to_original_fqns())",
    "runner(4) after cuda init": "import torch; torch.zeros(1, device='cuda'); r = torch._C._aoti.AOTIModelContainerRunnerCuda(SO, 1, 'cuda', CUBIN); print(r.get_constant_names_to_original_fqns())",
    "runner(5) after cuda init": "import torch; torch.zeros(1, device='cuda'); r = torch._C._aoti.AOTIModelContainerRunnerCuda(SO, 1, 'cuda', CUBIN, True); print(r.get_constant_names_to_original_fqns())",
    "runner(4) cuda:0 + run": ("import torch; torch.zeros(1, device='cuda'); r = torch._C._aoti.AOTIModelContainerRunnerCuda(SO, 1, 'cuda:0', CUBIN)\n"
                               "n = dict(r.get_constant_names_to_original_fqns()); sd = {k: v.cuda() for k, v in torch.load(STATE).items()}\n"
                               "r.update_constant_buffer({k: sd[f] for k, f in n.items()}, False, True, True) if EXTERNAL else None\n"
                               "print(r.run(list(ARGS))[0].shape)"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/aoti-probe")
    ap.add_argument("--timeout", type=float, default=90)
    a = ap.parse_args()
    d = Path(a.dir)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    c = subprocess.run([sys.executable, "-c", COMPILE, str(d)], capture_output=True, text=True, timeout=600)
    print("compile rc", c.returncode, c.stdout.strip()[-200:], c.stderr.strip()[-1500:] if c.returncode else "", flush=True)
    results = []
    for pkg in ("default", "external"):
        p = d / f"{pkg}.pt2"
        out = d / pkg
        with zipfile.ZipFile(p) as z:
            names = z.namelist()
            z.extractall(out)
        sos = [n for n in names if n.endswith(".so")]
        print(pkg, "entries:", [n for n in names if not n.endswith(".cubin")][:30], f"+{sum(n.endswith('.cubin') for n in names)} cubins", flush=True)
        so = out / sos[0] if sos else Path("/nonexistent")
        for way, code in WAYS.items():
            prelude = (f"P={str(p)!r}; SO={str(so)!r}; CUBIN={str(so.parent)!r}; STATE={str(d / 'state.pt')!r}; EXTERNAL={pkg == 'external'}\n"
                       "import torch\nARGS = (torch.randn(1, 64, device='cuda'), torch.tensor([1], device='cuda')) if 'ARGS' in " + repr(code) + " else ()\n")
            try:
                r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", BACKTRACE + prelude + code],
                                   capture_output=True, text=True, timeout=a.timeout)
                rc, tail = r.returncode, (r.stdout + r.stderr).strip()
            except subprocess.TimeoutExpired:
                rc, tail = "timeout", ""
            results.append({"package": pkg, "way": way, "rc": rc, "output": tail[-3000:]})
            print(f"{pkg:9} {way:38} rc={rc}  {tail.splitlines()[-1][:150] if tail else ''}", flush=True)
    for r in results:
        if r["rc"] != 0:
            print(f"--- {r['package']} / {r['way']} (rc {r['rc']})\n{r['output'][-2500:]}")
    out = Path(os.environ.get("OUT", d))
    (out / "aoti_probe.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
