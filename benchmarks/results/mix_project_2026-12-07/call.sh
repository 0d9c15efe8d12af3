#!/usr/bin/env bash
# Prepared, not run: no device machine was lent in the session that wrote it (2026-12-07, from 20:03 UTC).
# mix_project.patch: a layer's out projection inside the kernel that makes its mix row (Fusions::mix_project:
# the GDN step, the attention's merge; OutSlab in csrc/backends/cuda/kernels.cuh). This call applies it, builds
# lily and the decode harness (its mix_project_case under compute-sanitizer at the small shapes, then in full),
# and runs the CUDA tests (the fusion on by default, and switched off in test_each_fusion_off_decodes_the_same),
# ~6 min. Then ab.sh beside it (~4 min), on the same warm machine: greedy decode at 4K with the fusion on and
# off in the same build. From the tree's root, with `models` carried (the tiny test models,
# benchmarks/cuda_test_models.py):
#
#   bash benchmarks/results/mix_project_2026-12-07/call.sh
#   bash benchmarks/results/mix_project_2026-12-07/ab.sh
set -u
patch -p1 -s < benchmarks/results/mix_project_2026-12-07/mix_project.patch || { echo "the patch does not apply"; exit 1; }
export LILY_TEST_MODELS=$PWD/models
STEPS="build decode synth test" bash benchmarks/cuda_device.sh 2>&1 | grep -v "^ok\| ok$" | tail -40
# the full-size checkpoint cuda_device.sh began in the background, for ab.sh: a process left running is killed
# when the call returns, so it is waited for and marked complete here
while pgrep -f "lily.cli synth" >/dev/null; do sleep 2; done
[ -f /tmp/synth-full/config.json ] && touch /tmp/synth-full/.complete
