// SiLU as every compiled kernel computes it (elementwise.cpp's silu_mul, the gated epilogue
// of dpbf16_gemm.cpp): one expression, so that the fused and unfused paths give the same
// bits when the loops around it vectorize alike (glibc's vector expf under -ffast-math).

#pragma once

#include <algorithm>
#include <cmath>

namespace ps {

// x / (1 + e^-x), with the exponent capped at 88 (e^88 ~ 1.7e38, below float's max): past
// it e^-x is inf, and under -ffast-math the division becomes x * (1 / inf) refined by a
// Newton step, which is inf * 0 = NaN where torch gives -0.  Capped, x <= -88 gives
// |silu(x)| < 1e-36 (zero once flushed), as good as -0 to everything downstream.
inline float silu(float x) { return x / (1.0f + std::exp(std::min(-x, 88.0f))); }

}  // namespace ps
