// What the register-tiled GEMMs (sgemm.cpp, dpbf16_gemm.cpp) share: the row tiling and
// their per-thread scratch; and sgemm's split of panels over threads (share_items).

#pragma once

#include <algorithm>
#include <atomic>
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

// Items [0, n) of a parallel region shared by its nt threads; f(i, next) runs item i, next
// being the item the thread runs after it (-1 if not known yet: for prefetching).  Each
// thread first runs its own contiguous share of the first three quarters (neighbouring
// panels stream in order), then claims chunks of the last quarter from `claimed` (zero
// before the region) until none is left.  A static split made the step wait for the slower
// core: on a shared 2-core VM one core often runs 5-20% slower than the other for seconds
// at a time.  Which thread runs an item does not change its bits.  On a 2-core Zen 3 EPYC
// (sgemm, the `mid` projections streaming, medians of alternated runs): 1.02x at 38 rows,
// 1.14x at 1,870 in a noisy spell; whole offline runs 20.8 vs 21.1 s.
template <typename F>
void share_items(int64_t n, int t, int nt, std::atomic<int64_t>& claimed, F&& f) {
  const int64_t tail = nt > 1 ? n / 4 : 0, head = n - tail;
  const int64_t chunk = std::max<int64_t>(1, tail / (8 * nt));
  const int64_t s0 = head * t / nt, s1 = head * (t + 1) / nt;
  for (int64_t i = s0; i < s1; ++i) f(i, i + 1 < s1 ? i + 1 : -1);
  for (;;) {
    const int64_t c0 = head + claimed.fetch_add(chunk, std::memory_order_relaxed);
    if (c0 >= n) break;
    const int64_t c1 = std::min(n, c0 + chunk);
    for (int64_t i = c0; i < c1; ++i) f(i, i + 1 < c1 ? i + 1 : -1);
  }
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
