// The experts of a mixture-of-experts layer in one call, over weights packed in column
// panels (panel_linear.cpp's layout, one panel tensor per expert):
//
//   out[t] = sum over j < top_k of  w[t, j] * down_e(gate(up_e(x[t])))   (e = idx[t, j])
//
// Why: in Python the block was some 25 small ops a layer (sorting the step's (token,
// expert) pairs by expert, then per expert a gather, two matmuls, the gate and a
// scatter), dispatched one by one: at one row the dispatch cost more than the matmuls.
// Here the pairs are counting-sorted by expert, every active expert's up projection is
// one list of panel units split over the threads (an expert with few rows does not
// leave a thread idle while another computes a big one), then the gates, then the down
// projections the same way, and each token's top_k outputs are summed in rank order.
//
// Each projection output row is panel_linear's chain of FMAs over k in order, and the
// sum runs in rank order, so a token's result does not depend on which other tokens
// share its experts: batch-invariant like the dense path.
//
// Expert parallelism: the call holds the experts first_expert .. first_expert + E - 1 of
// the layer's total_experts (this rank's); pairs routed elsewhere are skipped (another
// rank adds them in the all-reduce), a token with none here gets zeros.
//
// Gates: "silu" and "gelu_tanh" (act(gate) * up, the gate columns first, then the up
// columns: transformers' default), "gpt_oss" (gate and up interleaved, clamped at
// `limit`, (up + 1) * gate * sigmoid(alpha * gate)).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_math.h"
#include "panel_run.h"
#include "work_split.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {

using raydecode::Isa;
using raydecode::PANEL;
using raydecode::PanelCall;

enum class Gate { kSilu, kGeluTanh, kGptOss };

Gate gate_of(const std::string& name) {
  if (name == "silu") return Gate::kSilu;
  if (name == "gelu_tanh") return Gate::kGeluTanh;
  if (name == "gpt_oss") return Gate::kGptOss;
  TORCH_CHECK(false, "moe_experts: unknown gate ", name, " (silu, gelu_tanh, gpt_oss)");
}

// One projection of every expert: each expert's panels [N / 16, K, 16] and bias [N].
struct Projection {
  std::vector<const float*> panels, biases;
  int64_t K = 0, N = 0;
};

Projection projection_of(const std::vector<torch::Tensor>& panels, const std::vector<torch::Tensor>& biases,
                         int64_t experts, const char* name) {
  TORCH_CHECK(static_cast<int64_t>(panels.size()) == experts, "moe_experts: ", name, " needs one panel tensor an expert");
  TORCH_CHECK(biases.empty() || static_cast<int64_t>(biases.size()) == experts,
              "moe_experts: ", name, " biases: none, or one an expert");
  Projection p;
  for (int64_t e = 0; e < experts; ++e) {
    const torch::Tensor& w = panels[e];
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.dim() == 3 &&
                    w.size(2) == PANEL, "moe_experts: ", name, " panels must be contiguous float32 [N / 16, K, 16]");
    if (e == 0) {
      p.K = w.size(1);
      p.N = w.size(0) * PANEL;
    }
    TORCH_CHECK(w.size(1) == p.K && w.size(0) * PANEL == p.N, "moe_experts: ", name, " experts differ in shape");
    p.panels.push_back(w.data_ptr<float>());
    if (!biases.empty()) {
      const torch::Tensor& b = biases[e];
      TORCH_CHECK(b.scalar_type() == torch::kFloat32 && b.is_contiguous() && b.numel() == p.N,
                  "moe_experts: ", name, " biases must be contiguous float32 [N]");
      p.biases.push_back(b.data_ptr<float>());
    } else {
      p.biases.push_back(nullptr);
    }
  }
  return p;
}

// The units of all `calls`, split over the threads at once.
void run_calls(const std::vector<PanelCall>& calls, Isa isa) {
  const int64_t per = raydecode::panels_per_unit(isa);
  std::vector<int64_t> first(calls.size() + 1, 0);  // each call's first unit
  for (size_t c = 0; c < calls.size(); ++c) first[c + 1] = first[c] + (calls[c].N / PANEL + per - 1) / per;
  if (first.back() == 0) return;
  raydecode::StealingSplit(first.back(), at::get_num_threads()).run([&](int64_t unit, int64_t) {
    const size_t c = static_cast<size_t>(std::upper_bound(first.begin(), first.end(), unit) - first.begin()) - 1;
    raydecode::run_unit(calls[c], isa, unit - first[c]);
  });
}

inline float silu(float g) { return g / (1.f + raydecode::fast_exp(-g)); }

inline float gelu_tanh(float g) {
  const float x = 0.7978845608028654f * (g + 0.044715f * g * g * g);
  return 0.5f * g * (2.f - 2.f / (raydecode::fast_exp(2.f * x) + 1.f));
}

// act [rows, width] from the up projection's rows h [rows, 2 * width].
void apply_gate(Gate gate, const float* h, float* act, int64_t rows, int64_t width, float alpha, float limit) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(width, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* hr = h + r * 2 * width;
      float* ar = act + r * width;
      switch (gate) {
        case Gate::kSilu:
#pragma omp simd
          for (int64_t j = 0; j < width; ++j) ar[j] = silu(hr[j]) * hr[width + j];
          break;
        case Gate::kGeluTanh:
#pragma omp simd
          for (int64_t j = 0; j < width; ++j) ar[j] = gelu_tanh(hr[j]) * hr[width + j];
          break;
        case Gate::kGptOss:
#pragma omp simd
          for (int64_t j = 0; j < width; ++j) {
            const float g = std::min(hr[2 * j], limit);
            const float u = std::max(std::min(hr[2 * j + 1], limit), -limit);
            ar[j] = (u + 1.f) * (g / (1.f + raydecode::fast_exp(-alpha * g)));
          }
          break;
      }
    }
  });
}

}  // namespace

// out [T, H] = the experts' weighted sum for x [T, H] routed to experts idx [T, top_k]
// (int64) with weights w [T, top_k] (float32); up: per expert panels of its gate and up
// projection [2 W / 16, H, 16] (and biases [2 W]), down: of its down projection
// [H / 16, W, 16] (and biases [H]).
void moe_experts(torch::Tensor out, const torch::Tensor& x, const torch::Tensor& idx, const torch::Tensor& w,
                 const std::vector<torch::Tensor>& up_panels, const std::vector<torch::Tensor>& up_biases,
                 const std::vector<torch::Tensor>& down_panels, const std::vector<torch::Tensor>& down_biases,
                 const std::string& gate_name, double alpha, double limit, int64_t first_expert,
                 int64_t total_experts) {
  const Gate gate = gate_of(gate_name);
  const int64_t experts = static_cast<int64_t>(up_panels.size());
  TORCH_CHECK(experts > 0, "moe_experts: no experts");
  const Projection up = projection_of(up_panels, up_biases, experts, "up");
  const Projection down = projection_of(down_panels, down_biases, experts, "down");
  for (const torch::Tensor* t : {static_cast<const torch::Tensor*>(&out), &x, &w})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->dim() == 2,
                "moe_experts: out, x and w must be contiguous float32 [rows, features]");
  TORCH_CHECK(idx.scalar_type() == torch::kInt64 && idx.is_contiguous() && idx.sizes() == w.sizes(),
              "moe_experts: idx must be contiguous int64 shaped like w");
  const int64_t T = x.size(0), H = x.size(1), top_k = idx.size(1), width = up.N / 2;
  TORCH_CHECK(idx.size(0) == T && out.sizes() == x.sizes(), "moe_experts: rows differ");
  TORCH_CHECK(up.K == H && down.N == H && down.K == width && up.N == 2 * width,
              "moe_experts: the experts' shapes do not chain (up [2 W, H], down [H, W])");
  if (T == 0) return;
  const int64_t total = total_experts < 0 ? first_expert + experts : total_experts;
  TORCH_CHECK(first_expert >= 0 && first_expert + experts <= total, "moe_experts: experts ", first_expert, "..",
              first_expert + experts - 1, " are not among the layer's ", total);
  const int64_t* ids = idx.data_ptr<int64_t>();

  // The (token, rank) pairs routed here counting-sorted by expert, stable; pos -1: elsewhere.
  const int64_t all_pairs = T * top_k;
  std::vector<int64_t> start(experts + 1, 0), pos(all_pairs, -1);
  for (int64_t i = 0; i < all_pairs; ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < total, "moe_experts: expert index ", ids[i], " out of range");
    const int64_t e = ids[i] - first_expert;
    if (e >= 0 && e < experts) ++start[e + 1];
  }
  for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
  const int64_t pairs = start[experts];
  std::vector<int64_t> order(pairs);
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < all_pairs; ++i) {
      const int64_t e = ids[i] - first_expert;
      if (e < 0 || e >= experts) continue;
      pos[i] = fill[e]++;
      order[pos[i]] = i;
    }
  }
  auto buffer = [&](int64_t rows, int64_t cols) { return torch::empty({rows, cols}, x.options()); };
  torch::Tensor rows_in = buffer(pairs, H), hidden = buffer(pairs, 2 * width), act = buffer(pairs, width),
                rows_out = buffer(pairs, H);
  const float* xp = x.data_ptr<float>();
  float* in = rows_in.data_ptr<float>();
  at::parallel_for(0, pairs, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) std::memcpy(in + r * H, xp + (order[r] / top_k) * H, H * sizeof(float));
  });

  const Isa isa = raydecode::best_isa();
  std::vector<PanelCall> calls;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n) calls.push_back({in + start[e] * H, up.panels[e], up.biases[e], hidden.data_ptr<float>() + start[e] * 2 * width,
                            n, H, 2 * width});
  }
  run_calls(calls, isa);
  apply_gate(gate, hidden.data_ptr<float>(), act.data_ptr<float>(), pairs, width, static_cast<float>(alpha),
             static_cast<float>(limit));
  calls.clear();
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n) calls.push_back({act.data_ptr<float>() + start[e] * width, down.panels[e], down.biases[e],
                            rows_out.data_ptr<float>() + start[e] * H, n, width, H});
  }
  run_calls(calls, isa);

  // Each token's top_k outputs, weighted, summed in rank order.
  const float* ro = rows_out.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* o = op + t * H;
      bool first = true;
      for (int64_t j = 0; j < top_k; ++j) {
        if (pos[t * top_k + j] < 0) continue;  // another rank's expert
        const float weight = wp[t * top_k + j];
        const float* r = ro + pos[t * top_k + j] * H;
        if (first) {
#pragma omp simd
          for (int64_t i = 0; i < H; ++i) o[i] = r[i] * weight;
        } else {
#pragma omp simd
          for (int64_t i = 0; i < H; ++i) o[i] += r[i] * weight;
        }
        first = false;
      }
      if (first) std::fill(o, o + H, 0.f);
    }
  });
}

void register_moe_experts(pybind11::module_& m) {
  m.def("moe_experts", &moe_experts, "a mixture-of-experts layer's experts over column-panel weights (CPU)",
        pybind11::arg("out"), pybind11::arg("x"), pybind11::arg("idx"), pybind11::arg("w"), pybind11::arg("up_panels"),
        pybind11::arg("up_biases"), pybind11::arg("down_panels"), pybind11::arg("down_biases"), pybind11::arg("gate"),
        pybind11::arg("alpha") = 1.0, pybind11::arg("limit") = 0.0, pybind11::arg("first_expert") = 0,
        pybind11::arg("total_experts") = -1);
}
