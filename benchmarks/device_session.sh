#!/usr/bin/env bash
# One device call (at most 10 minutes): where libstdc++'s symbols resolve, then the benchmark of one
# recipe (build / restart / variants), a retry under LD_PRELOAD if the engine did not load in a new
# process, and the CLI report of a cache-hit run. At most 8 files under $OUT.
#
#   [PROFILE=0 | PROFILE=1 [PROFILE_PDL=1]] [PROBE="--graph decode --batch 8 --options plain,autotune"] [RESERVE=100] [GPU_TESTS=1 [GPU_TESTS_K=expr]] [SAVE_TACTICS=1] [SEED_TACTICS=DIR] [SAVE_PEER_CACHE=1] [SEED_PEER_CACHE=DIR] [LOAD_THREADS=8] [PRELOAD_THREADS=2,4] [RESTART_REPEATS=3] [BUDGET=545] bash benchmarks/device_session.sh recipes/llama-3.2-1b.yaml engine,eager [build,restart,variants]
#
# Seeds kept in git (a build that finds its timings and graphs there skips most of its selection and compile):
#   SEED_TACTICS=benchmarks/results/2026-12-06-h100-gate   (recipes/llama-3.2-1b.yaml, timed on an H100 at 7e3acb6)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RECIPE=${1:-recipes/llama-3.2-1b.yaml}; VARIANTS=${2:-engine,eager}; SECTIONS=${3:-build,restart,variants}
BUDGET=${BUDGET:-545}  # seconds this script may use in all; RESERVE of them are kept from the benchmark
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

# -- 1. where libstdc++'s locale symbols resolve: torch imported alone, and after trtbuild -------------
DIAG='from trtbuild.backends import cxx; print(sorted(set(cxx.shadowing_libraries().values())) or "libstdc++ first")'
log "symbols, torch imported first: $(python3 -c "import torch, sys; sys.path.insert(0, '.'); $DIAG" 2>&1 | tail -1)"
log "symbols, trtbuild imported first: $(python3 -c "import trtbuild, torch; $DIAG" 2>&1 | tail -1)"
log "start-up parts: $(python3 -c "
import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter()
n = torch.cuda.get_device_name(0); t2 = time.perf_counter()
torch.zeros(1, device='cuda'); torch.cuda.synchronize(); t3 = time.perf_counter()
from trtbuild.backends.torch.backend import TorchAOTIBackend; t4 = time.perf_counter(); TorchAOTIBackend().toolchain(); t5 = time.perf_counter()
print(f'import torch {t1-t0:.2f} s, device name (CUDA init) {t2-t1:.2f} s, first tensor (context) {t3-t2:.2f} s, import backend {t4-t3:.2f} s, toolchain {t5-t4:.2f} s')" 2>&1 | tail -1)"
FIX=none

# -- 2. the benchmark of one recipe ------------------------------------------------------------------
# SEED_TACTICS=DIR: compiled graphs an earlier call saved (DIR/tactics.tar.gz, carried), so this call's
# build copies them instead of compiling (the benchmark's build record lists the graphs it reused).
if [ -n "${SEED_TACTICS:-}" ] && ls "$SEED_TACTICS"/tactics.tar.gz* > /dev/null 2>&1; then
  mkdir -p /tmp/bench-engines && cat "$SEED_TACTICS"/tactics.tar.gz* | tar -xz -C /tmp/bench-engines
  log "tactic cache seeded from $SEED_TACTICS: $(ls /tmp/bench-engines/tactics/torch/*/graphs | wc -l) compiled graphs, $(ls /tmp/bench-engines/tactics/torch/*/decode_matmul 2>/dev/null | wc -l) decode-matmul timings"
fi
# The peers' torch.compile caches (Inductor's compiled graphs and GEMM autotuning, Triton's kernels) in a
# folder of their own, which SAVE_PEER_CACHE=1 returns as $OUT/peer-cache.tar.gz.part-* and SEED_PEER_CACHE=DIR
# (those parts, carried) restores: torch.compile(max-autotune) of the 8B decode graphs took more than the
# benchmark's whole call (2026-12-04, H200), and a cache hit only changes how long the peer takes to
# compile, not what it runs. The engine's own build points Inductor at its tactic cache while it builds.
export TORCHINDUCTOR_CACHE_DIR=/tmp/peer-cache/inductor TRITON_CACHE_DIR=/tmp/peer-cache/triton
mkdir -p /tmp/peer-cache
if [ -n "${SEED_PEER_CACHE:-}" ] && ls "$SEED_PEER_CACHE"/peer-cache.tar.gz.part-* > /dev/null 2>&1; then
  cat "$SEED_PEER_CACHE"/peer-cache.tar.gz.part-* | tar -xz -C /tmp/peer-cache
  log "peer caches seeded from $SEED_PEER_CACHE: $(du -sh /tmp/peer-cache | cut -f1)"
fi
log "bench $RECIPE sections=$SECTIONS variants=$VARIANTS (time left $(left) s)"
# TERM at the limit (the benchmark then prints the table of what it measured), KILL 15 s later
timeout -k 15 $(( $(left) - ${RESERVE:-45} - 15 )) python3 benchmarks/bench.py "$RECIPE" --engines /tmp/bench-engines --out "$OUT" \
  --sections "$SECTIONS" --variants "$VARIANTS" --load-threads "${LOAD_THREADS:-8}" --preload-threads "${PRELOAD_THREADS:-}" --restart-repeats "${RESTART_REPEATS:-1}" > "$OUT/bench.log" 2>&1; log "bench rc $?"
# A benchmark cut off by its time limit leaves its child processes running (one was still loading 15 GB
# when the CLI run below started, on 2026-12-03): end them before timing anything else.
pkill -f "bench.py --child" 2>/dev/null; sleep 1
grep -v "^  File\|^DEBUG" "$OUT/bench.log" | tail -40

# SAVE_TACTICS=1: the compiled graphs (not Inductor's caches) back as $OUT/tactics.tar.gz.part-*, in
# pieces under the 16 MiB a returned file may have, to seed later calls (cat the parts | tar -xz).
if [ "${SAVE_TACTICS:-0}" = 1 ] && [ -d /tmp/bench-engines/tactics ]; then
  (cd /tmp/bench-engines && tar -cz tactics/torch/*/graphs $(ls -d tactics/torch/*/decode_matmul 2>/dev/null) | split -b 15m - "$OUT/tactics.tar.gz.part-")
  log "tactics saved: $(du -ch "$OUT"/tactics.tar.gz.part-* | tail -1 | cut -f1) in $(ls "$OUT"/tactics.tar.gz.part-* | wc -l) part(s)"
fi

if [ "${SAVE_PEER_CACHE:-0}" = 1 ] && [ -d /tmp/peer-cache/inductor ]; then
  # Inductor's folder only (compiled graphs' code, GEMM autotuning results): Triton's holds a binary of every
  # autotuning candidate, too large to come back; on a cache hit the chosen kernels compile again from the
  # code, without autotuning.
  (cd /tmp/peer-cache && tar -cz inductor | split -b 15m - "$OUT/peer-cache.tar.gz.part-")
  log "peer caches saved: $(du -ch "$OUT"/peer-cache.tar.gz.part-* | tail -1 | cut -f1) in $(ls "$OUT"/peer-cache.tar.gz.part-* | wc -l) part(s) (at most 8 files come back from a call)"
fi

# -- the GPU tests (GPU_TESTS=1), right after the benchmark so a long one cannot crowd them out: pytest
#    is not on the device, so its wheels travel in .device-wheels (`pip download pytest -d .device-wheels`
#    here, then carry [".device-wheels"]) -------------------------------------------------------------
if [ "${GPU_TESTS:-0}" = 1 ] && [ "$(left)" -gt 60 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .device-wheels/*.whl \
    > /dev/null 2>&1 && export PYTHONPATH=$PYTHONPATH:/tmp/site
  log "gpu tests"
  # GPU_TESTS_K: a pytest -k expression, to run only the tests a change needs when time is short
  # SIGINT, not SIGTERM, at the limit: pytest then still prints its failures (2026-12-04: a TERM lost them);
  # --log-level=INFO: a failure's captured log without torch's DEBUG trace (1,100 lines of it on 2026-12-04)
  # -v: each test's name and outcome as it ends; a run cut off at the limit printed only "..." and no
  # summary (2026-12-05, the INT notwithstanding), so which tests passed had to be read from the order
  timeout -s INT $(( $(left) - 30 )) python3 -m pytest -v -rfE --tb=short --log-level=INFO -m gpu tests/test_gpu.py -p no:cacheprovider \
    ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} \
    > "$OUT/gpu_tests.txt" 2>&1
  log "rc $?"; tail -15 "$OUT/gpu_tests.txt"
fi

# -- 3. if the engine did not load in a new process, once more with LD_PRELOAD (the known workaround) ----
if python3 -c "import json,sys; r=list(json.load(open('$OUT/bench.json'))['recipes'].values())[0]; sys.exit(0 if 'error' in r['restart']['cold']['engine'] else 1)" 2>/dev/null \
   && [ "$(left)" -gt 90 ]; then
  FIX=preload; export LD_PRELOAD=$(readlink -f "$(g++ -print-file-name=libstdc++.so.6)"); mkdir -p "$OUT/preload"
  log "engine failed in a new process; again with LD_PRELOAD=$LD_PRELOAD"
  timeout $(( $(left) - 10 )) python3 benchmarks/bench.py "$RECIPE" --engines /tmp/bench-engines --out "$OUT/preload" \
    --sections restart,variants --variants engine > "$OUT/preload/bench.log" 2>&1; log "rc $?"
  tail -12 "$OUT/preload/bench.log"
fi

# -- 4. where a step's time goes, call site by call site (`trtbuild profile`; PROFILE=0 skips), and an A/B of
#       Inductor options for one graph
#       (PROBE = benchmarks/probes/probe.py's arguments, e.g. "--graph prefill --options plain,autotune
#       --example-lens 2,2048"; empty skips) --------------------------------------------------------------
if [ "${PROFILE:-1}" = 1 ] && [ "$(left)" -gt 60 ]; then
  # Serialized by default (PROFILE_PDL=0): under PDL a kernel's duration includes the time it waited for
  # its predecessor, so only a serialized capture gives each kernel's own cost (2026-12-04, H200)
  log "profile (TRTBUILD_PDL=${PROFILE_PDL:-0})"
  TRTBUILD_PDL=${PROFILE_PDL:-0} timeout $(( $(left) - 40 )) python3 -m trtbuild profile "$RECIPE" --engines /tmp/bench-engines \
    --plot "$OUT/profile.png" > "$OUT/profile.txt" 2>&1; log "rc $?"; grep -v "^USDT" "$OUT/profile.txt" | head -60
fi
if [ -n "${PROBE:-}" ] && [ "$(left)" -gt 90 ]; then
  log "probe ${PROBE}"
  # shellcheck disable=SC2086  # PROBE is a list of arguments
  timeout $(( $(left) - 30 )) python3 benchmarks/probes/probe.py "$RECIPE" $PROBE \
    --out "$OUT/probe.json" > "$OUT/probe.txt" 2>&1; log "rc $?"; grep -v "^USDT\|Warning\|return cls" "$OUT/probe.txt" | head -80
fi

# -- 5. the CLI report of a cache-hit run, if time is left ---------------------------------------------
if [ "$(left)" -gt 25 ]; then
  log "cli run (cache hit)"
  timeout $(( $(left) - 8 )) python3 -m trtbuild run "$RECIPE" --engines /tmp/bench-engines --no-build --iterations 3 \
    > "$OUT/run_cli.txt" 2>&1; log "rc $?"; tail -22 "$OUT/run_cli.txt"
fi
log "done; FIX=$FIX"
