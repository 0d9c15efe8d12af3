// Device token selection: the next token from logits f32 [V] in one block of LILY_SAMPLE_THREADS threads,
// the CUDA counterpart of metal/sample.metal — the same algorithm (read that file's header for the passes, their
// costs and why nothing is sorted), the same SampleArgs (metal/lily_args.h) and the same semantics and order of
// operations as the host Sampler (csrc/core/sampling.h). Greedy with a penalty is its one-pass special case
// (plain greedy takes argmax_kernel).
//
// What differs from Metal:
// - SampleArgs lives in device memory and the kernel advances its Philox counter itself after a sampled
//   token: a captured decode graph replays the same kernel parameters every step, so whatever changes per
//   step or per generation (the counter; the parameters, uploaded by select_begin) must be read from memory.
//   The counter counts sampled steps (sampling.h: one draw per sampled token), the degenerate all -inf row
//   included, as GpuBackend's host counter does.
// - The top-p masses (fixed point, 2^40) are summed with 64-bit shared-memory atomics instead of two 32-bit
//   halves: still integer sums, so the top-p cut does not depend on the order threads run in.
// - One block has only its own loads in flight, so every pass loads kBatch ids a thread before using them,
//   and the CDF pass sums each lane's ids before one warp reduction (Metal: a simd_sum per 32 ids); the
//   re-walk carries its running sum as the last lane's inclusive prefix, the value its crossing test compares.
// - simd_* collectives are warp shuffles and ballots; exp is expf (full precision: the build uses no fast
//   math), so the fp32 differences from the host's double are those sample.metal's header describes.
// Previous hop: CudaBackend::select_token (cuda_backend.cu); tests: tests/test_cuda.py (cuda_sample).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels.cuh"
#include "lily_args.h"

namespace lily::cuda {

static_assert(LILY_SIMD_WIDTH == 32, "the sampler's ranges are steps of one warp");

// The key of -inf: survivors have larger keys (NaN logits count as -inf).
constexpr uint32_t kNegInfKey = 0x007FFFFFu;
// Top-p masses in fixed point: e in (0, 1] times 2^40 (sample.metal: why a sum over V < 2^24 tokens fits).
constexpr float kMassScale = 1099511627776.0f;
constexpr uint32_t kNoToken = 0xFFFFFFFFu;

// Order-preserving map float -> uint32 (a < b <=> key(a) < key(b) for non-NaN floats), and back. -0 maps to
// the key of +0: the host sees them as equal, i.e. as a tie broken by id.
__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t b = __float_as_uint(f) == 0x80000000u ? 0u : __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float key_value(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// The penalised logit of a token with logit l, seen flag s and generated count c (sampling.h's steps 1-2).
__device__ __forceinline__ float penalise(const SampleArgs& a, float l, uint8_t s, int32_t c) {
  if (isnan(l)) return -INFINITY;
  if (a.repetition_penalty != 1.0f && s != 0) l = l > 0.0f ? l / a.repetition_penalty : l * a.repetition_penalty;
  // Rounded as the host rounds it (no FMA contraction), so penalised greedy ties break as on the host.
  if ((a.presence_penalty != 0.0f || a.frequency_penalty != 0.0f) && c > 0)
    l -= __fadd_rn(__fmul_rn(a.frequency_penalty, float(c)), a.presence_penalty);
  return l;
}

// Ids a pass loads before it uses any: one block has only its own threads' loads in flight, and a row read
// one load a thread at a time is bound by the memory latency (argmax_kernel measured ~100 µs over 248K logits).
constexpr int kBatch = 8;

// The row every pass re-reads: logits and, under a penalty, seen / counts.
struct PenalisedRow {
  const SampleArgs& a;
  const float* logits;
  const uint8_t* seen;
  const int32_t* counts;

  // l[j]: the penalised logit of id first + j · stride, -inf from `end` on.
  __device__ __forceinline__ void load(int first, int stride, int end, float (&l)[kBatch]) const {
    const bool rep = a.repetition_penalty != 1.0f, freq = a.presence_penalty != 0.0f || a.frequency_penalty != 0.0f;
    float raw[kBatch];
    uint8_t s[kBatch];
    int32_t c[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = first + j * stride;
      raw[j] = i < end ? logits[i] : -INFINITY;
      s[j] = rep && i < end ? seen[i] : 0;
      c[j] = freq && i < end ? counts[i] : 0;
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) l[j] = penalise(a, raw[j], s[j], c[j]);
  }

  // f(i, l) for the block's share of the ids, i = threadIdx.x + k · blockDim.x in increasing k.
  template <class F>
  __device__ __forceinline__ void for_each(F&& f) const {
    const int V = a.vocab, n = int(blockDim.x);
    for (int base = int(threadIdx.x); base < V; base += kBatch * n) {
      float l[kBatch];
      load(base, n, V, l);
#pragma unroll
      for (int j = 0; j < kBatch; ++j)
        if (base + j * n < V) f(base + j * n, l[j]);
    }
  }
};

// Unnormalised probability relative to the largest (which gets exactly 1).
__device__ __forceinline__ float mass(float l, float mx, float inv_t) { return expf((l - mx) * inv_t); }

// Word 0 of Philox4x32-10 (sampling.cpp's Philox::block) for key and counter, each as (lo, hi).
__device__ __forceinline__ uint32_t philox_word0(uint32_t k0, uint32_t k1, uint32_t c0, uint32_t c1) {
  const uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  uint32_t c2 = 0, c3 = 0;
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const uint32_t n0 = __umulhi(M1, c2) ^ c1 ^ k0, n1 = M1 * c2;
    const uint32_t n2 = __umulhi(M0, c0) ^ c3 ^ k1, n3 = M0 * c0;
    c0 = n0, c1 = n1, c2 = n2, c3 = n3;
    k0 += W0, k1 += W1;
  }
  return c0;
}

// Inclusive prefix sum over the warp's lanes in lane order.
__device__ __forceinline__ float warp_prefix_sum(float v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float n = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += n;
  }
  return v;
}

// The block's histogram of one 8-bit digit: token counts and (top-p) fixed-point masses.
struct DigitHistogram {
  uint32_t n[LILY_SAMPLE_BINS];
  unsigned long long m[LILY_SAMPLE_BINS];

  __device__ __forceinline__ void clear() {
    for (int b = threadIdx.x; b < LILY_SAMPLE_BINS; b += blockDim.x) n[b] = 0, m[b] = 0;
  }
};

// Kept mass of one warp's range: its mass without the ties at θ, plus the ties that still fit in n_keep.
__device__ __forceinline__ float range_mass(float other, uint32_t ties, uint32_t ties_before, uint32_t n_keep,
                                            float w_theta) {
  return other + w_theta * float(min(ties, n_keep - min(n_keep, ties_before)));
}

// The chosen token into *token and into seen / counts (Sampler::accept); a sampled step advances the counter.
__device__ __forceinline__ void record_token(SampleArgs* args, const SampleArgs& a, uint32_t t, int32_t* token,
                                       uint8_t* seen, int32_t* counts) {
  *token = int32_t(t);
  seen[t] = 1;
  counts[t] += 1;
  if (a.temperature > 0.0f) {
    const uint64_t next = (uint64_t(a.counter_hi) << 32 | a.counter_lo) + 1;
    args->counter_lo = uint32_t(next);
    args->counter_hi = uint32_t(next >> 32);
  }
}

// One block of LILY_SAMPLE_THREADS threads. args: the generation's SampleArgs in device memory (read by every
// thread before the first barrier, so the one write of its counter at the end races with no read).
__global__ void __launch_bounds__(LILY_SAMPLE_THREADS)
sample_token_kernel(SampleArgs* args, const float* logits, uint8_t* seen, int32_t* counts, int32_t* token) {
  constexpr int kWarps = LILY_SAMPLE_THREADS / 32;
  __shared__ DigitHistogram hist;
  __shared__ float part_v[kWarps];     // per warp: max, then kept mass
  __shared__ uint32_t part_u[kWarps];  // per warp: first index of the max, then top-p ties at the boundary
  __shared__ uint32_t pick_u[3];       // thread 0's digit scans: chosen bin, tokens still needed / in the bin, bin done
  __shared__ unsigned long long pick_m[2];  // top-p, fixed point: mass above the chosen bin, target top_p · S
  start_next_kernel();
  // Only the previous step's selection writes args, seen and counts (and the host, before the step): the
  // args load may overlap the lm_head's drain, the logits wait for it.
  const SampleArgs a = *args;
  wait_previous_kernel();
  const int tid = threadIdx.x, nthreads = blockDim.x, lane = tid & 31, warp = tid >> 5, nwarps = nthreads >> 5;
  const int V = a.vocab;
  const bool top_k = a.temperature > 0.0f && a.top_k > 0 && a.top_k < V;
  const PenalisedRow row{a, logits, seen, counts};

  // ---- pass 1: the first maximum of the penalised logits, and the top-k histogram of the key's top digit.
  if (top_k) hist.clear();
  __syncthreads();
  float bv = -INFINITY;
  uint32_t bi = kNoToken;
  row.for_each([&](int i, float l) {
    if (bi == kNoToken || l > bv) bv = l, bi = uint32_t(i);
    if (top_k) atomicAdd(&hist.n[order_key(l) >> 24], 1u);
  });
  float mx = bv;
#pragma unroll
  for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  uint32_t arg = bv == mx ? bi : kNoToken;
#pragma unroll
  for (int o = 16; o; o >>= 1) arg = min(arg, __shfl_xor_sync(0xffffffffu, arg, o));
  if (lane == 0) part_v[warp] = mx, part_u[warp] = arg;
  __syncthreads();
  // Every warp reduces the partials itself: all threads learn the maximum without another barrier.
  {
    const float v = lane < nwarps ? part_v[lane] : -INFINITY;
    mx = v;
#pragma unroll
    for (int o = 16; o; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    arg = lane < nwarps && v == mx ? part_u[lane] : kNoToken;
#pragma unroll
    for (int o = 16; o; o >>= 1) arg = min(arg, __shfl_xor_sync(0xffffffffu, arg, o));
  }
  // Greedy, and the degenerate all -inf row (the host throws there), take the first maximum without a draw.
  if (a.temperature <= 0.0f || mx == -INFINITY) {
    if (tid == 0) record_token(args, a, arg, token, seen, counts);
    return;
  }
  const float inv_t = 1.0f / a.temperature;

  // ---- top_k: radix select of the k-th largest key, one 8-bit digit per pass, most significant first.
  // Survivors are the keys >= lo (ties at the k-th value kept, -inf never).
  uint32_t lo = kNegInfKey + 1;
  if (top_k) {
    uint32_t prefix = 0, need = uint32_t(a.top_k);
    for (int shift = 24;; shift -= 8) {
      __syncthreads();
      if (tid == 0) {
        uint32_t above = 0, b = LILY_SAMPLE_BINS;
        while (b > 0) {
          const uint32_t c = hist.n[--b];
          if (above + c >= need) {
            pick_u[0] = b;
            pick_u[1] = need - above;
            pick_u[2] = above + c == need;  // the whole bin is inside the top k
            break;
          }
          above += c;
        }
      }
      __syncthreads();
      prefix = prefix << 8 | pick_u[0];
      need = pick_u[1];
      if (pick_u[2] != 0 || shift == 0) {
        lo = max(lo, prefix << shift);
        break;
      }
      hist.clear();
      __syncthreads();
      row.for_each([&](int, float l) {
        const uint32_t k = order_key(l);
        if (k >> shift == prefix) atomicAdd(&hist.n[(k >> (shift - 8)) & 0xFFu], 1u);
      });
    }
  }

  // ---- top_p: θ = the smallest survivor key whose mass strictly above is < top_p · S (S: survivors' mass).
  // Mass-weighted radix select: per digit, the lowest non-empty bin whose mass above is still < target.
  // Tokens with key > θ are kept; of the n_theta tokens equal to θ (weight w each, id order) the first
  // n_keep, those whose mass before them is < target. A bin holding one token ends the search early.
  uint32_t theta = 0, n_theta = 0, n_keep = 0;
  unsigned long long above = 0, target = 0;
  float w_theta = 0.0f;
  if (a.top_p < 1.0f) {
    uint32_t prefix = 0;
    for (int shift = 24;; shift -= 8) {
      hist.clear();
      __syncthreads();
      row.for_each([&](int, float l) {
        const uint32_t k = order_key(l);
        if (k >= lo && (shift == 24 || k >> (shift + 8) == prefix)) {
          const uint32_t bin = (k >> shift) & 0xFFu;
          atomicAdd(&hist.n[bin], 1u);
          atomicAdd(&hist.m[bin], static_cast<unsigned long long>(mass(l, mx, inv_t) * kMassScale));
        }
      });
      __syncthreads();
      if (tid == 0) {
        if (shift == 24) {
          unsigned long long S = 0;
          for (int b = LILY_SAMPLE_BINS - 1; b >= 0; --b) S += hist.m[b];
          target = static_cast<unsigned long long>(a.top_p * float(S));
          pick_m[1] = target;
        }
        // The top non-empty bin always qualifies: the mass above it is the previous digit's, < target.
        unsigned long long cum = above;
        for (int b = LILY_SAMPLE_BINS - 1; b >= 0 && cum < target; --b) {
          const uint32_t c = hist.n[b];
          if (c != 0) pick_u[0] = uint32_t(b), pick_u[1] = c, pick_m[0] = cum;
          cum += hist.m[b];
        }
      }
      __syncthreads();
      prefix = prefix << 8 | pick_u[0];
      n_theta = pick_u[1];
      above = pick_m[0];
      target = pick_m[1];
      if (n_theta == 1 || shift == 0) {
        theta = prefix << shift;
        break;
      }
    }
    lo = max(lo, theta);
    // n_theta > 1 only after all four digits: then θ is one exact value.
    w_theta = mass(key_value(theta), mx, inv_t);
    const float fit = float(target - above) / kMassScale / w_theta;  // > 0: tokens i with above + i·w < target
    n_keep = fit >= float(n_theta) ? n_theta : max(1u, uint32_t(ceilf(fit)));
  }
  // Ties at θ cut part-way: their ranks in id order decide, so they are counted apart from the other mass.
  const bool partial = n_keep < n_theta;

  // ---- the CDF in id order: kept mass per warp range (min_p: e >= min_p, e of the maximum being 1).
  const int R = ((V + nwarps - 1) / nwarps + 31) / 32 * 32;
  const int begin = warp * R, end = min(V, begin + R);
  // Each lane sums its own ids first (no collective per step); the re-walk's sums round a little differently,
  // which only moves a CDF step by rounding (the fallback below catches a crossing rounding lost).
  float lane_mass = 0.0f;
  uint32_t lane_ties = 0;
  for (int base = begin; base < end; base += 32 * kBatch) {
    float l[kBatch];
    row.load(base + lane, 32, end, l);
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const uint32_t k = order_key(l[j]);
      const float e = mass(l[j], mx, inv_t);
      const bool kept = k >= lo && e >= a.min_p;
      const bool tie = partial && kept && k == theta;
      lane_mass += kept && !tie ? e : 0.0f;
      lane_ties += tie;
    }
  }
  const float warp_mass = warp_sum(lane_mass);
  const uint32_t warp_ties = __reduce_add_sync(0xffffffffu, lane_ties);
  __syncthreads();  // part_v / part_u are reused
  if (lane == 0) part_v[warp] = warp_mass, part_u[warp] = warp_ties;
  __syncthreads();

  // Every thread scans the warp totals (nwarps values, the same order everywhere) to find the range where the
  // cumulative kept mass first exceeds u·K; rounding can leave u·K >= the total: then the last kept token.
  const float u = float(philox_word0(a.seed_lo, a.seed_hi, a.counter_lo, a.counter_hi) >> 8) * (1.0f / 16777216.0f);
  float K = 0.0f;
  uint32_t ties = 0;
  for (int s = 0; s < nwarps; ++s) {
    K += range_mass(part_v[s], part_u[s], ties, n_keep, w_theta);
    ties += part_u[s];
  }
  const float r = u * K;
  float cum = 0.0f, star_cum = 0.0f;
  int star = nwarps, last = 0;
  uint32_t last_ties = 0, star_ties = 0;
  ties = 0;
  for (int s = 0; s < nwarps; ++s) {
    const float m = range_mass(part_v[s], part_u[s], ties, n_keep, w_theta);
    if (m > 0.0f) last = s, last_ties = ties;
    if (star == nwarps && cum + m > r) star = s, star_cum = cum, star_ties = ties;
    cum += m;
    ties += part_u[s];
  }
  // No crossing: the re-walk of the last range with mass starts at -inf, so it ends on its last kept token.
  if (star == nwarps) star = last, star_cum = -INFINITY, star_ties = last_ties;
  if (warp != star) return;

  // ---- the chosen range, again in steps of 32 ids, now with inclusive prefix sums.
  float run = star_cum;
  uint32_t tie_run = star_ties;
  int chosen = -1, last_kept = -1;
  for (int base = begin; base < end && chosen < 0; base += 32 * kBatch) {
    float l[kBatch];
    row.load(base + lane, 32, end, l);
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int step = base + 32 * j;
      const uint32_t k = order_key(l[j]);
      const float e = mass(l[j], mx, inv_t);
      bool kept = k >= lo && e >= a.min_p;
      const bool tie = partial && kept && k == theta;
      const uint32_t ties = __ballot_sync(0xffffffffu, tie);
      if (tie) kept = tie_run + __popc(ties & ((1u << lane) - 1u)) < n_keep;  // rank in id order
      const float w = kept ? e : 0.0f;
      const float incl = run + warp_prefix_sum(w, lane);
      const uint32_t hit = __ballot_sync(0xffffffffu, kept && incl > r);
      const uint32_t any = __ballot_sync(0xffffffffu, kept);
      if (hit != 0) {
        chosen = step + __ffs(hit) - 1;
        break;
      }
      if (any != 0) last_kept = step + 31 - __clz(any);
      run = __shfl_sync(0xffffffffu, incl, 31);
      tie_run += __popc(ties);
    }
  }
  // Nothing kept only where every mass is NaN (a +inf logit): then the first maximum, never an id off the row.
  const int t = chosen >= 0 ? chosen : last_kept >= 0 ? last_kept : int(arg);
  if (lane == 0) record_token(args, a, uint32_t(t), token, seen, counts);
}

}  // namespace lily::cuda
