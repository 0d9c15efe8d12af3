#!/bin/bash
# Issue 14's figures in one device call (docs/performance.md, "CUDA backend on one H200"): llama.cpp e21cdc11a
# built in the background from the start (PEER: benchmarks/peers/llamacpp.sh set up as benchmarks/peers/README.md
# says, default .peer/peer.sh); lily built, its decode kernel harness, the CUDA tests, the full-size decode and
# prefill benchmarks and `lily bench`; then llama-bench; transformers bf16 and the bytes of a decode step (ncu)
# while time is left. Run from the root of a copy of the repository, with $OUT set (at most 8 files come back).
# FALLBACK: a second tree whose tests and benchmarks run instead when the decode harness fails in this one.
# BUDGET: seconds from the start by which llama.cpp's jobs stop (560); END: by which the optional steps
# (transformers, the bytes of a step) must be done (590). STAGE1: cuda_device.sh's steps before the tests
# ("build decode"). PRE: a script run once llama.cpp's build has started, before lily is built (a kernel's A/B
# that may change the tree, say).
set -u
cd "$(dirname "$0")/.."
T0=$(date +%s)
PEER=${PEER:-.peer/peer.sh}
el() { echo "== +$(( $(date +%s) - T0 )) s $*"; }
export PEER_DEADLINE=$(( T0 + ${BUDGET:-560} )) LILY_TEST_MODELS=${LILY_TEST_MODELS:-$PWD/models} PEER_NICE=0 PEER_JOBS=14
mkdir -p "$OUT/extra"
bash "$PEER" start
if [ -n "${PRE:-}" ]; then el "$PRE"; bash "$PRE"; fi
STAGE1=${STAGE1:-build decode}
el "lily: $STAGE1"
nice -n 5 env STEPS="$STAGE1" bash benchmarks/cuda_device.sh > "$OUT/extra/stage1.txt" 2>&1
mv "$OUT/logs.tar.gz" "$OUT/extra/logs_build_kernels.tar.gz" 2>/dev/null
grep -E "FAIL|passed|ERROR SUMMARY|error|time |tiles|step|argmax|cuda:" "$OUT/extra/stage1.txt" | tail -22
TREE=$PWD
if [[ " $STAGE1 " == *" decode "* ]] && ! grep -q "all passed" "$OUT/extra/stage1.txt" && [ -n "${FALLBACK:-}" ]; then
  el "harness failed: the fallback tree"; TREE=$FALLBACK
  (cd "$TREE" && STEPS="build" bash benchmarks/cuda_device.sh > "$OUT/extra/stage1_fb.txt" 2>&1; rm -f "$OUT/logs.tar.gz")
fi
el "lily tests + benchmarks in $TREE"
(cd "$TREE" && STEPS="synth test bench lilybench" LENGTHS=512,4096 CONTEXTS=128,1024,4096 \
  bash benchmarks/cuda_device.sh 2>&1 | grep -v "^PASSED" | tail -30)
el "llama.cpp"
bash "$PEER" bench 2>&1 | tail -22
LEFT=$(( T0 + ${END:-590} - $(date +%s) ))
if [ $LEFT -gt 60 ]; then
  el "transformers bf16 (${LEFT} s)"
  (cd "$TREE" && PYTHONPATH=src PYTHONUNBUFFERED=1 timeout $(( LEFT > 150 ? LEFT - 70 : LEFT )) python3 \
    benchmarks/transformers_peer.py --decode-tokens 16 --repeats 2 --json "$OUT/transformers_bf16_h200.json" \
    > "$OUT/extra/transformers.log" 2>&1; tail -6 "$OUT/extra/transformers.log")
else
  el "transformers skipped (${LEFT} s left)"
fi
LEFT=$(( T0 + ${END:-590} - $(date +%s) ))
if [ $LEFT -gt 50 ]; then
  el "bytes per decode step (${LEFT} s)"
  (cd "$TREE" && PYTHONPATH=src timeout $(( LEFT - 5 )) python3 benchmarks/cuda_bytes.py --model /tmp/synth-full \
    --json "$OUT/extra/cuda_bytes.json" 2>&1 | tail -3)
fi
cp /tmp/lily-peer/build.log "$OUT/extra/llama_build.log" 2>/dev/null
tar czf "$OUT/extra.tgz" -C "$OUT" extra && rm -rf "$OUT/extra"
el "done"; ls "$OUT"
