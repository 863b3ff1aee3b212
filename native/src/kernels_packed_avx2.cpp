// AVX2 + FMA + F16C kernels for the packed formats: kernels_packed_simd.h at 8 float lanes, tiles
// of up to 4 rows x 2 tokens.
#include <immintrin.h>

#include "packed.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace ft {
namespace {

struct V {
    static constexpr int W = 8, TMAX = 2;
    static constexpr bool kI8FromMemory = true;  // decoded codes widened by i8p from a stack copy, else by i8
    static constexpr bool kLut16 = false;        // no 16-entry float lookup in 8 lanes
    using F = __m256;
    static F zero() { return _mm256_setzero_ps(); }
    static F set1(float f) { return _mm256_set1_ps(f); }
    static F load(const float* p) { return _mm256_loadu_ps(p); }
    static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    static F add(F a, F b) { return _mm256_add_ps(a, b); }
    static float hsum(F v) {
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        s = _mm_add_ss(s, _mm_movehdup_ps(s));
        return _mm_cvtss_f32(s);
    }
    static F i8(__m128i q, int off) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(off ? _mm_srli_si128(q, 8) : q)); }
    static F i8p(const uint8_t* p) {  // W int8 at p as floats
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    }
    static F fp8(const uint8_t* p) {  // 8 e4m3 bytes -> fp16 bit patterns (value / 256) -> float
        const __m128i h = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
        const __m128i sign = _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x80)), 8);
        const __m128i mag = _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7f)), 7);
        return _mm256_cvtph_ps(_mm_or_si128(sign, mag));
    }
    static void prefetch(const uint8_t* p) {
        if (g_prefetch_bytes > 0) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
    }
};

#include "kernels_packed_simd.h"

}  // namespace

// called only where the CPU has avx2 (moe_packed.cpp): the fill may use its instructions
void register_packed_avx2(GemvFn table[kNumQ]) { fill_table(table); }

}  // namespace ft

#pragma GCC pop_options
#else
namespace ft {
void register_packed_avx2(GemvFn*) {}
}  // namespace ft
#endif
