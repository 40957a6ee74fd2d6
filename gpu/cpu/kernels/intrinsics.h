// <immintrin.h> for the kernels, which build with -Wall -Wextra -Werror.  GCC 12 warns
// -Wmaybe-uninitialized inside its own intrinsics (the `__Y = __Y` placeholders of
// _mm256_undefined_* and friends, GCC bug 105593, fixed in 13) wherever they are inlined;
// the warning is placed in the header, so it is silenced for the header only.

#pragma once

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif
