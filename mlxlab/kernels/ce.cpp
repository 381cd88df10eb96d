// Cross-entropy over a large vocabulary on the CPU: per row, ce = logsumexp(x) - x[label], and
// its gradient (softmax(x) - onehot(label)) * cotangent.
//
// MLX's CPU backend runs exp, the row reductions and the softmax one op at a time, on one
// thread, with scalar exp: over gemma3's 262144-entry vocabulary that is ~25 ns per logit, so
// the loss head's softmax took longer than its matmuls (3.2 s for logsumexp and 4.7 s for the
// softmax of 608 positions, against 1.8 s for the head's matmul). Here each row is two passes
// forward (max, then the sum of exp) and one backward, with a vectorized exp, rows split over
// the cores. Sums run in 16 lanes in a fixed order, so a row's result does not depend on the
// thread count or on the other rows.

#include <cmath>
#include <limits>
#include <stdexcept>

#include "common.h"
#include "kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "vexp.h"

using namespace mlx::core;

namespace mlxlab {

namespace {

// 8 floats from p[0..n), the rest `fill`.
ALWAYS_INLINE v8 load_tail(const float* p, int n, float fill) {
  float buf[8];
  for (int j = 0; j < 8; ++j) {
    buf[j] = j < n ? p[j] : fill;
  }
  return load8(buf);
}

// (max, sum of exp(x - max)) of one row; nan when it has a NaN or an infinite logit.
ALWAYS_INLINE void row_stats(const float* x, int V, bool& nan, float& max, float& sum) {
  const float ninf = -std::numeric_limits<float>::infinity();
  v8 m0 = splat(ninf), m1 = m0;
  i32x8 bad = {};
  int k = 0;
  for (; k + 16 <= V; k += 16) {
    v8 a = load8(x + k), b = load8(x + k + 8);
    bad |= (a != a) | (b != b);
    m0 = a > m0 ? a : m0;
    m1 = b > m1 ? b : m1;
  }
  for (; k < V; k += 8) {
    v8 a = load_tail(x + k, V - k, ninf);
    bad |= (a != a);
    m0 = a > m0 ? a : m0;
  }
  nan = false;
  for (int j = 0; j < 8; ++j) {
    nan |= bad[j] != 0;
  }
  float m = fold16(m0, m1, true);
  if (nan || std::isinf(m)) {  // NaN in the row, or +-inf logits: no finite answer
    nan = true;
    max = sum = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  // Blocks of 1024 logits sum in 16 float lanes, the blocks' sums in a double: a float sum
  // over 262144 terms would carry ~1e-5 of rounding into every probability.
  constexpr int BLOCK = 1024;
  double total = 0.0;
  v8 vm = splat(m);
  k = 0;
  while (k + 16 <= V) {
    v8 s0 = {}, s1 = {};
    int end = std::min(V - 15, k + BLOCK);
    for (; k < end; k += 16) {
      s0 += vexp(load8(x + k) - vm);
      s1 += vexp(load8(x + k + 8) - vm);
    }
    total += fold16(s0, s1, false);
  }
  v8 s0 = {};
  for (; k < V; k += 8) {
    int n = V - k;
    v8 e = vexp(load_tail(x + k, n, 0.0f) - vm);
    for (int j = n; j < 8; ++j) {
      e[j] = 0.0f;
    }
    s0 += e;
  }
  total += fold16(s0, v8{}, false);
  max = m;
  sum = static_cast<float>(total);
}

// ce and lse per row, and (max, 1 / sum) for the backward: exp(x - max) / sum keeps the
// softmax's large entries as exact as MLX's softmax, where exp(x - lse) would carry lse's rounding.
ALWAYS_INLINE void forward_impl(
    const float* x, const int32_t* labels, float* ce, float* lse, float* aux, int V, int r0, int r1) {
  for (int r = r0; r < r1; ++r) {
    const float* row = x + static_cast<size_t>(r) * V;
    bool nan;
    float m, sum;
    row_stats(row, V, nan, m, sum);
    float l = m + std::log(sum);
    int label = labels[r];
    lse[r] = l;
    aux[2 * r] = m;
    aux[2 * r + 1] = 1.0f / sum;
    ce[r] = (nan || label < 0 || label >= V) ? std::numeric_limits<float>::quiet_NaN()
                                             : l - row[label];
  }
}

// g = (c_ce + c_lse) * exp(x - max) / sum, and g[label] -= c_ce.
ALWAYS_INLINE void backward_impl(
    const float* x,
    const int32_t* labels,
    const float* aux,
    const float* c_ce,
    const float* c_lse,
    float* g,
    int V,
    int r0,
    int r1) {
  for (int r = r0; r < r1; ++r) {
    const float* row = x + static_cast<size_t>(r) * V;
    float* out = g + static_cast<size_t>(r) * V;
    v8 vm = splat(aux[2 * r]);
    v8 c = splat((c_ce[r] + c_lse[r]) * aux[2 * r + 1]);
    int k = 0;
    for (; k + 8 <= V; k += 8) {
      store8(out + k, c * vexp(load8(row + k) - vm));
    }
    for (; k < V; ++k) {
      v8 e = vexp(splat(row[k]) - vm);
      out[k] = c[0] * e[0];
    }
    int label = labels[r];
    if (label >= 0 && label < V) {
      out[label] -= c_ce[r];
    }
  }
}

MLXLAB_DISPATCH(
    forward,
    (const float* x, const int32_t* l, float* ce, float* lse, float* aux, int V, int r0, int r1),
    (x, l, ce, lse, aux, V, r0, r1))
MLXLAB_DISPATCH(
    backward,
    (const float* x, const int32_t* l, const float* aux, const float* a, const float* b, float* g,
     int V, int r0, int r1),
    (x, l, aux, a, b, g, V, r0, r1))

// Threads for rows of V logits: below ~64k logits a hand-off is not worth it.
int threads_for_rows(int rows, int V) { return threads_for(static_cast<size_t>(rows) * V, 65536); }

class CrossEntropyGrad : public UnaryPrimitive {
 public:
  explicit CrossEntropyGrad(Stream stream) : UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    auto& encoder = bind_io(stream(), inputs, out, "[cross_entropy]");
    int N = inputs[0].shape(0), V = inputs[0].shape(1);
    const float* x = inputs[0].data<float>();
    const int32_t* l = inputs[1].data<int32_t>();
    const float* aux = inputs[2].data<float>();
    const float* a = inputs[3].data<float>();
    const float* b = inputs[4].data<float>();
    float* g = out.data<float>();
    encoder.dispatch([=]() {
      parallel_for(threads_for_rows(N, V), N, [=](int r0, int r1) { backward(x, l, aux, a, b, g, V, r0, r1); });
    });
  }

  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("[cross_entropy] is a CPU kernel");
  }

  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    return {inputs[0].shape()};
  }

  const char* name() const override { return "CrossEntropyGrad"; }
  bool is_equivalent(const Primitive&) const override { return true; }
};

class CrossEntropy : public Primitive {
 public:
  explicit CrossEntropy(Stream stream) : Primitive(stream) {}

  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    auto& encoder = bind_io(stream(), inputs, outputs, "[cross_entropy]");
    int N = inputs[0].shape(0), V = inputs[0].shape(1);
    const float* x = inputs[0].data<float>();
    const int32_t* l = inputs[1].data<int32_t>();
    float* ce = outputs[0].data<float>();
    float* lse = outputs[1].data<float>();
    float* aux = outputs[2].data<float>();
    encoder.dispatch([=]() {
      parallel_for(threads_for_rows(N, V), N, [=](int r0, int r1) { forward(x, l, ce, lse, aux, V, r0, r1); });
    });
  }

  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("[cross_entropy] is a CPU kernel");
  }

  std::vector<array> vjp(
      const std::vector<array>& primals,
      const std::vector<array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<array>& outputs) override {
    std::vector<array> grads;
    for (int arg : argnums) {
      if (arg == 0) {
        auto s = stream();
        auto c_ce = contiguous(astype(cotangents[0], float32, s), false, s);
        auto c_lse = contiguous(astype(cotangents[1], float32, s), false, s);
        grads.push_back(array(
            primals[0].shape(),
            float32,
            std::make_shared<CrossEntropyGrad>(s),
            {primals[0], primals[1], outputs[2], c_ce, c_lse}));
      } else {
        grads.push_back(zeros_like(primals[arg], stream()));
      }
    }
    return grads;
  }

  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    int N = inputs[0].shape(0);
    return {{N}, {N}, {N, 2}};
  }

  const char* name() const override { return "CrossEntropy"; }
  bool is_equivalent(const Primitive&) const override { return true; }
};

}  // namespace

std::vector<array> cross_entropy(const array& logits, const array& labels, StreamOrDevice s) {
  if (logits.ndim() != 2 || labels.ndim() != 1 || labels.shape(0) != logits.shape(0)) {
    throw std::invalid_argument("[cross_entropy] logits must be [N, V] and labels [N]");
  }
  if (logits.dtype() != float32) {
    throw std::invalid_argument("[cross_entropy] logits must be float32");
  }
  if (!issubdtype(labels.dtype(), integer)) {
    throw std::invalid_argument("[cross_entropy] labels must be integers");
  }
  auto stream = to_stream(s);
  if (stream.device != Device::cpu) {
    throw std::invalid_argument("[cross_entropy] runs on the CPU only");
  }
  int N = logits.shape(0);
  auto outs = array::make_arrays(
      {{N}, {N}, {N, 2}},
      {float32, float32, float32},
      std::make_shared<CrossEntropy>(stream),
      {contiguous(logits, false, stream), contiguous(astype(labels, int32, stream), false, stream)});
  outs.pop_back();  // (max, 1 / sum): the backward's, not the caller's
  return outs;
}

}  // namespace mlxlab
