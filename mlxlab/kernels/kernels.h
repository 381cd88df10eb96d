// The kernels' entry points (module.cpp binds them to Python).
#pragma once

#include <optional>

#include "mlx/mlx.h"

namespace mlxlab {

// y = x @ w.T with w stored [out, in] (float32 or bfloat16), x float32 with few rows (matvec.cpp).
mlx::core::array matvec(
    const mlx::core::array& x, const mlx::core::array& w, mlx::core::StreamOrDevice s = {});

// Whether matvec runs its AVX-512 loops (bit for bit the AVX2+FMA loops' results); `on` 0 or 1
// turns them off or back on (tests compare the two), -1 only asks.
bool matvec_avx512(int on = -1);

// Per-row cross-entropy of float32 logits [N, V] against int labels [N]: (ce [N], lse [N]),
// with its vjp (ce.cpp).
std::vector<mlx::core::array> cross_entropy(
    const mlx::core::array& logits, const mlx::core::array& labels, mlx::core::StreamOrDevice s = {});

// softmax(scale * scores) over the last axis of causal attention scores [B, ..., K]. Each batch
// entry holds whole blocks of `queries` rows (0: K, square blocks); row r is query
// q_offset + r % queries and column c key k_offset + c. Key k is seen from query i when k <= i,
// i - k < window (window > 0), and k >= starts[b, i] (packed rows, starts [B, L] by absolute
// position); masked entries are 0. The keys must cover all that the queries see: a band of a
// sliding window, or a causal block of queries. vjp in scores (layer.cpp).
mlx::core::array attention_softmax(
    const mlx::core::array& scores,
    float scale,
    int window,
    const std::optional<mlx::core::array>& starts,
    int queries = 0,
    int q_offset = 0,
    int k_offset = 0,
    mlx::core::StreamOrDevice s = {});

// gelu_approx(g) * u, float32, with its vjp in both (layer.cpp).
mlx::core::array gelu_mul(
    const mlx::core::array& g, const mlx::core::array& u, mlx::core::StreamOrDevice s = {});

}  // namespace mlxlab
