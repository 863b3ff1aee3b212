// The AVX-512 kernel files' ISA region. FT_AVX512_BEGIN("avx512f,...") / FT_AVX512_END wrap a
// file's code in `#pragma GCC target` so it may use those instructions; its functions are called
// only where the CPU has them (moe_layer.cpp: isa_supported). Built with FT_EMULATE_AVX512 (tests:
// `native/build.py --emulate-avx512 DIR`), the region compiles for the AVX2 of the command line
// and every AVX-512 intrinsic comes from SIMDe (emulate_avx512.h), so the same kernel source runs,
// slowly, on any AVX2 machine; such a module reports the AVX-512 paths as supported.
#pragma once

#define FT_PRAGMA(x) _Pragma(#x)

#if defined(FT_EMULATE_AVX512)
#include "emulate_avx512.h"
#define FT_AVX512_BEGIN(isa) FT_PRAGMA(GCC push_options)
#else
#include <immintrin.h>
#define FT_AVX512_BEGIN(isa) FT_PRAGMA(GCC push_options) FT_PRAGMA(GCC target(isa))
#endif
#define FT_AVX512_END FT_PRAGMA(GCC pop_options)
