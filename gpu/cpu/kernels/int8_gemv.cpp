// Weight-only INT8 matmul for a few activation rows (decode): y = x . (q * scale)^T.
//
// Decode reads every weight once per token, so its time is the bytes read.  torch's
// `_weight_int8pack_mm` is no faster than oneDNN's bf16 GEMV on some x86 CPUs (and ~10x
// slower with float32 activations on AMD EPYC), which throws away the halved bytes.  Here
// each weight vector is widened int8 -> float32 once and multiplied into up to 4 activation
// rows held in float32, so the arithmetic stays exact weight-only quantization (no
// activation rounding; the VNNI path below rounds them to 16 bits) and the loop streams
// int8 at memory speed, from a layout packed at load (ps_int8_pack).  Rows of the weight
// are split over threads.
//
// x [m, k] float32 or bfloat16 (row stride xs), q [n, k] int8 packed, scale [n] float32,
// bias [n] (optional) float32 or bfloat16, y [m, n] float32 or bfloat16 (row stride ys);
// k % 32 == 0.  Activations are read and results written in the model's dtype here, with
// the bias added before the one rounding: converting them with ATen ops around the call
// cost two more parallel regions per projection and step.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "entry_points.h"
#include "simd.h"

namespace {

using ps::kW;
using ps::vf;
using ps::vs8;

inline vf widen(const int8_t* p) {
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
#else
  // Through int32: GCC scalarises a direct int8 -> float vector conversion.
  vs8 b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(__builtin_convertvector(b, ps::vi), vf);
#endif
}

inline uint16_t to_bf16(float x) {  // round to nearest even (-ffast-math: no NaNs)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// The activations as given: row j, column c.
struct In {
  const void* x;
  int64_t xs;
  int bf16;
  float at(int64_t j, int64_t c) const {
    return bf16 ? ps::to_f(static_cast<const uint16_t*>(x)[j * xs + c])
                : static_cast<const float*>(x)[j * xs + c];
  }
};

// Where results go: y[j, i] = v (+ bias[i]), in y's dtype.
struct Out {
  void* y;
  int64_t ys;
  int bf16;
  const void* bias;
  int bias_bf16;
  void put(int64_t j, int64_t i, float v) const {
    if (bias != nullptr)
      v += bias_bf16 ? ps::to_f(static_cast<const uint16_t*>(bias)[i])
                     : static_cast<const float*>(bias)[i];
    if (bf16)
      static_cast<uint16_t*>(y)[j * ys + i] = to_bf16(v);
    else
      static_cast<float*>(y)[j * ys + i] = v;
  }
};

inline float hsum(vf v) {
  float s = 0.0f;
  for (int i = 0; i < kW; ++i) s += v[i];
  return s;
}

// The weight's layout (ps_int8_pack): rows in tiles of kTile, each tile's rows interleaved
// in 32-byte column groups (tile t: [k / 32][kTile][32]), so that a tile streams from one
// sequential run of memory.  Read row by row, the tile's kTile rows of a few cache lines
// each were too short a stream for the hardware prefetchers: the kernel read memory at
// half the bandwidth that one long stream gets.  The n % kTile last rows stay row-major.
// Weight (r, c) of a tile at `w`: w + (c / 32) * cs + r * rs + c % 32.
constexpr int64_t kTile = 8;
constexpr int64_t kTileCs = 32 * kTile;  // a packed tile's column-group stride

// NR weight rows against MB activation rows: NR x MB accumulators live in registers.
template <int NR, int MB>
void tile(const float* x, int64_t k, const int8_t* w, int64_t cs, int64_t rs,
          const float* scale, int64_t n_row, const Out& o, int64_t j0) {
  vf acc[NR][MB] = {};
  for (int64_t c = 0; c < k; c += kW) {
    vf xv[MB];
    for (int j = 0; j < MB; ++j) xv[j] = ps::loadv(x + j * k + c);
    for (int r = 0; r < NR; ++r) {
      const vf wv = widen(w + (c >> 5) * cs + r * rs + (c & 31));
      for (int j = 0; j < MB; ++j) acc[r][j] += wv * xv[j];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < MB; ++j) o.put(j0 + j, n_row + r, hsum(acc[r][j]) * scale[n_row + r]);
}

// Rows lo..hi (lo a multiple of kTile) of the packed weight: whole tiles below n_tiled,
// then row-major rows.  MB > 2 takes a tile in two halves of 4 rows, to stay within the
// 32 vector registers with enough independent FMA chains to hide their latency.
#define PS_INT8_ROWS(TILE, ...)                                                   \
  int64_t i = lo;                                                                 \
  for (; i < hi && i < n_tiled; i += kTile) {                                     \
    const int8_t* t = q + i * k;                                                  \
    if constexpr (MB <= 2) {                                                      \
      TILE<8, MB>(__VA_ARGS__, t, kTileCs, 32, scale, i, o, j0);                  \
    } else {                                                                      \
      TILE<4, MB>(__VA_ARGS__, t, kTileCs, 32, scale, i, o, j0);                  \
      TILE<4, MB>(__VA_ARGS__, t + 128, kTileCs, 32, scale, i + 4, o, j0);        \
    }                                                                             \
  }                                                                               \
  for (; i < hi; ++i) TILE<1, MB>(__VA_ARGS__, q + i * k, 32, k, scale, i, o, j0);

template <int MB>
void rows(const float* x, int64_t k, const int8_t* q, const float* scale, int64_t lo,
          int64_t hi, int64_t n_tiled, const Out& o, int64_t j0) {
  PS_INT8_ROWS(tile, x, k)
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PS_INT8_VNNI 1
// With AVX512-VNNI: activations as 16-bit fixed point (one scale per row, |x| max ->
// 32767, an error of 2^-16 of the row's largest value: below the bf16 rounding the
// activations already carry), and vpdpwssd multiplies 32 int16 pairs into int32 lanes
// per instruction, against ~3 instructions per 16 weights for the float path.  Products
// are at most 2 * 127 * 32767 per lane and step, so the int32 sums are flushed to float
// every kFlush steps, long before they could overflow.
constexpr int kFlush = 256;

template <int NR, int MB>
void tile_vnni(const int16_t* x, const float* xs, int64_t k, const int8_t* w, int64_t cs,
               int64_t rs, const float* scale, int64_t n_row, const Out& o, int64_t j0) {
  float sum[NR][MB] = {};
  for (int64_t c0 = 0; c0 < k; c0 += 32 * kFlush) {
    const int64_t c1 = std::min(k, c0 + 32 * kFlush);
    __m512i acc[NR][MB];
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < MB; ++j) acc[r][j] = _mm512_setzero_si512();
    for (int64_t c = c0; c < c1; c += 32) {
      __m512i xv[MB];
      for (int j = 0; j < MB; ++j) xv[j] = _mm512_loadu_si512(x + j * k + c);
      const int8_t* wc = w + (c >> 5) * cs;
      for (int r = 0; r < NR; ++r) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc + r * rs));
        const __m512i wv = _mm512_cvtepi8_epi16(b);
        for (int j = 0; j < MB; ++j) acc[r][j] = _mm512_dpwssd_epi32(acc[r][j], wv, xv[j]);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < MB; ++j) sum[r][j] += static_cast<float>(_mm512_reduce_add_epi32(acc[r][j]));
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < MB; ++j) o.put(j0 + j, n_row + r, sum[r][j] * xs[j] * scale[n_row + r]);
}

template <int MB>
void rows_vnni(const int16_t* x, int64_t k, const int8_t* q, const float* scale, const float* xs,
               int64_t lo, int64_t hi, int64_t n_tiled, const Out& o, int64_t j0) {
  PS_INT8_ROWS(tile_vnni, x, xs, k)
}

// Rows of x to 16-bit fixed point: xq = round(x / xs), xs = max|x| / 32767.
void quantize_rows(const In& x, int64_t m, int64_t k, int16_t* xq, float* xs) {
  for (int64_t j = 0; j < m; ++j) {
    float amax = 0.0f;
    for (int64_t c = 0; c < k; ++c) amax = std::max(amax, std::abs(x.at(j, c)));
    xs[j] = amax > 0.0f ? amax / 32767.0f : 1.0f;
    const float inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
    for (int64_t c = 0; c < k; ++c)
      xq[j * k + c] = static_cast<int16_t>(std::lrint(x.at(j, c) * inv));
  }
}
#else
#define PS_INT8_VNNI 0
#endif

}  // namespace

extern "C" {

// Inner dimension multiple the kernel needs (the packed layout's column groups); 0: no
// vector int8 widening on this CPU (the generic code is scalarised there), so the layer
// keeps torch's paths.
int ps_int8_lanes() {
#if defined(__AVX2__) || defined(__AVX512F__)
  return 32;
#else
  return 0;
#endif
}

// q [n, k] row-major -> the packed layout above (out: n * k bytes).
void ps_int8_pack(const int8_t* q, int64_t n, int64_t k, int8_t* out) {
  const int64_t n_tiled = n / kTile * kTile;
  for (int64_t i = 0; i < n_tiled; ++i)
    for (int64_t c = 0; c < k; c += 32)
      std::memcpy(out + (i / kTile) * kTile * k + (c / 32) * kTileCs + (i % kTile) * 32,
                  q + i * k + c, 32);
  std::memcpy(out + n_tiled * k, q + n_tiled * k, (n - n_tiled) * k);
}

// ps_int8_pack's inverse, widened to float32 or bfloat16 (exact: |q| <= 127) as it goes:
// the prefill path's weight, in one pass over it.
void ps_int8_unpack(const int8_t* packed, int64_t n, int64_t k, void* out, int out_bf16,
                    int nthreads) {
  const int64_t n_tiled = n / kTile * kTile;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t c = 0; c < k; c += 32) {
      const int8_t* src = i < n_tiled
          ? packed + (i / kTile) * kTile * k + (c / 32) * kTileCs + (i % kTile) * 32
          : packed + i * k + c;
      for (int e = 0; e < 32; ++e) {
        const float v = static_cast<float>(src[e]);
        if (out_bf16) {
          uint32_t u;
          std::memcpy(&u, &v, 4);
          static_cast<uint16_t*>(out)[i * k + c + e] = static_cast<uint16_t>(u >> 16);
        } else {
          static_cast<float*>(out)[i * k + c + e] = v;
        }
      }
    }
  }
}

// The weight is ps_int8_pack's layout.
void ps_int8_gemv(const void* x, int x_bf16, int64_t xs, int64_t m, int64_t k, const int8_t* q,
                  const float* scale, const void* bias, int bias_bf16, int64_t n, void* y,
                  int y_bf16, int64_t ys, int nthreads) {
  constexpr int64_t kChunk = 64;  // weight rows per work item (a multiple of 8)
  const int64_t items = (n + kChunk - 1) / kChunk;
  const In in{x, xs, x_bf16};
  const Out o{y, ys, y_bf16, bias, bias_bf16};
  const int64_t n_tiled = n / kTile * kTile;
  // Waking a second thread costs more than a small matrix takes on one.
  if (n * k < (int64_t{1} << 18)) nthreads = 1;
#if PS_INT8_VNNI
  std::vector<int16_t> xq(m * k);
  std::vector<float> xsc(m);
  quantize_rows(in, m, k, xq.data(), xsc.data());
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t it = 0; it < items; ++it) {
    const int64_t lo = it * kChunk, hi = std::min(n, lo + kChunk);
    for (int64_t j = 0; j < m; j += 4) {
      const int16_t* xj = xq.data() + j * k;
      const float* sj = xsc.data() + j;
      switch (std::min<int64_t>(4, m - j)) {
        case 1: rows_vnni<1>(xj, k, q, scale, sj, lo, hi, n_tiled, o, j); break;
        case 2: rows_vnni<2>(xj, k, q, scale, sj, lo, hi, n_tiled, o, j); break;
        case 3: rows_vnni<3>(xj, k, q, scale, sj, lo, hi, n_tiled, o, j); break;
        default: rows_vnni<4>(xj, k, q, scale, sj, lo, hi, n_tiled, o, j); break;
      }
    }
  }
  return;
#endif
  // The float path reads dense float32 rows.
  std::vector<float> xf;
  const float* xd = static_cast<const float*>(x);
  if (x_bf16 || xs != k) {
    xf.resize(m * k);
    for (int64_t j = 0; j < m; ++j)
      for (int64_t c = 0; c < k; ++c) xf[j * k + c] = in.at(j, c);
    xd = xf.data();
  }
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t it = 0; it < items; ++it) {
    const int64_t lo = it * kChunk, hi = std::min(n, lo + kChunk);
    for (int64_t j = 0; j < m; j += 4) {
      const float* xj = xd + j * k;
      switch (std::min<int64_t>(4, m - j)) {
        case 1: rows<1>(xj, k, q, scale, lo, hi, n_tiled, o, j); break;
        case 2: rows<2>(xj, k, q, scale, lo, hi, n_tiled, o, j); break;
        case 3: rows<3>(xj, k, q, scale, lo, hi, n_tiled, o, j); break;
        default: rows<4>(xj, k, q, scale, lo, hi, n_tiled, o, j); break;
      }
    }
  }
}

}  // extern "C"
