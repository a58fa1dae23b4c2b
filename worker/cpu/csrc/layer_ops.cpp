// Fused per-layer ops for the CPU decoder path (worker/cpu/fused_decoder.py): the
// elementwise work of a Llama-shaped layer done in one pass each, so a step dispatches
// a handful of ops per layer instead of dozens.
//
//   rms_norm(out, x, residual, weight, eps)
//                                      out = weight * (x / sqrt(mean(x^2) + eps)), per row,
//                                      the normalized value rounded to the model dtype
//                                      before the weight (transformers' RMSNorm); with a
//                                      residual, residual += x first and the sum is
//                                      normalized (the layer's skip connection, in place).
//   silu_mul(out, gate, up)            out = silu(gate) * up (the MLP's activation).
//   gelu_tanh_mul(out, gate, up)       out = gelu_tanh(gate) * up (Gemma's).
//   rotary_to_cache(q, k, v, cos, sin, k_pool, v_pool, slot_rows)
//                                      rotates q in place and k on its way into the
//                                      pool (rotate-half rotary, cos/sin [T, head_dim]),
//                                      and writes v; token t's KV head h goes to pool row
//                                      slot_rows[t * kv_heads + h] (the pool seen as
//                                      [blocks * kv_heads * block_size, head_dim]).
//
// Float accumulation; tensors float32 or bfloat16. These functions join the module
// that paged_attention.cpp defines (register_layer_ops).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <optional>

#include "cpu_math.h"

namespace {

using raydecode::fast_exp;
using raydecode::from_float;
using raydecode::to_float;

// With `residual` set: residual += x first (rounded to T, as transformers' `residual +
// hidden_states`), and the sum is what gets normalized.
template <typename T>
void rms_norm_rows(T* out, const T* x, T* residual, const T* weight, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * dim;
      T* o = out + r * dim;
      if (residual != nullptr) {
        T* res = residual + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) res[i] = from_float<T>(to_float(res[i]) + to_float(xr[i]));
        xr = res;
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < dim; ++i) {
        const float v = to_float(xr[i]);
        sum += v * v;
      }
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(dim) + eps);
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) {
        const T normed = from_float<T>(to_float(xr[i]) * inv);
        o[i] = from_float<T>(to_float(weight[i]) * to_float(normed));
      }
    }
  });
}

// The gate activations: SiLU, g / (1 + exp(-g)); GELU with the tanh approximation
// (Gemma's gelu_pytorch_tanh), 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), its
// tanh as 1 - 2 / (exp(2x) + 1) (exact at both ends: exp overflows to inf, or goes to 0).
struct Silu {
  static inline float apply(float g) { return g / (1.f + fast_exp(-g)); }
};
struct GeluTanh {
  static inline float apply(float g) {
    const float x = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return 0.5f * g * (2.f - 2.f / (fast_exp(2.f * x) + 1.f));
  }
};

// act(gate) * up, elementwise over [rows, cols]; act(g) rounded to T before the product
// (transformers' act_fn(gate_proj(x)) * up_proj(x)). Rows may be strided (gate and up as
// the two halves of one merged gate/up projection's output).
template <typename Act, typename T>
void act_mul_impl(T* out, const T* gate, const T* up, int64_t rows, int64_t cols, int64_t out_stride,
                  int64_t gate_stride, int64_t up_stride) {
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(cols, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g_row = gate + r * gate_stride;
      const T* u_row = up + r * up_stride;
      T* o_row = out + r * out_stride;
#pragma omp simd
      for (int64_t i = 0; i < cols; ++i) {
        const float g = to_float(g_row[i]);
        const T act = from_float<T>(Act::apply(g));
        o_row[i] = from_float<T>(to_float(act) * to_float(u_row[i]));
      }
    }
  });
}

// x[i] * cos[i] - x[i + half] * sin[i] for the first half, x[i] * cos[i] + x[i - half]
// * sin[i] for the second; from `src` into `dst` (which may be `src`).
template <typename T>
inline void rotate_half(T* dst, const T* src, const T* cos, const T* sin, int64_t dim) {
  const int64_t half = dim / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = to_float(src[i]);
    const float b = to_float(src[i + half]);
    dst[i] = from_float<T>(a * to_float(cos[i]) - b * to_float(sin[i]));
    dst[i + half] = from_float<T>(b * to_float(cos[i + half]) + a * to_float(sin[i + half]));
  }
}

template <typename T>
void rotary_to_cache_impl(T* q, const T* k, const T* v, const T* cos, const T* sin, T* k_pool, T* v_pool,
                          const int64_t* slot_rows, int64_t tokens, int64_t heads, int64_t kv_heads,
                          int64_t dim, int64_t q_stride, int64_t k_stride, int64_t v_stride) {
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* qh = q + t * q_stride + h * dim;
        rotate_half(qh, qh, c, s, dim);
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t slot = slot_rows[t * kv_heads + h];
        rotate_half(k_pool + slot * dim, k + t * k_stride + h * dim, c, s, dim);
        const T* vh = v + t * v_stride + h * dim;
        T* dst = v_pool + slot * dim;
        for (int64_t i = 0; i < dim; ++i) dst[i] = vh[i];
      }
    }
  });
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, features] with contiguous rows");
}

template <typename T>
T* data_or_null(const std::optional<torch::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

void rms_norm(torch::Tensor out, torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor weight,
              double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && weight.is_contiguous(), "rms_norm wants contiguous tensors");
  TORCH_CHECK(out.sizes() == x.sizes() && weight.numel() == x.size(1), "rms_norm: shapes differ");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(), "rms_norm: dtypes differ");
  if (residual.has_value()) {
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "rms_norm: the residual must be contiguous and shaped and typed like x");
  }
  const int64_t rows = x.size(0), dim = x.size(1);
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows(out.data_ptr<float>(), x.data_ptr<float>(), data_or_null<float>(residual), weight.data_ptr<float>(),
                  rows, dim, e);
  } else if (x.scalar_type() == at::kBFloat16) {
    using B = c10::BFloat16;
    rms_norm_rows(out.data_ptr<B>(), x.data_ptr<B>(), data_or_null<B>(residual), weight.data_ptr<B>(), rows, dim, e);
  } else {
    TORCH_CHECK(false, "rms_norm: float32 or bfloat16 only");
  }
}

template <typename Act>
void act_mul(const char* name, torch::Tensor out, torch::Tensor gate, torch::Tensor up) {
  check_rows(out, "out");
  check_rows(gate, "gate");
  check_rows(up, "up");
  TORCH_CHECK(gate.sizes() == up.sizes() && out.sizes() == gate.sizes(), name, ": shapes differ");
  TORCH_CHECK(gate.scalar_type() == up.scalar_type() && out.scalar_type() == gate.scalar_type(), name, ": dtypes differ");
  const int64_t rows = gate.size(0), cols = gate.size(1);
  if (gate.scalar_type() == at::kFloat) {
    act_mul_impl<Act>(out.data_ptr<float>(), gate.data_ptr<float>(), up.data_ptr<float>(), rows, cols, out.stride(0),
                      gate.stride(0), up.stride(0));
  } else if (gate.scalar_type() == at::kBFloat16) {
    using B = c10::BFloat16;
    act_mul_impl<Act>(out.data_ptr<B>(), gate.data_ptr<B>(), up.data_ptr<B>(), rows, cols, out.stride(0),
                      gate.stride(0), up.stride(0));
  } else {
    TORCH_CHECK(false, name, ": float32 or bfloat16 only");
  }
}

void silu_mul(torch::Tensor out, torch::Tensor gate, torch::Tensor up) { act_mul<Silu>("silu_mul", out, gate, up); }

void gelu_tanh_mul(torch::Tensor out, torch::Tensor gate, torch::Tensor up) {
  act_mul<GeluTanh>("gelu_tanh_mul", out, gate, up);
}

void rotary_to_cache(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                     torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor slot_rows) {
  check_rows(q, "q");
  check_rows(k, "k");
  check_rows(v, "v");
  const int64_t tokens = q.size(0);
  TORCH_CHECK(k_pool.dim() == 4 && k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.sizes() == v_pool.sizes(),
              "pools must be contiguous [blocks, kv_heads, block_size, head_dim]");
  const int64_t kv_heads = k_pool.size(1), dim = k_pool.size(3);
  TORCH_CHECK(dim % 2 == 0, "rotary needs an even head_dim");
  TORCH_CHECK(q.size(1) % dim == 0 && k.size(1) == kv_heads * dim && v.size(1) == kv_heads * dim,
              "q, k, v widths do not match the pool's heads and head_dim");
  TORCH_CHECK(k.size(0) == tokens && v.size(0) == tokens, "q, k, v token counts differ");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(0) == tokens &&
                  cos.size(1) == dim && sin.sizes() == cos.sizes(),
              "cos and sin must be contiguous [tokens, head_dim]");
  TORCH_CHECK(slot_rows.scalar_type() == at::kLong && slot_rows.is_contiguous() && slot_rows.numel() == tokens * kv_heads,
              "slot_rows must be int64 [tokens * kv_heads]");
  const auto dtype = q.scalar_type();
  for (const auto* t : {&k, &v, &cos, &sin, &k_pool, &v_pool}) {
    TORCH_CHECK(t->scalar_type() == dtype, "rotary_to_cache: dtypes differ");
  }
  const int64_t pool_rows = k_pool.numel() / dim;
  const int64_t* slots = slot_rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < slot_rows.numel(); ++i) {
    TORCH_CHECK(slots[i] >= 0 && slots[i] < pool_rows, "slot row ", slots[i], " is outside the pool");
  }
  const int64_t heads = q.size(1) / dim;
  if (dtype == at::kFloat) {
    rotary_to_cache_impl(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), cos.data_ptr<float>(),
                         sin.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), slots, tokens,
                         heads, kv_heads, dim, q.stride(0), k.stride(0), v.stride(0));
  } else if (dtype == at::kBFloat16) {
    using B = c10::BFloat16;
    rotary_to_cache_impl(q.data_ptr<B>(), k.data_ptr<B>(), v.data_ptr<B>(), cos.data_ptr<B>(), sin.data_ptr<B>(),
                         k_pool.data_ptr<B>(), v_pool.data_ptr<B>(), slots, tokens, heads, kv_heads, dim, q.stride(0),
                         k.stride(0), v.stride(0));
  } else {
    TORCH_CHECK(false, "rotary_to_cache: float32 or bfloat16 only");
  }
}

}  // namespace

void register_layer_ops(pybind11::module_& m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, after adding x into the residual when one is given (CPU)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up (CPU)");
  m.def("gelu_tanh_mul", &gelu_tanh_mul, "gelu_tanh(gate) * up (CPU)");
  m.def("rotary_to_cache", &rotary_to_cache, "rotary on q (in place) and k, k and v into the paged pool (CPU)");
}
