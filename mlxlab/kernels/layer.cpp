// Two elementwise-heavy parts of a decoder layer, for training on the CPU:
//
// - softmax(scale * scores) over causal attention rows, with a sliding window and packed rows'
//   example starts, masked positions exactly 0 (and never exponentiated);
// - gelu_approx(g) * u, the gated MLP's activation (Gemma).
//
// MLX's CPU backend runs exp and tanh one op at a time on one thread (~28 ns per element here):
// in gemma3-270m's training step at 1152 tokens the attention softmax and the MLP activation
// took more time than the layer's matmuls. Each kernel here is one pass forward and one
// backward, vectorized (exp as in ce.cpp), rows split over the cores; every result depends only
// on its own row, so it is the same whatever the thread count or batch.

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

// --- attention softmax ---------------------------------------------------------------------

// Which queries and keys a block of scores holds (see kernels.h).
struct Band {
  int queries;
  int q_offset;
  int k_offset;
  bool operator==(const Band& o) const {
    return queries == o.queries && q_offset == o.q_offset && k_offset == o.k_offset;
  }
};

struct RowMask {
  int K;  // keys per row: positions k_offset .. k_offset + K - 1
  int Q;  // queries per block of rows: row r is query q_offset + r % Q
  int q_offset;
  int k_offset;
  int rows_per_batch;  // rows of one batch entry: heads x Q
  int window;  // 0: none; else key k is seen from query i when i - k < window
  const int32_t* starts;  // [B, starts_len] first position of each query's example, or null
  int starts_len;
};

// The row's visible keys [lo, hi] (inclusive), as offsets into the row. The wrapper checks that
// the row holds every key a query may see, so lo >= 0 and hi < K.
ALWAYS_INLINE void row_range(const RowMask& m, int row, int& lo, int& hi) {
  int i = m.q_offset + row % m.Q;
  int b = row / m.rows_per_batch;
  int first = 0;
  if (m.window > 0) {
    first = std::max(first, i - m.window + 1);
  }
  if (m.starts != nullptr) {
    first = std::max(first, static_cast<int>(m.starts[static_cast<size_t>(b) * m.starts_len + i]));
  }
  first = std::min(first, i);  // a query always sees itself
  lo = first - m.k_offset;
  hi = i - m.k_offset;
}

ALWAYS_INLINE void softmax_impl(const float* s, float* p, float scale, RowMask m, int r0, int r1) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const int K = m.K;
  for (int r = r0; r < r1; ++r) {
    const float* x = s + static_cast<size_t>(r) * K;
    float* y = p + static_cast<size_t>(r) * K;
    int lo, hi;
    row_range(m, r, lo, hi);
    // max of scale * x over [lo, hi]
    v8 m0 = splat(ninf), m1 = m0;
    int k = lo;
    for (; k + 16 <= hi + 1; k += 16) {
      v8 a = load8(x + k), b = load8(x + k + 8);
      m0 = a > m0 ? a : m0;
      m1 = b > m1 ? b : m1;
    }
    for (; k <= hi; ++k) {
      m0[0] = std::max(m0[0], x[k]);
    }
    float mx_ = fold16(m0, m1, true) * scale;  // scale > 0
    v8 vs = splat(scale), vm = splat(mx_);
    double total = 0.0;
    k = lo;
    while (k + 16 <= hi + 1) {
      v8 s0 = {}, s1 = {};
      int end = std::min(hi + 1 - 15, k + 1024);
      for (; k < end; k += 16) {
        v8 e0 = vexp(load8(x + k) * vs - vm), e1 = vexp(load8(x + k + 8) * vs - vm);
        store8(y + k, e0);
        store8(y + k + 8, e1);
        s0 += e0;
        s1 += e1;
      }
      total += fold16(s0, s1, false);
    }
    float tail = 0.0f;
    for (; k <= hi; ++k) {
      float e = vexp(splat(x[k] * scale - mx_))[0];
      y[k] = e;
      tail += e;
    }
    total += tail;
    float inv = static_cast<float>(1.0 / total);
    v8 vi = splat(inv);
    k = lo;
    for (; k + 8 <= hi + 1; k += 8) {
      store8(y + k, load8(y + k) * vi);
    }
    for (; k <= hi; ++k) {
      y[k] *= inv;
    }
    std::memset(y, 0, sizeof(float) * lo);
    std::memset(y + hi + 1, 0, sizeof(float) * (K - hi - 1));
  }
}

// dS = scale * P * (dP - sum(dP * P)) over the row's unmasked range (0 elsewhere).
ALWAYS_INLINE void softmax_grad_impl(
    const float* p, const float* dp, float* ds, float scale, RowMask m, int r0, int r1) {
  const int K = m.K;
  for (int r = r0; r < r1; ++r) {
    size_t off = static_cast<size_t>(r) * K;
    const float* y = p + off;
    const float* g = dp + off;
    float* out = ds + off;
    int lo, hi;
    row_range(m, r, lo, hi);
    v8 a0 = {}, a1 = {};
    int k = lo;
    for (; k + 16 <= hi + 1; k += 16) {
      a0 += load8(y + k) * load8(g + k);
      a1 += load8(y + k + 8) * load8(g + k + 8);
    }
    float tail = 0.0f;
    for (; k <= hi; ++k) {
      tail += y[k] * g[k];
    }
    float dot = fold16(a0, a1, false) + tail;
    v8 vd = splat(dot), vs = splat(scale);
    k = lo;
    for (; k + 8 <= hi + 1; k += 8) {
      store8(out + k, vs * load8(y + k) * (load8(g + k) - vd));
    }
    for (; k <= hi; ++k) {
      out[k] = scale * y[k] * (g[k] - dot);
    }
    std::memset(out, 0, sizeof(float) * lo);
    std::memset(out + hi + 1, 0, sizeof(float) * (K - hi - 1));
  }
}

// --- gelu_approx(g) * u --------------------------------------------------------------------

constexpr float GELU_C = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float GELU_A = 0.044715f;

// gelu_approx(x) = 0.5 x (1 + tanh(z)), z = c (x + a x^3), computed as x * sigmoid(2z) =
// x / (1 + exp(-2z)): no cancellation in 1 + tanh(z) for negative x. With e = exp(-2z),
// s = 1 / (1 + e) and 1 - s = e / (1 + e), so d gelu / dx = s + 2 x z' e / (1 + e)^2.
ALWAYS_INLINE void gelu_parts(v8 x, v8& gelu, v8& dgelu) {
  v8 x2 = x * x;
  v8 e = vexp(-2.0f * GELU_C * (x + GELU_A * x2 * x));
  v8 inv = 1.0f / (1.0f + e);
  gelu = x * inv;
  // (e * inv) first: e alone may be ~1e38, and times x it would overflow
  dgelu = inv + (e * inv) * inv * (2.0f * x * (GELU_C * (1.0f + 3.0f * GELU_A * x2)));
}

ALWAYS_INLINE v8 gelu_only(v8 x) {
  v8 e = vexp(-2.0f * GELU_C * (x + GELU_A * x * x * x));
  return x / (1.0f + e);
}

ALWAYS_INLINE void gelu_mul_impl(const float* g, const float* u, float* out, size_t i0, size_t i1) {
  size_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    store8(out + i, gelu_only(load8(g + i)) * load8(u + i));
  }
  for (; i < i1; ++i) {
    out[i] = gelu_only(splat(g[i]))[0] * u[i];
  }
}

ALWAYS_INLINE void gelu_mul_grad_impl(
    const float* g, const float* u, const float* d, float* dg, float* du, size_t i0, size_t i1) {
  size_t i = i0;
  v8 gelu, dgelu;
  for (; i + 8 <= i1; i += 8) {
    gelu_parts(load8(g + i), gelu, dgelu);
    v8 dd = load8(d + i);
    store8(dg + i, dd * load8(u + i) * dgelu);
    store8(du + i, dd * gelu);
  }
  for (; i < i1; ++i) {
    gelu_parts(splat(g[i]), gelu, dgelu);
    dg[i] = d[i] * u[i] * dgelu[0];
    du[i] = d[i] * gelu[0];
  }
}

// --- instruction-set dispatch (common.h) ----------------------------------------------------

MLXLAB_DISPATCH(
    softmax,
    (const float* s, float* p, float scale, RowMask m, int r0, int r1),
    (s, p, scale, m, r0, r1))
MLXLAB_DISPATCH(
    softmax_grad,
    (const float* p, const float* dp, float* ds, float scale, RowMask m, int r0, int r1),
    (p, dp, ds, scale, m, r0, r1))
MLXLAB_DISPATCH(
    gelu_mul,
    (const float* g, const float* u, float* out, size_t i0, size_t i1),
    (g, u, out, i0, i1))
MLXLAB_DISPATCH(
    gelu_mul_grad,
    (const float* g, const float* u, const float* d, float* dg, float* du, size_t i0, size_t i1),
    (g, u, d, dg, du, i0, i1))

// Below ~32k floats of exp and friends a thread hand-off costs more than it saves.
int threads_for_work(size_t elements) { return threads_for(elements, 32768); }

// Elementwise work over [0, n) in pieces of whole 8-float vectors.
void parallel_elements(size_t n, const std::function<void(size_t, size_t)>& fn) {
  int T = threads_for_work(n);
  size_t blocks = (n + 7) / 8;
  size_t per = (blocks + T - 1) / T;
  parallel_for(T, T, [&](int t0, int t1) {
    for (int t = t0; t < t1; ++t) {
      size_t i0 = std::min(n, static_cast<size_t>(t) * per * 8);
      size_t i1 = std::min(n, static_cast<size_t>(t + 1) * per * 8);
      if (i0 < i1) {
        fn(i0, i1);
      }
    }
  });
}

RowMask make_mask(const array& scores, const Band& band, int window, const array* starts) {
  RowMask m;
  m.K = scores.shape(-1);
  m.Q = band.queries;
  m.q_offset = band.q_offset;
  m.k_offset = band.k_offset;
  m.rows_per_batch = static_cast<int>(scores.size() / scores.shape(0) / scores.shape(-1));
  m.window = window;
  m.starts = starts ? starts->data<int32_t>() : nullptr;
  m.starts_len = starts ? starts->shape(1) : 0;
  return m;
}

class AttentionSoftmaxGrad : public UnaryPrimitive {
 public:
  AttentionSoftmaxGrad(Stream s, float scale, int window, Band band, bool has_starts)
      : UnaryPrimitive(s), scale_(scale), window_(window), band_(band), has_starts_(has_starts) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    auto& enc = bind_io(stream(), inputs, out, "[attention_softmax]");
    const array& p = inputs[0];
    int rows = static_cast<int>(p.size() / p.shape(-1));
    RowMask m = make_mask(p, band_, window_, has_starts_ ? &inputs[2] : nullptr);
    const float* pp = p.data<float>();
    const float* dp = inputs[1].data<float>();
    float* ds = out.data<float>();
    float scale = scale_;
    size_t work = p.size();
    enc.dispatch([=]() {
      parallel_for(threads_for_work(work), rows, [=](int r0, int r1) {
        softmax_grad(pp, dp, ds, scale, m, r0, r1);
      });
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("[attention_softmax] is a CPU kernel");
  }
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    return {inputs[0].shape()};
  }
  const char* name() const override { return "AttentionSoftmaxGrad"; }
  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const AttentionSoftmaxGrad&>(other);
    return scale_ == o.scale_ && window_ == o.window_ && band_ == o.band_ &&
        has_starts_ == o.has_starts_;
  }

 private:
  float scale_;
  int window_;
  Band band_;
  bool has_starts_;
};

class AttentionSoftmax : public UnaryPrimitive {
 public:
  AttentionSoftmax(Stream s, float scale, int window, Band band, bool has_starts)
      : UnaryPrimitive(s), scale_(scale), window_(window), band_(band), has_starts_(has_starts) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    auto& enc = bind_io(stream(), inputs, out, "[attention_softmax]");
    const array& s = inputs[0];
    int rows = static_cast<int>(s.size() / s.shape(-1));
    RowMask m = make_mask(s, band_, window_, has_starts_ ? &inputs[1] : nullptr);
    const float* sp = s.data<float>();
    float* pp = out.data<float>();
    float scale = scale_;
    size_t work = s.size();
    enc.dispatch([=]() {
      parallel_for(threads_for_work(work), rows, [=](int r0, int r1) {
        softmax(sp, pp, scale, m, r0, r1);
      });
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("[attention_softmax] is a CPU kernel");
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
        std::vector<array> in = {outputs[0], contiguous(astype(cotangents[0], float32, s), false, s)};
        if (has_starts_) {
          in.push_back(primals[1]);
        }
        grads.push_back(array(
            primals[0].shape(),
            float32,
            std::make_shared<AttentionSoftmaxGrad>(s, scale_, window_, band_, has_starts_),
            in));
      } else {
        grads.push_back(zeros_like(primals[arg], stream()));
      }
    }
    return grads;
  }
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    return {inputs[0].shape()};
  }
  const char* name() const override { return "AttentionSoftmax"; }
  bool is_equivalent(const Primitive& other) const override {
    auto& o = static_cast<const AttentionSoftmax&>(other);
    return scale_ == o.scale_ && window_ == o.window_ && band_ == o.band_ &&
        has_starts_ == o.has_starts_;
  }

 private:
  float scale_;
  int window_;
  Band band_;
  bool has_starts_;
};

class GeluMulGrad : public Primitive {
 public:
  explicit GeluMulGrad(Stream s) : Primitive(s) {}
  void eval_cpu(const std::vector<array>& inputs, std::vector<array>& outputs) override {
    auto& enc = bind_io(stream(), inputs, outputs, "[gelu_mul]");
    const float* g = inputs[0].data<float>();
    const float* u = inputs[1].data<float>();
    const float* d = inputs[2].data<float>();
    float* dg = outputs[0].data<float>();
    float* du = outputs[1].data<float>();
    size_t n = inputs[0].size();
    enc.dispatch([=]() {
      parallel_elements(n, [=](size_t i0, size_t i1) { gelu_mul_grad(g, u, d, dg, du, i0, i1); });
    });
  }
  void eval_gpu(const std::vector<array>&, std::vector<array>&) override {
    throw std::runtime_error("[gelu_mul] is a CPU kernel");
  }
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    return {inputs[0].shape(), inputs[0].shape()};
  }
  const char* name() const override { return "GeluMulGrad"; }
  bool is_equivalent(const Primitive&) const override { return true; }
};

class GeluMul : public UnaryPrimitive {
 public:
  explicit GeluMul(Stream s) : UnaryPrimitive(s) {}
  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    auto& enc = bind_io(stream(), inputs, out, "[gelu_mul]");
    const float* g = inputs[0].data<float>();
    const float* u = inputs[1].data<float>();
    float* o = out.data<float>();
    size_t n = out.size();
    enc.dispatch([=]() {
      parallel_elements(n, [=](size_t i0, size_t i1) { gelu_mul(g, u, o, i0, i1); });
    });
  }
  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("[gelu_mul] is a CPU kernel");
  }
  std::vector<array> vjp(
      const std::vector<array>& primals,
      const std::vector<array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<array>&) override {
    auto s = stream();
    auto both = array::make_arrays(
        {primals[0].shape(), primals[0].shape()},
        {float32, float32},
        std::make_shared<GeluMulGrad>(s),
        {primals[0], primals[1], contiguous(astype(cotangents[0], float32, s), false, s)});
    std::vector<array> grads;
    for (int arg : argnums) {
      grads.push_back(both[arg]);
    }
    return grads;
  }
  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    return {inputs[0].shape()};
  }
  const char* name() const override { return "GeluMul"; }
  bool is_equivalent(const Primitive&) const override { return true; }
};

void check_cpu_f32(const array& a, const char* who, const char* what) {
  if (a.dtype() != float32) {
    throw std::invalid_argument(std::string(who) + ": " + what + " must be float32");
  }
}

}  // namespace

array attention_softmax(
    const array& scores,
    float scale,
    int window,
    const std::optional<array>& starts,
    int queries,
    int q_offset,
    int k_offset,
    StreamOrDevice s) {
  const char* who = "[attention_softmax]";
  check_cpu_f32(scores, who, "scores");
  if (scores.ndim() < 2 || scale <= 0 || window < 0) {
    throw std::invalid_argument(
        "[attention_softmax] scores must be [B, ..., K], scale > 0 and window >= 0");
  }
  int K = scores.shape(-1);
  if (scores.shape(0) == 0 || K == 0) {
    throw std::invalid_argument("[attention_softmax] scores must not be empty");
  }
  int Q = queries > 0 ? queries : K;
  if (queries < 0 || q_offset < 0 || k_offset < 0 ||
      (scores.size() / scores.shape(0) / K) % static_cast<size_t>(Q) != 0) {
    throw std::invalid_argument(
        "[attention_softmax] each batch entry must hold whole blocks of `queries` rows, and "
        "offsets must be >= 0");
  }
  // every key a query of the block may see lies in the row: its own position (k <= i) up to
  // the last query, and back to the window's start (or position 0 without a window)
  int first_seen = window > 0 ? std::max(0, q_offset - window + 1) : 0;
  if (k_offset > first_seen || q_offset + Q > k_offset + K) {
    throw std::invalid_argument(
        "[attention_softmax] the keys k_offset .. k_offset + K - 1 must cover every key the "
        "queries q_offset .. q_offset + queries - 1 see");
  }
  auto stream = to_stream(s);
  if (stream.device != Device::cpu) {
    throw std::invalid_argument("[attention_softmax] runs on the CPU only");
  }
  std::vector<array> in = {contiguous(scores, false, stream)};
  if (starts) {
    // square blocks (queries = 0) are whole rows: starts [B, K]; else it spans the block
    bool fits = starts->ndim() == 2 && starts->shape(0) == scores.shape(0) &&
        (queries == 0 ? starts->shape(1) == K : starts->shape(1) >= q_offset + Q);
    if (!fits) {
      throw std::invalid_argument(
          "[attention_softmax] starts must be [B, L] with L >= q_offset + queries");
    }
    in.push_back(contiguous(astype(*starts, int32, stream), false, stream));
  }
  Band band{Q, q_offset, k_offset};
  return array(
      scores.shape(),
      float32,
      std::make_shared<AttentionSoftmax>(stream, scale, window, band, starts.has_value()),
      in);
}

array gelu_mul(const array& g, const array& u, StreamOrDevice s) {
  check_cpu_f32(g, "[gelu_mul]", "g");
  check_cpu_f32(u, "[gelu_mul]", "u");
  if (g.shape() != u.shape()) {
    throw std::invalid_argument("[gelu_mul] g and u must have one shape");
  }
  if (g.size() == 0) {
    return zeros(g.shape(), float32, s);
  }
  auto stream = to_stream(s);
  if (stream.device != Device::cpu) {
    throw std::invalid_argument("[gelu_mul] runs on the CPU only");
  }
  return array(
      g.shape(),
      float32,
      std::make_shared<GeluMul>(stream),
      {contiguous(g, false, stream), contiguous(u, false, stream)});
}

}  // namespace mlxlab
