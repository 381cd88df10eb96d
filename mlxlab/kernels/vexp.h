// A vectorized exp and a fixed-order fold of 16 lanes, shared by the kernels that
// exponentiate (ce.cpp, layer.cpp).
#pragma once

#include <algorithm>
#include <cstring>
#include <limits>

#include "common.h"

namespace mlxlab {

// exp(x) for 8 floats: Cephes' expf (x = n ln2 + r, |r| <= ln2/2, a degree-6 polynomial in r,
// times 2^n), about 1 ulp. Inputs below -87.3 give ~1e-38 (not 0), NaN stays NaN.
ALWAYS_INLINE v8 vexp(v8 x) {
  const v8 hi = splat(88.3762626647949f), lo = splat(-87.3365447504f);
  i32x8 nan_mask = x != x;
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  const v8 magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  v8 n = (x * 1.44269504088896341f + magic) - magic;
  v8 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  v8 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  v8 y = p * (r * r) + r + 1.0f;
  i32x8 bits = (__builtin_convertvector(n, i32x8) + 127) << 23;
  v8 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  y = y * scale;
  return nan_mask != 0 ? splat(std::numeric_limits<float>::quiet_NaN()) : y;
}

// The 16 lanes of (a, b) folded in a fixed tree: max, or sum.
ALWAYS_INLINE float fold16(v8 a, v8 b, bool is_max) {
  float lanes[16];
  std::memcpy(lanes, &a, sizeof a);
  std::memcpy(lanes + 8, &b, sizeof b);
  for (int width = 8; width > 0; width /= 2) {
    for (int j = 0; j < width; ++j) {
      lanes[j] = is_max ? std::max(lanes[j], lanes[j + width]) : lanes[j] + lanes[j + width];
    }
  }
  return lanes[0];
}

}  // namespace mlxlab
