// SiLU as every compiled kernel computes it (elementwise.cpp's silu_mul, the gated epilogue
// of dpbf16_gemm.cpp).  Both take it in groups of 16 values through silu16, one out-of-line
// body for the whole library, so the fused and the unfused path give the same bits: the
// same expression inlined into two loops need not (the vectorizer may pick another width
// or keep a scalar expf in one of them).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace ps {

// e^x for x in [-87, 87] (normal floats throughout), within ~1 ulp, in code the vectorizer
// inlines: n = round(x / ln 2), r = x - n ln 2 in two parts (Cody-Waite: n ln2_hi is
// exact), e^r by its Taylor series to r^7 (|r| <= ln 2 / 2: the next term is below 2^-29),
// times 2^n built in the exponent bits.  libmvec's expf, which `#pragma omp simd` calls
// for std::exp, cost 12% of the gated gate_up product at 24 rows on a Zen 4 (the call,
// per 16 values, inside every register tile's epilogue): ~1 ulp the same.
inline float exp_bounded(float x) {
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(n, -0.693145751953125f, x);
  r = std::fma(n, -1.42860682030941723212e-6f, r);
  float p = 1.0f / 5040.0f;
  p = std::fma(p, r, 1.0f / 720.0f);
  p = std::fma(p, r, 1.0f / 120.0f);
  p = std::fma(p, r, 1.0f / 24.0f);
  p = std::fma(p, r, 1.0f / 6.0f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// x / (1 + e^-x), and 0 below x = -87 (torch: x / (1 + e^-x) there is below 1e-36, and -0
// past -88.7).  e^-x is taken at -x clamped to [-87, 87]: below -87, 1 + e^-x is 1 in
// float as it is for every x above 17.  Uncapped, e^-x overflows past -88.7 and under
// -ffast-math the division is x * (1 / d) refined by a Newton step: inf * 0 = NaN.  And
// between -88.7 and -87.3 1 / d is subnormal, which a thread that flushes subnormals (FTZ:
// the one that loaded this library) zeroes and another does not: the same row would
// differ by the thread that computed it.  Above -87 every intermediate is a normal float.
inline float silu(float x) {
  return x < -87.0f ? 0.0f : x / (1.0f + exp_bounded(std::max(std::min(-x, 87.0f), -87.0f)));
}

// y[i] = silu(x[i]) for n values, n a multiple of 16, each group of 16 by the same vector
// code wherever it falls.  noinline: an inline function's out-of-line copies are merged at
// link time, so every caller runs this one body.
__attribute__((noinline)) inline void silu16(const float* x, float* y, int n) {
  for (int j = 0; j < n; j += 16) {
#pragma omp simd
    for (int i = 0; i < 16; ++i) y[j + i] = silu(x[j + i]);
  }
}

}  // namespace ps
