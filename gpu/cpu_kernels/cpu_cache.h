// What the kernels ask of the CPU's caches at run time (the library is built per CPU model
// too, but a VM's model name does not always say which core it runs).

#pragma once

#include <unistd.h>

namespace ps {

// An L1 data cache of 48 KB or more (Zen 5; Zen 4 has 32 KB).  Where the weight GEMMs
// (dpbf16_gemm.cpp, Pass::pf) and decode attention (paged_decode.cpp, Prefetcher) put their
// software prefetches depends on it: measured the other way round on the two.
inline bool wide_l1() {
  static const bool wide = sysconf(_SC_LEVEL1_DCACHE_SIZE) >= 48 * 1024;
  return wide;
}

}  // namespace ps
