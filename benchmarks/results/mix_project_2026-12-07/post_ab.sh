#!/usr/bin/env bash
# POST for benchmarks/cuda_h200_run.sh: one round of ab.sh beside it on the figures call's own build and
# full-size checkpoint (complete once the benchmarks before have run on it).
touch /tmp/synth-full/.complete
ROUNDS=1 bash "$(dirname "$0")/ab.sh"
