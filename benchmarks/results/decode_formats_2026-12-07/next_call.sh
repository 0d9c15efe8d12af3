#!/usr/bin/env bash
# Prepared, not run (no device time was left): the chunk loads hoisted in the kernels built for one format,
# against the tree. The night's A/B found the GEMV built for q4 alone 1.5% slower a step, and its machine code
# waits on each 16-byte load of codes before the next (93 registers, one load in flight); the kernel for
# every format holds 120 and keeps several loads in flight. The experts' down phase is the same: each of a tile's
# rows waits for its loads before the next row's go out. hoist.patch, in the kernels built for one format only
# (the experts' kernel on the MLX checkpoint; 113 registers, no spills): a tile row's chunks of all the lane's
# columns (rows of up to 2,048 columns) loaded together, then their dot products; and the down tile's rows four
# at a time. The kernels for every format keep their machine code. hoist_gemv_q4.patch is the same with the
# GEMV built for q4 too (gemv_q4.patch; 104 registers, no spills). From the tree's root, nothing carried:
#
#   bash benchmarks/results/decode_formats_2026-12-07/next_call.sh
#
# ~470 s: three builds, the step chain and greedy decode at 4K twice each, alternating, then the decode
# harness in full on each variant (a variant is kept only if it passes and is faster).
set -u
D=benchmarks/results/decode_formats_2026-12-07
mkdir -p "$OUT/ab"
OUT=$OUT/ab WHAT="step decode" ROUNDS=2 CONTEXTS=4096 timeout 480 bash benchmarks/cuda_ab.sh \
  hoist=$D/hoist.patch hoist_gemv=$D/hoist_gemv_q4.patch 2>&1 | tail -16  # (all of it: ab/ab_summary.txt)
for n in hoist hoist_gemv; do
  timeout 60 /tmp/ab/$n/build/decode_kernels > "$OUT/ab/decode_kernels_$n.log" 2>&1
  echo "$n: $(grep -cE ' ok' "$OUT/ab/decode_kernels_$n.log") ok, $(grep -E 'passed|FAILED' "$OUT/ab/decode_kernels_$n.log")"
  grep FAIL "$OUT/ab/decode_kernels_$n.log" | head -5
done
rm -f "$OUT"/ab/ab_build_*.log
tar czf "$OUT/ab.tgz" -C "$OUT" ab && rm -rf "$OUT/ab"
