// The kernels' entry points (module.cpp binds them to Python).
#pragma once

#include "mlx/mlx.h"

namespace mlxlab {

// y = x @ w.T with w stored [out, in] (float32 or bfloat16), x float32 with few rows (matvec.cpp).
mlx::core::array matvec(
    const mlx::core::array& x, const mlx::core::array& w, mlx::core::StreamOrDevice s = {});

// Per-row cross-entropy of float32 logits [N, V] against int labels [N]: (ce [N], lse [N]),
// with its vjp (ce.cpp).
std::vector<mlx::core::array> cross_entropy(
    const mlx::core::array& logits, const mlx::core::array& labels, mlx::core::StreamOrDevice s = {});

}  // namespace mlxlab
