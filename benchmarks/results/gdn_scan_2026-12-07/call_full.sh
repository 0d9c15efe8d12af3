#!/usr/bin/env bash
# Every figure of issue 14 in one call, with the chunked GDN scan on the tensor cores checked (and timed against
# 53556b8's) first: benchmarks/cuda_h200_run.sh with pre_gdn_mma.sh as its PRE and no decode harness (the decode
# kernels are 53556b8's, measured before). Carried: models (the tiny test models), .peer (llama.cpp), exp
# (exp/gdn_chunked_head.cuh, 53556b8's csrc/backends/cuda/gdn_chunked.cuh).
PRE=benchmarks/results/gdn_scan_2026-12-07/pre_gdn_mma.sh STAGE1=build BUDGET=${BUDGET:-470} END=${END:-540} \
  LILY_TEST_MODELS=$PWD/models exec bash benchmarks/cuda_h200_run.sh
