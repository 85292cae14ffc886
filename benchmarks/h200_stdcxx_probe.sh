#!/usr/bin/env bash
# Where the AOTInductor load crash comes from (std::regex in parse_device_str, inside the compiled
# graph), and which of two fixes holds: preloading the compiler's libstdc++, or a graph that links
# its own. Then the issue-2 flow with the fix that held. Writes logs under $OUT.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
{
echo "== toolchain"; which g++ gcc c++; g++ --version | head -1; echo "CXX=${CXX:-}"
python3 -c "import torch._inductor.config as c; print('inductor cxx', c.cpp.cxx)"
echo "compiler's libstdc++: $(g++ -print-file-name=libstdc++.so.6) -> $(readlink -f "$(g++ -print-file-name=libstdc++.so.6)")"
python3 -c "import torch; print([l.split()[-1] for l in open('/proc/self/maps') if 'stdc++' in l][:1])"
for f in $(python3 -c "import torch; print(' '.join(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'stdc++' in l})))") "$(readlink -f "$(g++ -print-file-name=libstdc++.so.6)")"; do
  echo "$f newest: $(strings "$f" | grep -o '^GLIBCXX_3\.4\.[0-9]*' | sort -t. -k3 -n | tail -1)"; done
} 2>&1 | tee "$OUT/toolchain.log"
cat > /tmp/tiny.py <<'PY'
import sys, torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.lin = torch.nn.Linear(64, 64)
    def forward(self, x):
        return self.lin(x)
ep = torch.export.export(M().cuda(), (torch.randn(2, 64, device="cuda"),))
cfg = {"cpp.cxx": (None, sys.argv[2])} if len(sys.argv) > 2 else {}
torch._inductor.aoti_compile_and_package(ep, package_path=sys.argv[1], inductor_configs=cfg)
PY
LOAD='import sys, torch; m = torch._inductor.aoti_load_package(sys.argv[1]); print("LOADED", m(torch.randn(2, 64, device="cuda")).shape)'
PRE=$(readlink -f "$(g++ -print-file-name=libstdc++.so.6)")
FIX=none
timeout 150 python3 /tmp/tiny.py /tmp/plain.pt2 && {
  echo "== plain load"; timeout 60 python3 -c "$LOAD" /tmp/plain.pt2 2>&1 | tail -2
  echo "== plain load, LD_PRELOAD=$PRE"; timeout 60 env LD_PRELOAD="$PRE" python3 -c "$LOAD" /tmp/plain.pt2 2>&1 | tail -2 | tee /tmp/pre.log
  grep -q LOADED /tmp/pre.log && FIX=preload; } 2>&1 | tee -a "$OUT/probe.log"
grep -q LOADED /tmp/pre.log 2>/dev/null && FIX=preload
if [ "$FIX" = none ]; then
  timeout 150 python3 /tmp/tiny.py /tmp/static.pt2 "$PWD/trtbuild/backends/cxx_static.sh" 2>&1 | tail -3
  echo "== static-libstdc++ load"; timeout 60 python3 -c "$LOAD" /tmp/static.pt2 2>&1 | tail -2 | tee /tmp/static.log
  grep -q LOADED /tmp/static.log && FIX=static
fi 2>&1 | tee -a "$OUT/probe.log"
grep -q LOADED /tmp/static.log 2>/dev/null && FIX=static
echo "FIX=$FIX" | tee -a "$OUT/probe.log"
case $FIX in
  preload) export LD_PRELOAD="$PRE";;
  static) export TRTBUILD_AOTI_STATIC_LIBSTDCXX=1;;
  none) exit 1;;
esac
bash benchmarks/h200_e2e.sh "${1:-recipes/llama-3.2-1b.yaml}" > "$OUT/e2e.log" 2>&1
grep -v "^  File" "$OUT/e2e.log" | tail -45
