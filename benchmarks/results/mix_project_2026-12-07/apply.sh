#!/usr/bin/env bash
# PRE for benchmarks/cuda_h200_run.sh: the figures call on the tree with mix_project.patch applied; the tree as it
# was first copied to /tmp/fb, the call's FALLBACK should the decode harness fail with the patch.
rm -rf /tmp/fb && mkdir -p /tmp/fb
tar -c --exclude=./models --exclude=./.peer --exclude=./build --exclude=./out . | tar -x -C /tmp/fb
patch -p1 -s < benchmarks/results/mix_project_2026-12-07/mix_project.patch || { echo "the patch does not apply"; exit 1; }
