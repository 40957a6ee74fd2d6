// The elementwise chain of a decoder layer, fused for CPU: residual add + RMSNorm, rotary
// embedding (in place, q and k together, cos/sin looked up by position), SiLU(gate) * up.
//
// In torch each of these is several ATen ops, each its own pass over memory and its own
// OpenMP region (RMSNorm in bf16 alone is eight); at decode batch sizes they cost more in
// fork/join than in arithmetic, and on a loaded machine every join waits for the slowest
// thread.  Here each is one pass, threaded only when the rows are big enough to pay.
//
// Rounding follows the torch ops they replace (Hugging Face's Llama code): in bf16, every
// intermediate that torch stores as a bf16 tensor is rounded to bf16 (round to nearest
// even) at the same point, so results differ from torch only by float summation order.
// The loops are plain scalar code over rows; the compiler vectorizes them at the native
// width (-march), bf16 <-> fp32 conversions included.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "activation.h"
#include "entry_points.h"

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) {
  uint32_t u = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline void store(float* p, int64_t i, float x) { p[i] = x; }
inline void store(uint16_t* p, int64_t i, float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even (no NaNs here)
  p[i] = static_cast<uint16_t>(u >> 16);
}

// x as the storage type T would hold it.
template <class T>
inline float round_as(float x) {
  if constexpr (sizeof(T) == 4) {
    return x;
  } else {
    uint32_t u;
    std::memcpy(&u, &x, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
}

// Below this, one thread.  A decode step's norms and rotary (64 rows x 1024: 65k elements;
// 82k) take ~30 us on one core and ~20 us on two when the machine is quiet, but when its
// cores are shared a join waits for whichever thread lost its core, for up to a scheduler
// slice: measured at load ~3.7 on 2 cores, a batch-64 decode step of the `mid` preset was
// 196 vs 216 and 624 vs 920 ms in two runs (medians, steps alternated) with these
// single-threaded.  SiLU * up (64 x 2816, and exp per element: ~120 us on one core) stays
// threaded.
constexpr int64_t kParallelElems = 1 << 17;

inline int threads_for(int64_t elems, int nthreads, int rows) {
  return elems < kParallelElems ? 1 : std::max(1, std::min(nthreads, rows));
}

// res[r] += x[r] (when x), then out[r] = rmsnorm(res[r]) * w.
template <class T>
void add_rms_norm(const T* x, int64_t xs, T* res, int64_t rs, const T* w, T* out, int64_t os,
                  int rows, int dim, float eps, int nthreads) {
#pragma omp parallel for num_threads(threads_for(int64_t(rows) * dim, nthreads, rows))
  for (int r = 0; r < rows; ++r) {
    T* rr = res + r * rs;
    float ss = 0.f;
    if (x != nullptr) {
      const T* xr = x + r * xs;
      for (int j = 0; j < dim; ++j) {
        const float s = round_as<T>(load(xr, j) + load(rr, j));
        store(rr, j, s);
        ss += s * s;
      }
    } else {
      for (int j = 0; j < dim; ++j) ss += load(rr, j) * load(rr, j);
    }
    const float inv = 1.0f / std::sqrt(ss / dim + eps);
    T* o = out + r * os;
    // bf16: normalise in fp32, round, then scale (a bf16 product); fp32: one product chain.
    for (int j = 0; j < dim; ++j) store(o, j, load(w, j) * round_as<T>(load(rr, j) * inv));
  }
}

// out[r, j] = silu(gu[r, j]) * gu[r, inter + j]; torch rounds silu's result first.
template <class T>
void silu_mul(const T* gu, int64_t gs, T* out, int64_t os, int rows, int inter, int nthreads) {
#pragma omp parallel for num_threads(threads_for(int64_t(rows) * inter, nthreads, rows))
  for (int r = 0; r < rows; ++r) {
    thread_local std::vector<float> buf;
    if (static_cast<int>(buf.size()) < inter) buf.resize(inter);
    float* sv = buf.data();
    const T* g = gu + r * gs;
    const T* u = g + inter;
    T* o = out + r * os;
    // silu16 over the row's whole groups of 16 (the gated GEMM epilogue's bits), then the
    // rest one by one.
    const int whole = inter / 16 * 16;
    for (int j = 0; j < whole; ++j) sv[j] = load(g, j);
    ps::silu16(sv, sv, whole);
    for (int j = 0; j < whole; ++j) store(o, j, round_as<T>(sv[j]) * load(u, j));
    for (int j = whole; j < inter; ++j) store(o, j, round_as<T>(ps::silu(load(g, j))) * load(u, j));
  }
}

// Rotate-half rotary embedding of `heads` heads of `dim` at x + r * xs, in place:
// (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), with cos/sin rounded to T first and
// every product and sum rounded to T, as torch computes it on T tensors.
template <class T>
inline void rope_row(T* x, int heads, int dim, const float* c, const float* s) {
  const int half = dim / 2;
  for (int h = 0; h < heads; ++h) {
    T* x1 = x + h * dim;
    T* x2 = x1 + half;
    for (int j = 0; j < half; ++j) {
      const float a = load(x1, j), b = load(x2, j);
      const float cj = round_as<T>(c[j]), sj = round_as<T>(s[j]);
      const float lo = round_as<T>(round_as<T>(a * cj) - round_as<T>(b * sj));
      const float hi = round_as<T>(round_as<T>(b * cj) + round_as<T>(a * sj));
      store(x1, j, lo);
      store(x2, j, hi);
    }
  }
}

template <class T>
void rope(T* q, int64_t qs, int hq, T* k, int64_t ks, int hk, const int64_t* pos,
          const float* cos, const float* sin, int rows, int dim, int nthreads) {
  const int64_t elems = int64_t(rows) * (hq + hk) * dim;
#pragma omp parallel for num_threads(threads_for(elems, nthreads, rows))
  for (int r = 0; r < rows; ++r) {
    const float* c = cos + pos[r] * (dim / 2);
    const float* s = sin + pos[r] * (dim / 2);
    rope_row(q + r * qs, hq, dim, c, s);
    rope_row(k + r * ks, hk, dim, c, s);
  }
}

}  // namespace

extern "C" {

void ps_add_rms_norm(int bf16, const void* x, int64_t xs, void* res, int64_t rs, const void* w,
                     void* out, int64_t os, int rows, int dim, float eps, int nthreads) {
  if (bf16)
    add_rms_norm(static_cast<const uint16_t*>(x), xs, static_cast<uint16_t*>(res), rs,
                 static_cast<const uint16_t*>(w), static_cast<uint16_t*>(out), os, rows, dim,
                 eps, nthreads);
  else
    add_rms_norm(static_cast<const float*>(x), xs, static_cast<float*>(res), rs,
                 static_cast<const float*>(w), static_cast<float*>(out), os, rows, dim, eps,
                 nthreads);
}

void ps_silu_mul(int bf16, const void* gu, int64_t gs, void* out, int64_t os, int rows,
                 int inter, int nthreads) {
  if (bf16)
    silu_mul(static_cast<const uint16_t*>(gu), gs, static_cast<uint16_t*>(out), os, rows, inter,
             nthreads);
  else
    silu_mul(static_cast<const float*>(gu), gs, static_cast<float*>(out), os, rows, inter,
             nthreads);
}

void ps_rope(int bf16, void* q, int64_t qs, int hq, void* k, int64_t ks, int hk,
             const int64_t* pos, const float* cos, const float* sin, int rows, int dim,
             int nthreads) {
  if (bf16)
    rope(static_cast<uint16_t*>(q), qs, hq, static_cast<uint16_t*>(k), ks, hk, pos, cos, sin,
         rows, dim, nthreads);
  else
    rope(static_cast<float*>(q), qs, hq, static_cast<float*>(k), ks, hk, pos, cos, sin, rows,
         dim, nthreads);
}

}  // extern "C"
