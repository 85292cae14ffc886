#!/usr/bin/env bash
# The issue-2 flow on the lent H200, in one call: cold build, rebuild with the tactic cache kept,
# cache hit + run in new processes. Writes JSON and logs under $OUT.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TRTBUILD_ENGINES=/tmp/trtbuild-engines
RECIPE=${1:-recipes/llama-3.2-1b.yaml}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/steps.log"; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__)" | tee -a "$OUT/gpu.txt"
log "cold build"
/usr/bin/time -v timeout 420 python3 -m trtbuild build "$RECIPE" --json > "$OUT/build_cold.json" 2> "$OUT/build_cold.err"; log "rc $?"
tail -3 "$OUT/build_cold.err"
name=$(python3 -c "import yaml,sys; print(yaml.safe_load(open('$RECIPE'))['name'])")
python3 -m trtbuild cache rm "$name" | tee -a "$OUT/steps.log"
log "rebuild with tactic cache"
timeout 300 python3 -m trtbuild build "$RECIPE" --json > "$OUT/build_warm.json" 2> "$OUT/build_warm.err"; log "rc $?"
tail -3 "$OUT/build_warm.err"
log "cache hit + run"
timeout 120 python3 -m trtbuild run "$RECIPE" --json --iterations 5 > "$OUT/run_b1.json" 2> "$OUT/run_b1.err"; log "rc $?"
timeout 120 python3 -m trtbuild run "$RECIPE" --json --iterations 3 --batch-size 8 > "$OUT/run_b8.json" 2> "$OUT/run_b8.err"; log "rc $?"
python3 -m trtbuild run "$RECIPE" --iterations 3 2>&1 | tail -20
python3 -m trtbuild cache ls
python3 - <<'PY'
import json, os
out = os.environ["OUT"]
for f in ("build_cold", "build_warm", "run_b1", "run_b8"):
    try:
        d = json.loads(open(f"{out}/{f}.json").read().strip().splitlines()[-1])
    except Exception as e:
        print(f, "missing", e); continue
    if "build_s" in d and "phases" in d and "ttft_ms" not in d:
        print(f, "hit" if d["engine"]["cache_hit"] else "miss", f"build {d['build_s']:.1f}s", {k: round(v, 1) for k, v in d["phases"].items()})
    else:
        print(f, "hit" if d["engine"]["cache_hit"] else "miss", {k: round(v, 4) for k, v in d["phases"].items()},
              "ttft_ms", round(d["ttft_ms"], 3), "tpot", {k: round(v, 4) for k, v in d["tpot_ms"].items()},
              "GB/s", round(d["roofline"].get("decode_bandwidth_Bps", 0) / 1e9, 1))
PY
log "gpu tests"
timeout 240 python3 -m pytest tests/test_gpu.py -q -x --tb=short -p no:logging 2>&1 | grep -v "^DEBUG" | tail -40 | tee "$OUT/gpu_tests.log"
