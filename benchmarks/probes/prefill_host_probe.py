"""The prefill package on a GPU, timed three ways (generate's interval, CUDA events around the call, the
host's time to issue it) at 128 / 1024 / 2048 tokens, with a kernel table of the 128-token call: where the
host's time to issue a prefill exceeds its kernels' time, the prefill is host-bound.

    python3 benchmarks/probes/prefill_host_probe.py recipes/llama-3.2-1b.yaml   (engines in /tmp/e, files in $OUT)
"""
import os, statistics, sys, time, warnings, json
sys.path.insert(0, os.getcwd())
import torch
import trtbuild

out = os.environ.get("OUT", "/tmp/out")
recipe = sys.argv[1] if len(sys.argv) > 1 else "recipes/llama-3.2-1b.yaml"
t0 = time.perf_counter()
s = trtbuild.open(recipe, engines="/tmp/e", progress=lambda m: print("  build:", m, flush=True))
with s:
    print(f"open+build {time.perf_counter() - t0:.1f} s", flush=True)
    eng = s.engine
    print("graphs", list(eng._packages), flush=True)
    g = torch.Generator().manual_seed(0)
    res = {}
    for t in (128, 1024, 2048):
        ids = torch.randint(0, 1000, (1, t), generator=g).tolist()
        for _ in range(3):
            eng.generate(ids, 2)
        pre = [eng.generate(ids, 2).prefill_s for _ in range(10)]
        tokens = torch.tensor(ids, device="cuda")
        pos, slots = torch.arange(t, device="cuda"), torch.arange(1, device="cuda")
        pkg = eng._packages["prefill"]
        for _ in range(3):
            pkg(tokens, pos, slots)
        torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(10)]
        for a, b in ev:
            a.record(); pkg(tokens, pos, slots); b.record()
        torch.cuda.synchronize()
        raw = [a.elapsed_time(b) for a, b in ev]
        host = []
        for _ in range(10):
            torch.cuda.synchronize(); h = time.perf_counter(); pkg(tokens, pos, slots); host.append(time.perf_counter() - h)
        torch.cuda.synchronize()
        res[t] = dict(generate_ms=statistics.median(pre) * 1e3, package_events_ms=statistics.median(raw),
                      package_host_launch_ms=statistics.median(host) * 1e3)
        print(t, res[t], flush=True)
        if t == 128:
            from torch.profiler import profile, ProfilerActivity
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    pkg(tokens, pos, slots)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90), flush=True)
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=90), flush=True)
    dec = [eng.generate([[1] * 128], 64) for _ in range(3)]
    print("decode b1 TPOT ms", statistics.median(dec[-1].decode_step_s) * 1e3)
    json.dump(res, open(f"{out}/diag.json", "w"))
