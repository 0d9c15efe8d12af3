#!/usr/bin/env bash
# Prepared, not run: no device machine was lent in the session that wrote it (2026-12-07, from 20:03 UTC).
# mix_project.patch: a layer's out projection inside the kernel that makes its mix row (Fusions::mix_project:
# the GDN step, the attention's merge; OutSlab in csrc/backends/cuda/kernels.cuh). This call applies it, builds
# lily, runs the CUDA tests (the fusion on by default, and switched off in
# test_each_fusion_off_decodes_the_same), then greedy decode at 4K with the fusion on and off in the same build,
# alternating, ROUNDS rounds (~8 min). From the tree's root, with `models` carried (the tiny test models,
# benchmarks/cuda_test_models.py):
#
#   bash benchmarks/results/mix_project_2026-12-07/call.sh
set -u
patch -p1 -s < benchmarks/results/mix_project_2026-12-07/mix_project.patch || { echo "the patch does not apply"; exit 1; }
export LILY_TEST_MODELS=$PWD/models
STEPS="build synth test" bash benchmarks/cuda_device.sh 2>&1 | tail -24
echo "== $(date -u +%T) synth"
while pgrep -f "lily.cli synth" >/dev/null; do sleep 2; done  # (cuda_device.sh's synth runs on in the background)
for r in $(seq 1 "${ROUNDS:-2}"); do
  for v in on off; do
    f=; [ $v = off ] && f=mix_project
    PYTHONPATH=src timeout 100 python3 benchmarks/cuda_ab.py --model /tmp/synth-full --tag "mix_project_$v" \
      --contexts 4096 --fusions "$f" 2>&1 | grep -E "^ab|^turn|Error" | sed "s/^/round $r: /" | tee -a "$OUT/ab.txt"
  done
done
echo "== $(date -u +%T) done"
