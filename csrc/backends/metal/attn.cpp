// The attention family (metal/attn.metal): the fused q/k norm + RoPE + KV-cache write, causal prefill attention
// over the cache, and GQA-packed decode attention with its long-context fixed-block (split-KV) path — the
// encoders, and MetalBackend's attn_* ops. Previous hop: the schedule (csrc/schedule/schedule.cpp; tests:
// csrc/bindings/kernels_attn.cpp); next hop: Encoder::dispatch.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "metal_backend.h"

namespace lily::metal {

static_assert(sizeof(AttnPrepareArgs) == 36 && sizeof(AttnArgs) == 56);

struct AttnScratch {
  std::shared_ptr<Buffer> q;        // bf16 [max_rows, n_q, d]: normed + roped queries from attn_prepare
  std::shared_ptr<Buffer> part_o;   // f32 [n_q, LILY_ATTN_SPLIT_MAX_BLOCKS, d]: split-path partial outputs
  std::shared_ptr<Buffer> part_ml;  // f32 [n_q, LILY_ATTN_SPLIT_MAX_BLOCKS, 2]: split-path (max, sum)
  int max_rows = 0;
};

namespace {

std::string shape(const AttnDevice& A) {
  return "n_q " + std::to_string(A.n_q) + ", n_kv " + std::to_string(A.n_kv) + ", d " + std::to_string(A.head_dim) +
         ", r " + std::to_string(A.rotary_dim);
}

void check(const AttnDevice& A, const char* op) {
  const bool ok = A.n_q > 0 && A.n_kv > 0 && A.n_q % A.n_kv == 0 &&
                  (A.head_dim == 32 || A.head_dim == 64 || A.head_dim == 128 || A.head_dim == 256) &&
                  A.rotary_dim >= 0 && A.rotary_dim <= A.head_dim && A.rotary_dim % 2 == 0;
  if (!ok) throw std::invalid_argument(std::string("[") + op + "] unsupported shape (" + shape(A) + ")");
}

void check_rows(const AttnScratch& s, int T, int64_t pos, int64_t capacity, const char* op) {
  if (T < 1 || T > s.max_rows)
    throw std::out_of_range(std::string("[") + op + "] " + std::to_string(T) + " rows, scratch holds " +
                            std::to_string(s.max_rows));
  if (pos < 0 || pos + T > capacity || capacity > INT32_MAX)
    throw std::out_of_range(std::string("[") + op + "] rows [" + std::to_string(pos) + ", " + std::to_string(pos + T) +
                            ") outside the cache capacity " + std::to_string(capacity));
}

// Query heads per threadgroup: up to LILY_ATTN_PACK_HEADS of the heads sharing a KV head (a divisor of the group).
int pack_of(const AttnDevice& A, int limit = LILY_ATTN_PACK_HEADS) {
  const int group = A.n_q / A.n_kv;
  if (limit == 1) return 1;
  for (int p = limit; p > 1; p /= 2)
    if (group % p == 0) return p;
  return 1;
}

// kAttnKernels[d index][mode]; mode: 0 prefill, 1 decode, 2 decode_split, 3 decode_prep, 4 decode_split_prep
constexpr KernelId kAttnKernels[4][5] = {
    {KernelId::attn_prefill_bf16_d32, KernelId::attn_decode_bf16_d32, KernelId::attn_decode_split_bf16_d32,
     KernelId::attn_decode_prep_bf16_d32, KernelId::attn_decode_split_prep_bf16_d32},
    {KernelId::attn_prefill_bf16_d64, KernelId::attn_decode_bf16_d64, KernelId::attn_decode_split_bf16_d64,
     KernelId::attn_decode_prep_bf16_d64, KernelId::attn_decode_split_prep_bf16_d64},
    {KernelId::attn_prefill_bf16_d128, KernelId::attn_decode_bf16_d128, KernelId::attn_decode_split_bf16_d128,
     KernelId::attn_decode_prep_bf16_d128, KernelId::attn_decode_split_prep_bf16_d128},
    {KernelId::attn_prefill_bf16_d256, KernelId::attn_decode_bf16_d256, KernelId::attn_decode_split_bf16_d256,
     KernelId::attn_decode_prep_bf16_d256, KernelId::attn_decode_split_prep_bf16_d256}};
constexpr int kHeadDims[] = {32, 64, 128, 256};
constexpr int kModeArgs[5][2] = {{0, false}, {1, false}, {2, false}, {1, true}, {2, true}};  // attn_impl's MODE, PREP
constexpr bool attn_kernels_ordered() {
  for (int i = 0; i < 4; ++i)
    for (int m = 0; m < 5; ++m)
      if (!kernel_instantiates(kAttnKernels[i][m], "attn_impl", {kHeadDims[i], kModeArgs[m][0], kModeArgs[m][1]}))
        return false;
  return true;
}
static_assert(attn_kernels_ordered(), "kAttnKernels[d][mode] is attn_impl<d, MODE, PREP> of mode");

KernelId attn_kernel(int d, int mode) {
  const int i = d == 32 ? 0 : d == 64 ? 1 : d == 128 ? 2 : 3;
  return kAttnKernels[i][mode];
}

// attn_impl declares the split partials in every mode; the prefill and general decode modes never touch
// them, but every declared buffer must be bound: a 4-byte read range adds no dependency worth a barrier.
Binding unused_partial(AttnScratch& s, int slot) {
  return {slot, slot == ATTN_PART_O ? s.part_o.get() : s.part_ml.get(), 0, Access::read, 4};
}

// The prep variants' inputs, bound (never read) in the other modes like the unused partials.
struct PrepBindings {
  Binding k, v, qn, kn;
};
PrepBindings unused_prep(AttnScratch& s) {
  return {{ATTN_K_NEW, s.part_ml.get(), 0, Access::read, 4}, {ATTN_V_NEW, s.part_ml.get(), 0, Access::read, 4},
          {ATTN_Q_NORM, s.part_ml.get(), 0, Access::read, 4}, {ATTN_K_NORM, s.part_ml.get(), 0, Access::read, 4}};
}

uint64_t cache_bytes(const AttnDevice& A, int64_t capacity) { return uint64_t(A.n_kv) * capacity * A.head_dim * 2; }

}  // namespace

std::shared_ptr<AttnScratch> make_attn_scratch(Device& dev, const AttnDevice& A, int max_rows) {
  check(A, "attn");
  if (max_rows <= 0) throw std::invalid_argument("[attn] max_rows must be positive");
  auto s = std::make_shared<AttnScratch>();
  s->max_rows = max_rows;
  const uint64_t nd = uint64_t(A.n_q) * A.head_dim;
  s->q = dev.alloc(uint64_t(max_rows) * nd * 2, Role::activations, "attn.q");
  s->part_o = dev.alloc(nd * LILY_ATTN_SPLIT_MAX_BLOCKS * 4, Role::activations, "attn.part_o");
  s->part_ml = dev.alloc(uint64_t(A.n_q) * LILY_ATTN_SPLIT_MAX_BLOCKS * 2 * 4, Role::activations, "attn.part_ml");
  return s;
}

View attn_scratch_queries(AttnScratch& s) { return {s.q.get(), 0}; }

void encode_attn_prepare(Encoder& enc, AttnScratch& s, const AttnDevice& A, View q_gate, View k, View v, int T,
                         int64_t pos, View k_cache, View v_cache, int64_t capacity) {
  check(A, "attn_prepare");
  check_rows(s, T, pos, capacity, "attn_prepare");
  if (A.q_norm.size != A.head_dim || A.k_norm.size != A.head_dim)
    throw std::invalid_argument("[attn_prepare] q/k norm weights of " + std::to_string(A.q_norm.size) + "/" +
                                std::to_string(A.k_norm.size) + " for d " + std::to_string(A.head_dim));
  const AttnPrepareArgs args{.T = T, .pos = int32_t(pos), .n_q = A.n_q, .n_kv = A.n_kv, .head_dim = A.head_dim,
                             .rotary_dim = A.rotary_dim, .capacity = int32_t(capacity), .rope_theta = A.rope_theta,
                             .eps = A.eps};
  const uint64_t d = uint64_t(A.head_dim);
  const int heads = A.n_q + A.n_kv;
  const Grid groups{uint32_t((heads + LILY_ATTN_PREPARE_HEADS - 1) / LILY_ATTN_PREPARE_HEADS), uint32_t(T), 1};
  const Grid threads{uint32_t(LILY_SIMD_WIDTH), uint32_t(LILY_ATTN_PREPARE_HEADS), 1};
  enc.dispatch(KernelId::attn_prepare_bf16, groups, threads, args,
               {{ATTN_PREPARE_Q_GATE, q_gate.buffer, q_gate.offset, Access::read, uint64_t(T) * A.n_q * 2 * d * 2},
                {ATTN_PREPARE_K, k.buffer, k.offset, Access::read, uint64_t(T) * A.n_kv * d * 2},
                {ATTN_PREPARE_V, v.buffer, v.offset, Access::read, uint64_t(T) * A.n_kv * d * 2},
                {ATTN_PREPARE_Q_NORM, A.q_norm.buffer, A.q_norm.offset, Access::read, d * 4},
                {ATTN_PREPARE_K_NORM, A.k_norm.buffer, A.k_norm.offset, Access::read, d * 4},
                {ATTN_PREPARE_Q_OUT, s.q.get(), 0, Access::write, uint64_t(T) * A.n_q * d * 2},
                // rows [pos, pos + T) of every KV head: declared as the whole cache (one range per binding)
                {ATTN_PREPARE_K_CACHE, k_cache.buffer, k_cache.offset, Access::write, cache_bytes(A, capacity)},
                {ATTN_PREPARE_V_CACHE, v_cache.buffer, v_cache.offset, Access::write, cache_bytes(A, capacity)}});
}

void encode_attn_prefill(Encoder& enc, AttnScratch& s, const AttnDevice& A, View q_gate, int T, int64_t pos,
                         View k_cache, View v_cache, int64_t capacity, View out, int pack_limit) {
  check(A, "attn_prefill");
  check_rows(s, T, pos, capacity, "attn_prefill");
  const int pack = pack_of(A, pack_limit ? pack_limit : LILY_ATTN_PACK_HEADS);
  // Rows per threadgroup: fill LILY_ATTN_MAX_ITEMS simdgroups, so that each staged KV tile serves
  // pack × rows (head, row) items; no more rows than the chunk has.
  const int rows = std::min(LILY_ATTN_MAX_ITEMS / pack, T);
  const AttnArgs args{.T = T, .pos = int32_t(pos), .n_q = A.n_q, .n_kv = A.n_kv, .head_dim = A.head_dim,
                      .capacity = int32_t(capacity), .pack = pack, .rows = rows, .block = 0, .blocks = 1,
                      .scale = 1.f / std::sqrt(float(A.head_dim)), .rotary_dim = A.rotary_dim, .rope_theta = A.rope_theta,
                .eps = A.eps};
  const uint64_t d = uint64_t(A.head_dim);
  const Grid groups{uint32_t(A.n_q / pack), uint32_t((T + rows - 1) / rows), 1};
  const PrepBindings np = unused_prep(s);
  const Grid threads{uint32_t(LILY_SIMD_WIDTH * pack * rows), 1, 1};
  enc.dispatch(attn_kernel(A.head_dim, 0), groups, threads, args,
               {{ATTN_Q, s.q.get(), 0, Access::read, uint64_t(T) * A.n_q * d * 2},
                {ATTN_Q_GATE, q_gate.buffer, q_gate.offset, Access::read, uint64_t(T) * A.n_q * 2 * d * 2},
                {ATTN_K_CACHE, k_cache.buffer, k_cache.offset, Access::read, cache_bytes(A, capacity)},
                {ATTN_V_CACHE, v_cache.buffer, v_cache.offset, Access::read, cache_bytes(A, capacity)},
                {ATTN_OUT, out.buffer, out.offset, Access::write, uint64_t(T) * A.n_q * d * 2},
                unused_partial(s, ATTN_PART_O), unused_partial(s, ATTN_PART_ML), np.k, np.v, np.qn, np.kn});
}

void encode_attn_decode(Encoder& enc, AttnScratch& s, const AttnDevice& A, View q_gate, int64_t pos, View k_cache,
                        View v_cache, int64_t capacity, View out, AttnDecodePath path, int split_block, int pack_limit,
                        AttnPrepareInputs prep) {
  check(A, "attn_decode");
  check_rows(s, 1, pos, capacity, "attn_decode");
  const bool fused = prep.k.buffer != nullptr;
  if (fused && (A.q_norm.size != A.head_dim || A.k_norm.size != A.head_dim))
    throw std::invalid_argument("[attn_decode] q/k norm weights of " + std::to_string(A.q_norm.size) + "/" +
                                std::to_string(A.k_norm.size) + " for d " + std::to_string(A.head_dim));
  const int64_t context = pos + 1;
  if (path == AttnDecodePath::automatic)
    path = context >= LILY_ATTN_SPLIT_MIN_CONTEXT && A.head_dim == 256 && A.n_q / A.n_kv == 8 ? AttnDecodePath::split
                                                                                               : AttnDecodePath::general;
  const int pack = pack_of(A, pack_limit ? pack_limit : LILY_ATTN_PACK_HEADS);
  const uint64_t d = uint64_t(A.head_dim);
  AttnArgs args{.T = 1, .pos = int32_t(pos), .n_q = A.n_q, .n_kv = A.n_kv, .head_dim = A.head_dim,
                .capacity = int32_t(capacity), .pack = pack, .rows = 1, .block = 0, .blocks = 1,
                .scale = 1.f / std::sqrt(float(A.head_dim)), .rotary_dim = A.rotary_dim, .rope_theta = A.rope_theta,
                .eps = A.eps};
  // The fused variants read the raw q rows from q_gate instead of the prepared queries and write row pos of
  // the caches (declared as read-write of the whole cache, one range per binding).
  const Binding bq = fused ? Binding{ATTN_Q, s.q.get(), 0, Access::read, 4}
                           : Binding{ATTN_Q, s.q.get(), 0, Access::read, uint64_t(A.n_q) * d * 2};
  const Binding bg{ATTN_Q_GATE, q_gate.buffer, q_gate.offset, Access::read, uint64_t(A.n_q) * 2 * d * 2};
  const Access cache_access = fused ? Access::read_write : Access::read;
  const Binding bk{ATTN_K_CACHE, k_cache.buffer, k_cache.offset, cache_access, cache_bytes(A, capacity)};
  const Binding bv{ATTN_V_CACHE, v_cache.buffer, v_cache.offset, cache_access, cache_bytes(A, capacity)};
  const PrepBindings np =
      fused ? PrepBindings{{ATTN_K_NEW, prep.k.buffer, prep.k.offset, Access::read, uint64_t(A.n_kv) * d * 2},
                           {ATTN_V_NEW, prep.v.buffer, prep.v.offset, Access::read, uint64_t(A.n_kv) * d * 2},
                           {ATTN_Q_NORM, A.q_norm.buffer, A.q_norm.offset, Access::read, d * 4},
                           {ATTN_K_NORM, A.k_norm.buffer, A.k_norm.offset, Access::read, d * 4}}
            : unused_prep(s);
  const Binding bo{ATTN_OUT, out.buffer, out.offset, Access::write, uint64_t(A.n_q) * d * 2};
  const Grid threads{uint32_t(LILY_SIMD_WIDTH * pack), 1, 1};
  if (path == AttnDecodePath::general) {
    enc.dispatch(attn_kernel(A.head_dim, fused ? 3 : 1), Grid{uint32_t(A.n_q / pack), 1, 1}, threads, args,
                 {bq, bg, bk, bv, bo, unused_partial(s, ATTN_PART_O), unused_partial(s, ATTN_PART_ML), np.k, np.v, np.qn,
                  np.kn});
    return;
  }
  // Fixed blocks of `block` keys; past LILY_ATTN_SPLIT_MAX_BLOCKS blocks the blocks grow instead.
  int64_t block = split_block > 0 ? split_block : LILY_ATTN_SPLIT_BLOCK;
  block = std::max<int64_t>(block, (context + LILY_ATTN_SPLIT_MAX_BLOCKS - 1) / LILY_ATTN_SPLIT_MAX_BLOCKS);
  args.block = int32_t(block);
  args.blocks = int32_t((context + block - 1) / block);
  const uint64_t po_bytes = uint64_t(A.n_q) * args.blocks * d * 4, ml_bytes = uint64_t(A.n_q) * args.blocks * 2 * 4;
  enc.dispatch(attn_kernel(A.head_dim, fused ? 4 : 2), Grid{uint32_t(A.n_q / pack), 1, uint32_t(args.blocks)}, threads,
               args,
               {bq, bg, bk, bv, {ATTN_OUT, out.buffer, out.offset, Access::read, 2},  // bound, never touched
                {ATTN_PART_O, s.part_o.get(), 0, Access::write, po_bytes},
                {ATTN_PART_ML, s.part_ml.get(), 0, Access::write, ml_bytes}, np.k, np.v, np.qn, np.kn});
  enc.dispatch(KernelId::attn_decode_merge_bf16, Grid{uint32_t(A.n_q), 1, 1}, Grid{uint32_t(d), 1, 1}, args,
               {bg, bo, {ATTN_PART_O, s.part_o.get(), 0, Access::read, po_bytes},
                {ATTN_PART_ML, s.part_ml.get(), 0, Access::read, ml_bytes}});
}

// ---------------------------------------------------------------- MetalBackend's attention ops (metal_backend.h)

void MetalBackend::attn_prepare(int layer, int T, int64_t pos) {
  encode_attn_prepare(enc(), *attn_scratch_, attn_[layer], view(Act::q_gate), view(Act::k), view(Act::v), T, pos,
                      k_cache(layer), v_cache(layer), kv_capacity());
}

void MetalBackend::attn_prefill(int layer, int T, int64_t pos) {
  encode_attn_prefill(enc(), *attn_scratch_, attn_[layer], view(Act::q_gate), T, pos, k_cache(layer), v_cache(layer),
                      kv_capacity(), view(Act::mix), opt_.gqa_pack ? 0 : 1);
}

void MetalBackend::attn_prepare_decode(int layer, int64_t pos) {
  attend_one_row(layer, pos, AttnPrepareInputs{view(Act::k), view(Act::v)});
}

void MetalBackend::attn_decode(int layer, int64_t pos) { attend_one_row(layer, pos, {}); }

// Decode attention of one row; with prep set, the q/k preparation and KV-row write happen inside.
void MetalBackend::attend_one_row(int layer, int64_t pos, AttnPrepareInputs prep) {
  encode_attn_decode(enc(), *attn_scratch_, attn_[layer], view(Act::q_gate), pos, k_cache(layer), v_cache(layer),
                     kv_capacity(), view(Act::mix), AttnDecodePath(opt_.attn_path), 0, opt_.gqa_pack ? 0 : 1, prep);
}

}  // namespace lily::metal
