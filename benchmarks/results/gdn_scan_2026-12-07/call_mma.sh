#!/usr/bin/env bash
# One call on a fresh machine. A: this tree (the scan's products on the tensor cores). B: a copy with 53556b8's
# scan (exp/gdn_chunked_head.cuh: the same pipeline, products on the CUDA cores). Both lily._core and both prefill
# harnesses built; the GDN cases of both, alternating; the CUDA tests on A while the synthetic checkpoint is
# written; prefill 512 / 4K, processes B, A, B, A (the other kernels are unchanged: their harness is left out).
set -uo pipefail
ROOT=$PWD; OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
log() { echo "== $(date -u +%T) $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
rm -rf /tmp/ab && mkdir -p /tmp/ab/B
tar --exclude=./build --exclude=./models --exclude=./.peer -cf - . | tar -xf - -C /tmp/ab/B
cp exp/gdn_chunked_head.cuh /tmp/ab/B/csrc/backends/cuda/gdn_chunked.cuh
log build
mkdir -p build /tmp/ab/B/build
for v in new old; do
  INC=csrc; [ $v = old ] && INC=/tmp/ab/B/csrc
  (nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -O3 -I $INC benchmarks/cuda/prefill_kernels.cu \
     -o build/pk_$v > build/pk_$v.log 2>&1 || { echo "pk $v build failed"; tail -5 build/pk_$v.log; }) &
done
for T in "$ROOT" /tmp/ab/B; do
  (cd "$T" && cmake -S . -B build/dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python3)" \
      -DLILY_METAL_EMU=OFF > build/lily.log 2>&1 && cmake --build build/dev -j7 >> build/lily.log 2>&1 && ln -sf "$T"/build/dev/_core*.so src/lily/ \
      || { echo "$T lily build failed"; tail -30 build/lily.log; }) &
done
wait
log "gdn cases, 53556b8's scan (old) and this one (new), alternating"
for r in 1 2; do
  for v in old new; do
    timeout 60 build/pk_$v --gdn > "$OUT/gdn_mma_${v}_$r.log" 2>&1
    grep -E "ms|FAIL|passed" "$OUT/gdn_mma_${v}_$r.log" | sed "s/^/$v r$r /"
  done
done
grep -q "all passed" "$OUT/gdn_mma_new_1.log" || { echo "new scan failed: no tests, no bench"; cat "$OUT/gdn_mma_new_1.log" | head -40; exit 1; }
log "synth (background) and the CUDA tests on A"
(PYTHONPATH=$ROOT/src python3 -m lily.cli synth --scale full --out /tmp/synth-full > "$OUT/synth.log" 2>&1 || tail -5 "$OUT/synth.log"; log "synth done") &
LILY_TEST_MODELS=$ROOT/models STEPS=test timeout 240 bash benchmarks/cuda_device.sh 2>&1 | grep -E "passed|failed|FAILED|ERROR|cuda vs"
wait
log bench
r=1
for n in B A B A; do
  T=$ROOT; [ $n = B ] && T=/tmp/ab/B
  (cd "$T" && PYTHONPATH=$T/src timeout 80 python3 "$ROOT"/benchmarks/cuda_bench.py --model /tmp/synth-full --lengths 512,4096 \
     --contexts 128 --decode-tokens 8 --repeats 2 --json "$OUT/bench_mma_${n}_$r.json" 2>&1 | grep -E "prefill|Error" | sed "s/^/$n r$r /")
  r=$((r + 1))
  [ $SECONDS -gt 480 ] && break
done
log done
