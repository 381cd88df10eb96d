// The Python module of mlxlab's CPU kernels (mlxlab/kernels/__init__.py wraps it).

#include <string>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/vector.h>

#include "kernels.h"
#include "mlx/version.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_kernels, m) {
  m.doc() = "mlxlab's CPU kernels: decode matvec, cross-entropy, attention softmax, gelu_mul";
  m.attr("built_against_mlx") = std::to_string(MLX_VERSION_MAJOR) + "." +
      std::to_string(MLX_VERSION_MINOR) + "." + std::to_string(MLX_VERSION_PATCH);
  m.def(
      "matvec",
      &mlxlab::matvec,
      "x"_a,
      "w"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "x @ w.T with w stored [out, in] (float32 or bfloat16), x float32 with few rows.");
  m.def(
      "matvec_avx512",
      &mlxlab::matvec_avx512,
      "on"_a = -1,
      "Whether matvec runs its AVX-512 loops; on=0/1 turns them off/on (tests), -1 only asks.");
  m.def(
      "cross_entropy",
      &mlxlab::cross_entropy,
      "logits"_a,
      "labels"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "(ce, lse) per row of float32 logits [N, V] and labels [N]; differentiable in logits.");
  m.def(
      "attention_softmax",
      &mlxlab::attention_softmax,
      "scores"_a,
      "scale"_a,
      "window"_a = 0,
      "starts"_a = nb::none(),
      nb::kw_only(),
      "queries"_a = 0,
      "q_offset"_a = 0,
      "k_offset"_a = 0,
      "stream"_a = nb::none(),
      "softmax(scale * scores) of causal attention rows (sliding window, packed-row starts); a "
      "block of `queries` queries from q_offset against keys from k_offset.");
  m.def(
      "gelu_mul",
      &mlxlab::gelu_mul,
      "g"_a,
      "u"_a,
      nb::kw_only(),
      "stream"_a = nb::none(),
      "gelu_approx(g) * u (float32), differentiable in both.");
}
