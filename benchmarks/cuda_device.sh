#!/usr/bin/env bash
# One call on a lent CUDA machine (an H200): build lily._core with the CUDA backend, run the CUDA tests, build
# the full-size synthetic checkpoint and measure it (benchmarks/cuda_bench.py, then `lily bench --backend
# cuda`). Logs and JSON go to $OUT (default ./out). Steps: STEPS="build kernels decode test synth bench" (default
# all; kernels / decode: benchmarks/cuda/prefill_kernels.cu / decode_kernels.cu, each under compute-sanitizer on
# its small shapes, then in full; kernels times the earlier prefill kernels too when build/old_kernels.cuh, a
# copy of them in namespace lily::old, was carried; trace: the experts' kernel's timeline in the decode harness's
# step chain, from a build with -DLILY_DECODE_TRACE).
# Tiny test models: $LILY_TEST_MODELS (carried: the mlx kinds and the tokenizer cannot be built there; make the
# folder with benchmarks/cuda_test_models.py).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
STEPS=${STEPS:-build kernels decode test synth bench chunk512 lilybench}  # also: trace bytes profile ncu
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
has() { [[ " $STEPS " == *" $1 "* ]]; }
log() { echo "== $(date -u +%T) $*"; }
source benchmarks/cuda_builds.sh  # build_core, build_harness; prebuilt: .prebuilt for this tree (cuda_prebuild.sh)

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.total --format=csv | tee "$OUT/gpu.txt"
if has build; then
  # .prebuilt (benchmarks/cuda_prebuild.sh, carried): built off the device's clock, taken only for the tree it
  # was built from, the module only if it imports here
  so=$(cd .prebuilt 2>/dev/null && ls _core*.so.gz 2>/dev/null | sed 's/\.gz$//')
  if [ -n "$so" ] && prebuilt "$so" && ln -sf "$PWD/build/$so" src/lily/ && python3 -c "import lily._core" 2>"$OUT/build.log"; then
    log "build: .prebuilt ($(cat .prebuilt/sources)) taken"
  else
    [ -d .prebuilt ] && log "build: .prebuilt not for this tree or not importable here (build.log); building"
    rm -f src/lily/_core*.so
    build_core "$(command -v python3)" build/dev 16 >>"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
    ln -sf "$PWD"/build/dev/_core*.so src/lily/
  fi
  python3 -c "import lily; print('cuda:', lily.backend_unavailable('cuda') or 'available')"
fi
if has synth; then
  log "synth full (background)"
  (time python3 -m lily.cli synth --scale full --out /tmp/synth-full) >"$OUT/synth.log" 2>&1 &
  SYNTH=$!
fi
if has kernels; then
  log "prefill kernels"
  OLD=()
  [ -f build/old_kernels.cuh ] && OLD=(-DLILY_OLD_KERNELS=\"../../build/old_kernels.cuh\")
  mkdir -p build
  { [ ${#OLD[@]} = 0 ] && prebuilt prefill_kernels; } ||
    build_harness prefill build/prefill_kernels "${OLD[@]}" >"$OUT/kernels_build.log" 2>&1 || tail -20 "$OUT/kernels_build.log"
  timeout 240 compute-sanitizer --tool memcheck build/prefill_kernels --small >"$OUT/kernels_memcheck.log" 2>&1
  tail -4 "$OUT/kernels_memcheck.log"
  timeout 300 build/prefill_kernels 2>&1 | tee "$OUT/prefill_kernels.log"
fi
if has decode; then
  log "decode kernels"
  mkdir -p build
  prebuilt decode_kernels ||
    build_harness decode build/decode_kernels >"$OUT/decode_build.log" 2>&1 || tail -20 "$OUT/decode_build.log"
  timeout 120 compute-sanitizer --tool memcheck build/decode_kernels --small >"$OUT/decode_memcheck.log" 2>&1
  tail -4 "$OUT/decode_memcheck.log"
  timeout 300 build/decode_kernels 2>&1 | tee "$OUT/decode_kernels.log"
fi
if has trace; then
  log "the experts' kernel's timeline in the step chain"
  mkdir -p build
  build_harness decode build/decode_trace -DLILY_DECODE_TRACE >"$OUT/trace_build.log" 2>&1 || tail -20 "$OUT/trace_build.log"
  timeout 120 build/decode_trace --trace 2>&1 | tee "$OUT/decode_trace.log"
fi
if has test; then
  log tests
  # the carried tiny models count as built (tinymodels.py looks for .complete)
  for d in "${LILY_TEST_MODELS:-/nonexistent}"/*/*/*/; do [ -f "$d/config.json" ] && touch "$d/.complete"; done
  python3 - <<'PY'
import sys
sys.path.insert(0, "tests")
import tinymodels as tm
for g in (tm.PEAKED, tm.BASE, tm.INTERVAL2):
    d = tm.cache_root() / tm.CACHE_VERSION / f"{g.name}-{g.key()}" / "mlx_q4_bf16"
    print("test model", d, "complete" if (d / ".complete").exists() else "MISSING")
PY
  tests_to() {  # LOG SECONDS LINES PYTEST_ARGS...: pytest's lines and its summary, LINES of them shown here
    local out=$OUT/$1 t=$2 n=$3; shift 3
    # nanobind's leak report at exit (the engines cached across tests) is noise here
    timeout "$t" python3 -m pytest -q -rA -p no:cacheprovider "$@" 2>&1 | grep -v "leaked\|^ - " >"$out"
    grep -E "passed|failed|PASSED|FAILED|ERROR|cuda vs" "$out" | tail -"$n"
  }
  tests_to test_cuda.log 300 40 tests/test_cuda.py
  LILY_TEST_BACKEND=cuda tests_to test_one_row.log 200 12 tests/test_one_row_chunks.py
  LILY_TEST_BACKEND=cuda tests_to test_fork.log 120 6 tests/test_metal_model.py -k fork_continues
fi
wait_synth() { [ -n "${SYNTH:-}" ] && { log "wait synth"; wait "$SYNTH"; SYNTH=; tail -3 "$OUT/synth.log"; }; }
if has bench; then
  wait_synth
  log bench
  timeout 300 python3 benchmarks/cuda_bench.py --model /tmp/synth-full --lengths ${LENGTHS:-512,4096} \
    --contexts ${CONTEXTS:-128,1024,4096} --decode-tokens 64 --repeats 3 --json "$OUT/cuda_full.json" 2>&1 \
    | tee "$OUT/bench.log"
fi
if has chunk512; then
  wait_synth
  timeout 120 python3 benchmarks/cuda_bench.py --model /tmp/synth-full --lengths 4096 --contexts 4096 \
    --prefill-chunk 512 --decode-tokens 16 --repeats 2 --json "$OUT/cuda_full_chunk512.json" 2>&1 | grep prefill
fi
if has lilybench; then
  wait_synth
  timeout 200 python3 -m lily.cli bench --backend cuda --model /tmp/synth-full --lengths 4096 --contexts 4096 \
    --decode-tokens 32 --repeats 2 --counters --quiet --json "$OUT/lily_bench_cuda_full.json" 2>&1 | tail -15
fi
if has bytes; then
  wait_synth
  log "bytes per decode step (ncu)"
  timeout 240 python3 benchmarks/cuda_bytes.py --model /tmp/synth-full --json "$OUT/cuda_bytes.json" 2>&1 | tail -3
fi
if has profile; then
  wait_synth
  log profile
  timeout 200 python3 benchmarks/cuda_profile.py --model /tmp/synth-full --prompt 4096 --chunk 2048 2>&1 \
    | grep -v "^STAGE\|Warning" | tee "$OUT/profile.log"
fi
if has ncu; then
  # hardware counters of one decode layer's kernels (a penalised sampler: the step runs without its graph)
  wait_synth
  log ncu
  timeout 240 ncu --clock-control none -k "regex:${NCU_KERNELS:-gemv_kernel|moe_decode_kernel|gdn_step_kernel|attention}" \
    --launch-skip ${NCU_SKIP:-200} --launch-count ${NCU_COUNT:-16} --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section Occupancy --section LaunchStats --section WarpStateStats python3 -c "
import numpy as np, lily
e = lily.Engine.from_pretrained('/tmp/synth-full', backend='cuda', prefill_chunk=512)
ids = np.random.default_rng(0).integers(0, e.config.vocab_size, 64).tolist()
e.generate(ids, max_tokens=8, temperature=0, repetition_penalty=1.1)
" >"$OUT/ncu.log" 2>&1; grep -E "^  [a-z_:]+.*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Theoretical Occ|Block Limit Reg|Grid Size" "$OUT/ncu.log" | head -150
fi
# at most 8 files come back: the logs travel as one archive
(cd "$OUT" && tar czf logs.tar.gz *.log && rm -f *.log)
log done
