#!/usr/bin/env bash
# Issue 33's next call on a GPU host, in the order of what it settles, within DEADLINE seconds
# (default 540: one device command may run 600). Each step gets what time is left and writes
# into OUT_DIR as it goes, so a call cut short keeps the steps done.
#
#   scripts/device_next.sh OUT_DIR
#
# The seventeenth session's calls (docs/design/scaling.md, "The landed mover measured") found
# every row at 8 and 15 workers at 1.0x torch or more, and the JPEG row at 15 workers at 89.6%
# of the roof (paired by round, 7 rounds; the issue asks 90%), 92.2% on 240-batch epochs, at
# d7b8f5b; since then (009309c) a worker stacks the jpeg rows' permuted images straight into its
# slab (4 ms of a worker's 430 ms a batch on the dev machine, not measured there). So:
#
# 1. bench/: the scaling mode at 15 and 8 workers, jpeg and uint8, no thread workers, ferry
#    with move_workers=False beside ferry and torch, 9 rounds (gpu_host_bench.sh with
#    WORKERS=15,8 UNMOVED=1 NO_THREADS=1 REPS=9): every row at 1.0x torch or more, and jpeg at
#    15 at 90% of the roof, are the issue's targets.
# 2. long/: jpeg at 15 workers on 240-batch epochs, balance_workers=True beside (BPW=16
#    BALANCED=1, 3 rounds).
# 3. cpu_speeds.txt, with the time left: scripts/cpu_speeds.py (the CPU map of that machine, to
#    read the rows above by).
#
# Environment: PYTHON (default python3), DEADLINE, FEED (gpu, the default, or cpu: a smoke
# test without CUDA), QUICK=1 (tiny rows: a smoke test of the script itself, figures
# meaningless). docs/design/scaling.md ("What stays unverified") says how to read the output.
set -u

out="${1:-${OUT:-device-next-$(date -u +%Y%m%dT%H%M%SZ)}}"
python="${PYTHON:-python3}"
deadline=$(($(date +%s) + ${DEADLINE:-540}))
repo="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$out" || exit 2
out="$(cd "$out" && pwd)"
cd "$repo" || exit 2
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"

if [ -n "${QUICK:-}" ]; then
  bench=(QUICK=1 WORKERS=2 REPS=1 LIMIT=60)
  long=(QUICK=1 WORKERS=2 REPS=1 LIMIT=60)
else
  bench=(WORKERS=15,8 REPS=9 LIMIT=270 BUDGET=220)
  long=(WORKERS=15 REPS=3 LIMIT=180 BUDGET=120)
fi

left() { echo $((deadline - $(date +%s))); }
# One run of gpu_host_bench.sh: NAME, the least time it needs (s), then its settings; left out
# when short of that (the script bounds itself with its LIMIT).
bench() {
  local name=$1 least=$2
  shift 2
  if [ "$(left)" -lt "$least" ]; then
    echo "device_next: $name left out ($(left) s left)" | tee -a "$out/steps.txt"
    return
  fi
  env "$@" NO_THREADS=1 FEED="${FEED:-gpu}" PYTHON="$python" \
    scripts/gpu_host_bench.sh "$out/$name" >"$out/$name.log" 2>&1
  echo "device_next: $name exit $?, $(left) s left" | tee -a "$out/steps.txt"
}
bench bench 60 "${bench[@]}" UNMOVED=1
bench long 120 "${long[@]}" ONLY=jpeg BPW=16 BALANCED=1 UNMOVED=1
if [ "$(left)" -gt 45 ]; then
  timeout -k 5 $(($(left) - 5)) "$python" scripts/cpu_speeds.py >"$out/cpu_speeds.txt" 2>&1
  echo "device_next: cpu_speeds exit $?, $(left) s left" | tee -a "$out/steps.txt"
fi
cat "$out/bench/table.txt" "$out/long/table.txt" "$out/cpu_speeds.txt" 2>/dev/null
