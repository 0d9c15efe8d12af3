#!/usr/bin/env bash
# Every figure of issue 14 in one call, with the GDN packs on the tensor cores checked (and timed against the
# tree before them) first: benchmarks/cuda_h200_run.sh with pre.sh as its PRE. Carried: models (the tiny test
# models), .peer (llama.cpp), exp (exp/before.patch).
PRE=benchmarks/results/gdn_prep_2026-12-07/pre.sh BUDGET=${BUDGET:-470} END=${END:-540} \
  LILY_TEST_MODELS=$PWD/models exec bash benchmarks/cuda_h200_run.sh
