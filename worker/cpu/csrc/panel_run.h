// One call of the float column-panel linear, by unit of work (a pair of panels under
// AVX-512, one otherwise): panel_linear.cpp splits a call's units over the threads,
// moe_experts.cpp the units of every expert's call of a step at once; quant_linear.cpp takes
// its instruction-set choice.
#pragma once

#include "panel_blocks.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#ifndef RAYDECODE_X86
#define RAYDECODE_X86 1
#endif
#endif

#include <algorithm>
#include <cstdint>

namespace raydecode {

struct PanelCall {
  const float* x;     // [M, K] row-major
  const float* w;     // panels [P, K, 16]
  const float* bias;  // [N] or null
  float* y;           // [M, N] row-major
  int64_t M, K, N;
};

// Rows m0 .. m0 + rows of panel p, plain loops.
inline void block_plain(const PanelCall& a, int64_t m0, int64_t rows, int64_t p) {
  const int64_t K = a.K;
  const float* w = a.w + p * K * PANEL;
  for (int64_t m = m0; m < m0 + rows; ++m) {
    float acc[PANEL] = {};
    const float* x = a.x + m * K;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < PANEL; ++j) acc[j] += x[k] * w[k * PANEL + j];
    float* y = a.y + m * a.N + p * PANEL;
    for (int64_t j = 0; j < PANEL; ++j) y[j] = acc[j] + (a.bias ? a.bias[p * PANEL + j] : 0.0f);
  }
}

enum class Isa { kAvx512, kAvx2, kPlain };

inline Isa best_isa() {
#ifdef RAYDECODE_X86
  static const Isa isa = __builtin_cpu_supports("avx512f") ? Isa::kAvx512
                         : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? Isa::kAvx2
                                                                                             : Isa::kPlain;
  return isa;
#else
  return Isa::kPlain;
#endif
}

// The panels of one unit of work: a pair of panels under AVX-512, one panel otherwise.
inline int64_t panels_per_unit(Isa isa) { return isa == Isa::kAvx512 ? 2 : 1; }

inline void run_unit(const PanelCall& a, Isa isa, int64_t unit) {
  const int64_t P = a.N / PANEL;
  switch (isa) {
#ifdef RAYDECODE_X86
    case Isa::kAvx512: {
      const int64_t p = unit * 2;
      const int np = p + 1 < P ? 2 : 1;
      // With several blocks of rows, only the first reads the unit's panels from
      // memory and the rest compute from L2, so reading and computing took turns: the
      // next unit's panels are asked into L2 meanwhile, a share in each block, and its
      // first block finds them there (faster from a few blocks of rows on). Below 6 rows
      // (a block mostly waiting on memory) the hardware prefetcher alone did as well.
      const int64_t next = std::min<int64_t>(2, P - (p + 2));
      const int64_t lines = a.M >= 6 && next > 0 ? next * a.K : 0;  // a panel's row of 16 floats: one line
      const char* pf = lines ? reinterpret_cast<const char*>(a.w + (p + 2) * a.K * PANEL) : nullptr;
      const float* w0 = a.w + p * a.K * PANEL;
      const float* b0 = a.bias ? a.bias + p * PANEL : nullptr;
      panel_rows_avx512(a.x, a.M, a.K, w0, w0 + a.K * PANEL, np, b0, b0 ? b0 + PANEL : nullptr,
                                   a.y + p * PANEL, a.N, pf, lines);
      return;
    }
    case Isa::kAvx2:
      for (int64_t m0 = 0; m0 < a.M; m0 += PANEL_AVX2_ROWS) {
        const PanelBlock blk{a.x + m0 * a.K, a.K, a.w + unit * a.K * PANEL, nullptr,
                                        a.bias ? a.bias + unit * PANEL : nullptr, nullptr, a.y + m0 * a.N + unit * PANEL,
                                        a.N};
        PANEL_AVX2_BLOCKS[std::min<int64_t>(PANEL_AVX2_ROWS, a.M - m0)](blk);
      }
      return;
#endif
    default:
      block_plain(a, 0, a.M, unit);
  }
}

}  // namespace raydecode
