// The row tiling shared by the register-tiled GEMMs (sgemm.cpp, dpbf16_gemm.cpp).

#pragma once

namespace ps {

// A block of mb rows as register tiles of up to mr rows (row offset, rows): tiles of mr,
// and where the last would be 1-2 rows, the last two as 4 + (rest) instead: a 1-2 row tile
// keeps too few products in flight to hide their latency.  tiles needs mb / 2 + 2 entries;
// returns the count.
inline int plan_row_tiles(int mb, int mr, int (*tiles)[2]) {
  int q = mb / mr, rem = mb % mr, n = 0, r0 = 0;
  if (rem > 0 && rem < 3 && q > 0) --q, rem += mr;
  for (int i = 0; i < q; ++i, r0 += mr) tiles[n][0] = r0, tiles[n++][1] = mr;
  if (rem > mr) {
    tiles[n][0] = r0, tiles[n++][1] = 4, r0 += 4, rem -= 4;
  }
  if (rem > 0) tiles[n][0] = r0, tiles[n++][1] = rem;
  return n;
}

}  // namespace ps
