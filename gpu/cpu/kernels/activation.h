// SiLU as every compiled kernel computes it (elementwise.cpp's silu_mul, the gated epilogue
// of dpbf16_gemm.cpp).  Both take it in groups of 16 values through silu16, one out-of-line
// body for the whole library, so the fused and the unfused path give the same bits: the
// same expression inlined into two loops need not (the vectorizer may pick another width
// or keep a scalar expf in one of them).

#pragma once

#include <algorithm>
#include <cmath>

namespace ps {

// x / (1 + e^-x), and 0 below x = -87 (torch: x / (1 + e^-x) there is below 1e-36, and -0
// past -88.7).  Uncapped, e^-x overflows past -88.7 and under -ffast-math the division is
// x * (1 / d) refined by a Newton step: inf * 0 = NaN.  And between -88.7 and -87.3 1 / d
// is subnormal, which a thread that flushes subnormals (FTZ: the one that loaded this
// library) zeroes and another does not: the same row would differ by the thread that
// computed it.  Above -87 every intermediate is a normal float.
inline float silu(float x) {
  return x < -87.0f ? 0.0f : x / (1.0f + std::exp(std::min(-x, 87.0f)));
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
