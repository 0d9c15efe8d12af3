#!/usr/bin/env bash
# The first device call of 2026-12-07 (H100, 01:55 UTC): the prefill GEMM of this change (A) against 12d8238's (B,
# built from a copy of the tree with exp/old.patch applied: `git diff -R` of the change), harness and 4K prefill;
# the grouped products then still took the 64 × 256 tile (the *_wide_tile.json files). Run from the tree's root.
set -uo pipefail
ROOT=$PWD; OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
log() { echo "== $(date -u +%T) $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
rm -rf /tmp/ab/B && mkdir -p /tmp/ab/B
tar --exclude=./build --exclude=./models --exclude=./.peer -cf - . | tar -xf - -C /tmp/ab/B
(cd /tmp/ab/B && patch -p1 -s < "$ROOT/exp/old.patch") || { echo "old patch failed"; exit 1; }
log build
for T in "$ROOT" /tmp/ab/B; do
  (cd "$T" && mkdir -p build && nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -O3 -I csrc \
     benchmarks/cuda/prefill_kernels.cu -o build/prefill_kernels > build/pk.log 2>&1 || { echo "$T pk build failed"; tail -5 build/pk.log; }) &
  (cd "$T" && cmake -S . -B build/dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python3)" \
      -DLILY_METAL_EMU=OFF > build/lily.log 2>&1 && cmake --build build/dev -j7 >> build/lily.log 2>&1 && ln -sf "$T"/build/dev/_core*.so src/lily/ \
      || { echo "$T lily build failed"; tail -30 build/lily.log; }
   if [ "$T" = "$ROOT" ]; then log "synth"; PYTHONPATH=$ROOT/src python3 -m lily.cli synth --scale full --out /tmp/synth-full > "$OUT/synth.log" 2>&1 || tail -5 "$OUT/synth.log"; log "synth done"; fi) &
done
(cd "$ROOT" && nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -O3 -I csrc benchmarks/cuda/decode_kernels.cu -o build/decode_kernels > build/dk.log 2>&1 || echo "dk build failed") &
(cd "$ROOT" && nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -O3 -I csrc -DLILY_GEMM_STAGES=4 benchmarks/cuda/prefill_kernels.cu -o build/prefill_kernels4 > build/pk4.log 2>&1 || echo "pk4 build failed") &
wait
log "prefill kernels A full"
timeout 150 build/prefill_kernels > "$OUT/pk_A.log" 2>&1; grep -v " ok  $" "$OUT/pk_A.log" | head -60
bench() {  # round, builds...
  local r=$1; shift
  for n in "$@"; do
    T=$ROOT; [ $n = B ] && T=/tmp/ab/B
    (cd "$T" && PYTHONPATH=$T/src timeout 100 python3 "$ROOT"/benchmarks/cuda_bench.py --model /tmp/synth-full --lengths 4096 \
       --contexts 128 --decode-tokens 8 --repeats 2 --json "$OUT/bench_${n}_$r.json" 2>&1 | grep -E "prefill|decode|Error" | sed "s/^/$n r$r /")
  done
}
bench 1 B A
log "tests (A)"
for d in "$ROOT"/models/*/*/*/; do [ -f "$d/config.json" ] && touch "$d/.complete"; done
LILY_TEST_MODELS=$ROOT/models PYTHONPATH=$ROOT/src timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda.py \
  -k "logits_within or chunk_remainders or greedy_matches or each_fusion" 2>&1 | grep -v leaked | tail -5
log "prefill kernels B full"
timeout 150 /tmp/ab/B/build/prefill_kernels > "$OUT/pk_B.log" 2>&1; grep -E "TFLOP" "$OUT/pk_B.log" | grep gemm | head -30
bench 2 B A
log "prefill kernels, 4 stages"
timeout 100 build/prefill_kernels4 > "$OUT/pk_A4.log" 2>&1; grep -v " ok  $" "$OUT/pk_A4.log" | grep -E "gemm|FAIL|passed" | head -40
log "decode kernels"
timeout 100 build/decode_kernels > "$OUT/dk.log" 2>&1; grep -v " ok" "$OUT/dk.log" | tail -15; grep -c " ok" "$OUT/dk.log"
log done
