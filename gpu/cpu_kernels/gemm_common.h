// What the register-tiled GEMMs (sgemm.cpp, dpbf16_gemm.cpp) share: the row tiling and
// their per-thread scratch.

#pragma once

#include <cstdint>
#include <vector>

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

// Grow-only scratch of the calling thread, 64-byte aligned: a call's packed x, partial sums
// or float32 y (a fresh vector per call would be zeroed, and past glibc's mmap threshold
// mapped and faulted in, every call).
template <typename T>
T* scratch(std::vector<T>& buf, int64_t n) {
  const int64_t pad = (64 + sizeof(T) - 1) / sizeof(T);  // room to align the start
  if (static_cast<int64_t>(buf.size()) < n + pad) buf.resize(n + pad);
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
}

}  // namespace ps
