// A vector x matrix product for decoding on the CPU: y = x @ w.T for a few rows of x.
//
// MLX's CPU matmul hands every product to cblas_sgemm; with one row and a transposed weight
// (how nn.Linear and a tied LM head multiply) OpenBLAS runs it at a fraction of the memory
// bandwidth, which is what bounds a decode step. Here each weight row is read once, in its
// stored [out, in] layout, and dotted with every row of x while it is in cache; the rows are
// split across threads. Each output is one thread's fixed-order sum (16 lanes, then a fixed
// tree), so results do not depend on the thread count or on how many rows x has.
//
// Built through MLX's documented custom-primitive mechanism (mlx.extension.CMakeBuild); the
// Python side is mlxlab/models/fastdecode.py.

#include <stdexcept>
#include <string>

#include "common.h"
#include "kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"

using namespace mlx::core;

namespace mlxlab {

namespace {

constexpr int LANES = 16;  // two 8-float vectors

// y[m, n] for G rows of x at once: each block of the weight row is loaded once and used for
// every row. Each (m, n) sums its k in the same order whatever G is: lane j takes
// k = j, j + 16, ... in sequence, the tail goes to lanes 0.., then the lanes fold in a fixed
// tree. So a row's result does not depend on how many rows are computed with it.
template <int G, typename W>
ALWAYS_INLINE void dots(const float* x, size_t ldx, const W* w, int K, float* out) {
  v8 acc[G][2] = {};
  int k = 0;
  for (; k + LANES <= K; k += LANES) {
    v8 w0 = load8(w + k), w1 = load8(w + k + 8);
    for (int g = 0; g < G; ++g) {
      const float* xg = x + g * ldx + k;
      acc[g][0] += w0 * load8(xg);
      acc[g][1] += w1 * load8(xg + 8);
    }
  }
  for (int g = 0; g < G; ++g) {
    float lanes[LANES];
    std::memcpy(lanes, &acc[g][0], sizeof(v8));
    std::memcpy(lanes + 8, &acc[g][1], sizeof(v8));
    for (int kk = k, j = 0; kk < K; ++kk, ++j) {
      lanes[j] += load1(w + kk) * x[g * ldx + kk];
    }
    for (int width = LANES / 2; width > 0; width /= 2) {
      for (int j = 0; j < width; ++j) {
        lanes[j] += lanes[j + width];
      }
    }
    out[g] = lanes[0];
  }
}

template <typename W>
ALWAYS_INLINE void rows_any_impl(const float* x, const W* w, float* y, int M, int K, int N, int n0, int n1) {
  constexpr int G = 4;  // rows of x per pass: 4 x 16 accumulators fit in the vector registers
  float out[G];
  for (int n = n0; n < n1; ++n) {
    const W* wr = w + static_cast<size_t>(n) * K;
    int m = 0;
    for (; m + G <= M; m += G) {
      dots<G>(x + static_cast<size_t>(m) * K, K, wr, K, out);
      for (int g = 0; g < G; ++g) {
        y[static_cast<size_t>(m + g) * N + n] = out[g];
      }
    }
    for (; m < M; ++m) {
      dots<1>(x + static_cast<size_t>(m) * K, K, wr, K, out);
      y[static_cast<size_t>(m) * N + n] = out[0];
    }
  }
}

MLXLAB_DISPATCH_WITH(
    template <typename W>,
    rows_any,
    (const float* x, const W* w, float* y, int M, int K, int N, int n0, int n1),
    (x, w, y, M, K, N, n0, n1))

#ifdef MLXLAB_X86_DISPATCH
// AVX-512: the 16 lanes of `dots` are one register, so each (m, n) sums in exactly the order
// above (lane j takes k = j, j + 16, ... with a fused multiply-add, as the AVX2+FMA loop does;
// the same tail and fold) and the results are bit for bit the AVX2 path's. It takes up to 8 rows
// of x per pass over a weight row (one weight load per 8 fused multiply-adds), which a verify
// step's few tokens per row use; they still cost more than one row (measured on the 2-core box:
// 1 row x 5 positions ~1.5x a plain step, 4 x 4 ~2.4x; decode/speculative_batch.py STEP_COST).
typedef float v16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

ALWAYS_INLINE v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
ALWAYS_INLINE v16 load16(const uint16_t* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  u32x16 u = __builtin_convertvector(h, u32x16) << 16;
  v16 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

template <int G, typename W>
ALWAYS_INLINE void dots16(const float* x, size_t ldx, const W* w, int K, float* out) {
  v16 acc[G] = {};
  int k = 0;
  for (; k + LANES <= K; k += LANES) {
    v16 w0 = load16(w + k);
    for (int g = 0; g < G; ++g) {
      acc[g] += w0 * load16(x + g * ldx + k);
    }
  }
  for (int g = 0; g < G; ++g) {
    float lanes[LANES];
    std::memcpy(lanes, &acc[g], sizeof(v16));
    for (int kk = k, j = 0; kk < K; ++kk, ++j) {
      lanes[j] += load1(w + kk) * x[g * ldx + kk];
    }
    for (int width = LANES / 2; width > 0; width /= 2) {
      for (int j = 0; j < width; ++j) {
        lanes[j] += lanes[j + width];
      }
    }
    out[g] = lanes[0];
  }
}

template <int G, typename W>
ALWAYS_INLINE int rows16_pass(const float* x, const W* wr, float* y, int m, int M, int K, int N, int n) {
  float out[G];
  for (; m + G <= M; m += G) {
    dots16<G>(x + static_cast<size_t>(m) * K, K, wr, K, out);
    for (int g = 0; g < G; ++g) {
      y[static_cast<size_t>(m + g) * N + n] = out[g];
    }
  }
  return m;
}

template <typename W>
__attribute__((target("avx512f,avx512bw,avx2,fma"))) void rows_avx512(
    const float* x, const W* w, float* y, int M, int K, int N, int n0, int n1) {
  for (int n = n0; n < n1; ++n) {
    const W* wr = w + static_cast<size_t>(n) * K;
    int m = rows16_pass<8>(x, wr, y, 0, M, K, N, n);
    m = rows16_pass<4>(x, wr, y, m, M, K, N, n);
    m = rows16_pass<2>(x, wr, y, m, M, K, N, n);
    rows16_pass<1>(x, wr, y, m, M, K, N, n);
  }
}

inline bool has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
#endif

// 1: the AVX-512 loops when the CPU has them (same results as AVX2+FMA), 0: never (tests).
int use_avx512 = 1;

template <typename W>
void rows(const float* x, const W* w, float* y, int M, int K, int N, int n0, int n1) {
#ifdef MLXLAB_X86_DISPATCH
  if (use_avx512 && has_avx512()) {
    rows_avx512(x, w, y, M, K, N, n0, n1);
    return;
  }
#endif
  rows_any(x, w, y, M, K, N, n0, n1);
}

// Below ~256 KB of weights a thread hand-off costs more than the reading it saves.
int threads_for_weights(size_t weight_bytes) { return threads_for(weight_bytes, 256 * 1024); }

template <typename W>
void run(const float* x, const W* w, float* y, int M, int K, int N) {
  int T = threads_for_weights(static_cast<size_t>(N) * K * sizeof(W));
  parallel_for(T, N, [=](int n0, int n1) { rows(x, w, y, M, K, N, n0, n1); });
}

// A strided array's elements in row-major order.
void gather(const float* src, const Shape& shape, const Strides& strides, size_t size, float* dst) {
  int nd = static_cast<int>(shape.size());
  std::vector<int> idx(nd, 0);
  for (size_t i = 0; i < size; ++i) {
    int64_t off = 0;
    for (int d = 0; d < nd; ++d) {
      off += idx[d] * strides[d];
    }
    dst[i] = src[off];
    for (int d = nd - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) {
        break;
      }
      idx[d] = 0;
    }
  }
}

class MatVec : public UnaryPrimitive {
 public:
  explicit MatVec(Stream stream) : UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<array>& inputs, array& out) override {
    const array& x = inputs[0];
    const array& w = inputs[1];
    if (!w.flags().row_contiguous) {
      throw std::runtime_error("[matvec] w must be row-contiguous");
    }
    out.set_data(allocator::malloc(out.nbytes()));
    int K = w.shape(1), N = w.shape(0);
    int M = K == 0 ? 0 : static_cast<int>(x.size() / K);
    auto& encoder = cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(w);
    encoder.set_output_array(out);
    float* yp = out.data<float>();
    if (K == 0 || M == 0 || N == 0) {
      std::memset(yp, 0, out.nbytes());
      return;
    }
    // The task runs later, on the stream's thread, when the inputs are computed. It captures
    // plain pointers, shape and strides (set by now), not the arrays: the encoder keeps the
    // inputs alive, and an array copy would keep x's graph alive and release it off-thread.
    const float* xsrc = x.data<float>();
    bool x_contiguous = x.flags().row_contiguous;
    Shape x_shape = x.shape();
    Strides x_strides = x.strides();
    size_t x_size = x.size();
    auto compute = [=](const auto* wp) {
      const float* xp = xsrc;
      std::vector<float> packed;
      if (!x_contiguous) {  // gather a strided x (only M x K floats)
        packed.resize(x_size);
        gather(xsrc, x_shape, x_strides, x_size, packed.data());
        xp = packed.data();
      }
      run(xp, wp, yp, M, K, N);
    };
    if (w.dtype() == float32) {
      const float* wp = w.data<float>();
      encoder.dispatch([=]() { compute(wp); });
    } else {
      const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data<bfloat16_t>());
      encoder.dispatch([=]() { compute(wp); });
    }
  }

  void eval_gpu(const std::vector<array>&, array&) override {
    throw std::runtime_error("[matvec] is a CPU kernel; on a GPU use x @ w.T");
  }

  std::vector<array> vjp(
      const std::vector<array>& primals,
      const std::vector<array>& cotangents,
      const std::vector<int>& argnums,
      const std::vector<array>&) override {
    const array& x = primals[0];
    const array& w = primals[1];
    const array& cot = cotangents[0];
    std::vector<array> grads;
    for (int arg : argnums) {
      if (arg == 0) {
        grads.push_back(matmul(cot, astype(w, float32, stream()), stream()));
      } else {
        int K = w.shape(1), N = w.shape(0);
        auto c2 = reshape(cot, {-1, N}, stream());
        auto x2 = reshape(x, {-1, K}, stream());
        grads.push_back(astype(matmul(transpose(c2, stream()), x2, stream()), w.dtype(), stream()));
      }
    }
    return grads;
  }

  std::vector<Shape> output_shapes(const std::vector<array>& inputs) override {
    Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

  const char* name() const override { return "MatVec"; }
  bool is_equivalent(const Primitive&) const override { return true; }
};

}  // namespace

bool matvec_avx512(int on) {
  if (on >= 0) {
    use_avx512 = on;
  }
#ifdef MLXLAB_X86_DISPATCH
  return use_avx512 && has_avx512();
#else
  return false;
#endif
}

array matvec(const array& x, const array& w, StreamOrDevice s) {
  if (w.ndim() != 2) {
    throw std::invalid_argument("[matvec] w must be [out, in]");
  }
  if (x.ndim() < 1 || x.shape(-1) != w.shape(1)) {
    throw std::invalid_argument("[matvec] x's last axis must equal w's in-features");
  }
  if (x.dtype() != float32 || (w.dtype() != float32 && w.dtype() != bfloat16)) {
    throw std::invalid_argument("[matvec] x must be float32 and w float32 or bfloat16");
  }
  auto stream = to_stream(s);
  if (stream.device != Device::cpu) {
    throw std::invalid_argument("[matvec] runs on the CPU only");
  }
  Shape shape = x.shape();
  shape.back() = w.shape(0);
  return array(
      shape,
      float32,
      std::make_shared<MatVec>(stream),
      // A stored weight is already row-contiguous: no contiguous() node (each node costs ~10 us
      // of scheduling on the CPU, per product per step). x is gathered in eval_cpu if strided.
      {x, w.is_available() && w.flags().row_contiguous ? w : contiguous(w, false, stream)});
}

}  // namespace mlxlab
