// bfloat16 GEMM on AMX tiles for decode-sized products: y = x . w^T (+ bias), x [m, k],
// w [n, k] (nn.Linear), bf16 in and out, float32 accumulation.
//
// Why by hand: on a 2-core Xeon with AMX, oneDNN's packed bf16 kernel (brgemm, AMX) runs
// the `mid` model's decode projections with the weights streaming at 16-22 GB/s (1-38
// rows), where two threads read memory at 22-36 GB/s; the products are far from AMX's
// compute limit (a tile product, 16 rows x 32 k x 16 columns, takes 16 cycles), so the
// kernel's job is to keep the weight stream moving.  Measured over the `mid` model's
// projections (246 MB, cold): 28-29 GB/s at 1-16 rows, ~20 at 38-48, 17 at 64 (oneDNN 22 /
// 16 / 14); on 2026-12-03, with per-thread x copies and three row tiles in one pass, 37-39
// at 1-16, 32-33 at 32, 27-28 at 38-48, 23 at 64 (the machine's memory ran faster that day:
// 1-16 rows are memory-bound, 32 and more bound by tile loads from L2).  See
// gpu/cpu/linear.py for the routing.
//
// Layout: the weight is packed once at load into panels of 16 output columns, each panel
// k/32 consecutive 1 KB tiles in the VNNI order tdpbf16ps reads (tile row r holds k pairs
// 2r, 2r+1 for each of the 16 columns), so a panel is one sequential stream.  x is copied
// per call into tile order (1 KB per 16 rows x 32 k, zero rows past m), by each thread into
// its own copy.  One row tile runs against 4 panels a pass, more row tiles 2 x 2 (C tiles
// 0-3, A 4-5, B 6-7), so several tile products are always independent; three row tiles go
// through the panels once, k in chunks, the C tiles of the idle pair parked in L1; from four
// row tiles, further passes over the same panels find them in L2.  Panels are split over
// threads; a thread does all of k for a panel group before the next.  From 80 rows the
// rows go in blocks instead (amx_gemm_large), which the caller runs at prompt sizes too
// (gpu/cpu/linear.py: oneDNN's AMX kernel only under PAGESTREAM_PREFILL_GEMM=onednn).
//
// Every output element is the same sum over k in the same order whatever m is and
// wherever its row falls in a tile: a row's result does not depend on its batch.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "activation.h"
#include "entry_points.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include "intrinsics.h"
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

inline __m512 round_bf16(__m512 v) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v)); }

// One output row of a tile: 16 float32 plus the bias, rounded to bf16, the first cols
// (mask) stored.
inline void store_row(const float* c, __m512 bias, __mmask16 mask, uint16_t* y) {
  const __m512 v = _mm512_add_ps(_mm512_loadu_ps(c), bias);
  _mm256_mask_storeu_epi16(y, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

inline __mmask16 col_mask(int cols) {
  return cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
}

inline __m512 bias_row(const float* bias, __mmask16 mask) {
  return bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
}

// Adds the bias and rounds rows [0, rows) of a 16 x 16 float32 tile into y (columns
// [0, cols) of the panel).
inline void store_tile(const float* c, int rows, int cols, const float* bias, uint16_t* y,
                       int64_t ys) {
  const __mmask16 mask = col_mask(cols);
  const __m512 b = bias_row(bias, mask);
  for (int r = 0; r < rows; ++r) store_row(c + r * kN, b, mask, y + r * ys);
}

// silu(gate) * up of one row of a gate and an up tile into 16 outputs of y, rounded as
// amx_gemm + silu_mul round them: gate and up to bf16 (the product's rounding), silu
// through the library's one silu16 (elementwise.cpp's bits), rounded, times up, rounded.
inline void gated_row(const float* cg, const float* cu, uint16_t* y) {
  alignas(64) float g[16], sg[16];
  _mm512_store_ps(g, round_bf16(_mm512_load_ps(cg)));
  ps::silu16(g, sg, 16);
  const __m512 v = _mm512_mul_ps(round_bf16(_mm512_load_ps(sg)), round_bf16(_mm512_load_ps(cu)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y),
                      reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

// gated_row for rows [0, rows) of a gate and an up tile.
inline void store_gated(const float* cg, const float* cu, int rows, uint16_t* y, int64_t ys) {
  for (int r = 0; r < rows; ++r) gated_row(cg + r * kN, cu + r * kN, y + r * ys);
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

// All `tiles` row tiles, two at a time, against a pair of panels, k in chunks of kc tiles:
// each chunk of the panels comes from memory once and feeds every row pair from L1, where
// the C tiles of the other pairs wait between chunks (c: C tile of row tile mi, panel ni at
// (ni * tiles + mi) * 256, as tile_pass lays out MT = tiles).  Each C tile still sums k in
// order, so the results are those of tile_pass to the bit.
void chunked_pass(const uint16_t* a, const uint16_t* b, int64_t ps, int64_t kt, int tiles,
                  int64_t kc, float* c) {
  const int64_t as = kt * kTile;
  for (int64_t t0 = 0; t0 < kt; t0 += kc) {
    const int64_t t1 = std::min(kt, t0 + kc);
    for (int i = 0; i < tiles; i += 2) {
      const bool two = i + 1 < tiles;
      float* c00 = c + i * 256;             // row tile i, panel 0
      float* c01 = c + (tiles + i) * 256;   // row tile i, panel 1
      if (t0 == 0) {
        _tile_zero(0);
        _tile_zero(2);
        if (two) {
          _tile_zero(1);
          _tile_zero(3);
        }
      } else {
        _tile_loadd(0, c00, 64);
        _tile_loadd(2, c01, 64);
        if (two) {
          _tile_loadd(1, c00 + 256, 64);
          _tile_loadd(3, c01 + 256, 64);
        }
      }
      const uint16_t* ai = a + i * as;
      for (int64_t t = t0; t < t1; ++t) {
        const uint16_t* bt = b + t * kTile;
        if (i == 0)
          for (int j = 0; j < 2; ++j)
            for (int l = 0; l < 1024; l += 64)
              _mm_prefetch(reinterpret_cast<const char*>(bt + j * ps + 8 * kTile) + l,
                           _MM_HINT_T1);
        _tile_loadd(4, ai + t * kTile, 64);
        _tile_loadd(6, bt, 64);
        _tile_loadd(7, bt + ps, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 4, 7);
        if (two) {
          _tile_loadd(5, ai + as + t * kTile, 64);
          _tile_dpbf16ps(1, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, c00, 64);
      _tile_stored(2, c01, 64);
      if (two) {
        _tile_stored(1, c00 + 256, 64);
        _tile_stored(3, c01 + 256, 64);
      }
    }
  }
}

using PassFn = void (*)(const uint16_t*, const uint16_t*, int64_t, int64_t, float*, bool);

PassFn pass_for(int mt, int nb) {
  if (nb == 4) return tile_pass<1, 4>;
  if (nb == 2) return mt == 2 ? tile_pass<2, 2> : tile_pass<1, 2>;
  return mt == 2 ? tile_pass<2, 1> : tile_pass<1, 1>;
}

// Prefill-sized products (kLargeFrom rows and more): rows in blocks of kLargeRows, whose x
// rows stay in L2 while the thread's panel pairs go by; per row pair, 2 x 2 C tiles over
// k with the A tiles loaded straight from x's rows, and the next panel pair pulled toward
// L2 meanwhile.  k goes in passes of kLargeK tiles, so a block's k range (256 rows x 2,048
// values, 1 MB) stays in L2; between passes the C tiles wait in memory (fp32, exact).  Each
// C tile sums k in the same order as the passes above, so a row gets the same bits here as
// in a decode-sized call.
//
// What bounds it (a standalone copy of the loop on a 2-core AMX Xeon, random bf16 data):
// a 2 x 2 block with one operand's tiles in L1 runs at ~2.7 TFLOP/s a core (3.2 on zeros:
// the tiles' rate depends on the data), with both from L2 at ~40% of that, and the weights
// streaming in from memory take ~25-35% more (the prefetched lines hold the L1 fill buffers
// the A tile loads need).  Splitting k to keep the panel pair's chunk in L1 costs more in
// C tile stores and reloads than it saves.  Against oneDNN's packed AMX kernel: 1.02-1.25x
// over the 1B shape's projections at 256-2,048 rows on both AMX kinds measured.
// The row blocks against the passes above (the 1B shape's and mid's projections): 0.86x at
// 33-48 rows, level at 56-80, 1.10-1.16x from 96.
constexpr int64_t kLargeFrom = 80;
constexpr int64_t kLargeRows = 256;  // 128 and 512 measured the same
// A longer k (the MLP's down, 8,192: a 4 MB block, from L3 for every panel pair) in passes
// of 2,048: down 1.31x, the 1B shape's projections 1.06-1.16x; passes of 1,024: 0.91-0.97x.
constexpr int64_t kLargeK = 64;

// The outputs of one row pair x panel pair (its C tiles at c, as block22 leaves them),
// written a row at a time between the next block's tile products, where the tiles do not
// wait for them: after the block, the rounding and stores took ~17% of a prompt GEMM's
// time (gate_up's SiLU epilogue ~27%).  Units in order: plain, (row tile, panel, row);
// gated, (row tile, row).  Each row gets the same instructions as store_tile/store_gated.
struct Epilogue {
  const float* c = nullptr;  // null: nothing pending
  int rows[2] = {0, 0};      // rows of the two row tiles
  int npan = 1;              // plain: panels (1 or 2)
  __mmask16 mask[2] = {0, 0};
  __m512 bias[2];
  uint16_t* y = nullptr;  // the row pair's first row: the pair's first column (gated: its
                          // 16 outputs)
  int64_t ys = 0;
  bool gated = false;
  int units = 0, done = 0;

  void unit(int i) const {
    if (gated) {
      const int h = i / 16, r = i % 16;
      if (r < rows[h])
        gated_row(c + h * 256 + r * kN, c + 512 + h * 256 + r * kN, y + (h * 16 + r) * ys);
      return;
    }
    const int h = i / (16 * npan), ni = i / 16 % npan, r = i % 16;
    if (r < rows[h])
      store_row(c + ni * 512 + h * 256 + r * kN, bias[ni], mask[ni], y + (h * 16 + r) * ys + ni * kN);
  }
  // Units [done, upto).
  void run(int upto) {
    for (; done < std::min(upto, units); ++done) unit(done);
  }
  void finish() {
    run(units);
    c = nullptr;
    units = done = 0;
  }
};

// A row pair x a panel pair over k tiles [t0, t1): the four C tiles start at zero (t0 == 0)
// or from c, and end in c; ep's pending rows are written along the way.  pf / pfl: the
// next panel pair's lines pulled toward L2, pfl a k step.
inline void block22(const uint16_t* a0, int64_t as, const uint16_t* b, int64_t ps, int64_t t0,
                    int64_t t1, float* c, const char* pf, int pfl, Epilogue& ep) {
  if (t0 == 0) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, c, 64);
    _tile_loadd(1, c + 256, 64);
    _tile_loadd(2, c + 512, 64);
    _tile_loadd(3, c + 768, 64);
  }
  const uint16_t* a1 = a0 + 16 * as;
  const int64_t steps = t1 - t0;
  for (int64_t t = t0; t < t1; ++t) {
    for (int l = 0; l < pfl; ++l) _mm_prefetch(pf + ((t - t0) * pfl + l) * 64, _MM_HINT_T1);
    _tile_loadd(4, a0 + t * kK, as * 2);
    _tile_loadd(6, b + t * kTile, 64);
    _tile_loadd(5, a1 + t * kK, as * 2);
    _tile_loadd(7, b + ps + t * kTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 5, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_dpbf16ps(3, 5, 7);
    if (ep.c) ep.run(static_cast<int>(((t - t0 + 1) * ep.units + steps - 1) / steps));
  }
  if (ep.c) ep.finish();  // before the stores: with one C buffer, c may be ep's
  _tile_stored(0, c, 64);
  _tile_stored(1, c + 256, 64);
  _tile_stored(2, c + 512, 64);
  _tile_stored(3, c + 768, 64);
}

void amx_gemm_large(const uint16_t* x, int64_t xs, int64_t m, int64_t k, const uint16_t* wp,
                    int64_t n, const float* bias, uint16_t* y, int64_t ys, int nthreads,
                    bool gated) {
  const int64_t np = panels(n), kt = k / kK, ps = kt * kTile;
  const int64_t pairs = (np + 1) / 2;  // a gated weight's pair is one gate and its up panel
  const int64_t full = m / 32 * 32;    // rows read in place; the rest from a padded copy
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nthreads, pairs)));
  const int64_t passes = (kt + kLargeK - 1) / kLargeK;
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num();
    configure_tiles();
    const int64_t q0 = pairs * t / nt, q1 = pairs * (t + 1) / nt;
    // A tile reads 16 whole rows: the last (m % 32) rows go through a zero-padded copy.
    thread_local std::vector<uint16_t> tail;
    const uint16_t* tx = nullptr;
    if (full < m) {
      tail.assign(32 * k + 32, 0);
      const auto base = reinterpret_cast<uintptr_t>(tail.data());
      uint16_t* tw = reinterpret_cast<uint16_t*>((base + 63) & ~uintptr_t(63));
      for (int64_t r = full; r < m; ++r)
        std::memcpy(tw + (r - full) * k, x + r * xs, k * sizeof(uint16_t));
      tx = tw;
    }
    // The C tiles of a row pair (4 x 1 KB): two, one written while the other's outputs are;
    // with several passes over k, those of every row pair and panel pair of the thread's
    // share.
    thread_local std::vector<float> parked;
    const int64_t rps = kLargeRows / 32;
    parked.resize(((passes > 1 ? (q1 - q0) * rps : 2) * 1024) + 16);
    float* const cp = reinterpret_cast<float*>(
        (reinterpret_cast<uintptr_t>(parked.data()) + 63) & ~uintptr_t(63));
    Epilogue ep;
    ep.gated = gated;
    ep.ys = ys;
    int64_t blocks = 0;
    for (int64_t m0 = 0; m0 < m; m0 += kLargeRows) {
      const int64_t nrp = (std::min(m, m0 + kLargeRows) - m0 + 31) / 32;
      for (int64_t s = 0; s < passes; ++s) {
        const int64_t t0 = s * kLargeK, t1 = std::min(kt, t0 + kLargeK);
        const bool last = s + 1 == passes;
        for (int64_t q = q0; q < q1; ++q) {
          const int64_t p = 2 * q;
          const bool two = p + 1 < np;
          // The next pair's 2 panels (this pass's k range: two runs of `lines / 2`, `gap`
          // bytes apart; none with one pass), spread over this pair's row pairs and their
          // k steps.
          const char* next = reinterpret_cast<const char*>(wp + (p + 2) * ps + t0 * kTile);
          const int64_t lines = 2 * (t1 - t0) * kTile * 2 / 64;
          const int64_t gap = (ps - (t1 - t0) * kTile) * 2;
          const int64_t per = q + 1 < q1 ? (lines + nrp - 1) / nrp : 0;
          const int pfl = static_cast<int>((per + (t1 - t0) - 1) / (t1 - t0));
          for (int64_t rp = 0; rp < nrp; ++rp) {
            const int64_t r0 = m0 + rp * 32;
            const bool direct = r0 < full;
            float* c = cp + (passes > 1 ? ((q - q0) * rps + rp) : (blocks++ & 1)) * 1024;
            const char* pf = next + rp * per * 64 + (rp * per < lines / 2 ? 0 : gap);
            block22(direct ? x + r0 * xs : tx, direct ? xs : k, wp + p * ps, two ? ps : 0, t0,
                    t1, c, pf, pfl, ep);
            if (!last) continue;
            ep.c = c;
            ep.rows[0] = static_cast<int>(std::min<int64_t>(16, m - r0));
            ep.rows[1] = static_cast<int>(std::clamp<int64_t>(m - r0 - 16, 0, 16));
            if (gated) {
              ep.y = y + r0 * ys + q * kN;
              ep.units = 32;
            } else {
              ep.npan = two ? 2 : 1;
              ep.y = y + r0 * ys + p * kN;
              for (int ni = 0; ni < ep.npan; ++ni) {
                const int64_t col = (p + ni) * kN;
                ep.mask[ni] = col_mask(static_cast<int>(std::min<int64_t>(kN, n - col)));
                ep.bias[ni] = bias_row(bias ? bias + col : nullptr, ep.mask[ni]);
              }
              ep.units = 32 * ep.npan;
            }
            ep.done = 0;
          }
        }
      }
    }
    ep.finish();
    _tile_release();
  }
}

// ps_amx_gemm, or with `gated` ps_amx_silu (n = 2 * inter: panels 2j and 2j + 1 are
// the gate and up halves of outputs 16j..16j+15).
void amx_gemm(const uint16_t* x, int64_t xs, int64_t m, int64_t k, const uint16_t* wp,
              int64_t n, const float* bias, uint16_t* y, int64_t ys, int nthreads, bool gated) {
  if (m <= 0 || n <= 0) return;
  // A process that never asked (ps_amx_available) would die of SIGILL at the first tile
  // instruction; asking is once per process.
  amx_permitted();
  if (m >= kLargeFrom) {
    amx_gemm_large(x, xs, m, k, wp, n, bias, y, ys, nthreads, gated);
    return;
  }
  const int64_t np = panels(n), kt = k / kK, ps = kt * kTile;
  const int64_t tiles = (m + 15) / 16;
  // Three row tiles (33-48 rows) go through the panels once, in chunks of 4 k tiles
  // (2, 3 and 8 measured slower; two passes, the second from L2, ~6% slower at 38-48 rows
  // over the `mid` model's projections; four row tiles: level either way).
  const bool chunked = tiles == 3;
  const int nb = tiles == 1 ? 4 : 2;  // panels per pass
  const int64_t groups = (np + nb - 1) / nb;
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(nthreads, groups)));
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num();
    // x in tile order: row tile i, k tile t at (i * kt + t) * kTile, 1 KB each, rows past m
    // zero.  A tile load then reads 16 consecutive lines (x's own rows are k apart, which
    // costs a tile load 16 scattered lines), and the last row tile needs no guard.
    // On a 64-byte line boundary: a tile row straddling two lines costs its load 2-5% at
    // 48-96 rows (measured against a deliberately misaligned copy).
    // Each thread lays out all of x in its own copy: no barrier, and its tile loads of x
    // stay in its own core's caches.  Sharing one copy, each thread laying out half the
    // rows, cost 1.3-1.8x per call with the weights in L2 (half of every A tile load came
    // from the other core) and ~3% over a decode step's projections.
    thread_local std::vector<uint16_t> xa;
    xa.resize(tiles * kt * kTile + 32);
    const auto base = reinterpret_cast<uintptr_t>(xa.data());
    uint16_t* xw = reinterpret_cast<uint16_t*>((base + 63) & ~uintptr_t(63));
    for (int64_t row = 0; row < tiles * 16; ++row) {
      const int64_t i = row / 16, r = row % 16;
      for (int64_t kk = 0; kk < kt; ++kk) {
        uint16_t* dst = xw + (i * kt + kk) * kTile + r * kK;
        if (row < m)
          std::memcpy(dst, x + row * xs + kk * kK, kK * sizeof(uint16_t));
        else
          std::memset(dst, 0, kK * sizeof(uint16_t));
      }
    }
    configure_tiles();
    alignas(64) float cbuf[6 * 256];  // up to 3 row tiles x 2 panels
    const int64_t g0 = groups * t / nt, g1 = groups * (t + 1) / nt;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p0 = g * nb;
      const int pg = static_cast<int>(std::min<int64_t>(nb, np - p0));
      // A short group (the last panels) goes two panels or one at a time (a gated
      // weight's panel count is even: its gate and up panels stay together).
      const int step = pg == nb ? nb : pg % 2 == 0 ? 2 : 1;
      for (int j = 0; j < pg; j += step) {
        const int64_t p = p0 + j;
        // Two row tiles per pass: the first pass streams the panels from memory, the
        // later ones find them in L2.
        const bool one_pass = chunked && step == 2;
        for (int64_t i0 = 0; i0 < tiles; i0 += one_pass ? tiles : 2) {
          const int mt = static_cast<int>(std::min<int64_t>(one_pass ? tiles : 2, tiles - i0));
          if (one_pass)
            chunked_pass(xw, wp + p * ps, ps, kt, mt, 4, cbuf);
          else
            pass_for(mt, step)(xw + i0 * kt * kTile, wp + p * ps, ps, kt, cbuf, i0 == 0);
          if (gated) {
            for (int ni = 0; ni < step; ni += 2)
              for (int mi = 0; mi < mt; ++mi) {
                const int64_t row = (i0 + mi) * 16;
                store_gated(cbuf + (ni * mt + mi) * 256, cbuf + ((ni + 1) * mt + mi) * 256,
                            static_cast<int>(std::min<int64_t>(16, m - row)),
                            y + row * ys + (p + ni) / 2 * kN, ys);
              }
            continue;
          }
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
  amx_gemm(x, xs, m, k, wp, n, bias, y, ys, nthreads, false);
#else
  (void)x, (void)xs, (void)m, (void)k, (void)wp, (void)n, (void)bias, (void)y, (void)ys,
      (void)nthreads;
#endif
}

// The MLP's gate_up product with SiLU(gate) * up as its epilogue: wp is ps_amx_gemm_pack of
// the gate_up weight [2 * inter, k] with its rows in gated order (each 16 gate rows, then
// the 16 up rows they pair with), y [m, inter], n = 2 * inter.  Returns 0 (nothing done)
// without the AMX build or unless inter is a multiple of 16.
int ps_amx_silu(const uint16_t* x, int64_t xs, int64_t m, int64_t k, const uint16_t* wp,
                int64_t n, uint16_t* y, int64_t ys, int nthreads) {
#if PS_AMX
  if (n % (2 * kN) != 0) return 0;
  amx_gemm(x, xs, m, k, wp, n, nullptr, y, ys, nthreads, true);
  return 1;
#else
  (void)x, (void)xs, (void)m, (void)k, (void)wp, (void)n, (void)y, (void)ys, (void)nthreads;
  return 0;
#endif
}

}  // extern "C"
