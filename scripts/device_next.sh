#!/usr/bin/env bash
# Issue 33's next call on a GPU host, in the order of what it settles, within DEADLINE seconds
# (default 540: one device command may run 600). Each step gets what time is left and writes
# into OUT_DIR as it goes, so a call cut short keeps the steps done.
#
#   scripts/device_next.sh OUT_DIR
#
# 1. bench/: the scaling mode at 15 and 8 workers, jpeg only, no thread workers, 7 measured
#    epochs a loader (ferry against torch at 8 and 15 workers, and the share of the roof), after
#    scripts/cpu_speeds.py (whether the vCPUs' speed belongs to the CPU, and whether moving the
#    workers round them evens it out): gpu_host_bench.sh with CPU_SPEEDS=1 WORKERS=15,8
#    ONLY=jpeg NO_THREADS=1 REPS=7.
# 2. nudged.txt: torch's and ferry's workers at 15, moved one CPU on every 50 ms
#    (scaling_costs.py --nudge-ms 50), beside the unnudged rows of step 1.
# 3. long.txt: long epochs at 15 workers (240 batches), where the workers' memory reads at an
#    epoch's end made ferry's end 83-126 ms after the last sample against torch's 32-41.
# 4. threads.txt: ferry's thread workers at 15 beside torch's processes (jpeg, 2 measured
#    epochs): 0.25x before thread workers ran torch's parallel copies on one thread each
#    (docs/design/scaling.md, "Thread workers ran torch's copies on teams as wide as the machine").
# 5. ceiling.txt, with the time that is left: the main process's ceiling (instant batches)
#    against torch's at 8 and 16 workers (scripts/main_ceiling.py), so far measured on 2 cores.
# 6. auto_gil.txt, with the time still left: num_workers="auto" on reads that wait, then
#    compute (scripts/auto_gil.py): threads bound by the GIL become processes again, one GIL
#    each, which gains more the more CPUs there are (5-23% on 2 cores).
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
  workers=(--workers 2) long=(--samples 512 --epochs 1) ceiling=(--workers 2 --reps 1)
  threads=(--epochs 1) autogil=(--epochs 1)
else
  bench=(WORKERS=15,8 REPS=7 LIMIT=300)
  workers=(--workers 15) long=(--samples 30720 --epochs 2) ceiling=(--workers 8 16 --reps 3)
  threads=(--epochs 2) autogil=(--epochs 3)
fi

left() { echo $((deadline - $(date +%s))); }

# 1. (gpu_host_bench.sh bounds itself: LIMIT for the bench, 120 s more for cpu_speeds.py)
if [ "$(left)" -gt 60 ]; then
  env "${bench[@]}" CPU_SPEEDS=1 ONLY=jpeg NO_THREADS=1 FEED="${FEED:-gpu}" PYTHON="$python" \
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
costs=(scripts/scaling_costs.py --workload jpeg "${gpu[@]}")
# 2., 3. and 4.: each with the time left, 10 s kept for the end
step nudged 30 10 "${costs[@]}" --loader torch ferry "${workers[@]}" --epochs 3 --nudge-ms 50
step long 30 10 "${costs[@]}" --loader torch ferry "${workers[@]}" "${long[@]}"
step threads 30 10 "${costs[@]}" --loader torch ferry-thread "${workers[@]}" "${threads[@]}"
# 5. and 6. (the least of them: only with time to spare)
step ceiling 45 10 scripts/main_ceiling.py "${ceiling[@]}"
step auto_gil 40 5 scripts/auto_gil.py "${autogil[@]}"
cat "$out/bench/table.txt" "$out/nudged.txt" "$out/long.txt" "$out/threads.txt" "$out/ceiling.txt" \
  "$out/auto_gil.txt" 2>/dev/null
