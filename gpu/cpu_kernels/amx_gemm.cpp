// bfloat16 GEMM on AMX tiles for decode-sized products: y = x . w^T (+ bias), x [m, k],
// w [n, k] (nn.Linear), bf16 in and out, float32 accumulation.
//
// Why by hand: on a 2-core Xeon with AMX, oneDNN's packed bf16 kernel (brgemm, AMX) runs
// the `mid` model's decode projections with the weights streaming at 16-22 GB/s (1-38
// rows), where two threads read memory at 22-36 GB/s; the products are far from AMX's
// compute limit (a tile product, 16 rows x 32 k x 16 columns, takes 16 cycles), so the
// kernel's job is to keep the weight stream moving.  Measured: 28-29 GB/s at 1-16 rows,
// ~20 at 38-48, 17 at 64 (oneDNN 22 / 16 / 14); see gpu/cpu_linear.py for the routing.
//
// Layout: the weight is packed once at load into panels of 16 output columns, each panel
// k/32 consecutive 1 KB tiles in the VNNI order tdpbf16ps reads (tile row r holds k pairs
// 2r, 2r+1 for each of the 16 columns), so a panel is one sequential stream.  x is copied
// per call into tile order (1 KB per 16 rows x 32 k, zero rows past m).  One row tile runs
// against 4 panels a pass, more row tiles 2 x 2 (C tiles 0-3, A 4-5, B 6-7), so several
// tile products are always independent; row tiles past the second take further passes over
// the same panels, which then come from L2.  Panels are split over threads; a thread does
// all of k for a panel group before the next.  Past ~96 rows oneDNN's blocking wins (the
// caller routes those to it).
//
// Every output element is the same sum over k in the same order whatever m is and
// wherever its row falls in a tile: a row's result does not depend on its batch.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PS_AMX 1
#else
#define PS_AMX 0
#endif

namespace {

constexpr int kN = 16;           // output columns per panel (a tile's fp32 columns)
constexpr int kK = 32;           // k per tile: 16 rows of bf16 pairs
constexpr int64_t kTile = 512;   // bf16 values per 1 KB tile

inline int64_t panels(int64_t n) { return (n + kN - 1) / kN; }

#if PS_AMX

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux (5.16+) hands a process the AMX register state only on request; oneDNN asks too,
// but this library must not depend on oneDNN having run first.
bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

// Every tile 16 rows x 64 bytes: A (16 rows x 32 bf16), B (16 k pairs x 16 columns), C
// (16 x 16 float32).  The configuration is per thread, and oneDNN loads its own between
// our calls, so each parallel region loads it again.
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// Adds the bias and rounds rows [0, rows) of a 16 x 16 float32 tile into y (columns
// [0, cols) of the panel).
inline void store_tile(const float* c, int rows, int cols, const float* bias, uint16_t* y,
                       int64_t ys) {
  const __mmask16 mask = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int r = 0; r < rows; ++r) {
    const __m512 v = _mm512_add_ps(_mm512_loadu_ps(c + r * kN), b);
    const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
    _mm256_mask_storeu_epi16(y + r * ys, mask, h);
  }
}

// One pass: MT row tiles of packed x (a, tile t of k at a + t * kTile, the next row tile
// kt tiles on) x NB panels starting at b (panel stride ps values) over kt tiles of k;
// results into cbuf[(ni * MT + mi) * 256].  prefetch: pull the panels toward L2 a few
// tiles ahead of use (the first pass over them; later passes find them in L2).
template <int MT, int NB>
void tile_pass(const uint16_t* a, const uint16_t* b, int64_t ps, int64_t kt, float* cbuf,
               bool prefetch) {
  static_assert(MT * NB <= 4 && MT <= 2, "four C tiles, two A tiles");
  _tile_zero(0);
  if constexpr (MT * NB > 1) _tile_zero(1);
  if constexpr (MT * NB > 2) _tile_zero(2);
  if constexpr (MT * NB > 3) _tile_zero(3);
  const int64_t as = kt * kTile;  // next row tile
  for (int64_t t = 0; t < kt; ++t) {
    const uint16_t* bt = b + t * kTile;
    const uint16_t* at = a + t * kTile;
    if (prefetch) {
      // 8 tiles ahead; distances of 0-32 tiles and an L1 hint measured within 5% of this.
      for (int j = 0; j < NB; ++j)
        for (int l = 0; l < 1024; l += 64)
          _mm_prefetch(reinterpret_cast<const char*>(bt + j * ps + 8 * kTile) + l, _MM_HINT_T1);
    }
    if constexpr (NB == 4) {  // MT == 1: one row tile, four panels
      _tile_loadd(4, at, 64);
      _tile_loadd(6, bt, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, bt + ps, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(6, bt + 2 * ps, 64);
      _tile_dpbf16ps(2, 4, 6);
      _tile_loadd(7, bt + 3 * ps, 64);
      _tile_dpbf16ps(3, 4, 7);
    } else if constexpr (NB == 2) {
      _tile_loadd(4, at, 64);
      _tile_loadd(6, bt, 64);
      _tile_loadd(7, bt + ps, 64);
      if constexpr (MT == 2) {
        _tile_loadd(5, at + as, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      } else {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
      }
    } else {  // one panel
      _tile_loadd(4, at, 64);
      _tile_loadd(6, bt, 64);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (MT == 2) {
        _tile_loadd(5, at + as, 64);
        _tile_dpbf16ps(1, 5, 6);
      }
    }
  }
  _tile_stored(0, cbuf, 64);
  if constexpr (MT * NB > 1) _tile_stored(1, cbuf + 256, 64);
  if constexpr (MT * NB > 2) _tile_stored(2, cbuf + 512, 64);
  if constexpr (MT * NB > 3) _tile_stored(3, cbuf + 768, 64);
}

using PassFn = void (*)(const uint16_t*, const uint16_t*, int64_t, int64_t, float*, bool);

PassFn pass_for(int mt, int nb) {
  if (nb == 4) return tile_pass<1, 4>;
  if (nb == 2) return mt == 2 ? tile_pass<2, 2> : tile_pass<1, 2>;
  return mt == 2 ? tile_pass<2, 1> : tile_pass<1, 1>;
}

#endif  // PS_AMX

}  // namespace

extern "C" {

int ps_amx_available() {
#if PS_AMX
  return amx_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

// bf16 values of the packed weight: n rounded up to 16 columns, k a multiple of 32.
int64_t ps_amx_gemm_packed_size(int64_t n, int64_t k) { return panels(n) * kN * k; }

// w [n, k] bf16 (raw bits) -> panels of k/32 tiles, tile row r = k pairs (2r, 2r+1) of the
// panel's 16 columns; columns past n are zero.
void ps_amx_gemm_pack(const uint16_t* w, int64_t n, int64_t k, uint16_t* out, int nthreads) {
  const int64_t np = panels(n), kt = k / kK;
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t p = 0; p < np; ++p)
    for (int64_t t = 0; t < kt; ++t) {
      uint16_t* tile = out + (p * kt + t) * kTile;
      for (int r = 0; r < 16; ++r)
        for (int c = 0; c < kN; ++c)
          for (int q = 0; q < 2; ++q) {
            const int64_t col = p * kN + c;
            tile[r * 32 + c * 2 + q] = col < n ? w[col * k + t * kK + 2 * r + q] : 0;
          }
    }
}

// x [m, k] bf16 (row stride xs values), packed weight from ps_amx_gemm_pack, bias [n]
// float32 or null, y [m, n] bf16 (row stride ys).  k must be a multiple of 32.
void ps_amx_gemm(const uint16_t* x, int64_t xs, int64_t m, int64_t k, const uint16_t* wp,
                 int64_t n, const float* bias, uint16_t* y, int64_t ys, int nthreads) {
#if PS_AMX
  if (m <= 0 || n <= 0) return;
  const int64_t np = panels(n), kt = k / kK, ps = kt * kTile;
  const int64_t tiles = (m + 15) / 16;
  // x in tile order: row tile i, k tile t at (i * kt + t) * kTile, 1 KB each, rows past m
  // zero.  A tile load then reads 16 consecutive lines (x's own rows are k apart, which
  // costs a tile load 16 scattered lines), and the last row tile needs no guard.
  // On a 64-byte line boundary: a tile row straddling two lines costs its load 2-5% at
  // 48-96 rows (measured against a deliberately misaligned copy).
  thread_local std::vector<uint16_t> xa;
  xa.resize(tiles * kt * kTile + 32);
  const auto base = reinterpret_cast<uintptr_t>(xa.data());
  uint16_t* xw = reinterpret_cast<uint16_t*>((base + 63) & ~uintptr_t(63));
  const int nb = tiles == 1 ? 4 : 2;  // panels per pass
  const int64_t groups = (np + nb - 1) / nb;
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nthreads, groups)));
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num();
    // Each thread lays out a share of x's rows (a serial copy cost a decode step ~2%).
    for (int64_t row = tiles * 16 * t / nt; row < tiles * 16 * (t + 1) / nt; ++row) {
      const int64_t i = row / 16, r = row % 16;
      for (int64_t kk = 0; kk < kt; ++kk) {
        uint16_t* dst = xw + (i * kt + kk) * kTile + r * kK;
        if (row < m)
          std::memcpy(dst, x + row * xs + kk * kK, kK * sizeof(uint16_t));
        else
          std::memset(dst, 0, kK * sizeof(uint16_t));
      }
    }
#pragma omp barrier
    configure_tiles();
    alignas(64) float cbuf[4 * 256];
    const int64_t g0 = groups * t / nt, g1 = groups * (t + 1) / nt;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p0 = g * nb;
      const int pg = static_cast<int>(std::min<int64_t>(nb, np - p0));
      // A short group (the last panels) goes one panel at a time.
      const int step = pg == nb ? nb : 1;
      for (int j = 0; j < pg; j += step) {
        const int64_t p = p0 + j;
        // Two row tiles per pass: the first pass streams the panels from memory, the
        // later ones find them in L2.
        for (int64_t i0 = 0; i0 < tiles; i0 += 2) {
          const int mt = static_cast<int>(std::min<int64_t>(2, tiles - i0));
          pass_for(mt, step)(xw + i0 * kt * kTile, wp + p * ps, ps, kt, cbuf,
                             i0 == 0);
          for (int ni = 0; ni < step; ++ni) {
            const int64_t col = (p + ni) * kN;
            const int cols = static_cast<int>(std::min<int64_t>(kN, n - col));
            for (int mi = 0; mi < mt; ++mi) {
              const int64_t row = (i0 + mi) * 16;
              const int rows = static_cast<int>(std::min<int64_t>(16, m - row));
              store_tile(cbuf + (ni * mt + mi) * 256, rows, cols, bias ? bias + col : nullptr,
                         y + row * ys + col, ys);
            }
          }
        }
      }
    }
    _tile_release();
  }
#else
  (void)x, (void)xs, (void)m, (void)k, (void)wp, (void)n, (void)bias, (void)y, (void)ys,
      (void)nthreads;
#endif
}

}  // extern "C"
