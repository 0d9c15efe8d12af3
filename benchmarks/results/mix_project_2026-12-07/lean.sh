#!/usr/bin/env bash
# call.sh's work in the least device time (the session that wrote it had ~5 min left): the patch applied, the
# decode harness compiled beside lily's build and the full-size checkpoint made beside both; the harness under
# compute-sanitizer at its small shapes, then in full; the CUDA tests; then, while LEFT seconds remain (from the
# start), ab.sh's A/B, one round. From the tree's root with `models` carried:  LEFT=280 bash .../lean.sh
set -u
T0=$(date +%s)
el() { echo "== +$(( $(date +%s) - T0 )) s $*"; }
patch -p1 -s < benchmarks/results/mix_project_2026-12-07/mix_project.patch || { echo "the patch does not apply"; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
mkdir -p build
nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -O3 -I csrc benchmarks/cuda/decode_kernels.cu \
  -o build/decode_kernels > "$OUT/decode_build.log" 2>&1 &
HARNESS=$!
(PYTHONPATH=src python3 -m lily.cli synth --scale full --out /tmp/synth-full > "$OUT/synth.log" 2>&1 &&
  touch /tmp/synth-full/.complete) &
el build
STEPS=build bash benchmarks/cuda_device.sh 2>&1 | tail -2
wait $HARNESS || tail -20 "$OUT/decode_build.log"
el "harness, small, under compute-sanitizer"
timeout 90 compute-sanitizer --tool memcheck build/decode_kernels --small > "$OUT/decode_memcheck.log" 2>&1
grep -E "mixproj|counts|again|FAIL|all passed" "$OUT/decode_memcheck.log" | head -20; tail -2 "$OUT/decode_memcheck.log"
el "harness, full"
timeout 120 build/decode_kernels > "$OUT/decode_kernels.log" 2>&1
grep -E "mixproj|counts|again|FAIL|^step|all passed" "$OUT/decode_kernels.log" | head -30
el "CUDA tests"
export LILY_TEST_MODELS=$PWD/models PYTHONPATH=$PWD/src
STEPS=test bash benchmarks/cuda_device.sh 2>&1 | grep -v "^ok\| ok$\|^PASSED" | tail -25
el "A/B"
for v in on off; do
  [ $(( $(date +%s) - T0 )) -lt $(( ${LEFT:-280} - 50 )) ] || { echo "no time left for the A/B ($v)"; break; }
  [ -f /tmp/synth-full/.complete ] || { echo "the full-size checkpoint is not ready"; break; }
  f=; [ $v = off ] && f=mix_project
  timeout $(( ${LEFT:-280} - ($(date +%s) - T0) - 5 )) python3 benchmarks/cuda_ab.py --model /tmp/synth-full \
    --tag "mix_project_$v" --contexts 4096 --fusions "$f" 2>&1 | grep -E "^ab|^turn|Error" | tee -a "$OUT/ab.txt"
done
el done
