#!/usr/bin/env bash
# POST for benchmarks/cuda_h200_run.sh (PRE=apply.sh beside it): one round of ab.sh on the figures call's own
# build and full-size checkpoint (complete once the benchmarks before have run on it).
grep -q mix_project csrc/schedule/backend.h || { echo "the tree measured has no mix_project (the fallback): no A/B"; exit 0; }
touch /tmp/synth-full/.complete
ROUNDS=1 bash "$(dirname "$0")/ab.sh"
