#!/usr/bin/env bash
# Issue 33's next call on a GPU host, in the order of what it settles, within DEADLINE seconds
# (default 540: one device command may run 600). Each step gets what time is left and writes
# into OUT_DIR as it goes, so a call cut short keeps the steps done.
#
#   scripts/device_next.sh OUT_DIR
#
# The sixteenth session's calls (docs/design/scaling.md, "Workers moved round the CPUs") found
# the vCPUs' speed half the CPU's and built move_workers: 1.12x torch at 8 and 15 workers on
# jpeg, 88% of the roof at 15. Measured there before its last change (idle workers are not
# moved, and the looks slow down while all idle); not measured at all on uint8. So:
#
# 1. bench/: the scaling mode at 15 and 8 workers, jpeg and uint8, no thread workers, ferry
#    with move_workers=False beside ferry and torch, 5 measured epochs a loader:
#    gpu_host_bench.sh with WORKERS=15,8 UNMOVED=1 NO_THREADS=1 REPS=5. Every row at 1.0x
#    torch or more, and jpeg at 15 at 90% of the roof, are the issue's targets.
# 2. rotate.txt: ferry's trading (50 ms) against the pinned rotation at 15 workers, jpeg
#    (scaling_costs.py --loader ferry ferry-rotate torch): the rotation measured 96-97% of the
#    summed rates in cpu_speeds.py against the trading's 92%.
# 3. period.txt: ferry's trading every 20 ms (--move-ms 20), the same rows: whether a shorter
#    period closes the last points to the roof.
# 4. long.txt: long epochs at 15 workers (240 batches), torch, ferry, ferry unmoved.
# 5. cpu_speeds.txt, with the time left: scripts/cpu_speeds.py again (the CPU map of that
#    machine, to read the rows above by).
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

gpu=(--gpu)
[ "${FEED:-gpu}" = cpu ] && gpu=()
if [ -n "${QUICK:-}" ]; then
  bench=(QUICK=1 WORKERS=2 REPS=1 LIMIT=60)
  workers=(--workers 2) long=(--samples 512 --epochs 1) epochs=(--epochs 1)
else
  bench=(WORKERS=15,8 REPS=5 LIMIT=300)
  workers=(--workers 15) long=(--samples 30720 --epochs 2) epochs=(--epochs 3)
fi

left() { echo $((deadline - $(date +%s))); }

# 1. (gpu_host_bench.sh bounds itself with LIMIT)
if [ "$(left)" -gt 60 ]; then
  env "${bench[@]}" UNMOVED=1 NO_THREADS=1 FEED="${FEED:-gpu}" PYTHON="$python" \
    scripts/gpu_host_bench.sh "$out/bench" >"$out/bench.log" 2>&1
  echo "device_next: 1. bench exit $?, $(left) s left" | tee -a "$out/steps.txt"
fi
# One step: NAME, the least budget it needs (s), the seconds kept for the end, then its
# command; it gets the time left but those, writes NAME.txt, and is left out when short.
step() {
  local name=$1 least=$2 keep=$3 budget
  shift 3
  budget=$(($(left) - keep))
  if [ "$budget" -lt "$least" ]; then
    echo "device_next: $name left out (${budget} s left)" | tee -a "$out/steps.txt"
    return
  fi
  timeout -k 5 "$budget" "$python" "$@" >"$out/$name.txt" 2>&1
  echo "device_next: $name exit $?, $(left) s left" | tee -a "$out/steps.txt"
}
costs=(scripts/scaling_costs.py --workload jpeg "${gpu[@]}" "${workers[@]}")
step rotate 30 10 "${costs[@]}" --loader ferry ferry-rotate torch "${epochs[@]}"
step period 20 10 "${costs[@]}" --loader ferry --move-ms 20 "${epochs[@]}"
step long 40 10 "${costs[@]}" --loader torch ferry ferry-unmoved "${long[@]}"
step cpu_speeds 40 5 scripts/cpu_speeds.py
cat "$out/bench/table.txt" "$out/rotate.txt" "$out/period.txt" "$out/long.txt" \
  "$out/cpu_speeds.txt" 2>/dev/null | grep -v timeline
