// AVX-512F/BW/VL kernels for the packed formats: kernels_packed_simd.h at 16 float lanes, tiles
// of up to 4 rows x 4 tokens.
#include "avx512_target.h"

#include "packed.h"

#if defined(__x86_64__)
FT_AVX512_BEGIN("avx512f,avx512bw,avx512vl,avx2,fma,f16c")

namespace ft {
namespace {

struct V {
    static constexpr int W = 16, TMAX = 4;
    static constexpr bool kI8FromMemory = false;  // decoded codes widened by i8p from a stack copy, else by i8
    static constexpr bool kLut16 = true;          // the 4-bit formats' codes by lut16
    using F = __m512;
    static F zero() { return _mm512_setzero_ps(); }
    static F set1(float f) { return _mm512_set1_ps(f); }
    static F load(const float* p) { return _mm512_loadu_ps(p); }
    static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
    static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    static F add(F a, F b) { return _mm512_add_ps(a, b); }
    static float hsum(F v) { return _mm512_reduce_add_ps(v); }
    static F i8(__m128i q, int) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }
    static F i8p(const uint8_t* p) {  // W int8 at p as floats
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    }
    static F lut16(const uint8_t* p, bool hi, F table) {  // vpermps reads each index's low 4 bits
        __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        if (hi) w = _mm512_srli_epi32(w, 4);
        return _mm512_permutexvar_ps(w, table);
    }
    static F q6k16(const uint8_t* b, int j, int v) {  // (ql nibble | 2 qh bits << 4) - 32 per int32 lane
        const int g = j >> 2, jj = j & 3, sh = 2 * jj;  // qh bits sh, sh + 1 go to bits 4, 5
        __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 64 * g + 32 * (jj & 1) + 16 * v)));
        if (jj >> 1) lo = _mm512_srli_epi32(lo, 4);
        __m512i hi = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 128 + 32 * g + 16 * v)));
        hi = sh >= 4 ? _mm512_srli_epi32(hi, sh - 4) : _mm512_slli_epi32(hi, 4 - sh);
        hi = _mm512_and_si512(hi, _mm512_set1_epi32(0x30));
        const __m512i code = _mm512_ternarylogic_epi32(hi, _mm512_set1_epi32(0x0f), lo, 0xb8);  // 0x0f ? lo : hi, per bit
        return _mm512_cvtepi32_ps(_mm512_sub_epi32(code, _mm512_set1_epi32(32)));
    }
    static F fp8(const uint8_t* p) {  // 16 e4m3 bytes -> fp16 bit patterns (value / 256) -> float
        const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8);
        const __m256i mag = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7f)), 7);
        return _mm512_cvtph_ps(_mm256_or_si256(sign, mag));
    }
    static void prefetch(const uint8_t* p) {
        if (g_prefetch_bytes > 0) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
    }
};

#include "kernels_packed_simd.h"

}  // namespace

// called only where the CPU has avx512 (moe_packed.cpp): the fill may use its instructions
void register_packed_avx512(GemvFn table[kNumQ]) { fill_table(table); }

}  // namespace ft

FT_AVX512_END
#else
namespace ft {
void register_packed_avx512(GemvFn*) {}
}  // namespace ft
#endif
