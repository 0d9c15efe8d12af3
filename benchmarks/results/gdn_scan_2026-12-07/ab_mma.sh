#!/usr/bin/env bash
# The end-to-end A/B of the scan's products on the tensor cores, run on the machine that call_full.sh left warm
# (its build/dev of this tree and /tmp/synth-full in place; exp/ carried). B: a fresh build of a copy with 53556b8's
# scan (exp/gdn_chunked_head.cuh). Prefill 512 / 4K, processes B, A, B, A, each printing which lily._core it loaded.
# (A first try copied build/ and src/lily/_core*.so into B: B then loaded A's module, so bench_same_build_*.json
# are A against A: the spread of one build between processes.)
set -u
ROOT=$PWD
rm -rf /tmp/ab && mkdir -p /tmp/ab/B
tar --exclude=./build --exclude=./models --exclude=./src/lily/_core*.so -cf - . | tar -xf - -C /tmp/ab/B
cp exp/gdn_chunked_head.cuh /tmp/ab/B/csrc/backends/cuda/gdn_chunked.cuh
(cd /tmp/ab/B && cmake -S . -B build/dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v python3)" \
   -DLILY_METAL_EMU=OFF > /tmp/bB.log 2>&1 && cmake --build build/dev -j16 >> /tmp/bB.log 2>&1 \
   && ln -sf /tmp/ab/B/build/dev/_core*.so src/lily/) || { tail -20 /tmp/bB.log; exit 1; }
r=1
for n in B A B A; do
  T=$ROOT; [ $n = B ] && T=/tmp/ab/B
  (cd "$T" && PYTHONPATH=$T/src python3 -c "import lily._core as c; print(c.__file__)" \
     && PYTHONPATH=$T/src timeout 80 python3 "$ROOT"/benchmarks/cuda_bench.py --model /tmp/synth-full --lengths 512,4096 \
        --contexts 128 --decode-tokens 8 --repeats 2 --json "$OUT/bench_mma_${n}_$r.json" 2>&1 | grep -E "prefill|Error" | sed "s/^/$n r$r /")
  r=$((r + 1))
done
