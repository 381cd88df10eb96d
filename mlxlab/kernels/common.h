// What the CPU kernels share: 8-float vectors, bfloat16 loads, the usable cores, a thread pool
// and how many threads a piece of work gets, the primitives' eval_cpu preamble, and run-time
// AVX2+FMA dispatch (a build made for a generic x86-64 still runs AVX2+FMA loops on a CPU that
// has them: the hot loops are inlined into one function per instruction set).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <future>
#include <stdexcept>
#include <string>
#if defined(__linux__)
#include <sched.h>
#endif
#include <thread>
#include <vector>

#include "mlx/array.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/threadpool.h"

namespace mlxlab {

#define ALWAYS_INLINE inline __attribute__((always_inline))

// 8 floats as one value (GCC/Clang vector extensions: AVX on x86-64, two NEON ops on arm64).
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));

ALWAYS_INLINE v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
ALWAYS_INLINE void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }
ALWAYS_INLINE v8 load8(const uint16_t* p) {  // bfloat16: the top half of a float32
  u16x8 h;
  std::memcpy(&h, p, sizeof h);
  u32x8 u = __builtin_convertvector(h, u32x8) << 16;
  v8 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}
ALWAYS_INLINE float load1(const float* p) { return *p; }
ALWAYS_INLINE float load1(const uint16_t* p) {
  uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
ALWAYS_INLINE v8 splat(float f) { return v8{} + f; }

// The cores this process may run on (its affinity mask on Linux, so a container's or taskset's
// limit is respected), at least 1.
inline int usable_cores() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    return std::max(1, CPU_COUNT(&set));
  }
#endif
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

inline int cores() {
  static const int n = usable_cores();
  return n;
}

inline ::ThreadPool& pool() {
  static ::ThreadPool p(std::max(1, cores() - 1));
  return p;
}

// Threads for `work` units when a thread hand-off is worth `min_per_thread` of them: 1 .. cores().
inline int threads_for(size_t work, size_t min_per_thread) {
  return static_cast<int>(std::max<size_t>(
      1, std::min(static_cast<size_t>(cores()), work / std::max<size_t>(1, min_per_thread))));
}

// fn(i0, i1) over [0, n) in `threads` contiguous pieces, the first on the calling thread.
inline void parallel_for(int threads, int n, const std::function<void(int, int)>& fn) {
  threads = std::max(1, std::min(threads, n));
  if (threads == 1) {
    fn(0, n);
    return;
  }
  int step = (n + threads - 1) / threads;
  std::vector<std::future<void>> done;
  for (int t = 1; t < threads; ++t) {
    int i0 = std::min(n, t * step), i1 = std::min(n, (t + 1) * step);
    done.push_back(pool().enqueue([=, &fn] { fn(i0, i1); }));
  }
  std::exception_ptr error;
  try {
    fn(0, std::min(n, step));
  } catch (...) {
    error = std::current_exception();
  }
  for (auto& d : done) {  // every piece joined before anything is rethrown: they use `fn`
    try {
      d.get();
    } catch (...) {
      if (!error) {
        error = std::current_exception();
      }
    }
  }
  if (error) {
    std::rethrow_exception(error);
  }
}

// The eval_cpu preamble of a kernel primitive whose wrapper made every input row-contiguous: it
// checks that, gives each output a fresh buffer and tells the command encoder of both (so the
// buffers live until the dispatched work has run). Returns the encoder.
inline mlx::core::cpu::CommandEncoder& bind_io(
    const mlx::core::Stream& stream,
    const std::vector<mlx::core::array>& inputs,
    std::vector<mlx::core::array>& outputs,
    const char* who) {
  for (auto& a : inputs) {
    if (!a.flags().row_contiguous) {
      throw std::runtime_error(std::string(who) + ": inputs must be row-contiguous");
    }
  }
  auto& encoder = mlx::core::cpu::get_command_encoder(stream);
  for (auto& a : inputs) {
    encoder.set_input_array(a);
  }
  for (auto& o : outputs) {
    o.set_data(mlx::core::allocator::malloc(o.nbytes()));
    encoder.set_output_array(o);
  }
  return encoder;
}

inline mlx::core::cpu::CommandEncoder& bind_io(
    const mlx::core::Stream& stream,
    const std::vector<mlx::core::array>& inputs,
    mlx::core::array& out,
    const char* who) {
  std::vector<mlx::core::array> outs = {out};  // a handle: the same array
  return bind_io(stream, inputs, outs, who);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MLXLAB_X86_DISPATCH 1
inline bool has_avx2_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
#endif

// name(params) runs name_impl(args), compiled twice on x86-64 (generic and AVX2+FMA) and picked
// at run time; one CPU always takes the same path, so its results are deterministic. `prefix`
// is empty or a template head without a top-level comma (`template <typename W>`). The functions
// are not inline: use it inside an anonymous namespace, as ce.cpp, layer.cpp and matvec.cpp do.
#define MLXLAB_DISPATCH_WITH(prefix, name, params, args) \
  prefix void name##_generic params { name##_impl args; } \
  MLXLAB_AVX2_VARIANT(prefix, name, params, args)         \
  prefix void name params {                               \
    MLXLAB_AVX2_CALL(name, args)                          \
    name##_generic args;                                  \
  }
#define MLXLAB_DISPATCH(name, params, args) MLXLAB_DISPATCH_WITH(, name, params, args)

#ifdef MLXLAB_X86_DISPATCH
#define MLXLAB_AVX2_VARIANT(prefix, name, params, args) \
  prefix __attribute__((target("avx2,fma"))) void name##_avx2 params { name##_impl args; }
#define MLXLAB_AVX2_CALL(name, args) \
  if (has_avx2_fma()) {              \
    name##_avx2 args;                \
    return;                          \
  }
#else
#define MLXLAB_AVX2_VARIANT(prefix, name, params, args)
#define MLXLAB_AVX2_CALL(name, args)
#endif

}  // namespace mlxlab
