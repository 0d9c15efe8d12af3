#!/usr/bin/env bash
# Prepared, not run (no device time was left): the two prefill GEMM changes beside this script checked and timed
# against the tree before them (the harness's products), then the tests and every figure in one call on the
# tree with both. From the tree's root, with models, .peer and exp carried:
#
#   git apply benchmarks/results/gemm_dequant_2026-12-07/{gemm_diet,group_tile}.patch
#   mkdir -p exp && git diff -R -- csrc > exp/before.patch
#   bash benchmarks/results/gemm_dequant_2026-12-07/next_call.sh
#
# Each change's own share: a variant without the other, e.g. `git diff -R -- csrc/... > exp/no_group_tile.patch`
# of group_tile.patch alone, then `OUT=$OUT WHAT=gemm bash benchmarks/cuda_ab.sh before=exp/before.patch
# diet_only=exp/no_group_tile.patch`.
set -u
AB_WHAT=gemm AB_BEFORE=exp/before.patch PRE=benchmarks/cuda_ab_pre.sh BUDGET=${BUDGET:-500} END=${END:-560} \
  LILY_TEST_MODELS=$PWD/models exec bash benchmarks/cuda_h200_run.sh
