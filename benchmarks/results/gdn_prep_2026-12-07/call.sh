#!/usr/bin/env bash
# Every figure of issue 14 in one call, with the GDN packs on the tensor cores checked (and timed against the
# tree before them) first: benchmarks/cuda_h200_run.sh with the harness A/B of benchmarks/cuda_ab_pre.sh as its
# PRE (the call ran a copy of that script written for it, since folded into cuda_ab_pre.sh). Carried: models
# (the tiny test models), .peer (llama.cpp), exp (exp/before.patch: `git diff -R -- csrc` of the change).
AB_WHAT=gdn AB_BEFORE=exp/before.patch PRE=benchmarks/cuda_ab_pre.sh BUDGET=${BUDGET:-470} END=${END:-540} \
  LILY_TEST_MODELS=$PWD/models exec bash benchmarks/cuda_h200_run.sh
