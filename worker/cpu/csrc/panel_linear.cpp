// Float32 linear layers on CPU over weights packed in column panels:
//   y [M, N] = x [M, K] @ W^T (+ bias),  W [N, K] packed as panels [N / 16, K, 16]
// (panel p holds columns 16p .. 16p + 15, one row of 16 per k: pack_panels below).
//
// Why: at decode sizes (1 to a few dozen rows) a step is bound by reading the weights,
// and oneDNN's packed linear read them well below the rate the memory streams at. A
// panel is one contiguous run, read once per block of up to 12 rows: each weight vector
// feeds 12 FMAs from registers (two panels at once: 24 accumulators of 16 lanes,
// AVX-512), the rows' inputs broadcast from L1. More rows take the same panel again from
// L2 (the next panels prefetched meanwhile: run_unit). On long prefill chunks the FMA
// units bound the call and a library GEMM is ahead, so the engine runs those calls on
// a library GEMM's packed copy (worker/cpu/packed_linear.py: large_call_gemm,
// gemm_from_rows).
//
// Each output is one chain of FMAs over k in order, whatever M, the thread count or the
// row's neighbours: a row's result does not depend on the batch it is in.
//
// Instruction sets: AVX-512F (two panels per pass), AVX2 + FMA (one panel per pass,
// 6 rows: 12 accumulators), picked at run time; plain loops elsewhere.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "panel_run.h"
#include "work_split.h"

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace {

using raydecode::Isa;
using raydecode::PANEL;
using raydecode::PanelCall;
using raydecode::best_isa;
using raydecode::panels_per_unit;
using raydecode::run_unit;

void check(const torch::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.dim() == dims,
              "panel_linear: ", name, " must be a contiguous float32 CPU tensor of ", dims, " dimensions");
}

}  // namespace

std::vector<std::string> panel_isas() {
  std::vector<std::string> out;
#ifdef RAYDECODE_X86
  if (__builtin_cpu_supports("avx512f")) out.push_back("avx512");
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) out.push_back("avx2");
#endif
  out.push_back("plain");
  return out;
}

// y [M, N] = x [M, K] @ W^T (+ bias) with W packed by pack_panels. ``isa`` forces an
// instruction set this CPU has ("avx512", "avx2", "plain": tests); "" picks the best.
void panel_linear(torch::Tensor y, const torch::Tensor& x, const torch::Tensor& panels,
                  const c10::optional<torch::Tensor>& bias, const std::string& isa_name) {
  check(y, "y", 2);
  check(x, "x", 2);
  check(panels, "panels", 3);
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), N = P * PANEL;
  TORCH_CHECK(panels.size(1) == K && panels.size(2) == PANEL, "panel_linear: panels must be [N / 16, K, 16]");
  TORCH_CHECK(y.size(0) == M && y.size(1) == N, "panel_linear: y must be [M, N]");
  if (bias.has_value()) {
    check(*bias, "bias", 1);
    TORCH_CHECK(bias->size(0) == N, "panel_linear: bias must have N entries");
  }
  if (M == 0 || N == 0) return;
  const PanelCall a{x.data_ptr<float>(), panels.data_ptr<float>(), bias.has_value() ? bias->data_ptr<float>() : nullptr,
               y.data_ptr<float>(), M, K, N};
  Isa isa = best_isa();
  if (!isa_name.empty()) {
    const auto have = panel_isas();
    TORCH_CHECK(std::find(have.begin(), have.end(), isa_name) != have.end(), "panel_linear: this CPU has no ", isa_name);
    isa = isa_name == "avx512" ? Isa::kAvx512 : isa_name == "avx2" ? Isa::kAvx2 : Isa::kPlain;
  }
  const int64_t per = panels_per_unit(isa);
  const int64_t units = (P + per - 1) / per;
  // Contiguous runs of units per thread, a thread done early taking the other's from the
  // back (work_split.h); a thread's own next unit is the one run_unit prefetched.
  raydecode::StealingSplit(units, at::get_num_threads()).run([&](int64_t unit, int64_t) { run_unit(a, isa, unit); });
}

// W [N, K] (N a multiple of 16) -> panels [N / 16, K, 16].
torch::Tensor pack_panels(const torch::Tensor& weight) {
  check(weight, "weight", 2);
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % PANEL == 0, "pack_panels: the output features (", N, ") must be a multiple of 16");
  return weight.view({N / PANEL, PANEL, K}).transpose(1, 2).contiguous();
}

void register_panel_linear(pybind11::module_& m) {
  m.def("panel_linear", &panel_linear, "float32 linear over column-panel weights (CPU)", pybind11::arg("y"),
        pybind11::arg("x"), pybind11::arg("panels"), pybind11::arg("bias"), pybind11::arg("isa") = "");
  m.def("panel_isas", &panel_isas, "the instruction sets panel_linear can use here, best first");
  m.def("pack_panels", &pack_panels, "W [N, K] -> panels [N / 16, K, 16]");
}
