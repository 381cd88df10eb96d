// What the CPU kernels share: 8-float vectors, bfloat16 loads, the usable cores and a thread
// pool, and run-time AVX2+FMA detection (a build made for a generic x86-64 still runs AVX2+FMA
// loops on a CPU that has them: the hot loops are inlined into one function per instruction set).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <future>
#if defined(__linux__)
#include <sched.h>
#endif
#include <thread>
#include <vector>

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

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MLXLAB_X86_DISPATCH 1
inline bool has_avx2_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
#endif

}  // namespace mlxlab
