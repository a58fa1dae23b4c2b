// The float column-panel kernel's blocks of rows: panel_linear.cpp runs them over the
// packed float weights; quant_linear.cpp over panels it has just dequantized.
//
// A block computes rows m0 .. m0 + MR of one or two panels (16 output columns each):
// every output one chain of FMAs over k in order, whatever the block's size.
#pragma once

#include <torch/extension.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>

namespace raydecode {

constexpr int64_t PANEL = 16;

// One block's operands: its rows' inputs, its panels ([K, 16] each) and where their
// outputs go.
struct PanelBlock {
  const float* x;   // the block's first row of x [*, K]
  int64_t K;
  const float* w0;  // the first panel
  const float* w1;  // the second (two-panel blocks)
  const float* b0;  // bias of the first panel's 16 columns, or null
  const float* b1;
  float* y;         // the block's first row of y, at the first panel's first column
  int64_t ldy;      // y's row stride
};

#if defined(__x86_64__) || defined(_M_X64)
// Rows of panels w0 and w1 (np = 1 or 2 of them). pf, pf_lines: 64-byte lines to ask
// into L2 meanwhile (the next unit's panels), spread over the k loop.
template <int MR>
__attribute__((target("avx512f,fma"))) void panel_block_avx512(const PanelBlock& a, int np, const char* pf,
                                                                 int64_t pf_lines) {
  __m512 acc0[MR], acc1[MR];
  for (int m = 0; m < MR; ++m) {
    acc0[m] = _mm512_setzero_ps();
    acc1[m] = _mm512_setzero_ps();
  }
  const int64_t K = a.K;
  const float* w0 = a.w0;
  const float* w1 = a.w1;
  const float* x = a.x;
  // Lines per prefetch point: more than one when the block has more lines to ask for
  // than k steps (a single block of rows asks for both of the next unit's panels, 2K
  // lines; one per step left the second panel to demand misses: 6 to 12 rows ran 35-45%
  // slower), then the spacing of the points.
  const int64_t pf_burst = std::max<int64_t>(1, (pf_lines + K - 1) / K);
  const int64_t pf_every = pf_lines > 0 ? std::max<int64_t>(1, K * pf_burst / pf_lines) : K + 1;
  int64_t pf_left = pf_lines;
  if (np == 2) {
    for (int64_t k = 0; k < K; ++k) {
      if (pf_left > 0 && k % pf_every == 0) {
        for (int64_t j = 0; j < pf_burst && pf_left > 0; ++j) {
          _mm_prefetch(pf, _MM_HINT_T1);
          pf += 64;
          --pf_left;
        }
      }
      const __m512 wa = _mm512_loadu_ps(w0 + k * PANEL);
      const __m512 wb = _mm512_loadu_ps(w1 + k * PANEL);
#pragma GCC unroll 12
      for (int m = 0; m < MR; ++m) {
        const __m512 xv = _mm512_set1_ps(x[m * K + k]);
        acc0[m] = _mm512_fmadd_ps(xv, wa, acc0[m]);
        acc1[m] = _mm512_fmadd_ps(xv, wb, acc1[m]);
      }
    }
  } else {
    for (int64_t k = 0; k < K; ++k) {
      const __m512 wa = _mm512_loadu_ps(w0 + k * PANEL);
#pragma GCC unroll 12
      for (int m = 0; m < MR; ++m) acc0[m] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + k]), wa, acc0[m]);
    }
  }
  const __m512 b0 = a.b0 ? _mm512_loadu_ps(a.b0) : _mm512_setzero_ps();
  const __m512 b1 = (a.b1 && np == 2) ? _mm512_loadu_ps(a.b1) : _mm512_setzero_ps();
  for (int m = 0; m < MR; ++m) {
    float* y = a.y + m * a.ldy;
    _mm512_storeu_ps(y, _mm512_add_ps(acc0[m], b0));
    if (np == 2) _mm512_storeu_ps(y + PANEL, _mm512_add_ps(acc1[m], b1));
  }
}

// Rows of panel w0 (16 columns: two 8-lane halves).
template <int MR>
__attribute__((target("avx2,fma"))) void panel_block_avx2(const PanelBlock& a) {
  __m256 lo[MR], hi[MR];
  for (int m = 0; m < MR; ++m) {
    lo[m] = _mm256_setzero_ps();
    hi[m] = _mm256_setzero_ps();
  }
  const int64_t K = a.K;
  const float* w = a.w0;
  const float* x = a.x;
  for (int64_t k = 0; k < K; ++k) {
    const __m256 wl = _mm256_loadu_ps(w + k * PANEL);
    const __m256 wh = _mm256_loadu_ps(w + k * PANEL + 8);
#pragma GCC unroll 6
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_broadcast_ss(x + m * K + k);
      lo[m] = _mm256_fmadd_ps(xv, wl, lo[m]);
      hi[m] = _mm256_fmadd_ps(xv, wh, hi[m]);
    }
  }
  const __m256 bl = a.b0 ? _mm256_loadu_ps(a.b0) : _mm256_setzero_ps();
  const __m256 bh = a.b0 ? _mm256_loadu_ps(a.b0 + 8) : _mm256_setzero_ps();
  for (int m = 0; m < MR; ++m) {
    float* y = a.y + m * a.ldy;
    _mm256_storeu_ps(y, _mm256_add_ps(lo[m], bl));
    _mm256_storeu_ps(y + 8, _mm256_add_ps(hi[m], bh));
  }
}

using PanelBlockAvx512 = void (*)(const PanelBlock&, int, const char*, int64_t);
using PanelBlockAvx2 = void (*)(const PanelBlock&);
constexpr int PANEL_AVX512_ROWS = 12;  // 24 accumulators + 2 weight vectors + a broadcast of 32 registers
constexpr int PANEL_AVX2_ROWS = 6;     // 12 accumulators + 2 + 1 of 16
inline const PanelBlockAvx512 PANEL_AVX512_BLOCKS[PANEL_AVX512_ROWS + 1] = {
    nullptr, panel_block_avx512<1>, panel_block_avx512<2>, panel_block_avx512<3>, panel_block_avx512<4>,
    panel_block_avx512<5>, panel_block_avx512<6>, panel_block_avx512<7>, panel_block_avx512<8>,
    panel_block_avx512<9>, panel_block_avx512<10>, panel_block_avx512<11>, panel_block_avx512<12>};
inline const PanelBlockAvx2 PANEL_AVX2_BLOCKS[PANEL_AVX2_ROWS + 1] = {
    nullptr, panel_block_avx2<1>, panel_block_avx2<2>, panel_block_avx2<3>,
    panel_block_avx2<4>, panel_block_avx2<5>, panel_block_avx2<6>};

// Blocks of 12 rows over a pair of panels, except that a remainder of 1 to 5 shares the
// last two blocks evenly (16 rows: 8 + 8, not 12 + 4): a block that short ends before
// its share of the next unit's prefetch has arrived (measured: 16 rows 10-15% faster, 13
// rows 25-30%; 12 + 8 stays, 10 + 10 was slower). The block after the first even one is
// what is left. ``lines``: the next unit's lines to ask for, a share in each block.
inline void panel_rows_avx512(const float* x, int64_t M, int64_t K, const float* w0, const float* w1, int np,
                              const float* b0, const float* b1, float* y, int64_t ldy, const char* pf,
                              int64_t lines) {
  const int64_t blocks = (M + PANEL_AVX512_ROWS - 1) / PANEL_AVX512_ROWS;
  const int64_t rem = M % PANEL_AVX512_ROWS;
  const int64_t even_from = (M > PANEL_AVX512_ROWS && rem > 0 && rem < 6) ? M - PANEL_AVX512_ROWS - rem : M;
  int64_t done = 0;
  for (int64_t b = 0, m0 = 0; m0 < M; ++b) {
    const int64_t rows = m0 == even_from ? (PANEL_AVX512_ROWS + rem + 1) / 2 : std::min<int64_t>(PANEL_AVX512_ROWS, M - m0);
    const int64_t upto = lines * (b + 1) / blocks;
    const PanelBlock blk{x + m0 * K, K, w0, w1, b0, b1, y + m0 * ldy, ldy};
    PANEL_AVX512_BLOCKS[rows](blk, np, pf ? pf + done * 64 : nullptr, upto - done);
    done = upto;
    m0 += rows;
  }
}
#endif

}  // namespace raydecode
