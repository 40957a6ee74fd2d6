// What the kernels ask of the CPU's caches at run time (the library is built per CPU model
// too, but a VM's model name does not always say which core it runs).

#pragma once

#include <unistd.h>

namespace ps {

// An AMD core with an L1 data cache of 48 KB or more (Zen 5; Zen 4 has 32 KB).  Where the
// weight GEMMs (dpbf16_gemm.cpp, Pass::pf) and decode attention (paged_decode.cpp,
// Prefetcher) put their software prefetches depends on it: measured the other way round on
// the two.  Intel cores with 48 KB (Ice Lake and later, the AMX Xeons) keep the Zen 4
// choice, which is what ran when they were measured.
inline bool wide_l1() {
#if (defined(__x86_64__) || defined(__i386__)) && defined(_SC_LEVEL1_DCACHE_SIZE)
  static const bool wide = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") && sysconf(_SC_LEVEL1_DCACHE_SIZE) >= 48 * 1024;
  }();
  return wide;
#else
  return false;  // __builtin_cpu_is is x86's; the size query glibc's
#endif
}

}  // namespace ps
