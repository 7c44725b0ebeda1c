#!/usr/bin/env bash
# The scaling mode of `ferry bench` with the GPU feed, on a GPU host, in at most 6 minutes.
#
#   scripts/gpu_host_bench.sh [OUT_DIR]        (or OUT=dir scripts/gpu_host_bench.sh)
#
# Runs from a plain checkout with the host's own python: PYTHONPATH=src, nothing installed, no
# network, no matplotlib; it needs torch (with CUDA for the GPU feed; without CUDA it runs the
# CPU feed and says so) and Pillow. Rows: the jpeg (decode, random crop, resize, flip; batch 128)
# and uint8 (3x224x224, batch 256) workloads at 8, 15, 4, 2 and 1 workers, in that order, so
# that the rows that matter most run first; each loader (torch, ferry processes, ferry threads)
# beside the roof, the same work in N plain processes. Training-loop options: pin_memory,
# persistent_workers, prefetch_factor=4, shuffle; each batch .to("cuda", non_blocking=True) and
# normalized there.
#
# Bounded three ways: no row starts after BUDGET seconds (default 240), an epoch or a roof over
# EPOCH_TIMEOUT seconds (default 60) fails its side only, and the whole run is stopped at LIMIT
# seconds (default 330). OUT_DIR/scaling.md and scaling.json are rewritten after every row, so a
# run cut short keeps what it measured. Also written: host.txt (machine, versions, commit),
# progress.log (one line per row, with each loader's rate and its share of the roof),
# table.txt (the text table). Exit status: the benchmark's (0 all rows ran, 1 some row failed or
# was left out by the budget, 2 bad arguments), 124 when LIMIT stopped it.
#
# Environment: PYTHON (default python3), WORKERS (default 8,15,4,2,1), REPS (measured epochs
# per loader, default 3), BUDGET, EPOCH_TIMEOUT, LIMIT, FEED (auto, gpu or cpu; default auto),
# QUICK=1 (tiny batches: a smoke test of the script itself, figures meaningless), BALANCED=1
# (also ferry's process workers with balance_workers=True), UNMOVED=1 (also ferry's process
# workers with move_workers=False, placed by the scheduler alone as torch's are), BPW (batches a worker makes in an
# epoch; default the workload's 4-6), ONLY (jpeg or uint8), NO_THREADS=1, CPU_SPEEDS=1 (first,
# scripts/cpu_speeds.py, about 30 s: whether the CPUs differ in speed and whether moving the
# workers round them evens it out; cpu_speeds.txt and .json; at most 2 minutes more, outside
# LIMIT). The long-epoch run of
# balanced workers, about 3 minutes:
#
#   WORKERS=15,8 ONLY=jpeg BPW=16 BALANCED=1 NO_THREADS=1 REPS=2 scripts/gpu_host_bench.sh OUT
set -u

out="${1:-${OUT:-gpu-bench-$(date -u +%Y%m%dT%H%M%SZ)}}"
python="${PYTHON:-python3}"
workers="${WORKERS:-8,15,4,2,1}"
reps="${REPS:-3}"
budget="${BUDGET:-240}"
epoch_timeout="${EPOCH_TIMEOUT:-60}"
limit="${LIMIT:-330}"
feed="${FEED:-auto}"
extra=()
[ -n "${BALANCED:-}" ] && extra+=(--balanced)
[ -n "${UNMOVED:-}" ] && extra+=(--unmoved)
[ -n "${NO_THREADS:-}" ] && extra+=(--no-threads)
[ -n "${BPW:-}" ] && extra+=(--batches-per-worker "$BPW")
[ -n "${ONLY:-}" ] && extra+=(--only "$ONLY")

repo="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$out" || exit 2
out="$(cd "$out" && pwd)"

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(uname -a)"
  echo "cpus: $(nproc 2>/dev/null || echo unknown)"
  echo "commit: $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "run: WORKERS=$workers REPS=$reps BUDGET=$budget EPOCH_TIMEOUT=$epoch_timeout LIMIT=$limit FEED=$feed ${extra[*]}"
  command -v lscpu >/dev/null 2>&1 &&
    lscpu | grep -E '^(Model name|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)|NUMA node\(s\)|Hypervisor vendor|L3 cache)' |
    sed 's/  */ /g'
  command -v nvidia-smi >/dev/null 2>&1 &&
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$python" - <<'EOF'
import platform, torch
print(f"python: {platform.python_version()}; torch: {torch.__version__}; "
      f"cuda: {torch.cuda.is_available()}"
      + (f" ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else ""))
try:
    import PIL
    print(f"Pillow: {PIL.__version__}")
except ImportError:
    print("Pillow: missing (the jpeg rows will fail)")
try:
    import numpy
    print(f"numpy: {numpy.__version__}")
except ImportError:
    print("numpy: missing")
EOF
} >"$out/host.txt" 2>&1
cat "$out/host.txt"

cd "$repo" || exit 2
if [ -n "${CPU_SPEEDS:-}" ]; then
  PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}" timeout -k 5 120 \
    "$python" scripts/cpu_speeds.py --json "$out/cpu_speeds.json" 2>&1 | tee "$out/cpu_speeds.txt"
fi
PYTHONPATH="$repo/src${PYTHONPATH:+:$PYTHONPATH}" timeout -k 15 "$limit" \
  "$python" -m ferry bench --scaling --feed "$feed" --workers-list "$workers" --reps "$reps" \
  --budget "$budget" --timeout "$epoch_timeout" ${QUICK:+--quick} "${extra[@]}" \
  --json "$out/scaling.json" --markdown "$out/scaling.md" \
  >"$out/table.txt" 2> >(tee "$out/progress.log" >&2)
status=$?

cat "$out/table.txt"
if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
  echo "gpu_host_bench: stopped at LIMIT=${limit}s; $out/scaling.md holds the rows done" >&2
fi
echo "gpu_host_bench: exit $status; results in $out (scaling.md, scaling.json)" >&2
exit "$status"
