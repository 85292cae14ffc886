#!/usr/bin/env bash
# The greedy path before and after a change, in one device call: benchmarks/bench.py's engine variant
# (decode steps at each batch bucket, prefills) on a tree extracted from an earlier commit, then on this
# checkout, each with its own store, both seeded with the same tactic cache so that neither times the
# decode matmuls again. Prints each side's table; bench.json of each under $OUT/before and $OUT/after.
#
#   mkdir -p .device-tactics && git archive -o .device-tactics/before.tar <commit> trtbuild benchmarks recipes
#   SEED_TACTICS=benchmarks/results/2026-12-06-h100-1b bash benchmarks/greedy_ab.sh recipes/llama-3.2-1b.yaml
# (.device-tactics/ is ignored by git: carry it to the device.)
#
# A seed's timings are its device's: on another GPU the selection runs again (about 60 s at 1B).
# A dry run on the CPU: PYTHON=$PWD/.venv/bin/python BENCH_ARGS=--quick OUT=/tmp/ab bash benchmarks/greedy_ab.sh recipes/tiny-llama.yaml
set -u
OUT=${OUT:-/tmp/out}; RECIPE=${1:-recipes/llama-3.2-1b.yaml}; SIDE_S=${SIDE_S:-270}
mkdir -p /tmp/ab-before "$OUT"
tar -xf "${BEFORE_TAR:-.device-tactics/before.tar}" -C /tmp/ab-before
HERE=$PWD
for side in before after; do
  tree=$([ "$side" = before ] && echo /tmp/ab-before || echo "$HERE")
  mkdir -p "/tmp/ab-$side-engines"
  if [ -n "${SEED_TACTICS:-}" ] && ls "$HERE/$SEED_TACTICS"/tactics.tar.gz* > /dev/null 2>&1; then
    cat "$HERE/$SEED_TACTICS"/tactics.tar.gz* | tar -xz -C "/tmp/ab-$side-engines"
  fi
  (cd "$tree" && PYTHONPATH="$tree" PYTHONUNBUFFERED=1 timeout -k 10 "$SIDE_S" "${PYTHON:-python3}" benchmarks/bench.py "$RECIPE" \
     --engines "/tmp/ab-$side-engines" --out "$OUT/$side" --sections variants --variants engine ${BENCH_ARGS:-} > "$OUT/$side.log" 2>&1)
  echo "== $side ($tree, rc $?)"
  tail -30 "$OUT/$side.log"
done
