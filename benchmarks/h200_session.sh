#!/usr/bin/env bash
# One device call (at most 10 minutes): place the AOTInductor load crash and pick the fix that holds,
# then the benchmark of one recipe (build cold / rebuild with tactics kept / restart / variants),
# the CLI report of a cache-hit run, and the GPU tests if time is left. At most 8 files under $OUT.
#
#   bash benchmarks/h200_session.sh recipes/llama-3.2-1b.yaml engine,eager [build,restart,variants]
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RECIPE=${1:-recipes/llama-3.2-1b.yaml}; VARIANTS=${2:-engine,eager}; SECTIONS=${3:-build,restart,variants}
BUDGET=${BUDGET:-575}  # seconds this script may use in all
left() { echo $((BUDGET - SECONDS)); }
LOG="$OUT/session.log"
log() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$LOG"; }
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, torch, triton; print(sys.executable, torch.__version__, torch.version.cuda, triton.__version__)"
  which g++; g++ --version | head -1; echo "CXX=${CXX:-}"; uname -r
  echo "compiler libstdc++: $(readlink -f "$(g++ -print-file-name=libstdc++.so.6)")"
  python3 -c "import torch; print('process libstdc++:', sorted({l.split()[-1] for l in open('/proc/self/maps') if 'stdc++' in l}))"
} 2>&1 | tee -a "$LOG"

# -- 1. the load crash: a tiny engine built for CUDA and run in a new process -------------------------
# Foreground: the product as shipped (compiler chosen by trtbuild/backends/cxx.py). Background, for the
# record: the graph linked with a static libstdc++ (the fallback), and $CXX pinned (expected to crash).
python3 - <<'PYY'
import yaml
d = yaml.safe_load(open("recipes/tiny-llama.yaml"))
d.update(name="probe", precision="bf16", tactics={"level": "none"})
d["shapes"].update(max_batch_size=1, batch_buckets=[1])
d["run"].update(batch_size=1)
yaml.safe_dump(d, open("/tmp/probe.yaml", "w"))
PYY
probe() {  # $1 = store, rest = env assignments: build, then run in a new process
  timeout 200 env TRTBUILD_ENGINES="$1" "${@:2}" python3 -m trtbuild build /tmp/probe.yaml 2>&1 | grep -v Warning | tail -4
  timeout 90 env TRTBUILD_ENGINES="$1" "${@:2}" python3 -X faulthandler -m trtbuild run /tmp/probe.yaml --no-build \
    --output-len 8 --iterations 2 > "/tmp/run-$(basename "$1").txt" 2>&1
  local rc=$?; tail -3 "/tmp/run-$(basename "$1").txt"; echo "probe $1 ${*:2}: run rc $rc"; return $rc
}
( probe /tmp/probe-static TRTBUILD_CXX=static; probe /tmp/probe-cxxenv TRTBUILD_CXX="${CXX:-g++}" ) > "$OUT/probe_bg.log" 2>&1 &
BG=$!
log "probe: the product's own compiler choice"
python3 -c "from trtbuild.backends import cxx; print(cxx.candidates(), cxx.choose())" 2>&1 | tee -a "$LOG"
if probe /tmp/probe-plain >> "$LOG" 2>&1; then FIX=none; else
  log "the product's choice crashed; C backtrace, then LD_PRELOAD for the rest of this call"
  timeout 90 env TRTBUILD_ENGINES=/tmp/probe-plain cuda-gdb -batch -ex run -ex bt --args python3 -m trtbuild run \
    /tmp/probe.yaml --no-build --output-len 8 > "$OUT/backtrace.txt" 2>&1
  grep -E "^#|signal" "$OUT/backtrace.txt" | cut -c1-200 | head -12 | tee -a "$LOG"
  FIX=preload; export LD_PRELOAD=$(readlink -f "$(g++ -print-file-name=libstdc++.so.6)")
fi
log "FIX=$FIX"

# -- 2. the benchmark of one recipe ------------------------------------------------------------------
log "bench $RECIPE sections=$SECTIONS variants=$VARIANTS (time left $(left) s)"
timeout $(( $(left) - 30 )) python3 benchmarks/bench.py "$RECIPE" --engines /tmp/bench-engines --out "$OUT" \
  --sections "$SECTIONS" --variants "$VARIANTS" > "$OUT/bench.log" 2>&1; log "bench rc $?"
grep -v "^  File\|^DEBUG" "$OUT/bench.log" | tail -40

# -- 3. the CLI report of a cache-hit run, then the GPU tests while time is left -------------------------
if [ "$(left)" -gt 25 ]; then
  log "cli run (cache hit)"
  timeout $(( $(left) - 8 )) python3 -m trtbuild run "$RECIPE" --engines /tmp/bench-engines --no-build --iterations 3 \
    > "$OUT/run_cli.txt" 2>&1; log "rc $?"; tail -30 "$OUT/run_cli.txt"
fi
if [ "$(left)" -gt 150 ]; then
  log "gpu tests"
  timeout $(( $(left) - 10 )) python3 -m pytest tests/test_gpu.py -q -x --tb=short -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  log "rc $?"; tail -15 "$OUT/gpu_tests.log"
fi
kill $BG 2>/dev/null; grep "^probe" "$OUT/probe_bg.log" | tee -a "$LOG"
log "done; FIX=$FIX"
