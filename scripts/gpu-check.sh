#!/usr/bin/env bash
# The CUDA path, checked on a GPU in one go (about 4-5 minutes, at most 7.5):
#   tests/unit/test_cuda.py, tests/unit/test_staging_paths.py and in-process recovery on CUDA (2 ranks, gloo on
#   one GPU; NCCL where there are two), then benchmarks/bench_gpu.py
#   at 1 GiB and 8 GiB, then a short summary. Without a CUDA device it says so and exits 0.
#
#   scripts/gpu-check.sh --prepare   # on a machine with a package registry: put the wheels a GPU
#                                    # image without one may lack (zstandard) into .whl/ (git-ignored)
#   scripts/gpu-check.sh             # on the GPU machine
#
# Python: .venv/bin/python when its torch sees a GPU, else python3 (a GPU image's own torch).
# Missing ftkit dependencies are installed from .whl/ (no index) into a temp dir on PYTHONPATH;
# zstandard, if still missing, is replaced by a stub (nothing here compresses).
# Logs, the benchmarks' JSON and summary.txt go to $GPU_CHECK_OUT, else $OUT, else /tmp/gpu-check.
# GPU_CHECK_GIB (default "1 8") picks the benchmark sizes. GPU_CHECK_ON_CPU=1 runs the whole script on
# a CPU (tiny sizes, tests with FTKIT_CUDA_TESTS_ON_CPU=1): to test this script where no GPU is.
# Exit status: 0 when the tests passed and every benchmark ran (a missed target is reported, not fatal).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--prepare" ]; then
  PY=.venv/bin/python
  [ -x "$PY" ] || PY=python3
  ver=$("$PY" -c "import zstandard; print(zstandard.__version__)" 2>/dev/null || echo 0.25.0)
  mkdir -p .whl
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo '/.whl/' >> .git/info/exclude; }
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "zstandard==$ver"
  ls -l .whl
  echo "gpu-check: prepared; on the device run scripts/gpu-check.sh with .whl carried along"
  exit 0
fi

OUTDIR=${GPU_CHECK_OUT:-${OUT:-/tmp/gpu-check}}
mkdir -p "$OUTDIR"
SIZES=${GPU_CHECK_GIB:-"1 8"}

has_cuda() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }
PY=""
BENCH_ARGS=()
for cand in .venv/bin/python python3; do
  if command -v "$cand" >/dev/null 2>&1 && has_cuda "$cand"; then PY=$cand; break; fi
done
if [ -z "$PY" ] && [ "${GPU_CHECK_ON_CPU:-}" = 1 ]; then
  PY=.venv/bin/python
  [ -x "$PY" ] || PY=python3
  export FTKIT_CUDA_TESTS_ON_CPU=1
  BENCH_ARGS=(--device cpu --rounds 1 --steps 2 --warmup 1)
  SIZES=${GPU_CHECK_GIB:-"0.01 0.02"}
  echo "gpu-check: GPU_CHECK_ON_CPU=1: the whole script on the CPU, sizes $SIZES"
fi
if [ -z "$PY" ]; then
  torch_v=$( (.venv/bin/python -c "import torch; print(torch.__version__)" || python3 -c "import torch; print(torch.__version__)") 2>/dev/null || echo "not installed")
  gpus=$(nvidia-smi -L 2>/dev/null | head -3 || true)
  echo "gpu-check: no CUDA device on this machine (torch ${torch_v}; nvidia-smi: ${gpus:-none}): nothing to check."
  echo "gpu-check: tests/unit/test_cuda.py skips here; tests/unit/test_staging_paths.py drives the same code with a simulated device."
  exit 0
fi

# ftkit's dependencies, as far as this image lacks them.
SITE=$(mktemp -d /tmp/ftkit-site.XXXX)
missing=$("$PY" - <<'EOF'
import importlib.util
print(" ".join(m for m in ("zstandard", "xxhash", "fsspec", "numpy", "psutil", "tqdm", "pytest")
               if importlib.util.find_spec(m) is None))
EOF
)
if [ -n "$missing" ] && ls .whl/*.whl >/dev/null 2>&1; then
  echo "gpu-check: installing from .whl/: $(ls .whl | tr '\n' ' ')"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl \
    || echo "gpu-check: installing the carried wheels failed"
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import zstandard" 2>/dev/null; then
  echo "gpu-check: zstandard is not installed: a stub stands in (nothing in these checks compresses)"
  cat > "$SITE/zstandard.py" <<'EOF'
"""Stand-in written by scripts/gpu-check.sh: zstandard is not installed on this machine."""
class ZstdError(Exception):
    pass
class _Missing:
    def __init__(self, *a, **k):
        raise ImportError("zstandard is not installed here (scripts/gpu-check.sh --prepare carries it)")
ZstdCompressor = ZstdDecompressor = _Missing
__version__ = "0 (stub)"
EOF
fi
still=$("$PY" - <<'EOF'
import importlib.util
print(" ".join(m for m in ("xxhash", "fsspec", "numpy", "psutil", "tqdm", "pytest") if importlib.util.find_spec(m) is None))
EOF
)
if [ -n "$still" ]; then
  echo "gpu-check: missing Python packages: $still (carry their wheels in .whl/)"
  exit 1
fi

export PYTHONUNBUFFERED=1 FTKIT_JOB_ID="gpu-check-$$"
T0=$(date +%s)
{
  echo "gpu-check: $(date -u +%FT%TZ) on $(hostname)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  "$PY" -c "import torch, sys; print(f'python {sys.version.split()[0]} ({sys.executable}), torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name() if torch.cuda.is_available() else \"no GPU\"}')"
  echo "cpus $(nproc); memory $(free -g | awk '/Mem:/{print $2}') GiB; /dev/shm $(df -h /dev/shm 2>/dev/null | awk 'NR==2{print $4}') free; /tmp $(df -h /tmp | awk 'NR==2{print $4" free ("$1")"}')"
} 2>&1 | tee "$OUTDIR/env.txt"

status=0
echo "== tests (tests/unit/test_cuda.py, tests/unit/test_staging_paths.py, in-process recovery on CUDA)"
timeout 180 "$PY" -m pytest -q -ra -p no:cacheprovider tests/unit/test_cuda.py tests/unit/test_staging_paths.py \
  "tests/drills/test_inprocess.py::test_in_process_recovery_on_cuda_keeps_the_context" 2>&1 | tee "$OUTDIR/tests.log"
tests_rc=${PIPESTATUS[0]}
[ "$tests_rc" = 0 ] || status=1

declare -A LIMIT=([1]=90 [8]=240)
for gib in $SIZES; do
  echo "== benchmarks/bench_gpu.py --gib $gib"
  timeout "${LIMIT[$gib]:-240}" "$PY" benchmarks/bench_gpu.py --gib "$gib" ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"} --json "$OUTDIR/bench-${gib}gib.json" \
    2>&1 | tee "$OUTDIR/bench-${gib}gib.log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" != 0 ] && [ "$rc" != 1 ]; then  # 1: a target missed (reported below); else it broke
    echo "gpu-check: bench_gpu.py --gib $gib ended with status $rc$([ "$rc" = 124 ] && echo ' (timed out)')"
    status=1
  fi
done

"$PY" - "$OUTDIR" "$tests_rc" "$(( $(date +%s) - T0 ))" $SIZES <<'EOF' | tee "$OUTDIR/summary.txt"
import json, os, sys
out, tests_rc, secs, sizes = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
log = open(os.path.join(out, "tests.log")).read().strip().splitlines()
print("\n==== gpu-check summary ====")
print(f"tests: {'PASSED' if tests_rc == 0 else f'FAILED (status {tests_rc})'}: {log[-1] if log else 'no output'}")
ms = lambda s: "-" if s is None else f"{s * 1e3:.1f} ms" if s < 0.1 else f"{s:.2f} s"
for gib in sizes:
    figs = {}
    for line in open(os.path.join(out, f"bench-{gib}gib.log"), errors="replace"):
        if line.startswith('{"figure"'):
            try:
                d = json.loads(line)
                figs[d.pop("figure")] = d
            except ValueError:
                pass
    g = lambda f, k: (figs.get(f) or {}).get(k)
    print(f"-- {gib} GiB ({(g('env', 'state_bytes') or 0) / 2**30:.2f} GiB state, {g('env', 'device_name')}, "
          f"torch {g('env', 'torch')})")
    print(f"   copy floor D2H {ms(g('copy_floor', 'd2h_s'))} ({g('copy_floor', 'd2h_gbps') or 0:.1f} GB/s), "
          f"H2D {ms(g('copy_floor', 'h2d_s'))}")
    print(f"   snapshot() stall: first {ms(g('ours_first_snapshot', 'stall_s'))} "
          f"(pinned by {g('ours_first_snapshot', 'pinned_by')}), steady {ms(g('ours_steps', 'stall_steady_s'))}, "
          f"max {ms(g('ours_steps', 'stall_max_s'))}; copy done {ms(g('ours_steps', 'copy_done_after_return_s'))} "
          f"after return")
    slow = g("ours_steps", "slowdown")
    fslow = g("ours_steps", "floor_slowdown")
    print(f"   step {ms(g('ours_steps', 'step_s'))} -> {ms(g('ours_steps', 'step_with_snapshot_s'))} with a snapshot "
          f"per step: {'-' if slow is None else f'{slow * 100:+.2f}%'} "
          f"(floor, the same copies with no ftkit code: {'-' if fslow is None else f'{fslow * 100:+.2f}%'})")
    print(f"   DCP async_save return: default {ms(g('dcp_async_default_0', 'return_s'))} / "
          f"{ms(g('dcp_async_default_1', 'return_s'))}; pinned stager {ms(g('dcp_async_pinned_stager_0', 'return_s'))}"
          f" (staged +{ms(g('dcp_async_pinned_stager_0', 'staged_after_return_s'))}) / "
          f"{ms(g('dcp_async_pinned_stager_1', 'return_s'))}; torch.save {ms(g('torch_save_fsync', 's'))}")
    print(f"   restore floor: read the RAM tier's files {ms(g('restore_floor', 'read_threads_s'))} "
          f"({g('restore_floor', 'threads')} threads; 1: {ms(g('restore_floor', 'read_1_thread_s'))}) + H2D "
          f"{ms(g('restore_floor', 'h2d_s'))}; pinning {ms(g('restore_floor', 'pin_s'))}")
    print(f"   restore: RAM tier {ms(g('ours_restore_ram', 's'))} (ok={g('ours_restore_ram', 'verified')}), "
          f"dir {ms(g('ours_restore_dir', 's'))} ({g('ours_restore_dir', 'cache')}, ok={g('ours_restore_dir', 'verified')})"
          f", DCP load {ms(g('dcp_load_dir', 's'))} (ok={g('dcp_load_dir', 'verified')})")
    for k, v in figs.items():
        if "error" in v:
            print(f"   ERROR {k}: {v['error'][:200]}")
    try:
        for t in json.load(open(os.path.join(out, f"bench-{gib}gib.json")))["targets"]:
            print(f"   {'PASS' if t['pass'] else 'MISS'} {t['what']}: {t['detail']}")
    except (OSError, ValueError, KeyError):
        print("   (no targets: the run did not finish)")
print(f"total {secs} s; logs and JSON in {out}")
EOF
exit $status
