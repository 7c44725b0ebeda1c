#!/usr/bin/env bash
# Issue 33's next call on a GPU host, in the order of what it settles, within DEADLINE seconds
# (default 540: one device command may run 600). Each step gets what time is left and writes
# into OUT_DIR as it goes (at most 8 files: what one device call brings back), so a call cut
# short keeps the steps done.
#
#   scripts/device_next.sh OUT_DIR
#
# The eighteenth session's first call found the JPEG row at 15 workers at 88.0% of the roof (20
# rounds; the issue asks 90%) with the mover trading places ("swap"). The mover's "even" mode
# (those furthest behind in the epoch to the fastest CPUs) is measured against it, paired by
# round (scripts/mover_ab.py: torch, ferry with "even", ferry with "swap", the roof):
#
# 1. j15: jpeg at 15 workers, 20 rounds: the issue's 90%.
# 2. j8: jpeg at 8 workers, 10 rounds.
# 3. uint8: uint8 at 15 and 8 workers, 5 rounds (bound by the main process: no change expected).
# 4. long: jpeg at 15 workers on 240-batch epochs, 3 rounds, with the time left.
#
# Each step: OUT_DIR/NAME.txt (its output; the first also the host) and NAME.json (the rows).
# Environment: PYTHON (default python3), DEADLINE, FEED (gpu, the default, or cpu: a smoke test
# without CUDA), QUICK=1 (tiny rows: a smoke test of the script itself, figures meaningless).
set -u

out="${1:-${OUT:-device-next-$(date -u +%Y%m%dT%H%M%SZ)}}"
python="${PYTHON:-python3}"
deadline=$(($(date +%s) + ${DEADLINE:-540}))
repo="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$out" || exit 2
out="$(cd "$out" && pwd)"
cd "$repo" || exit 2
export PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}"
feed="${FEED:-gpu}"

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ); commit: $(git rev-parse --short HEAD 2>/dev/null)"
  echo "cpus: $(nproc); $(uname -r)"
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name --format=csv,noheader
  "$python" -c 'import torch, PIL; print("torch", torch.__version__, "Pillow", PIL.__version__)'
} >"$out/j15.txt" 2>&1

left() { echo $((deadline - $(date +%s))); }
# One run of mover_ab.py: NAME, the least time it needs (s), then its arguments; left out when
# short of that, and stopped at the deadline.
step() {
  local name=$1 least=$2
  shift 2
  if [ "$(left)" -lt "$least" ]; then
    echo "device_next: $name left out ($(left) s left)" | tee -a "$out/j15.txt"
    return
  fi
  [ -n "${QUICK:-}" ] && set -- "$@" --quick --reps 1 --workers 2
  timeout -k 5 $(($(left) - 3)) "$python" scripts/mover_ab.py --feed "$feed" --timeout 60 \
    --json "$out/$name.json" "$@" >>"$out/$name.txt" 2>&1
  echo "device_next: $name exit $?, $(left) s left" | tee -a "$out/j15.txt"
}
step j15 60 --only jpeg --workers 15 --reps 20
step j8 60 --only jpeg --workers 8 --reps 10
step uint8 40 --only uint8 --workers 15 8 --reps 5
step long 130 --only jpeg --workers 15 --batches-per-worker 16 --reps 3
for name in j15 j8 uint8 long; do
  [ -f "$out/$name.txt" ] && sed -n '/ x[0-9]*: /,$p' "$out/$name.txt"
done
