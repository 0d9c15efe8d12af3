// sample: the next token from logits f32 [V] in one dispatch of one threadgroup (LILY_SAMPLE_THREADS
// threads), with the semantics and order of operations of csrc/core/sampling.h: repetition penalty over
// seen uint8 [V], frequency / presence penalties over counts int32 [V], greedy (temperature 0, no draw) or
// temperature -> top_k -> top_p -> min_p -> inverse CDF at u from Philox4x32-10. The chosen token goes into
// the int32 token slot (the next step's input) and into seen / counts, so the next step's penalties see it
// without the CPU. logits are never written (the host may still read them for logprobs).
//
// Nothing is sorted and no penalised copy is stored: every pass re-reads logits (and seen / counts when a
// penalty is on) and recomputes the penalised logit l and its order-preserving 32-bit key. Passes over V:
//   1      max (the greedy token; exp's reference) + the first top-k digit histogram      (always)
//   0..3   the remaining top-k digits; stops once the selected bin is wholly inside the top k   (top_k)
//   1..4   top-p digits weighted by mass e = exp((l - max) / T); stops at a bin of one token    (top_p)
//   1      kept mass per simdgroup over contiguous id ranges (the CDF in id order)              (sampling)
//   1/32   the simdgroup whose range holds u·K re-walks it to find the token                    (sampling)
// so greedy costs 1 pass, plain temperature sampling 2, and everything on at most 9.
// A thread owns logits tid, tid + nthreads, ... in the histogram passes (coalesced); simdgroup s owns the
// contiguous ids [s·R, s·R + R) in the CDF passes, 32 consecutive ids per step, so prefix sums in id order
// need only simd_prefix_* within a step and one scan over the simdgroups.
// Precision: fp32 throughout (Metal has no double; the host uses double). u is the top 24 bits of Philox
// word 0, i.e. the host's 53-bit u truncated to 24 bits; the host and this kernel can pick different tokens
// only when u·K lies within fp32 rounding (~1e-6 relative) of a CDF step, or a top-p / min-p boundary does.
// The top-p masses are summed in 64-bit fixed point by integer atomics (Apple GPUs have float atomics in
// device memory only): integer sums do not depend on the order threads run in, so the top-p cut is
// deterministic.
// Previous hop: csrc/backends/metal/sample.cpp (encode_sample).
#include <metal_stdlib>
#include "lily_args.h"

using namespace metal;

// The key of -inf: survivors have larger keys (NaN logits count as -inf).
constant constexpr uint kNegInfKey = 0x007FFFFFu;

// Order-preserving map float -> uint (a < b <=> key(a) < key(b) for non-NaN floats), and back. -0 maps to
// the key of +0: the host sees them as equal, i.e. as a tie broken by id.
static inline uint order_key(float f) {
  const uint b = as_type<uint>(f) == 0x80000000u ? 0u : as_type<uint>(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
static inline float key_value(uint k) { return as_type<float>((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k); }

static inline float penalised(constant SampleArgs& a, device const float* logits, device const uchar* seen,
                              device const int* counts, int i) {
  float l = logits[i];
  if (isnan(l)) return -INFINITY;
  if (a.repetition_penalty != 1.0f && seen[i] != 0) l = l > 0.0f ? l / a.repetition_penalty : l * a.repetition_penalty;
  if (a.presence_penalty != 0.0f || a.frequency_penalty != 0.0f) {
    const int c = counts[i];
    if (c > 0) l -= a.frequency_penalty * float(c) + a.presence_penalty;
  }
  return l;
}

// Unnormalised probability relative to the largest (which gets exactly 1).
static inline float mass(float l, float mx, float inv_t) { return exp((l - mx) * inv_t); }

// Word 0 of Philox4x32-10 (sampling.cpp's Philox::block) for key and counter, each as (lo, hi).
static inline uint philox_word0(uint k0, uint k1, uint c0, uint c1) {
  const uint M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  uint c2 = 0, c3 = 0;
  for (int r = 0; r < 10; ++r) {
    const uint n0 = mulhi(M1, c2) ^ c1 ^ k0, n1 = M1 * c2;
    const uint n2 = mulhi(M0, c0) ^ c3 ^ k1, n3 = M0 * c0;
    c0 = n0, c1 = n1, c2 = n2, c3 = n3;
    k0 += W0, k1 += W1;
  }
  return c0;
}

// Top-p masses in fixed point: e in (0, 1] times 2^40. A sum over V < 2^24 tokens fits in 64 bits, and a
// token's rounding (< 2^-40) is far below fp32's relative 2^-24 on the sums the cut compares.
constant constexpr float kMassScale = 1099511627776.0f;  // 2^40

// The threadgroup's histogram of one 8-bit digit: token counts and (top-p) masses, each mass a 64-bit
// fixed-point sum kept as two 32-bit halves (atomic_uint is what threadgroup memory supports everywhere).
struct Histogram {
  threadgroup atomic_uint* n;
  threadgroup atomic_uint* m_lo;
  threadgroup atomic_uint* m_hi;
};

static inline void add_mass(Histogram h, uint bin, float e) {
  const ulong q = ulong(e * kMassScale);
  const uint q_lo = uint(q), q_hi = uint(q >> 32);
  const uint old = atomic_fetch_add_explicit(&h.m_lo[bin], q_lo, memory_order_relaxed);
  const uint carry = old + q_lo < old ? 1u : 0u;  // the low half wrapped: exactly once per wrap, whatever the order
  if (q_hi + carry != 0) atomic_fetch_add_explicit(&h.m_hi[bin], q_hi + carry, memory_order_relaxed);
}

static inline ulong bin_mass(Histogram h, uint bin) {
  return ulong(atomic_load_explicit(&h.m_hi[bin], memory_order_relaxed)) << 32 |
         atomic_load_explicit(&h.m_lo[bin], memory_order_relaxed);
}

// Kept mass of one simdgroup's range: its mass without the ties at θ, plus the ties that still fit in n_keep.
static inline float range_mass(float other, uint ties, uint ties_before, uint n_keep, float w_theta) {
  return other + w_theta * float(min(ties, n_keep - min(n_keep, ties_before)));
}

static inline void clear_histogram(Histogram h, uint tid, uint nthreads) {
  for (uint b = tid; b < uint(LILY_SAMPLE_BINS); b += nthreads) {
    atomic_store_explicit(&h.n[b], 0u, memory_order_relaxed);
    atomic_store_explicit(&h.m_lo[b], 0u, memory_order_relaxed);
    atomic_store_explicit(&h.m_hi[b], 0u, memory_order_relaxed);
  }
}

kernel void sample_token(constant SampleArgs& a [[buffer(0)]],
                         device const float* logits [[buffer(LILY_SAMPLE_LOGITS)]],
                         device uchar* seen [[buffer(LILY_SAMPLE_SEEN)]],
                         device int* counts [[buffer(LILY_SAMPLE_COUNTS)]],
                         device int* token [[buffer(LILY_SAMPLE_TOKEN)]],
                         uint tid [[thread_index_in_threadgroup]],
                         uint nthreads [[threads_per_threadgroup]],
                         uint sg [[simdgroup_index_in_threadgroup]],
                         uint lane [[thread_index_in_simdgroup]]) {
  constexpr int NSG = LILY_SAMPLE_THREADS / LILY_SIMD_WIDTH;
  threadgroup atomic_uint hist_n[LILY_SAMPLE_BINS];
  threadgroup atomic_uint hist_m_lo[LILY_SAMPLE_BINS];
  threadgroup atomic_uint hist_m_hi[LILY_SAMPLE_BINS];
  threadgroup float part_v[NSG];  // per simdgroup: max, then kept mass
  threadgroup uint part_u[NSG];   // per simdgroup: first index of the max, then top-p ties at the boundary
  threadgroup uint pick_u[3];     // thread 0's digit scans: chosen bin, tokens still needed / in the bin, bin done
  threadgroup ulong pick_m[2];    // top-p, fixed point: mass above the chosen bin, target top_p · S
  const Histogram hist{hist_n, hist_m_lo, hist_m_hi};
  const int V = a.vocab;
  const uint nsg = nthreads / LILY_SIMD_WIDTH;
  const bool top_k = a.temperature > 0.0f && a.top_k > 0 && a.top_k < V;

  // ---- pass 1: the first maximum of the penalised logits, and the top-k histogram of the key's top digit.
  if (top_k) clear_histogram(hist, tid, nthreads);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint none = 0xFFFFFFFFu;
  float bv = -INFINITY;
  uint bi = none;
  for (int i = int(tid); i < V; i += int(nthreads)) {
    const float l = penalised(a, logits, seen, counts, i);
    if (bi == none || l > bv) bv = l, bi = uint(i);
    if (top_k) atomic_fetch_add_explicit(&hist_n[order_key(l) >> 24], 1u, memory_order_relaxed);
  }
  float mx = simd_max(bv);
  uint arg = simd_min(bv == mx ? bi : none);
  if (lane == 0) part_v[sg] = mx, part_u[sg] = arg;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // Every simdgroup reduces the partials itself: all threads learn the maximum without another barrier.
  {
    const float v = lane < nsg ? part_v[lane] : -INFINITY;
    mx = simd_max(v);
    arg = simd_min(lane < nsg && v == mx ? part_u[lane] : none);
  }
  // Greedy, and the degenerate all -inf row (the host throws there), take the first maximum without a draw.
  if (a.temperature <= 0.0f || mx == -INFINITY) {
    if (tid == 0) {
      token[0] = int(arg);
      seen[arg] = 1;
      counts[arg] += 1;
    }
    return;
  }
  const float inv_t = 1.0f / a.temperature;

  // ---- top_k: radix select of the k-th largest key, one 8-bit digit per pass, most significant first.
  // Survivors are the keys >= lo (ties at the k-th value kept, -inf never).
  uint lo = kNegInfKey + 1;
  if (top_k) {
    uint prefix = 0, need = uint(a.top_k);
    for (int shift = 24;; shift -= 8) {
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (tid == 0) {
        uint above = 0, b = LILY_SAMPLE_BINS;
        while (b > 0) {
          const uint c = atomic_load_explicit(&hist_n[--b], memory_order_relaxed);
          if (above + c >= need) {
            pick_u[0] = b;
            pick_u[1] = need - above;
            pick_u[2] = above + c == need;  // the whole bin is inside the top k
            break;
          }
          above += c;
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      prefix = prefix << 8 | pick_u[0];
      need = pick_u[1];
      if (pick_u[2] != 0 || shift == 0) {
        lo = max(lo, prefix << shift);
        break;
      }
      clear_histogram(hist, tid, nthreads);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (int i = int(tid); i < V; i += int(nthreads)) {
        const uint k = order_key(penalised(a, logits, seen, counts, i));
        if (k >> shift == prefix) atomic_fetch_add_explicit(&hist_n[(k >> (shift - 8)) & 0xFFu], 1u, memory_order_relaxed);
      }
    }
  }

  // ---- top_p: θ = the smallest survivor key whose mass strictly above is < top_p · S (S: survivors' mass).
  // Mass-weighted radix select: per digit, the lowest non-empty bin whose mass above is still < target.
  // Tokens with key > θ are kept; of the n_theta tokens equal to θ (weight w each, id order) the first
  // n_keep, those whose mass before them is < target. A bin holding one token ends the search early.
  uint theta = 0, n_theta = 0, n_keep = 0;
  ulong above = 0, target = 0;
  float w_theta = 0.0f;
  if (a.top_p < 1.0f) {
    uint prefix = 0;
    for (int shift = 24;; shift -= 8) {
      clear_histogram(hist, tid, nthreads);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      for (int i = int(tid); i < V; i += int(nthreads)) {
        const float l = penalised(a, logits, seen, counts, i);
        const uint k = order_key(l);
        if (k >= lo && (shift == 24 || k >> (shift + 8) == prefix)) {
          atomic_fetch_add_explicit(&hist_n[(k >> shift) & 0xFFu], 1u, memory_order_relaxed);
          add_mass(hist, (k >> shift) & 0xFFu, mass(l, mx, inv_t));
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (tid == 0) {
        if (shift == 24) {
          ulong S = 0;
          for (int b = LILY_SAMPLE_BINS - 1; b >= 0; --b) S += bin_mass(hist, uint(b));
          target = ulong(a.top_p * float(S));
          pick_m[1] = target;
        }
        // The top non-empty bin always qualifies: the mass above it is the previous digit's, < target.
        ulong cum = above;
        for (int b = LILY_SAMPLE_BINS - 1; b >= 0 && cum < target; --b) {
          const uint c = atomic_load_explicit(&hist_n[b], memory_order_relaxed);
          if (c != 0) pick_u[0] = uint(b), pick_u[1] = c, pick_m[0] = cum;
          cum += bin_mass(hist, uint(b));
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
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
    n_keep = fit >= float(n_theta) ? n_theta : max(1u, uint(ceil(fit)));
  }
  // Ties at θ cut part-way: their ranks in id order decide, so they are counted apart from the other mass.
  const bool partial = n_keep < n_theta;

  // ---- the CDF in id order: kept mass per simdgroup range (min_p: e >= min_p, e of the maximum being 1).
  const int R = ((V + int(nsg) - 1) / int(nsg) + LILY_SIMD_WIDTH - 1) / LILY_SIMD_WIDTH * LILY_SIMD_WIDTH;
  const int begin = int(sg) * R, end = min(V, begin + R);
  float sg_mass = 0.0f;
  uint sg_ties = 0;
  for (int base = begin; base < end; base += LILY_SIMD_WIDTH) {
    const int i = base + int(lane);
    const float l = i < end ? penalised(a, logits, seen, counts, i) : -INFINITY;
    const uint k = order_key(l);
    const float e = mass(l, mx, inv_t);
    const bool kept = k >= lo && e >= a.min_p;
    const bool tie = partial && kept && k == theta;
    sg_mass += simd_sum(kept && !tie ? e : 0.0f);
    sg_ties += simd_sum(tie ? 1u : 0u);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // part_v / part_u are reused
  if (lane == 0) part_v[sg] = sg_mass, part_u[sg] = sg_ties;
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // Every thread scans the simdgroup totals (nsg values, the same order everywhere) to find the range where
  // the cumulative kept mass first exceeds u·K; rounding can leave u·K >= the total: then the last kept token.
  const float u = float(philox_word0(a.seed_lo, a.seed_hi, a.counter_lo, a.counter_hi) >> 8) * (1.0f / 16777216.0f);
  float K = 0.0f;
  uint ties = 0;
  for (uint s = 0; s < nsg; ++s) {
    K += range_mass(part_v[s], part_u[s], ties, n_keep, w_theta);
    ties += part_u[s];
  }
  const float r = u * K;
  float cum = 0.0f;
  uint star = nsg, last = 0, last_ties = 0, star_ties = 0;
  float star_cum = 0.0f;
  ties = 0;
  for (uint s = 0; s < nsg; ++s) {
    const float m = range_mass(part_v[s], part_u[s], ties, n_keep, w_theta);
    if (m > 0.0f) last = s, last_ties = ties;
    if (star == nsg && cum + m > r) star = s, star_cum = cum, star_ties = ties;
    cum += m;
    ties += part_u[s];
  }
  // No crossing: the re-walk of the last range with mass starts at -inf, so it ends on its last kept token.
  if (star == nsg) star = last, star_cum = -INFINITY, star_ties = last_ties;
  if (sg != star) return;

  // ---- the chosen range, again in steps of 32 ids, now with inclusive prefix sums.
  float run = star_cum;
  uint tie_run = star_ties;
  int chosen = -1, last_kept = -1;
  for (int base = begin; base < end && chosen < 0; base += LILY_SIMD_WIDTH) {
    const int i = base + int(lane);
    const float l = i < end ? penalised(a, logits, seen, counts, i) : -INFINITY;
    const uint k = order_key(l);
    const float e = mass(l, mx, inv_t);
    bool kept = k >= lo && e >= a.min_p;
    const bool tie = partial && kept && k == theta;
    const uint rank = tie_run + simd_prefix_exclusive_sum(tie ? 1u : 0u);
    if (tie) kept = rank < n_keep;
    const float w = kept ? e : 0.0f;
    const float incl = run + simd_prefix_inclusive_sum(w);
    const uint hit = uint(ulong(simd_ballot(kept && incl > r)));
    const uint any = uint(ulong(simd_ballot(kept)));
    if (hit != 0) chosen = base + int(ctz(hit));
    if (any != 0) last_kept = base + 31 - int(clz(any));
    run += simd_sum(w);
    tie_run += simd_sum(tie ? 1u : 0u);
  }
  if (lane == 0) {
    const int t = chosen >= 0 ? chosen : last_kept;
    token[0] = t;
    seen[t] = 1;
    counts[t] += 1;
  }
}
