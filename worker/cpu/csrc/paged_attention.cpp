// Paged attention on CPU: decodes, speculative verification and prefill chunks (cut
// into runs of queries by the caller, worker/cpu/paged_attention.py).
//
// For row b and KV head h, the row's queries (q_lens[b] of them, the last ones of its
// kv_lens[b] positions, each with G = heads / kv_heads query heads) attend to the row's
// keys and values where they live: in the pool blocks its block table names
// (pool layout [num_blocks, kv_heads, block_size, head_dim]); nothing is gathered.
// Rows are dealt to ATen's threads (the same threads as torch's ops, so
// torch.set_num_threads sizes it), largest first to the least loaded (deal_rows); a
// thread done with its rows takes the others' not yet started (work_split.h).
// Two ways through a row:
// - few queries (decodes): attend_row. Memory bound: the keys are read a tile of blocks
//   at a time (every KV head of a block together: one contiguous run), scores for the
//   whole tile, one online-softmax update per tile (running max, sum and weighted values
//   per query), then the tile's values; blocks a few ahead in reading order are
//   prefetched a share at a time between the current block's dot products, and each key
//   and value is touched exactly once from memory.
// - many queries per KV head (prefill runs): attend_row_tiled. Compute bound: the
//   queries lie across the vector lanes and scores and values are two small matrix
//   products per tile (see there); on AVX-512 with 16 lanes a vector, and for bf16
//   pools on AVX512-BF16 as products of bf16 pairs (attend_row_tiled_bf16).
// The hot loops use AVX2/FMA where the build has them (the loader builds for the CPU it
// runs on), plain loops elsewhere (and attend_row for every row).
//
// Masking: query j of row b sits at position p = kv_lens[b] - q_lens[b] + j and sees
// keys at positions <= p, and with a sliding window W only keys > p - W (transformers'
// rule). Soft-capping (Gemma 2): score = softcap * tanh(score / softcap).
// Accumulation is in float; pools and queries are float32 or bfloat16.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_math.h"
#include "work_split.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

namespace {

using raydecode::fast_exp;
using raydecode::to_float;

#if defined(__AVX2__) && defined(__FMA__)
// exp over 8 lanes: the same reduction and polynomial as fast_exp.
inline __m256 exp8(__m256 x) {
  using namespace raydecode::exp_const;
  x = _mm256_max_ps(x, _mm256_set1_ps(kMin));
  x = _mm256_min_ps(x, _mm256_set1_ps(kMax));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kP0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), e));
}

inline float hsum8(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehl_ps(sh, s)));
}
#endif

// q . k over d (D a multiple of 8 on the vector path).
inline float dot(const float* q, const float* k, int64_t D) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t d = 0;
    for (; d + 16 <= D; d += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(k + d + 8), a1);
    }
    if (d < D) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a0);
    return hsum8(_mm256_add_ps(a0, a1));
  }
#endif
  float s = 0.f;
  for (int64_t d = 0; d < D; ++d) s += q[d] * k[d];
  return s;
}

// out[t] = q . k[t] for the n keys of a block (rows of k D apart): eight keys at a time
// on the vector path (eight independent FMA chains, their sums reduced together).
inline void block_scores(const float* q, const float* k, int64_t n, int64_t D, float* out) {
  int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    for (; t + 8 <= n; t += 8) {
      const float* kt = k + t * D;
      __m256 a[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qd = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kt + i * D + d), a[i]);
      }
      const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
      const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
      const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
      const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
      const __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
      _mm256_storeu_ps(out + t, _mm256_add_ps(lo, hi));
    }
  }
#endif
  for (; t < n; ++t) out[t] = dot(q, k + t * D, D);
}

#if defined(__AVX2__) && defined(__FMA__)
// acc[0:8C] = acc * corr + sum_t w[t] * v[t, 0:8C] (rows of v `stride` apart): C
// accumulators stay in registers over the positions, C independent FMA chains.
template <int C>
inline void weighted_add_chunks(float* acc, __m256 corr, const float* w, const float* v, int64_t n, int64_t stride) {
  __m256 a[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) a[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * c), corr);
  for (int64_t t = 0; t < n; ++t) {
    const __m256 wt = _mm256_set1_ps(w[t]);
    const float* vt = v + t * stride;
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) a[c] = _mm256_fmadd_ps(wt, _mm256_loadu_ps(vt + 8 * c), a[c]);
  }
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
}
#endif

// acc[0:D] = acc * corr + sum_t w[t] * v[t, 0:D], 64 columns at a time.
inline void weighted_add(float* acc, float corr, const float* w, const float* v, int64_t n, int64_t D) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    const __m256 c = _mm256_set1_ps(corr);
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
      switch (std::min<int64_t>(64, D - d0) / 8) {
        case 8: weighted_add_chunks<8>(acc + d0, c, w, v + d0, n, D); break;
        case 7: weighted_add_chunks<7>(acc + d0, c, w, v + d0, n, D); break;
        case 6: weighted_add_chunks<6>(acc + d0, c, w, v + d0, n, D); break;
        case 5: weighted_add_chunks<5>(acc + d0, c, w, v + d0, n, D); break;
        case 4: weighted_add_chunks<4>(acc + d0, c, w, v + d0, n, D); break;
        case 3: weighted_add_chunks<3>(acc + d0, c, w, v + d0, n, D); break;
        case 2: weighted_add_chunks<2>(acc + d0, c, w, v + d0, n, D); break;
        default: weighted_add_chunks<1>(acc + d0, c, w, v + d0, n, D); break;
      }
    }
    return;
  }
#endif
  for (int64_t d = 0; d < D; ++d) acc[d] *= corr;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t d = 0; d < D; ++d) acc[d] += w[t] * v[t * D + d];
}

// max(s[0:n]) (-inf for n = 0; a NaN is passed over, as std::max(mx, s[t]) does: MAXPS
// returns its second operand, the running max, when the first is NaN). Four independent
// max chains on the vector path: a scalar loop is one chain of dependent maxes, each
// waiting on the one before, and was a visible share of a decode's kernel time (the
// running max of every query row, every tile).
inline float max_of(const float* s, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (n >= 32) {
    __m256 m0 = _mm256_set1_ps(mx), m1 = m0, m2 = m0, m3 = m0;
    for (; t + 32 <= n; t += 32) {
      m0 = _mm256_max_ps(_mm256_loadu_ps(s + t), m0);
      m1 = _mm256_max_ps(_mm256_loadu_ps(s + t + 8), m1);
      m2 = _mm256_max_ps(_mm256_loadu_ps(s + t + 16), m2);
      m3 = _mm256_max_ps(_mm256_loadu_ps(s + t + 24), m3);
    }
    const __m256 m = _mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    mx = _mm_cvtss_f32(h);
  }
#endif
  for (; t < n; ++t) mx = std::max(mx, s[t]);
  return mx;
}

// s[0:n] = exp(s - m) in place (masked entries hold -inf and become 0); returns the sum.
inline float exp_and_sum(float* s, int64_t n, float m) {
  int64_t t = 0;
  float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
    _mm256_storeu_ps(s + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum8(acc);
#endif
  for (; t < n; ++t) {
    const float e = fast_exp(s[t] - m);
    s[t] = e;
    sum += e;
  }
  return sum;
}

// One call's shapes and settings, and its rows' lengths.
struct Shapes {
  int64_t Q, HQ, HKV, G, D, BS, MAXNB, window;
  float scale, softcap;
  const int32_t* kv_lens;  // [B]
  const int32_t* q_lens;  // [B]
  // Where row b's queries (and outputs) are: rows of the packed [T, HQ, D] tensors from
  // starts[b] on (paged_attention_packed), or from b * Q (the padded layout: starts null).
  const int32_t* starts = nullptr;
  int64_t q_stride = 0;  // elements from one query token to the next in q (HQ * D if dense)
  // Attention sinks (gpt-oss): per query head, an extra logit in each softmax's
  // denominator that attends to nothing (null: none).
  const float* sinks = nullptr;
  // 1 / the softmax's denominator of query head `head`, given its running max m and sum l.
  float inv_sum(float m, float l, int64_t head) const {
    const float denom = l + (sinks ? std::exp(sinks[head] - m) : 0.f);
    return denom > 0.f ? 1.f / denom : 0.f;
  }
  int64_t row0(int64_t b) const { return starts ? starts[b] : b * Q; }
  // Query token j of row b, and its output row.
  template <typename T>
  const T* q_at(const T* q, int64_t b, int64_t j) const { return q + (row0(b) + j) * q_stride; }
  float* out_at(float* out, int64_t b, int64_t j) const { return out + (row0(b) + j) * HQ * D; }
};

// Positions per tile (whole blocks, about 256): the softmax state is updated once per
// tile, not once per block.
inline int64_t tile_positions(int64_t block_size) { return std::max<int64_t>(1, 256 / block_size) * block_size; }

// Per-thread buffers: the row's queries (scaled, float), outputs, running max and sum,
// one tile's scores and per-query corrections, and one block of keys or values as float
// (bf16 pools).
struct Scratch {
  std::vector<float> qf, acc, m, l, s, corr, block_f;
  std::vector<const void*> order;  // the row's blocks in reading order (keys, values per tile)
  explicit Scratch(const Shapes& z)
      : qf(z.Q * z.HQ * z.D), acc(z.Q * z.HQ * z.D), m(z.Q * z.HQ), l(z.Q * z.HQ),
        s(z.Q * z.HQ * tile_positions(z.BS)), corr(z.Q * z.HQ), block_f(z.HKV * z.BS * z.D) {}
};

template <typename T>
inline const float* block_as_float(const T* pool, int64_t block, int64_t block_elems, Scratch& w) {
  if constexpr (std::is_same<T, float>::value) {
    return pool + block * block_elems;
  } else {
    const T* src = pool + block * block_elems;
    for (int64_t i = 0; i < block_elems; ++i) w.block_f[i] = to_float(src[i]);
    return w.block_f.data();
  }
}

// Blocks a row will read a few blocks from now (kPrefetchAheadBytes ahead in reading
// order: keys then values, tile by tile), asked for into L2 a share at a time between
// the current block's dot products. Each block is a separate run somewhere in the pool,
// so the hardware prefetcher cannot see the next one coming. What was measured (decode
// batches, SmolLM2's heads, float32, a pool per layer so nothing stays in L3): the
// whole next block into L1 in one burst at the start of a block was no better than no
// prefetch (the burst fills the core's miss buffers and stalls it until the block has
// mostly arrived); the next block spread over the work helped; 4 blocks ahead spread
// helped more, and most into L2 (into L1, 48 KB ahead evicts lines before their use;
// non-temporal prefetches were erratic). bf16 pools gain as well.
constexpr int64_t kPrefetchAheadBytes = 48 * 1024;

struct SpreadPrefetch {
  const char* next = nullptr;
  int64_t left = 0, share = 0;
  void start(const void* block, int64_t bytes, int64_t calls) {
    next = static_cast<const char*>(block);
    left = bytes;
    share = ((bytes + calls - 1) / calls + 63) / 64 * 64;
  }
  void step() {
    for (int64_t o = 0; o < share && left > 0; o += 64, left -= 64, next += 64) __builtin_prefetch(next, 0, 1);  // to L2, not L1
  }
};

// The first position a query at `first` sees (the sliding window's start, else 0).
inline int64_t first_key(int64_t first, const Shapes& z) {
  return z.window > 0 ? std::max<int64_t>(0, first - z.window + 1) : 0;
}

// Appends the blocks a row reads from position lo to ctx, in the order attend_row
// reads them (per tile: its key blocks, then its value blocks), at most `limit`.
template <typename T>
void reading_order(std::vector<const void*>& order, const T* k_pool, const T* v_pool, const int32_t* table,
                   int64_t lo, int64_t ctx, const Shapes& z, size_t limit) {
  const int64_t BS = z.BS, TL = tile_positions(BS), block_elems = z.HKV * BS * z.D;
  const size_t end = limit == SIZE_MAX ? SIZE_MAX : order.size() + limit;
  for (int64_t t0 = (lo / BS) * BS; t0 < ctx && order.size() < end; t0 += TL) {
    const int64_t b0 = t0 / BS, b1 = (std::min(ctx, t0 + TL) + BS - 1) / BS;
    for (int64_t blk = b0; blk < b1 && order.size() < end; ++blk) order.push_back(k_pool + table[blk] * block_elems);
    for (int64_t blk = b0; blk < b1 && order.size() < end; ++blk) order.push_back(v_pool + table[blk] * block_elems);
  }
}

// One row: its nq queries (every query head) against its keys, a tile of blocks at a
// time. Per tile: (1) scores of every query against every key of the tile, block by
// block, every KV head of a block together (one block is a contiguous [kv_heads, block,
// dim] run); (2) per query, what it may not see set aside, one online-softmax update
// (running max and sum; the outputs so far rescaled); (3) the values, block by block,
// weighted into the outputs. Each key and value is read from memory once; the blocks
// ahead are prefetched while one is computed (SpreadPrefetch).
// next_b: the row this thread attends next (-1: none), whose first blocks are prefetched
// at the end of this one.
template <typename T>
void attend_row(float* out, const T* q, const T* k_pool, const T* v_pool, const int32_t* block_table,
                int64_t b, int64_t nq, int64_t ctx, int64_t next_b, const Shapes& z, Scratch& w) {
  const int64_t G = z.G, D = z.D, BS = z.BS, HQ = z.HQ, HKV = z.HKV, TL = tile_positions(BS);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t first = ctx - nq;  // position of the row's first query
  const int64_t rows = nq * HQ;  // query (position, head) pairs, position-major
  float* qf = w.qf.data();
  float* acc = w.acc.data();
  float* m = w.m.data();
  float* l = w.l.data();
  float* s = w.s.data();
  float* corr = w.corr.data();
  for (int64_t j = 0; j < nq; ++j) {
    const T* src = z.q_at(q, b, j);
    float* dst = qf + j * HQ * D;
    for (int64_t i = 0; i < HQ * D; ++i) dst[i] = to_float(src[i]) * z.scale;
  }
  std::fill(acc, acc + rows * D, 0.f);
  std::fill(m, m + rows, neg_inf);
  std::fill(l, l + rows, 0.f);
  const int64_t block_elems = HKV * BS * D;
  const int64_t block_bytes = block_elems * (int64_t)sizeof(T);
  const int64_t calls = HKV * nq * G;  // dot-product calls per block, each followed by a prefetch share
  const int32_t* table = block_table + b * z.MAXNB;
  // fn(h, r) for every KV head h of a block and each query row r it serves (position j,
  // query head h * G + g).
  auto each_head_query = [&](auto&& fn) {
    for (int64_t h = 0; h < HKV; ++h)
      for (int64_t j = 0; j < nq; ++j)
        for (int64_t g = 0; g < G; ++g) fn(h, j * HQ + h * G + g);
  };
  const int64_t lo = first_key(first, z);
  // What to prefetch: this row's blocks in reading order, then the first ones of the
  // row this thread takes next (so a row's first blocks are on their way too).
  const size_t ahead_blocks = std::max<int64_t>(2, (kPrefetchAheadBytes + block_bytes - 1) / block_bytes);
  std::vector<const void*>& order = w.order;
  order.clear();
  reading_order(order, k_pool, v_pool, table, lo, ctx, z, SIZE_MAX);
  if (next_b >= 0) {
    const int64_t next_ctx = z.kv_lens[next_b];
    reading_order(order, k_pool, v_pool, block_table + next_b * z.MAXNB,
                  first_key(next_ctx - z.q_lens[next_b], z), next_ctx, z, ahead_blocks);
  }
  size_t read = 0;  // index in order of the block being read
  auto prefetch_ahead = [&](SpreadPrefetch& ahead) {
    const size_t i = read++ + ahead_blocks;
    if (i < order.size()) ahead.start(order[i], block_bytes, calls);
  };
  for (int64_t t0 = (lo / BS) * BS; t0 < ctx; t0 += TL) {
    const int64_t t1 = std::min(ctx, t0 + TL), nt = t1 - t0;
    const int64_t b0 = t0 / BS, b1 = (t1 + BS - 1) / BS;
    // (1) scores: s[r * TL + (pos - t0)]
    for (int64_t blk = b0; blk < b1; ++blk) {
      SpreadPrefetch ahead;
      prefetch_ahead(ahead);
      const int64_t start = blk * BS, n = std::min(BS, ctx - start);
      const float* kp = block_as_float(k_pool, table[blk], block_elems, w);
      each_head_query([&](int64_t h, int64_t r) {
        ahead.step();
        block_scores(qf + r * D, kp + h * BS * D, n, D, s + r * TL + (start - t0));
      });
    }
    // (2) per query: visible keys [vlo, vhi) of this tile; the rest weigh 0.
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t p = first + r / HQ;
      float* sr = s + r * TL;
      const int64_t vlo = std::max<int64_t>(t0, z.window > 0 ? p - z.window + 1 : 0);
      const int64_t vhi = std::min<int64_t>(t1, p + 1);
      if (vlo >= vhi) {
        std::fill(sr, sr + nt, 0.f);
        corr[r] = 1.f;
        continue;
      }
      float* vis = sr + (vlo - t0);
      const int64_t nv = vhi - vlo;
      if (z.softcap > 0.f)
        for (int64_t t = 0; t < nv; ++t) vis[t] = z.softcap * std::tanh(vis[t] / z.softcap);
      const float m_new = std::max(m[r], max_of(vis, nv));
      corr[r] = m[r] == neg_inf ? 0.f : fast_exp(m[r] - m_new);
      l[r] = l[r] * corr[r] + exp_and_sum(vis, nv, m_new);
      m[r] = m_new;
      std::fill(sr, vis, 0.f);
      std::fill(sr + (vhi - t0), sr + nt, 0.f);
    }
    // (3) values
    for (int64_t blk = b0; blk < b1; ++blk) {
      SpreadPrefetch ahead;
      prefetch_ahead(ahead);
      const int64_t start = blk * BS, n = std::min(BS, ctx - start);
      const float* vp = block_as_float(v_pool, table[blk], block_elems, w);
      each_head_query([&](int64_t h, int64_t r) {
        ahead.step();
        weighted_add(acc + r * D, blk == b0 ? corr[r] : 1.f, s + r * TL + (start - t0), vp + h * BS * D, n, D);
      });
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = z.inv_sum(m[r], l[r], r % HQ);
    float* dst = z.out_at(out, b, 0) + r * D;
    const float* ar = acc + r * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = ar[d] * inv;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// ---- Longer queries (prefill runs, long speculative rows): queries along the lanes ----
//
// A row with many queries per KV head is a small matrix product twice over, and is
// computed as one: for KV head h the row's nq * G queries (i = j * G + g: position j,
// query head h * G + g) are laid out across the vector lanes (qt [D, NP], NP the query
// count rounded up to 8), so scores s [t, i] = sum_d K[t, d] * qt[d, i] and outputs
// ot[d, i] += sum_t V[t, d] * p[t, i] each take one broadcast of a pool element per
// several FMAs, straight from the pool's [block, dim] layout (no transpose of keys or
// values). The online softmax runs per tile of tiled_positions() positions, a lane per
// query: column max, corrections, exp and sums all vectorized. Same masking and
// soft-capping rules as attend_row; the results agree with it to float rounding.

// Positions per tile (whole blocks, about 64): s [TP, NP] stays in L1/L2.
inline int64_t tiled_positions(int64_t block_size) { return std::max<int64_t>(1, 64 / block_size) * block_size; }

// Rows with at least this many query lanes per KV head take the tiled path.
constexpr int64_t kTiledMinLanes = 16;

// Per-thread buffers: queries and outputs across the lanes, one tile's scores, the
// lanes' running max, sum and corrections and positions, one head's block as float (bf16).
struct TiledScratch {
  std::vector<float> qt, ot, s, m, l, corr, block_f;
  std::vector<int32_t> pos;
  explicit TiledScratch(const Shapes& z, int64_t np)
      : qt(z.D * np), ot(z.D * np), s(tiled_positions(z.BS) * np), m(np), l(np), corr(np), block_f(z.BS * z.D),
        pos(np) {}
};

// out[r, 8c..] (rows NP apart) = (out[r, 8c..] if Acc, else 0) + sum_{x < n} a[x * a_step +
// r * a_row] * b[x, 8c..] (b rows NP apart), for R rows and CI vectors of query lanes: R x CI
// accumulators in registers, one broadcast of an `a` element per CI FMAs. Scores are
// rows = keys, x = dims (a = the keys, b = qt); the values pass is rows = dims, x =
// positions (a = the values, b = the weights p).
template <int R, int CI, bool Acc>
inline void lanes_micro(const float* a, int64_t a_step, int64_t a_row, const float* b, int64_t NP, int64_t n,
                        float* out) {
  __m256 acc[R][CI];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < CI; ++c) acc[r][c] = Acc ? _mm256_loadu_ps(out + r * NP + 8 * c) : _mm256_setzero_ps();
  for (int64_t x = 0; x < n; ++x) {
    __m256 bv[CI];
#pragma GCC unroll 4
    for (int c = 0; c < CI; ++c) bv[c] = _mm256_loadu_ps(b + x * NP + 8 * c);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(a + x * a_step + r * a_row);
#pragma GCC unroll 4
      for (int c = 0; c < CI; ++c) acc[r][c] = _mm256_fmadd_ps(av, bv[c], acc[r][c]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < CI; ++c) _mm256_storeu_ps(out + r * NP + 8 * c, acc[r][c]);
}

constexpr int kLaneVectors = 3;  // CI of the micro-kernel: 24 query lanes at a time
constexpr int kRowsPerMicro = 4;  // its R: keys (scores) or dims (values) at a time

template <int R, bool Acc>
inline void lanes_micro_ci(int64_t ci, const float* a, int64_t a_step, int64_t a_row, const float* b, int64_t NP,
                           int64_t n, float* out) {
  if (ci == 3) lanes_micro<R, 3, Acc>(a, a_step, a_row, b, NP, n, out);
  else if (ci == 2) lanes_micro<R, 2, Acc>(a, a_step, a_row, b, NP, n, out);
  else lanes_micro<R, 1, Acc>(a, a_step, a_row, b, NP, n, out);
}

// lanes_micro over every row (`rows` of them) and every query lane (NP).
template <bool Acc>
inline void lanes_product(const float* a, int64_t a_step, int64_t a_row, int64_t rows, const float* b, int64_t NP,
                          int64_t n, float* out) {
  for (int64_t c0 = 0; c0 < NP / 8; c0 += kLaneVectors) {
    const int64_t ci = std::min<int64_t>(kLaneVectors, NP / 8 - c0);
    int64_t r = 0;
    for (; r + kRowsPerMicro <= rows; r += kRowsPerMicro)
      lanes_micro_ci<kRowsPerMicro, Acc>(ci, a + r * a_row, a_step, a_row, b + 8 * c0, NP, n, out + r * NP + 8 * c0);
    for (; r < rows; ++r) lanes_micro_ci<1, Acc>(ci, a + r * a_row, a_step, a_row, b + 8 * c0, NP, n, out + r * NP + 8 * c0);
  }
}

// Head h's part of a pool block as float rows [BS, D] (bf16 converted into buf).
template <typename T>
inline const float* head_block(const T* pool, int64_t block, int64_t h, int64_t n, const Shapes& z, float* buf) {
  const T* src = pool + (block * z.HKV + h) * z.BS * z.D;
  if constexpr (std::is_same<T, float>::value) {
    return src;
  } else {
    for (int64_t i = 0; i < n * z.D; ++i) buf[i] = to_float(src[i]);
    return buf;
  }
}

// Shared by both ways through the lanes layout (AVX2 below, AVX-512 after it).
//
// Each lane's position; padding lanes take the last one (they see every key, so no lane
// is ever empty) and are dropped at the end.
inline void lane_positions(int32_t* pos, int64_t NP, int64_t NQ, int64_t G, int64_t first, int64_t ctx) {
  for (int64_t i = 0; i < NP; ++i) pos[i] = static_cast<int32_t>(i < NQ ? first + i / G : ctx - 1);
}

// KV head h's queries of row b across the lanes (qt [D, NP], scaled, padding lanes 0),
// and the head's outputs, running max and sum cleared.
template <typename T>
inline void start_head(float* qt, float* ot, float* m, float* l, const T* q, int64_t b, int64_t nq, int64_t h,
                       int64_t NP, const Shapes& z) {
  const int64_t G = z.G, D = z.D, NQ = nq * G;
  for (int64_t d = 0; d < D; ++d) std::fill(qt + d * NP + NQ, qt + (d + 1) * NP, 0.f);
  for (int64_t j = 0; j < nq; ++j)
    for (int64_t g = 0; g < G; ++g) {
      const T* src = z.q_at(q, b, j) + (h * G + g) * D;
      float* dst = qt + j * G + g;
      for (int64_t d = 0; d < D; ++d) dst[d * NP] = to_float(src[d]) * z.scale;
    }
  std::fill(ot, ot + D * NP, 0.f);
  std::fill(m, m + NP, -std::numeric_limits<float>::infinity());
  std::fill(l, l + NP, 0.f);
}

// KV head h's outputs of row b back from the lanes (ot [D, NP]), divided by the sums.
inline void finish_head(float* out, const float* ot, const float* m, const float* l, int64_t b, int64_t nq,
                        int64_t h, int64_t NP, const Shapes& z) {
  const int64_t G = z.G, D = z.D;
  for (int64_t j = 0; j < nq; ++j)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t i = j * G + g;
      const float inv = z.inv_sum(m[i], l[i], h * G + g);
      float* dst = z.out_at(out, b, j) + (h * G + g) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = ot[d * NP + i] * inv;
    }
}

// Row b (nq queries, the last of its ctx positions) by the lanes layout above.
template <typename T>
void attend_row_tiled(float* out, const T* q, const T* k_pool, const T* v_pool, const int32_t* block_table,
                      int64_t b, int64_t nq, int64_t ctx, const Shapes& z, TiledScratch& w) {
  const int64_t G = z.G, D = z.D, BS = z.BS, TP = tiled_positions(BS);
  const int64_t NQ = nq * G, NP = (NQ + 7) / 8 * 8;
  const int64_t first = ctx - nq, lo = first_key(first, z);
  const int32_t* table = block_table + b * z.MAXNB;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float *qt = w.qt.data(), *ot = w.ot.data(), *s = w.s.data(), *m = w.m.data(), *l = w.l.data(),
        *corr = w.corr.data();
  int32_t* pos = w.pos.data();
  lane_positions(pos, NP, NQ, G, first, ctx);
  const __m256 vneg_inf = _mm256_set1_ps(neg_inf);
  for (int64_t h = 0; h < z.HKV; ++h) {
    start_head(qt, ot, m, l, q, b, nq, h, NP, z);
    for (int64_t t0 = (lo / BS) * BS; t0 < ctx; t0 += TP) {
      const int64_t t1 = std::min(ctx, t0 + TP), nt = t1 - t0;
      const int64_t b0 = t0 / BS, b1 = (t1 + BS - 1) / BS;
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t n = std::min(BS, ctx - blk * BS);
        const float* kp = head_block(k_pool, table[blk], h, n, z, w.block_f.data());
        lanes_product<false>(kp, 1, D, n, qt, NP, D, s + (blk * BS - t0) * NP);  // s[t, i] = k[t] . qt[:, i]
      }
      if (z.softcap > 0.f)
        for (int64_t e = 0; e < nt * NP; ++e) s[e] = z.softcap * std::tanh(s[e] / z.softcap);
      // What a lane may not see: keys past its position, or before its window.
      const bool causal_cut = t1 - 1 > first;
      const bool window_cut = z.window > 0 && t0 <= ctx - 1 - z.window;
      if (causal_cut || window_cut)
        for (int64_t t = 0; t < nt; ++t) {
          const int64_t p = t0 + t;
          float* st = s + t * NP;
          for (int64_t i = 0; i < NP; ++i)
            if (p > pos[i] || (z.window > 0 && p <= pos[i] - z.window)) st[i] = neg_inf;
        }
      // Online softmax, 8 lanes at a time.
      for (int64_t i = 0; i < NP; i += 8) {
        __m256 mx = vneg_inf;
        for (int64_t t = 0; t < nt; ++t) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + t * NP + i));
        const __m256 m_old = _mm256_loadu_ps(m + i);
        const __m256 m_new = _mm256_max_ps(m_old, mx);
        // A lane that has seen nothing yet keeps weight 0 (its exp base 0, no NaN).
        const __m256 base = _mm256_blendv_ps(m_new, _mm256_setzero_ps(), _mm256_cmp_ps(m_new, vneg_inf, _CMP_EQ_OQ));
        const __m256 c = _mm256_blendv_ps(exp8(_mm256_sub_ps(m_old, base)), _mm256_setzero_ps(),
                                          _mm256_cmp_ps(m_old, vneg_inf, _CMP_EQ_OQ));
        __m256 sum = _mm256_setzero_ps();
        for (int64_t t = 0; t < nt; ++t) {
          const __m256 sv = _mm256_loadu_ps(s + t * NP + i);
          const __m256 e = _mm256_andnot_ps(_mm256_cmp_ps(sv, vneg_inf, _CMP_EQ_OQ), exp8(_mm256_sub_ps(sv, base)));
          _mm256_storeu_ps(s + t * NP + i, e);
          sum = _mm256_add_ps(sum, e);
        }
        _mm256_storeu_ps(l + i, _mm256_fmadd_ps(_mm256_loadu_ps(l + i), c, sum));
        _mm256_storeu_ps(m + i, m_new);
        _mm256_storeu_ps(corr + i, c);
      }
      for (int64_t d = 0; d < D; ++d)
        for (int64_t i = 0; i < NP; i += 8)
          _mm256_storeu_ps(ot + d * NP + i, _mm256_mul_ps(_mm256_loadu_ps(ot + d * NP + i), _mm256_loadu_ps(corr + i)));
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t n = std::min(BS, ctx - blk * BS);
        const float* vp = head_block(v_pool, table[blk], h, n, z, w.block_f.data());
        lanes_product<true>(vp, D, 1, D, s + (blk * BS - t0) * NP, NP, n, ot);  // ot[d, i] += sum_t v[t, d] p[t, i]
      }
    }
    finish_head(out, ot, m, l, b, nq, h, NP, z);
  }
}

// ---- The lanes layout on AVX-512: 16 lanes a vector, picked at run time ----
//
// The same computation as attend_row_tiled (same tiles, masking, online softmax and
// results to float rounding), with 16 query lanes a vector and 32 registers: the
// micro-kernels hold 8 rows x 3 vectors of accumulators (48 lanes), the values pass
// runs over a whole tile's blocks with its accumulators in registers (scaled by the
// lanes' corrections as they are loaded, no separate pass), and the causal and window
// cuts are vector compares. Used where the CPU has AVX-512F (tiled_isa()); the build
// itself stays x86-64-v3.
#define RD_AVX512 __attribute__((target("avx512f,fma")))

RD_AVX512 inline __m512 exp16(__m512 x) {
  using namespace raydecode::exp_const;
  x = _mm512_max_ps(x, _mm512_set1_ps(kMin));
  x = _mm512_min_ps(x, _mm512_set1_ps(kMax));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kP0);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP5));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), e));
}

constexpr int kRows512 = 8;  // rows (keys or dims) per micro-kernel call
constexpr int kLanes512 = 3;  // vectors of 16 query lanes per call

// Scores of R keys: s[r, 16c..] = sum_d k[r * D + d] * qt[d * NP + 16c..], d < D.
template <int R, int CI>
RD_AVX512 inline void scores16(const float* k, int64_t D, const float* qt, int64_t NP, float* s) {
  __m512 acc[R][CI];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < CI; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 bv[CI];
#pragma GCC unroll 4
    for (int c = 0; c < CI; ++c) bv[c] = _mm512_loadu_ps(qt + d * NP + 16 * c);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(k[r * D + d]);
#pragma GCC unroll 4
      for (int c = 0; c < CI; ++c) acc[r][c] = _mm512_fmadd_ps(av, bv[c], acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < CI; ++c) _mm512_storeu_ps(s + r * NP + 16 * c, acc[r][c]);
}

// Values of R dims over a tile: ot[r, 16c..] = ot[r, 16c..] * corr[16c..] + sum over the
// tile's positions t of v[t][r] * p[t * NP + 16c..] (v[t] the position's value row in its
// block: blocks[j] holds counts[j] positions, rows D apart).
template <int R, int CI>
RD_AVX512 inline void values16(const float* const* blocks, const int64_t* counts, int64_t nblocks, int64_t D,
                               const float* p, const float* corr, int64_t NP, float* ot) {
  __m512 acc[R][CI];
  __m512 cv[CI];
#pragma GCC unroll 4
  for (int c = 0; c < CI; ++c) cv[c] = _mm512_loadu_ps(corr + 16 * c);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < CI; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(ot + r * NP + 16 * c), cv[c]);
  for (int64_t j = 0; j < nblocks; ++j) {
    const float* v = blocks[j];
    for (int64_t t = 0; t < counts[j]; ++t, p += NP) {
      __m512 bv[CI];
#pragma GCC unroll 4
      for (int c = 0; c < CI; ++c) bv[c] = _mm512_loadu_ps(p + 16 * c);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 av = _mm512_set1_ps(v[t * D + r]);
#pragma GCC unroll 4
        for (int c = 0; c < CI; ++c) acc[r][c] = _mm512_fmadd_ps(av, bv[c], acc[r][c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < CI; ++c) _mm512_storeu_ps(ot + r * NP + 16 * c, acc[r][c]);
}

// The lane-vector count (1-3) as a template argument.
template <int R>
RD_AVX512 inline void scores16_ci(int64_t ci, const float* k, int64_t D, const float* qt, int64_t NP, float* s) {
  if (ci == 3) scores16<R, 3>(k, D, qt, NP, s);
  else if (ci == 2) scores16<R, 2>(k, D, qt, NP, s);
  else scores16<R, 1>(k, D, qt, NP, s);
}

template <int R>
RD_AVX512 inline void values16_ci(int64_t ci, const float* const* blocks, const int64_t* counts, int64_t nblocks,
                                  int64_t D, const float* p, const float* corr, int64_t NP, float* ot) {
  if (ci == 3) values16<R, 3>(blocks, counts, nblocks, D, p, corr, NP, ot);
  else if (ci == 2) values16<R, 2>(blocks, counts, nblocks, D, p, corr, NP, ot);
  else values16<R, 1>(blocks, counts, nblocks, D, p, corr, NP, ot);
}

// One tile's scores s [nt, NP] (positions t0.., scaled) made the tile's softmax weights
// in place: soft-capped, what a lane may not see (keys past its position, or before its
// window) set to 0, and each lane's running max m, sum l and correction corr (the factor
// its outputs so far take) updated: the online softmax, 16 lanes at a time.
RD_AVX512 inline void softmax_tile512(float* s, int64_t nt, int64_t t0, int64_t first, int64_t ctx, int64_t NP,
                                      const int32_t* pos, float* m, float* l, float* corr, const Shapes& z) {
  const __m512 vneg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  if (z.softcap > 0.f)
    for (int64_t e = 0; e < nt * NP; ++e) s[e] = z.softcap * std::tanh(s[e] / z.softcap);
  const bool window_cut = z.window > 0 && t0 <= ctx - 1 - z.window;
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t p = t0 + t;
    if (p <= first && !window_cut) continue;  // every lane sees it
    const __m512i pv = _mm512_set1_epi32(static_cast<int32_t>(p));
    const __m512i wv = _mm512_set1_epi32(static_cast<int32_t>(p + z.window));
    float* st = s + t * NP;
    for (int64_t i = 0; i < NP; i += 16) {
      const __m512i lane_pos = _mm512_loadu_si512(pos + i);
      __mmask16 hide = _mm512_cmpgt_epi32_mask(pv, lane_pos);
      if (z.window > 0) hide |= _mm512_cmple_epi32_mask(wv, lane_pos);  // p <= pos - W
      _mm512_storeu_ps(st + i, _mm512_mask_mov_ps(_mm512_loadu_ps(st + i), hide, vneg_inf));
    }
  }
  for (int64_t i = 0; i < NP; i += 16) {
    __m512 mx = vneg_inf;
    for (int64_t t = 0; t < nt; ++t) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + t * NP + i));
    const __m512 m_old = _mm512_loadu_ps(m + i);
    const __m512 m_new = _mm512_max_ps(m_old, mx);
    // A lane that has seen nothing yet keeps weight 0 (its exp base 0, no NaN).
    const __m512 base = _mm512_mask_mov_ps(m_new, _mm512_cmp_ps_mask(m_new, vneg_inf, _CMP_EQ_OQ),
                                           _mm512_setzero_ps());
    const __m512 c = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m_old, vneg_inf, _CMP_NEQ_UQ),
                                         exp16(_mm512_sub_ps(m_old, base)));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < nt; ++t) {
      const __m512 sv = _mm512_loadu_ps(s + t * NP + i);
      const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(sv, vneg_inf, _CMP_NEQ_UQ),
                                           exp16(_mm512_sub_ps(sv, base)));
      _mm512_storeu_ps(s + t * NP + i, e);
      sum = _mm512_add_ps(sum, e);
    }
    _mm512_storeu_ps(l + i, _mm512_fmadd_ps(_mm512_loadu_ps(l + i), c, sum));
    _mm512_storeu_ps(m + i, m_new);
    _mm512_storeu_ps(corr + i, c);
  }
}

// Per-thread buffers of the AVX-512 way: as TiledScratch with lanes rounded to 16, and a
// whole tile of one head's keys or values as float (bf16 pools).
struct TiledScratch512 {
  std::vector<float> qt, ot, s, m, l, corr, tile_f;
  std::vector<int32_t> pos;
  explicit TiledScratch512(const Shapes& z, int64_t np)
      : qt(z.D * np), ot(z.D * np), s(tiled_positions(z.BS) * np), m(np), l(np), corr(np),
        tile_f(tiled_positions(z.BS) * z.D), pos(np) {}
};

template <typename T>
RD_AVX512 void attend_row_tiled512(float* out, const T* q, const T* k_pool, const T* v_pool,
                                   const int32_t* block_table, int64_t b, int64_t nq, int64_t ctx, const Shapes& z,
                                   TiledScratch512& w) {
  const int64_t G = z.G, D = z.D, BS = z.BS, TP = tiled_positions(BS);
  const int64_t NQ = nq * G, NP = (NQ + 15) / 16 * 16, NV = NP / 16;
  const int64_t first = ctx - nq, lo = first_key(first, z);
  const int32_t* table = block_table + b * z.MAXNB;
  float *qt = w.qt.data(), *ot = w.ot.data(), *s = w.s.data(), *m = w.m.data(), *l = w.l.data(),
        *corr = w.corr.data();
  int32_t* pos = w.pos.data();
  lane_positions(pos, NP, NQ, G, first, ctx);
  const float* blocks[64];  // a tile's blocks (TP / BS <= 64)
  int64_t counts[64];
  for (int64_t h = 0; h < z.HKV; ++h) {
    start_head(qt, ot, m, l, q, b, nq, h, NP, z);
    for (int64_t t0 = (lo / BS) * BS; t0 < ctx; t0 += TP) {
      const int64_t t1 = std::min(ctx, t0 + TP), nt = t1 - t0;
      const int64_t b0 = t0 / BS, b1 = (t1 + BS - 1) / BS, nb = b1 - b0;
      // Scores, block by block (each block's keys of head h are BS rows of D).
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t n = std::min(BS, ctx - blk * BS);
        const float* kp = head_block(k_pool, table[blk], h, n, z, w.tile_f.data());
        float* sb = s + (blk * BS - t0) * NP;
        for (int64_t c0 = 0; c0 < NV; c0 += kLanes512) {
          const int64_t ci = std::min<int64_t>(kLanes512, NV - c0);
          int64_t r = 0;
          for (; r + kRows512 <= n; r += kRows512)
            scores16_ci<kRows512>(ci, kp + r * D, D, qt + 16 * c0, NP, sb + r * NP + 16 * c0);
          for (; r < n; ++r) scores16_ci<1>(ci, kp + r * D, D, qt + 16 * c0, NP, sb + r * NP + 16 * c0);
        }
      }
      softmax_tile512(s, nt, t0, first, ctx, NP, pos, m, l, corr, z);
      // Values: the tile's blocks at once, the outputs rescaled on the way.
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t n = std::min(BS, ctx - blk * BS);
        blocks[blk - b0] = head_block(v_pool, table[blk], h, n, z, w.tile_f.data() + (blk - b0) * BS * D);
        counts[blk - b0] = n;
      }
      for (int64_t c0 = 0; c0 < NV; c0 += kLanes512) {
        const int64_t ci = std::min<int64_t>(kLanes512, NV - c0);
        int64_t d = 0;
        for (; d + kRows512 <= D; d += kRows512) {
          const float* shifted[64];
          for (int64_t j = 0; j < nb; ++j) shifted[j] = blocks[j] + d;
          values16_ci<kRows512>(ci, shifted, counts, nb, D, s + 16 * c0, corr + 16 * c0, NP, ot + d * NP + 16 * c0);
        }
        for (; d < D; ++d) {
          const float* shifted[64];
          for (int64_t j = 0; j < nb; ++j) shifted[j] = blocks[j] + d;
          values16_ci<1>(ci, shifted, counts, nb, D, s + 16 * c0, corr + 16 * c0, NP, ot + d * NP + 16 * c0);
        }
      }
    }
    finish_head(out, ot, m, l, b, nq, h, NP, z);
  }
}

// ---- The lanes layout on AVX512-BF16: bf16 pools multiplied as bf16 pairs ----
//
// For bf16 pools where the CPU has AVX512-BF16 (VDPBF16PS: 16 lanes, each the sum of two
// bf16 products added to a float), both products of the lanes layout take half the
// instructions of the float way, and the keys are read from the pool as they are:
// - scores: the reduction runs over dims, so a query lane holds dims (2e, 2e+1) as one
//   pair (qt2 [D/2, NP] of bf16 pairs, unscaled: the scale multiplies the float scores)
//   and a key's two adjacent dims are one 32-bit broadcast straight from the pool;
// - values: the reduction runs over positions, so the softmax weights (float, as on the
//   AVX-512 way) are rounded to bf16 pairs of positions (2u, 2u+1) per lane (p2
//   [TP/2, NP]), and each tile's values are repacked as pairs of positions per dim (vp
//   [TP/2, D]), a pair of rows interleaved by two permutes per 32 dims.
// Scores, masking and the softmax statistics stay float; the weights' rounding to bf16
// before the values product is what SDPA's bf16 CPU kernel does too (relative 2**-9 per
// weight). Taken for rows whose head dim is a multiple of 32 and blocks of an even size
// (positions pair within a block), else the AVX-512 way.
#define RD_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512bf16,fma")))

inline uint32_t bf16_pair(const c10::BFloat16* p) {
  uint32_t x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

RD_AVX512BF16 inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// Scores of R keys (rows of bf16, D apart): s[r, 16c..] = scale * sum_e k[r, 2e..2e+1] .
// qt2[e, 16c..], e < D/2.
template <int R, int CI>
RD_AVX512BF16 inline void scores_bf16(const c10::BFloat16* k, int64_t D, const uint32_t* qt2, int64_t NP, float scale,
                                      float* s) {
  __m512 acc[R][CI];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < CI; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t e = 0; e < D / 2; ++e) {
    __m512bh bv[CI];
#pragma GCC unroll 4
    for (int c = 0; c < CI; ++c) bv[c] = as_bh(_mm512_loadu_si512(qt2 + e * NP + 16 * c));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh av = as_bh(_mm512_set1_epi32(static_cast<int32_t>(bf16_pair(k + r * D + 2 * e))));
#pragma GCC unroll 4
      for (int c = 0; c < CI; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], av, bv[c]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < CI; ++c) _mm512_storeu_ps(s + r * NP + 16 * c, _mm512_mul_ps(acc[r][c], sc));
}

// Values of R dims over a tile's n2 position pairs: ot[r, 16c..] = ot[r, 16c..] *
// corr[16c..] + sum_u vp[u, r] . p2[u, 16c..] (vp rows D apart, p2 rows NP apart).
template <int R, int CI>
RD_AVX512BF16 inline void values_bf16(const uint32_t* vp, int64_t D, int64_t n2, const uint32_t* p2,
                                      const float* corr, int64_t NP, float* ot) {
  __m512 acc[R][CI];
#pragma GCC unroll 4
  for (int c = 0; c < CI; ++c) {
    const __m512 cv = _mm512_loadu_ps(corr + 16 * c);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(ot + r * NP + 16 * c), cv);
  }
  for (int64_t u = 0; u < n2; ++u) {
    __m512bh bv[CI];
#pragma GCC unroll 4
    for (int c = 0; c < CI; ++c) bv[c] = as_bh(_mm512_loadu_si512(p2 + u * NP + 16 * c));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh av = as_bh(_mm512_set1_epi32(static_cast<int32_t>(vp[u * D + r])));
#pragma GCC unroll 4
      for (int c = 0; c < CI; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], av, bv[c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < CI; ++c) _mm512_storeu_ps(ot + r * NP + 16 * c, acc[r][c]);
}

template <int R>
RD_AVX512BF16 inline void scores_bf16_ci(int64_t ci, const c10::BFloat16* k, int64_t D, const uint32_t* qt2,
                                         int64_t NP, float scale, float* s) {
  if (ci == 3) scores_bf16<R, 3>(k, D, qt2, NP, scale, s);
  else if (ci == 2) scores_bf16<R, 2>(k, D, qt2, NP, scale, s);
  else scores_bf16<R, 1>(k, D, qt2, NP, scale, s);
}

template <int R>
RD_AVX512BF16 inline void values_bf16_ci(int64_t ci, const uint32_t* vp, int64_t D, int64_t n2, const uint32_t* p2,
                                         const float* corr, int64_t NP, float* ot) {
  if (ci == 3) values_bf16<R, 3>(vp, D, n2, p2, corr, NP, ot);
  else if (ci == 2) values_bf16<R, 2>(vp, D, n2, p2, corr, NP, ot);
  else values_bf16<R, 1>(vp, D, n2, p2, corr, NP, ot);
}

// 16-bit lane indices that interleave two sources' elements from `from` on: a[from],
// b[from], a[from + 1], b[from + 1], ... (b's indices offset by `b_at`).
RD_AVX512BF16 inline __m512i interleave_index(int from, int b_at) {
  alignas(64) int16_t idx[32];
  for (int i = 0; i < 16; ++i) {
    idx[2 * i] = static_cast<int16_t>(from + i);
    idx[2 * i + 1] = static_cast<int16_t>(b_at + from + i);
  }
  return _mm512_load_si512(idx);
}

// Per-thread buffers of the bf16 way.
struct TiledScratchBf16 {
  std::vector<uint32_t> qt2, p2, vp;
  std::vector<float> ot, s, m, l, corr;
  std::vector<int32_t> pos;
  explicit TiledScratchBf16(const Shapes& z, int64_t np)
      : qt2(z.D / 2 * np), p2((tiled_positions(z.BS) / 2 + 1) * np), vp((tiled_positions(z.BS) / 2 + 1) * z.D),
        ot(z.D * np), s(tiled_positions(z.BS) * np), m(np), l(np), corr(np), pos(np) {}
};

RD_AVX512BF16 void attend_row_tiled_bf16(float* out, const c10::BFloat16* q, const c10::BFloat16* k_pool,
                                         const c10::BFloat16* v_pool, const int32_t* block_table, int64_t b,
                                         int64_t nq, int64_t ctx, const Shapes& z, TiledScratchBf16& w) {
  const int64_t G = z.G, D = z.D, BS = z.BS, TP = tiled_positions(BS);
  const int64_t NQ = nq * G, NP = (NQ + 15) / 16 * 16, NV = NP / 16;
  const int64_t first = ctx - nq, lo = first_key(first, z);
  const int32_t* table = block_table + b * z.MAXNB;
  uint32_t *qt2 = w.qt2.data(), *p2 = w.p2.data(), *vp = w.vp.data();
  float *ot = w.ot.data(), *s = w.s.data(), *m = w.m.data(), *l = w.l.data(), *corr = w.corr.data();
  int32_t* pos = w.pos.data();
  lane_positions(pos, NP, NQ, G, first, ctx);
  const __m512i pair_lo = interleave_index(0, 32), pair_hi = interleave_index(16, 32);  // two rows' dims
  const __m512i lanes_pair = interleave_index(0, 16);  // one vector's two halves
  for (int64_t h = 0; h < z.HKV; ++h) {
    // Head h's queries across the lanes as dim pairs (padding lanes 0).
    for (int64_t e = 0; e < D / 2; ++e) std::fill(qt2 + e * NP + NQ, qt2 + (e + 1) * NP, 0u);
    for (int64_t j = 0; j < nq; ++j)
      for (int64_t g = 0; g < G; ++g) {
        const c10::BFloat16* src = z.q_at(q, b, j) + (h * G + g) * D;
        for (int64_t e = 0; e < D / 2; ++e) qt2[e * NP + j * G + g] = bf16_pair(src + 2 * e);
      }
    std::fill(ot, ot + D * NP, 0.f);
    std::fill(m, m + NP, -std::numeric_limits<float>::infinity());
    std::fill(l, l + NP, 0.f);
    for (int64_t t0 = (lo / BS) * BS; t0 < ctx; t0 += TP) {
      const int64_t t1 = std::min(ctx, t0 + TP), nt = t1 - t0, n2 = (nt + 1) / 2;
      const int64_t b0 = t0 / BS, b1 = (t1 + BS - 1) / BS;
      for (int64_t blk = b0; blk < b1; ++blk) {
        const int64_t n = std::min(BS, ctx - blk * BS);
        const c10::BFloat16* kp = k_pool + (int64_t(table[blk]) * z.HKV + h) * BS * D;
        float* sb = s + (blk * BS - t0) * NP;
        for (int64_t c0 = 0; c0 < NV; c0 += kLanes512) {
          const int64_t ci = std::min<int64_t>(kLanes512, NV - c0);
          int64_t r = 0;
          for (; r + kRows512 <= n; r += kRows512)
            scores_bf16_ci<kRows512>(ci, kp + r * D, D, qt2 + 16 * c0, NP, z.scale, sb + r * NP + 16 * c0);
          for (; r < n; ++r) scores_bf16_ci<1>(ci, kp + r * D, D, qt2 + 16 * c0, NP, z.scale, sb + r * NP + 16 * c0);
        }
        // The block's values as pairs of positions per dim (an odd last one paired with 0).
        const c10::BFloat16* vsrc = v_pool + (int64_t(table[blk]) * z.HKV + h) * BS * D;
        uint32_t* vdst = vp + (blk * BS - t0) / 2 * D;
        for (int64_t u = 0; u < (n + 1) / 2; ++u)
          for (int64_t d = 0; d < D; d += 32) {
            const __m512i a = _mm512_loadu_si512(vsrc + 2 * u * D + d);
            const __m512i c = 2 * u + 1 < n ? _mm512_loadu_si512(vsrc + (2 * u + 1) * D + d) : _mm512_setzero_si512();
            _mm512_storeu_si512(vdst + u * D + d, _mm512_permutex2var_epi16(a, pair_lo, c));
            _mm512_storeu_si512(vdst + u * D + d + 16, _mm512_permutex2var_epi16(a, pair_hi, c));
          }
      }
      softmax_tile512(s, nt, t0, first, ctx, NP, pos, m, l, corr, z);
      // The weights as bf16 pairs of positions per lane (an odd last one paired with 0).
      for (int64_t u = 0; u < n2; ++u)
        for (int64_t i = 0; i < NP; i += 16) {
          const __m512 a = _mm512_loadu_ps(s + 2 * u * NP + i);
          const __m512 c = 2 * u + 1 < nt ? _mm512_loadu_ps(s + (2 * u + 1) * NP + i) : _mm512_setzero_ps();
          const __m512bh halves = _mm512_cvtne2ps_pbh(c, a);  // a's 16 then c's 16
          _mm512_storeu_si512(p2 + u * NP + i,
                              _mm512_permutexvar_epi16(lanes_pair, (__m512i)halves));
        }
      for (int64_t c0 = 0; c0 < NV; c0 += kLanes512) {
        const int64_t ci = std::min<int64_t>(kLanes512, NV - c0);
        for (int64_t d = 0; d < D; d += kRows512)
          values_bf16_ci<kRows512>(ci, vp + d, D, n2, p2 + 16 * c0, corr + 16 * c0, NP, ot + d * NP + 16 * c0);
      }
    }
    finish_head(out, ot, m, l, b, nq, h, NP, z);
  }
}

// Whether the bf16 way applies to these shapes (else the AVX-512 float way).
inline bool bf16_pairs_fit(const Shapes& z) { return z.D % 32 == 0 && z.BS % 2 == 0; }

#define RAYDECODE_TILED 1
#endif

#ifdef RAYDECODE_TILED
// The way the lanes path takes: AVX512-BF16 (bf16 pools; float pools take AVX-512) or
// AVX-512 where the CPU has it, else AVX2; tests force each one the CPU has
// (set_tiled_isa).
constexpr int kTiledAvx2 = 1, kTiledAvx512 = 2, kTiledAvx512Bf16 = 3;
std::atomic<int> g_tiled_isa{0};  // 0: the best this CPU has

bool cpu_has_avx512_bf16() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512bf16");
}

int tiled_isa() {
  static const int best = cpu_has_avx512_bf16()                 ? kTiledAvx512Bf16
                          : __builtin_cpu_supports("avx512f") ? kTiledAvx512
                                                              : kTiledAvx2;
  const int forced = g_tiled_isa.load(std::memory_order_relaxed);
  return forced ? forced : best;
}
#endif

// Thread t's rows, in the order it attends them: order[bounds[t] .. bounds[t + 1]).
struct DealtRows {
  std::vector<int64_t> order, bounds;
};

// The rows are dealt to the threads before any starts, largest first (queries times
// keys read) to the thread with the least work so far: a prefill chunk's runs grow along
// the chunk (each reads the keys up to its own last query), and the even split by index
// that parallel_for makes gave one thread about three quarters of a fresh chunk's work.
// Dealt up front rather than taken from a shared counter, each thread knows the row it
// reads next and prefetches its first blocks (taking rows as they come made decodes
// slower: the guessed next row was often the other thread's). Only a thread done with
// its own rows takes others' (attend).
inline DealtRows deal_rows(int64_t B, int64_t threads, const Shapes& z) {
  std::vector<int64_t> rows, cost(B, 0);
  for (int64_t b = 0; b < B; ++b) {
    if (z.q_lens[b] <= 0) continue;
    rows.push_back(b);
    cost[b] = int64_t(z.q_lens[b]) * (z.kv_lens[b] - first_key(z.kv_lens[b] - z.q_lens[b], z));
  }
  std::stable_sort(rows.begin(), rows.end(), [&](int64_t a, int64_t c) { return cost[a] > cost[c]; });
  std::vector<std::vector<int64_t>> mine(std::max<int64_t>(1, std::min<int64_t>(threads, rows.size())));
  std::vector<int64_t> load(mine.size(), 0);
  for (int64_t b : rows) {
    const size_t t = std::min_element(load.begin(), load.end()) - load.begin();
    mine[t].push_back(b);
    load[t] += cost[b];
  }
  DealtRows dealt{{}, {0}};
  for (const auto& m : mine) {
    dealt.order.insert(dealt.order.end(), m.begin(), m.end());
    dealt.bounds.push_back(static_cast<int64_t>(dealt.order.size()));
  }
  return dealt;
}

template <typename T>
void attend(float* out, const T* q, const T* k_pool, const T* v_pool, const int32_t* block_table, int64_t B,
            const Shapes& z) {
  // A thread done with its own rows takes the others' from their backs (StealingSplit).
  const DealtRows dealt = deal_rows(B, at::get_num_threads(), z);
  const std::vector<int64_t>& order = dealt.order;
  const std::vector<int64_t>& bounds = dealt.bounds;
  raydecode::StealingSplit split(bounds);
  // Each way's buffers per thread, only where a row takes it (a prefill call needs no
  // Scratch).
  std::vector<std::unique_ptr<Scratch>> ws(split.threads());
#ifdef RAYDECODE_TILED
  std::vector<std::unique_ptr<TiledScratch>> tws(split.threads());
  std::vector<std::unique_ptr<TiledScratch512>> tws512(split.threads());
  std::vector<std::unique_ptr<TiledScratchBf16>> twsbf16(split.threads());
  const int isa = tiled_isa();
  const bool avx512 = isa >= kTiledAvx512;
  const bool bf16_pairs = std::is_same<T, c10::BFloat16>::value && isa == kTiledAvx512Bf16 && bf16_pairs_fit(z);
#endif
  split.run([&](int64_t i, int64_t t) {
    const int64_t b = order[i], nq = z.q_lens[b];
#ifdef RAYDECODE_TILED
    if (nq * z.G >= kTiledMinLanes) {
      if constexpr (std::is_same<T, c10::BFloat16>::value) {
        if (bf16_pairs) {
          if (!twsbf16[t]) twsbf16[t] = std::make_unique<TiledScratchBf16>(z, (z.Q * z.G + 15) / 16 * 16);
          attend_row_tiled_bf16(out, q, k_pool, v_pool, block_table, b, nq, z.kv_lens[b], z, *twsbf16[t]);
          return;
        }
      }
      if (avx512) {
        if (!tws512[t]) tws512[t] = std::make_unique<TiledScratch512>(z, (z.Q * z.G + 15) / 16 * 16);
        attend_row_tiled512<T>(out, q, k_pool, v_pool, block_table, b, nq, z.kv_lens[b], z, *tws512[t]);
      } else {
        if (!tws[t]) tws[t] = std::make_unique<TiledScratch>(z, (z.Q * z.G + 7) / 8 * 8);
        attend_row_tiled<T>(out, q, k_pool, v_pool, block_table, b, nq, z.kv_lens[b], z, *tws[t]);
      }
      return;
    }
#endif
    // The row this thread takes next, when it is working through its own run.
    const bool own = bounds[t] <= i && i < bounds[t + 1];
    const int64_t next_b = own && i + 1 < bounds[t + 1] ? order[i + 1] : -1;
    if (!ws[t]) ws[t] = std::make_unique<Scratch>(z);
    attend_row<T>(out, q, k_pool, v_pool, block_table, b, nq, z.kv_lens[b], next_b, z, *ws[t]);
  });
}

void check_common(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                  const at::Tensor& block_table, const at::Tensor& kv_lens, const at::Tensor& q_lens) {
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && out.is_contiguous() &&
                  block_table.is_contiguous() && kv_lens.is_contiguous() && q_lens.is_contiguous(),
              "paged_attention: contiguous tensors only");
  TORCH_CHECK(out.scalar_type() == at::kFloat, "paged_attention: out must be float32");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && kv_lens.scalar_type() == at::kInt &&
                  q_lens.scalar_type() == at::kInt, "paged_attention: int32 tables and lengths");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && k_pool.scalar_type() == v_pool.scalar_type(),
              "paged_attention: q and the pools share a dtype");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && k_pool.dim() == 4 && v_pool.sizes() == k_pool.sizes() &&
                  q.size(1) % k_pool.size(1) == 0 && k_pool.size(3) == q.size(2) && block_table.dim() == 2 &&
                  block_table.size(0) == kv_lens.size(0) && q_lens.size(0) == kv_lens.size(0),
              "paged_attention: shapes do not fit");
}

void run(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
         const at::Tensor& block_table, int64_t B, const Shapes& z) {
  if (q.scalar_type() == at::kFloat) {
    attend<float>(out.data_ptr<float>(), q.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(),
                  block_table.data_ptr<int32_t>(), B, z);
  } else if (q.scalar_type() == at::kBFloat16) {
    attend<c10::BFloat16>(out.data_ptr<float>(), q.data_ptr<c10::BFloat16>(), k_pool.data_ptr<c10::BFloat16>(),
                          v_pool.data_ptr<c10::BFloat16>(), block_table.data_ptr<int32_t>(), B, z);
  } else {
    TORCH_CHECK(false, "paged_attention: float32 or bfloat16 only");
  }
}

}  // namespace

// The heads' sinks as the kernel reads them: null for an empty tensor (no sinks), else
// float32 [HQ].
const float* sinks_of(const at::Tensor& sinks, int64_t HQ) {
  if (sinks.numel() == 0) return nullptr;
  TORCH_CHECK(sinks.scalar_type() == at::kFloat && sinks.is_contiguous() && sinks.dim() == 1 && sinks.size(0) == HQ,
              "paged_attention: sinks must be float32 [heads]");
  return sinks.data_ptr<float>();
}

// out [B*Q, HQ, D] float32; q [B*Q, HQ, D]; pools [NB, HKV, BS, D]; block_table [B, MAXNB]
// int32; kv_lens, q_lens [B] int32. Rows of out past a row's q_lens are left alone.
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_pool, at::Tensor v_pool, at::Tensor block_table,
                     at::Tensor kv_lens, at::Tensor q_lens, double scale, double softcap, int64_t window,
                     at::Tensor sinks) {
  check_common(out, q, k_pool, v_pool, block_table, kv_lens, q_lens);
  TORCH_CHECK(q.is_contiguous(), "paged_attention: contiguous tensors only");
  const int64_t B = kv_lens.size(0), HQ = q.size(1), D = q.size(2);
  const int64_t Q = B ? q.size(0) / B : 0;
  TORCH_CHECK(q.size(0) == B * Q, "paged_attention: shapes do not fit");
  const int64_t HKV = k_pool.size(1), BS = k_pool.size(2), MAXNB = block_table.size(1);
  Shapes z{Q, HQ, HKV, HQ / HKV, D, BS, MAXNB, window, (float)scale, (float)softcap,
           kv_lens.data_ptr<int32_t>(), q_lens.data_ptr<int32_t>()};
  z.q_stride = HQ * D;
  z.sinks = sinks_of(sinks, HQ);
  run(out, q, k_pool, v_pool, block_table, B, z);
}

// The same over the step's packed tokens, in place: q [T, HQ, D] (a token's heads
// contiguous; tokens any stride apart, e.g. a column view of the merged q/k/v
// projection), out [T, HQ, D] float32; row b's queries are tokens starts[b] ..
// starts[b] + q_lens[b] - 1. Tokens no row names are left alone.
void paged_attention_packed(at::Tensor out, at::Tensor q, at::Tensor k_pool, at::Tensor v_pool,
                            at::Tensor block_table, at::Tensor kv_lens, at::Tensor q_lens, at::Tensor starts,
                            double scale, double softcap, int64_t window, at::Tensor sinks) {
  check_common(out, q, k_pool, v_pool, block_table, kv_lens, q_lens);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && q.stride(0) >= q.size(1) * q.size(2),
              "paged_attention_packed: q's heads must be contiguous within a token");
  TORCH_CHECK(starts.scalar_type() == at::kInt && starts.is_contiguous() && starts.dim() == 1 &&
                  starts.size(0) == kv_lens.size(0), "paged_attention_packed: starts must be int32 [B]");
  const int64_t B = kv_lens.size(0), T = q.size(0), HQ = q.size(1), D = q.size(2);
  const auto* st = starts.data_ptr<int32_t>();
  const auto* ql = q_lens.data_ptr<int32_t>();
  const auto* kl = kv_lens.data_ptr<int32_t>();
  const int64_t HKV = k_pool.size(1), BS = k_pool.size(2), MAXNB = block_table.size(1);
  int64_t Q = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ql[b] >= 0 && st[b] >= 0 && st[b] + ql[b] <= T && kl[b] >= ql[b] && kl[b] <= MAXNB * BS,
                "paged_attention_packed: row ", b, " does not fit the packed tokens or its block table");
    Q = std::max<int64_t>(Q, ql[b]);
  }
  Shapes z{Q, HQ, HKV, HQ / HKV, D, BS, MAXNB, window, (float)scale, (float)softcap, kl, ql};
  z.starts = st;
  z.q_stride = q.stride(0);
  z.sinks = sinks_of(sinks, HQ);
  run(out, q, k_pool, v_pool, block_table, B, z);
}

// The instruction sets the prefill (lanes) path can take on this CPU, best first.
std::vector<std::string> tiled_isas() {
  std::vector<std::string> out;
#ifdef RAYDECODE_TILED
  if (cpu_has_avx512_bf16()) out.push_back("avx512bf16");
  if (__builtin_cpu_supports("avx512f")) out.push_back("avx512");
  out.push_back("avx2");
#endif
  return out;
}

// Forces the prefill path's instruction set (one of tiled_isas(); "" for the best): tests.
void set_tiled_isa(const std::string& name) {
  const auto have = tiled_isas();
  TORCH_CHECK(name.empty() || std::find(have.begin(), have.end(), name) != have.end(),
              "paged_attention: this build or CPU has no ", name, " prefill path");
#ifdef RAYDECODE_TILED
  g_tiled_isa.store(name.empty()           ? 0
                    : name == "avx512bf16" ? kTiledAvx512Bf16
                    : name == "avx512"     ? kTiledAvx512
                                           : kTiledAvx2);
#endif
}

void register_layer_ops(pybind11::module_& m);  // layer_ops.cpp
void register_panel_linear(pybind11::module_& m);  // panel_linear.cpp
void register_moe_experts(pybind11::module_& m);  // moe_experts.cpp
void register_quant_linear(pybind11::module_& m);  // quant_linear.cpp
void register_shm_allreduce(pybind11::module_& m);  // shm_allreduce.cpp

// For tests of StealingSplit: `items` split evenly over `threads` runs, the thread on
// run `slow` sleeping `sleep_us` before each item; which run's thread took each item.
std::vector<int64_t> stealing_split_takers(int64_t items, int64_t threads, int64_t slow, int64_t sleep_us) {
  std::vector<std::atomic<int64_t>> taker(items);
  for (auto& t : taker) t.store(-1);
  std::atomic<int64_t> twice{0};
  raydecode::StealingSplit(items, threads).run([&](int64_t item, int64_t t) {
    if (t == slow) std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
    int64_t none = -1;
    if (!taker[item].compare_exchange_strong(none, t)) twice.fetch_add(1);
  });
  TORCH_CHECK(twice.load() == 0, "stealing_split_takers: ", twice.load(), " items were taken twice");
  std::vector<int64_t> out(items);
  for (int64_t i = 0; i < items; ++i) out[i] = taker[i].load();
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("stealing_split_takers", &stealing_split_takers, "tests: which thread's run took each item");
  m.def("paged_attention", &paged_attention, "paged attention for short queries (CPU)");
  m.def("paged_attention_packed", &paged_attention_packed, "paged attention over a step's packed tokens (CPU)");
  m.def("tiled_isas", &tiled_isas, "instruction sets of the prefill path on this CPU, best first");
  m.def("set_tiled_isa", &set_tiled_isa, "forces the prefill path's instruction set (\"\": the best)");
  register_layer_ops(m);
  register_panel_linear(m);
  register_moe_experts(m);
  register_quant_linear(m);
  register_shm_allreduce(m);
}
