// Linear layers over quantized weights kept quantized, in column panels:
//   y [M, N] = x [M, K] @ W^T (+ bias),  W[n, k] = scale[n, k / g] * code[n, k] + offset[n, k / g]
// (worker/quant/weight.py's form). The panels (pack_quant_panels below):
//   codes    4-bit: [P, K / 2, 16] uint8, byte (p, j, l) = code(16p + l, 2j) | code(16p + l, 2j + 1) << 4
//            wider: [P, K, 16] uint8, one code a byte
//   groups   [P, K / g, 32]: each group's 16 scales then its 16 offsets, in float16 where
//            every value is exact in half precision (GGUF's legacy types: their scales
//            are half floats), else float32; one 64-byte line a group at float16
// Each weight is dequantized in registers, fma(code, scale, offset): the value
// QuantizedWeight.dequantize gives, rounded once. Each output is then one chain of FMAs
// over k in order, as panel_linear computes over float panels: the result is the float
// path's on the dequantized weights, bit for bit, whatever M, the thread count or a
// row's neighbours (a row's result does not depend on the batch it is in).
//
// At decode sizes a call is bound by unpacking the codes (a few vector instructions per
// 16 weights), not by reading them: a pass takes several panels (four at one or two
// rows) so that their FMA chains overlap. Prefill-sized calls take the library GEMM on
// dequantized weights instead (worker/cpu/quant_linear.py).
//
// Instruction sets: AVX-512F, AVX2 + FMA, picked at run time; plain loops elsewhere.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "panel_run.h"
#include "work_split.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define RAYDECODE_X86 1
#endif

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace {

using raydecode::PANEL;

struct QArgs {
  const float* x;         // [M, K]
  const uint8_t* codes;   // panels
  const void* groups;     // [P, K / g, 32] float16 or float32: scales, then offsets
  const float* bias;      // [N] or null
  float* y;               // [M, N]
  int64_t M, K, N, g;
  bool packed;            // 4-bit codes, two a byte
  bool half;              // groups in float16
  int64_t panel_code_bytes() const { return (packed ? K / 2 : K) * PANEL; }
  int64_t group_bytes() const { return 2 * PANEL * (half ? 2 : 4); }
  int64_t panel_group_bytes() const { return (K / g) * group_bytes(); }
  const char* group_at(int64_t p, int64_t group) const {
    return static_cast<const char*>(groups) + p * panel_group_bytes() + group * group_bytes();
  }
  // A group's scale and offset of output 16p + j (the plain path's and dequantize's).
  float scale(int64_t p, int64_t group, int64_t j) const { return value(p, group, j); }
  float offset(int64_t p, int64_t group, int64_t j) const { return value(p, group, PANEL + j); }
  float value(int64_t p, int64_t group, int64_t i) const {
    const char* at = group_at(p, group);
    return half ? static_cast<float>(reinterpret_cast<const c10::Half*>(at)[i]) : reinterpret_cast<const float*>(at)[i];
  }
};

// The next unit's panels (codes, scales, offsets: three contiguous runs), asked into
// L2 a few lines at a time while this unit computes. Streaming a model's layers from
// memory, the hardware prefetcher alone kept the kernel well under the memory's rate.
struct NextPanels {
  const char* run[2] = {nullptr, nullptr};
  int64_t lines[2] = {0, 0};
  int at = 0;

  NextPanels() = default;
  NextPanels(const QArgs& a, int64_t first, int64_t count) {
    const int64_t P = a.N / PANEL;
    count = std::min(count, P - first);
    if (count <= 0) return;
    run[0] = reinterpret_cast<const char*>(a.codes + first * a.panel_code_bytes());
    run[1] = a.group_at(first, 0);
    lines[0] = (count * a.panel_code_bytes() + 63) / 64;
    lines[1] = (count * a.panel_group_bytes() + 63) / 64;
  }
  int64_t total() const { return lines[0] + lines[1]; }
  // Asks for up to n more lines.
  void ask(int64_t n) {
#ifdef RAYDECODE_X86
    while (n > 0 && at < 2) {
      if (lines[at] == 0) {
        ++at;
        continue;
      }
      _mm_prefetch(run[at], _MM_HINT_T1);
      run[at] += 64;
      --lines[at];
      --n;
    }
#else
    (void)n;
#endif
  }
};

#ifdef RAYDECODE_X86
// A group's 16 scales and 16 offsets, as floats.
__attribute__((target("avx512f,fma"))) inline void load_group(const QArgs& a, int64_t p, int64_t group, __m512& s,
                                                               __m512& o) {
  const char* at = a.group_at(p, group);
  if (a.half) {
    const __m512i both = _mm512_loadu_si512(at);
    s = _mm512_cvtph_ps(_mm512_castsi512_si256(both));
    o = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(both, 1));
  } else {
    s = _mm512_loadu_ps(reinterpret_cast<const float*>(at));
    o = _mm512_loadu_ps(reinterpret_cast<const float*>(at) + PANEL);
  }
}
#endif

#ifdef RAYDECODE_X86
// Panel p's weights dequantized, each k's 16 outputs a row of 16 floats at out + k * ld
// (the kernel's values: one rounding); ``next``: lines to ask into L2 meanwhile.
__attribute__((target("avx512f,fma"))) void dequantize_panel_avx512(const QArgs& a, int64_t p, float* out, int64_t ld,
                                                                      NextPanels* next = nullptr) {
  const uint8_t* codes = a.codes + p * a.panel_code_bytes();
  const __m512 nibble = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int64_t groups = a.K / a.g;
  const int64_t per_group = next ? (next->total() + groups - 1) / groups : 0;
  for (int64_t k0 = 0; k0 < a.K; k0 += a.g) {
    __m512 s, o;
    if (next) next->ask(per_group);
    load_group(a, p, k0 / a.g, s, o);
    if (a.packed) {
      for (int64_t k = k0; k < k0 + a.g; k += 2) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + (k / 2) * PANEL)));
        _mm512_storeu_ps(out + k * ld, _mm512_fmadd_ps(_mm512_permutexvar_ps(v, nibble), s, o));
        _mm512_storeu_ps(out + (k + 1) * ld,
                         _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), nibble), s, o));
      }
    } else {
      for (int64_t k = k0; k < k0 + a.g; ++k) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * PANEL)));
        _mm512_storeu_ps(out + k * ld, _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), s, o));
      }
    }
  }
}
#endif

#ifdef RAYDECODE_X86
// Rows m0 .. m0 + MR of panels p .. p + NP (np <= NP of them real); ``next``: the lines
// to ask into L2 meanwhile, spread over the k loop.
template <int MR, int NP>
__attribute__((target("avx512f,fma"))) void qblock_avx512(const QArgs& a, int64_t m0, int64_t p, int np,
                                                            NextPanels next) {
  __m512 acc[MR][NP];
  for (int m = 0; m < MR; ++m)
    for (int i = 0; i < NP; ++i) acc[m][i] = _mm512_setzero_ps();
  const int64_t K = a.K, g = a.g;
  const float* x = a.x + m0 * K;
  const uint8_t* codes[NP];
  int64_t panel[NP];
  for (int i = 0; i < NP; ++i) {
    panel[i] = p + std::min(i, np - 1);  // a missing panel repeats the last (its result is dropped)
    codes[i] = a.codes + panel[i] * a.panel_code_bytes();
  }
  // float(code) of a 4-bit code by table: vpermps reads only an index's low 4 bits, so
  // the low nibble needs no mask (and the table's entries are exact: the same values).
  const __m512 nibble = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // Lines to ask for at each group: the whole next unit over this one's groups.
  const int64_t groups = K / g;
  const int64_t per_group = (next.total() + groups - 1) / groups;
  for (int64_t k0 = 0; k0 < K; k0 += g) {
    __m512 s[NP], o[NP];
    next.ask(per_group);
    for (int i = 0; i < NP; ++i) load_group(a, panel[i], k0 / g, s[i], o[i]);
    if (a.packed) {
      for (int64_t k = k0; k < k0 + g; k += 2) {
        __m512 w0[NP], w1[NP];
        for (int i = 0; i < NP; ++i) {
          const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes[i] + (k / 2) * PANEL)));
          w0[i] = _mm512_fmadd_ps(_mm512_permutexvar_ps(v, nibble), s[i], o[i]);
          w1[i] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), nibble), s[i], o[i]);
        }
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          const __m512 x0 = _mm512_set1_ps(x[m * K + k]);
          const __m512 x1 = _mm512_set1_ps(x[m * K + k + 1]);
          for (int i = 0; i < NP; ++i) acc[m][i] = _mm512_fmadd_ps(x0, w0[i], acc[m][i]);
          for (int i = 0; i < NP; ++i) acc[m][i] = _mm512_fmadd_ps(x1, w1[i], acc[m][i]);
        }
      }
    } else {
      for (int64_t k = k0; k < k0 + g; ++k) {
        __m512 w[NP];
        for (int i = 0; i < NP; ++i) {
          const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes[i] + k * PANEL)));
          w[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), s[i], o[i]);
        }
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          const __m512 xv = _mm512_set1_ps(x[m * K + k]);
          for (int i = 0; i < NP; ++i) acc[m][i] = _mm512_fmadd_ps(xv, w[i], acc[m][i]);
        }
      }
    }
  }
  for (int i = 0; i < np; ++i) {
    const __m512 b = a.bias ? _mm512_loadu_ps(a.bias + (p + i) * PANEL) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) _mm512_storeu_ps(a.y + (m0 + m) * a.N + (p + i) * PANEL, _mm512_add_ps(acc[m][i], b));
  }
}

// Rows m0 .. m0 + MR of panel p (16 columns: two 8-lane halves).
template <int MR>
__attribute__((target("avx2,fma,f16c"))) void qblock_avx2(const QArgs& a, int64_t m0, int64_t p) {
  __m256 lo[MR], hi[MR];
  for (int m = 0; m < MR; ++m) {
    lo[m] = _mm256_setzero_ps();
    hi[m] = _mm256_setzero_ps();
  }
  const int64_t K = a.K, g = a.g;
  const float* x = a.x + m0 * K;
  const uint8_t* codes = a.codes + p * a.panel_code_bytes();
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  for (int64_t k0 = 0; k0 < K; k0 += g) {
    __m256 sl, sh, ol, oh;
    const char* at = a.group_at(p, k0 / g);
    if (a.half) {
      const __m128i* h = reinterpret_cast<const __m128i*>(at);
      sl = _mm256_cvtph_ps(_mm_loadu_si128(h));
      sh = _mm256_cvtph_ps(_mm_loadu_si128(h + 1));
      ol = _mm256_cvtph_ps(_mm_loadu_si128(h + 2));
      oh = _mm256_cvtph_ps(_mm_loadu_si128(h + 3));
    } else {
      const float* f = reinterpret_cast<const float*>(at);
      sl = _mm256_loadu_ps(f), sh = _mm256_loadu_ps(f + 8), ol = _mm256_loadu_ps(f + 16), oh = _mm256_loadu_ps(f + 24);
    }
    const int64_t step = a.packed ? 2 : 1;
    for (int64_t k = k0; k < k0 + g; k += step) {
      const uint8_t* c = codes + (a.packed ? k / 2 : k) * PANEL;
      const __m256i vl = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
      const __m256i vh = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8)));
      if (a.packed) {
        const __m256 wl0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(vl, low4)), sl, ol);
        const __m256 wh0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(vh, low4)), sh, oh);
        const __m256 wl1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(vl, 4)), sl, ol);
        const __m256 wh1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(vh, 4)), sh, oh);
#pragma GCC unroll 4
        for (int m = 0; m < MR; ++m) {
          const __m256 x0 = _mm256_broadcast_ss(x + m * K + k);
          const __m256 x1 = _mm256_broadcast_ss(x + m * K + k + 1);
          lo[m] = _mm256_fmadd_ps(x0, wl0, lo[m]);
          hi[m] = _mm256_fmadd_ps(x0, wh0, hi[m]);
          lo[m] = _mm256_fmadd_ps(x1, wl1, lo[m]);
          hi[m] = _mm256_fmadd_ps(x1, wh1, hi[m]);
        }
      } else {
        const __m256 wl = _mm256_fmadd_ps(_mm256_cvtepi32_ps(vl), sl, ol);
        const __m256 wh = _mm256_fmadd_ps(_mm256_cvtepi32_ps(vh), sh, oh);
#pragma GCC unroll 4
        for (int m = 0; m < MR; ++m) {
          const __m256 xv = _mm256_broadcast_ss(x + m * K + k);
          lo[m] = _mm256_fmadd_ps(xv, wl, lo[m]);
          hi[m] = _mm256_fmadd_ps(xv, wh, hi[m]);
        }
      }
    }
  }
  const float* b = a.bias ? a.bias + p * PANEL : nullptr;
  const __m256 bl = b ? _mm256_loadu_ps(b) : _mm256_setzero_ps();
  const __m256 bh = b ? _mm256_loadu_ps(b + 8) : _mm256_setzero_ps();
  for (int m = 0; m < MR; ++m) {
    float* y = a.y + (m0 + m) * a.N + p * PANEL;
    _mm256_storeu_ps(y, _mm256_add_ps(lo[m], bl));
    _mm256_storeu_ps(y + 8, _mm256_add_ps(hi[m], bh));
  }
}

using QAvx512Block = void (*)(const QArgs&, int64_t, int64_t, int, NextPanels);
using QAvx2Block = void (*)(const QArgs&, int64_t, int64_t);
// Few rows: four panels a pass (their FMA chains overlap); more rows: two panels and
// blocks of up to 8 rows (16 accumulators, the weights and scales in the other registers).
constexpr int WIDE_PANELS = 4, WIDE_ROWS = 2;
constexpr int AVX512_ROWS = 8;
constexpr int AVX2_ROWS = 4;
const QAvx512Block WIDE_BLOCKS[WIDE_ROWS + 1] = {nullptr, qblock_avx512<1, WIDE_PANELS>, qblock_avx512<2, WIDE_PANELS>};
const QAvx512Block AVX512_BLOCKS[AVX512_ROWS + 1] = {
    nullptr, qblock_avx512<1, 2>, qblock_avx512<2, 2>, qblock_avx512<3, 2>, qblock_avx512<4, 2>,
    qblock_avx512<5, 2>, qblock_avx512<6, 2>, qblock_avx512<7, 2>, qblock_avx512<8, 2>};
const QAvx2Block AVX2_BLOCKS[AVX2_ROWS + 1] = {nullptr, qblock_avx2<1>, qblock_avx2<2>, qblock_avx2<3>, qblock_avx2<4>};
#endif

// Rows m0 .. m0 + rows of panel p, plain loops (one FMA chain per output, in k order).
void qblock_plain(const QArgs& a, int64_t m0, int64_t rows, int64_t p) {
  const int64_t K = a.K, g = a.g;
  const uint8_t* codes = a.codes + p * a.panel_code_bytes();
  for (int64_t m = m0; m < m0 + rows; ++m) {
    float acc[PANEL] = {};
    const float* x = a.x + m * K;
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t j = 0; j < PANEL; ++j) {
        const uint8_t byte = a.packed ? codes[(k / 2) * PANEL + j] : codes[k * PANEL + j];
        const int code = a.packed ? ((k & 1) ? byte >> 4 : byte & 0x0F) : byte;
        const float w = std::fma(static_cast<float>(code), a.scale(p, k / g, j), a.offset(p, k / g, j));
        acc[j] = std::fma(x[k], w, acc[j]);
      }
    }
    float* y = a.y + m * a.N + p * PANEL;
    for (int64_t j = 0; j < PANEL; ++j) y[j] = acc[j] + (a.bias ? a.bias[p * PANEL + j] : 0.0f);
  }
}

using raydecode::Isa;
using raydecode::best_isa;

int64_t panels_per_unit(Isa isa, int64_t M) {
  if (isa != Isa::kAvx512) return 1;
  return M <= 2 ? 4 : 2;  // WIDE_ROWS, WIDE_PANELS
}

// From this many rows (AVX-512) a unit's two panels are dequantized once into a float
// buffer and the float panel kernel's blocks run over them (panel_blocks.h): the same
// values and the same FMA chains as the in-register path, so a row's result is the same
// either way; the codes are unpacked once per call instead of once per block of rows.
constexpr int64_t DEQUANT_ROWS = 32;

void run_unit(const QArgs& a, Isa isa, int64_t unit, int64_t per, float* buffer, int64_t dequant_rows) {
  const int64_t P = a.N / PANEL;
  const int64_t p = unit * per;
  const int np = static_cast<int>(std::min<int64_t>(per, P - p));
  switch (isa) {
#ifdef RAYDECODE_X86
    case Isa::kAvx512: {
      if (a.M >= dequant_rows) {
        NextPanels next(a, p + per, per);
        for (int i = 0; i < np; ++i) dequantize_panel_avx512(a, p + i, buffer + i * a.K * PANEL, PANEL, &next);
        const float* b0 = a.bias ? a.bias + p * PANEL : nullptr;
        raydecode::panel_rows_avx512(a.x, a.M, a.K, buffer, buffer + a.K * PANEL, np, b0, b0 ? b0 + PANEL : nullptr,
                                     a.y + p * PANEL, a.N, nullptr, 0);
        return;
      }
      // The first block of rows asks for the next unit's panels (the thread's next unit,
      // as the split hands them out); later blocks find this unit's in L2.
      const NextPanels next(a, p + per, per);
      if (per == WIDE_PANELS) {
        WIDE_BLOCKS[a.M](a, 0, p, np, next);
        return;
      }
      for (int64_t m0 = 0; m0 < a.M; m0 += AVX512_ROWS)
        AVX512_BLOCKS[std::min<int64_t>(AVX512_ROWS, a.M - m0)](a, m0, p, np, m0 == 0 ? next : NextPanels());
      return;
    }
    case Isa::kAvx2:
      for (int64_t m0 = 0; m0 < a.M; m0 += AVX2_ROWS) AVX2_BLOCKS[std::min<int64_t>(AVX2_ROWS, a.M - m0)](a, m0, p);
      return;
#endif
    default:
      qblock_plain(a, 0, a.M, p);
  }
}

std::vector<std::string> quant_isas() {
  std::vector<std::string> out;
#ifdef RAYDECODE_X86
  if (__builtin_cpu_supports("avx512f")) out.push_back("avx512");
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) out.push_back("avx2");
#endif
  out.push_back("plain");
  return out;
}

void check(const torch::Tensor& t, const char* name, at::ScalarType type, int64_t dims) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == type && t.is_contiguous() && t.dim() == dims, "quant_linear: ",
              name, " must be a contiguous ", c10::toString(type), " CPU tensor of ", dims, " dimensions");
}

}  // namespace

// y [M, N] = x [M, K] @ W^T (+ bias), W in quantized panels (pack_quant_panels,
// pack_quant_groups). ``isa`` forces an instruction set this CPU has ("avx512",
// "avx2", "plain": tests); "" picks.
void quant_linear(torch::Tensor y, const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& groups,
                  const c10::optional<torch::Tensor>& bias, int64_t group_size, const std::string& isa_name,
                  int64_t dequant_rows) {
  check(y, "y", torch::kFloat32, 2);
  check(x, "x", torch::kFloat32, 2);
  check(codes, "codes", torch::kUInt8, 3);
  const bool half = groups.scalar_type() == torch::kFloat16;
  check(groups, "groups", half ? torch::kFloat16 : torch::kFloat32, 3);
  const int64_t M = x.size(0), K = x.size(1), P = codes.size(0), N = P * PANEL, g = group_size;
  TORCH_CHECK(g > 0 && K % g == 0, "quant_linear: K (", K, ") must be whole groups of ", g);
  const bool packed = codes.size(1) * 2 == K;
  TORCH_CHECK((packed || codes.size(1) == K) && codes.size(2) == PANEL,
              "quant_linear: codes must be [N / 16, K / 2, 16] (4-bit) or [N / 16, K, 16]");
  TORCH_CHECK(!packed || g % 2 == 0, "quant_linear: 4-bit codes need even groups");
  TORCH_CHECK(groups.size(0) == P && groups.size(1) == K / g && groups.size(2) == 2 * PANEL,
              "quant_linear: groups must be [N / 16, K / g, 32]");
  TORCH_CHECK(y.size(0) == M && y.size(1) == N, "quant_linear: y must be [M, N]");
  if (bias.has_value()) {
    check(*bias, "bias", torch::kFloat32, 1);
    TORCH_CHECK(bias->size(0) == N, "quant_linear: bias must have N entries");
  }
  if (M == 0 || N == 0) return;
  const QArgs a{x.data_ptr<float>(), codes.data_ptr<uint8_t>(), groups.data_ptr(),
                bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(), M, K, N, g, packed, half};
  Isa isa = best_isa();
  if (!isa_name.empty()) {
    const auto have = quant_isas();
    TORCH_CHECK(std::find(have.begin(), have.end(), isa_name) != have.end(), "quant_linear: this CPU has no ", isa_name);
    isa = isa_name == "avx512" ? Isa::kAvx512 : isa_name == "avx2" ? Isa::kAvx2 : Isa::kPlain;
  }
  if (dequant_rows < 0) dequant_rows = DEQUANT_ROWS;
  const int64_t per = isa == Isa::kAvx512 && M >= dequant_rows ? 2 : panels_per_unit(isa, M);
  const int64_t units = (P + per - 1) / per;
  raydecode::StealingSplit split(units, at::get_num_threads());
  // Each thread's float panels (the dequantizing path): two panels of [K, 16].
  std::vector<float> buffers(isa == Isa::kAvx512 && M >= dequant_rows ? split.threads() * 2 * K * PANEL : 0);
  split.run([&](int64_t unit, int64_t thread) {
    run_unit(a, isa, unit, per, buffers.empty() ? nullptr : buffers.data() + thread * 2 * K * PANEL, dequant_rows);
  });
}

// codes [N, K / 2] (4-bit, two a byte) or [N, K] -> [N / 16, K / 2 | K, 16].
torch::Tensor pack_quant_panels(const torch::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2, "pack_quant_panels: a 2-dimensional CPU tensor");
  const int64_t N = t.size(0), W = t.size(1);
  TORCH_CHECK(N % PANEL == 0, "pack_quant_panels: the output features (", N, ") must be a multiple of 16");
  return t.contiguous().view({N / PANEL, PANEL, W}).transpose(1, 2).contiguous();
}

// scales and offsets [N, K / g] (float32) -> groups [N / 16, K / g, 32]: float16 when
// every value is exact in half precision (``half`` allowed), else float32.
torch::Tensor pack_quant_groups(const torch::Tensor& scales, const torch::Tensor& offsets, bool allow_half) {
  TORCH_CHECK(scales.sizes() == offsets.sizes() && scales.dim() == 2 && scales.scalar_type() == torch::kFloat32 &&
                  offsets.scalar_type() == torch::kFloat32,
              "pack_quant_groups: scales and offsets must be float32 [N, K / g] alike");
  auto both = torch::cat({pack_quant_panels(scales), pack_quant_panels(offsets)}, 2).contiguous();
  if (allow_half) {
    auto half = both.to(torch::kFloat16);
    if (torch::equal(half.to(torch::kFloat32), both)) return half;
  }
  return both;
}

// The checks every entry point over quantized panels makes: codes [P, K / 2 | K, 16],
// groups [P, K / g, 32], whole groups (even ones for 4-bit codes). Returns K and
// whether the codes are packed two to a byte.
std::pair<int64_t, bool> check_panels(const char* who, const torch::Tensor& codes, const torch::Tensor& groups,
                                      int64_t g) {
  check(codes, "codes", torch::kUInt8, 3);
  check(groups, "groups", groups.scalar_type() == torch::kFloat16 ? torch::kFloat16 : torch::kFloat32, 3);
  TORCH_CHECK(g > 0, who, ": group_size must be positive, got ", g);
  const int64_t K = groups.size(1) * g;
  const bool packed = codes.size(1) * 2 == K;
  TORCH_CHECK(codes.size(0) == groups.size(0) && codes.size(2) == PANEL && groups.size(2) == 2 * PANEL &&
                  (packed || codes.size(1) == K),
              who, ": codes must be [P, K / 2, 16] (4-bit) or [P, K, 16] and groups [P, K / g, 32]");
  TORCH_CHECK(!packed || g % 2 == 0, who, ": 4-bit codes need even groups");
  return {K, packed};
}

// W^T [K, 16 (p1 - p0)] in float32 of panels [p0, p1): a prefill chunk's weights for a
// library GEMM (``rows @ W^T`` as one ``mm``), each panel's 16 outputs a row of 16
// floats at each k, the kernel's values (one rounding).
torch::Tensor dequantize_quant_panels(const torch::Tensor& codes, const torch::Tensor& groups, int64_t group_size,
                                      int64_t p0, int64_t p1) {
  const std::pair<int64_t, bool> shape = check_panels("dequantize_quant_panels", codes, groups, group_size);
  const int64_t K = shape.first;
  const bool packed = shape.second;
  const bool half = groups.scalar_type() == torch::kFloat16;
  const int64_t P = codes.size(0), g = group_size;
  TORCH_CHECK(0 <= p0 && p0 <= p1 && p1 <= P, "dequantize_quant_panels: panels out of range");
  const QArgs a{nullptr, codes.data_ptr<uint8_t>(), groups.data_ptr(), nullptr, nullptr, 0, K, P * PANEL, g, packed,
                half};
  const int64_t ld = (p1 - p0) * PANEL;
  auto out = torch::empty({K, ld}, torch::kFloat32);
  float* w = out.data_ptr<float>();
  const bool simd = best_isa() == Isa::kAvx512;
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const int64_t cb = codes.size(1) * PANEL;
  at::parallel_for(p0, p1, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      float* col = w + (p - p0) * PANEL;
#ifdef RAYDECODE_X86
      if (simd) {
        dequantize_panel_avx512(a, p, col, ld);
        continue;
      }
#endif
      for (int64_t k = 0; k < K; ++k) {
        for (int64_t j = 0; j < PANEL; ++j) {
          const uint8_t byte = packed ? c[p * cb + (k / 2) * PANEL + j] : c[p * cb + k * PANEL + j];
          const int code = packed ? ((k & 1) ? byte >> 4 : byte & 0x0F) : byte;
          col[k * ld + j] = std::fma(static_cast<float>(code), a.scale(p, k / g, j), a.offset(p, k / g, j));
        }
      }
    }
  });
  (void)simd;
  return out;
}

// The float32 rows ``ids`` of the weights in panels: a tied embedding's lookup from its
// output layer's panels (the table is stored once).
torch::Tensor quant_panel_rows(const torch::Tensor& codes, const torch::Tensor& groups, int64_t group_size,
                               const torch::Tensor& ids) {
  const std::pair<int64_t, bool> shape = check_panels("quant_panel_rows", codes, groups, group_size);
  const int64_t K = shape.first;
  const bool packed = shape.second;
  const bool half = groups.scalar_type() == torch::kFloat16;
  TORCH_CHECK(ids.device().is_cpu() && ids.dim() == 1 && ids.scalar_type() == torch::kLong,
              "quant_panel_rows: ids must be a 1-dimensional int64 CPU tensor");
  const int64_t P = codes.size(0), N = P * PANEL, g = group_size;
  const QArgs a{nullptr, codes.data_ptr<uint8_t>(), groups.data_ptr(), nullptr, nullptr, 0, K, N, g, packed, half};
  const int64_t R = ids.size(0);
  const auto id = ids.contiguous();
  const int64_t* rows = id.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(0 <= rows[r] && rows[r] < N, "quant_panel_rows: id ", rows[r], " is outside the ", N, " rows");
  auto out = torch::empty({R, K}, torch::kFloat32);
  float* w = out.data_ptr<float>();
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const int64_t cb = codes.size(1) * PANEL;
  at::parallel_for(0, R, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t p = rows[r] / PANEL, j = rows[r] % PANEL;
      for (int64_t k = 0; k < K; ++k) {
        const uint8_t byte = packed ? c[p * cb + (k / 2) * PANEL + j] : c[p * cb + k * PANEL + j];
        const int code = packed ? ((k & 1) ? byte >> 4 : byte & 0x0F) : byte;
        w[r * K + k] = std::fma(static_cast<float>(code), a.scale(p, k / g, j), a.offset(p, k / g, j));
      }
    }
  });
  return out;
}

void register_quant_linear(pybind11::module_& m) {
  m.def("quant_linear", &quant_linear, "linear over quantized panel weights, dequantized in registers (CPU)",
        pybind11::arg("y"), pybind11::arg("x"), pybind11::arg("codes"), pybind11::arg("groups"), pybind11::arg("bias"),
        pybind11::arg("group_size"), pybind11::arg("isa") = "", pybind11::arg("dequant_rows") = -1);
  m.def("quant_isas", &quant_isas, "the instruction sets quant_linear can use here, best first");
  m.def("pack_quant_panels", &pack_quant_panels, "codes [N, W] -> [N / 16, W, 16]");
  m.def("pack_quant_groups", &pack_quant_groups, "scales, offsets [N, K / g] -> groups [N / 16, K / g, 32]",
        pybind11::arg("scales"), pybind11::arg("offsets"), pybind11::arg("allow_half") = true);
  m.def("dequantize_quant_panels", &dequantize_quant_panels, "W^T float32 [K, 16 (p1 - p0)] of panels [p0, p1)");
  m.def("quant_panel_rows", &quant_panel_rows, "float32 rows [len(ids), K] of the weights in panels");
}
