// AVX-512 intrinsics on an AVX2 machine, for tests only (avx512_target.h, FT_EMULATE_AVX512):
// SIMDe's portable implementations under the native names, plus the few the kernels use that
// SIMDe 0.8.2 lacks, written here from their definitions in Intel's intrinsics guide.
#pragma once

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "the AVX-512 emulation builds with -mavx2 -mfma -mf16c"
#endif

#include <immintrin.h>

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

#include <cstdint>

namespace ft_emu {

inline simde__m512i cvtepi8_epi32(simde__m128i a) {  // 16 int8 -> 16 int32, sign-extended
    const simde__m128i_private a_ = simde__m128i_to_private(a);
    simde__m512i_private r;
    for (int i = 0; i < 16; ++i) r.i32[i] = a_.i8[i];
    return simde__m512i_from_private(r);
}

inline simde__m512i cvtepu8_epi32(simde__m128i a) {  // 16 uint8 -> 16 int32, zero-extended
    const simde__m128i_private a_ = simde__m128i_to_private(a);
    simde__m512i_private r;
    for (int i = 0; i < 16; ++i) r.i32[i] = a_.u8[i];
    return simde__m512i_from_private(r);
}

inline simde__m512i cvtepu8_epi16(simde__m256i a) {  // 32 uint8 -> 32 int16, zero-extended
    const simde__m256i_private a_ = simde__m256i_to_private(a);
    simde__m512i_private r;
    for (int i = 0; i < 32; ++i) r.i16[i] = a_.u8[i];
    return simde__m512i_from_private(r);
}

inline float reduce_add_ps(simde__m512 a) {  // in GCC's order: halves, quarters, then pairs
    const simde__m512_private a_ = simde__m512_to_private(a);
    float t8[8], t4[4];
    for (int i = 0; i < 8; ++i) t8[i] = a_.f32[8 + i] + a_.f32[i];
    for (int i = 0; i < 4; ++i) t4[i] = t8[4 + i] + t8[i];
    return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}

inline simde__m128i maskz_loadu_epi8(uint16_t k, const void* p) {  // masked-off bytes are not read
    simde__m128i_private r;
    for (int i = 0; i < 16; ++i) r.i8[i] = (k >> i) & 1 ? static_cast<const int8_t*>(p)[i] : 0;
    return simde__m128i_from_private(r);
}

// vcvtne2ps2bf16: b's 16 floats to bf16 in the low half, a's in the high half, rounded to nearest even
inline uint16_t to_bf16_rne(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline simde__m512bh cvtne2ps_pbh(simde__m512 a, simde__m512 b) {
    const simde__m512_private a_ = simde__m512_to_private(a), b_ = simde__m512_to_private(b);
    simde__m512bh_private r;
    for (int i = 0; i < 16; ++i) r.u16[i] = to_bf16_rne(b_.f32[i]), r.u16[16 + i] = to_bf16_rne(a_.f32[i]);
    return simde__m512bh_from_private(r);
}

}  // namespace ft_emu

#define _mm512_cvtepi8_epi32(a) ft_emu::cvtepi8_epi32(a)
#define _mm512_cvtepu8_epi32(a) ft_emu::cvtepu8_epi32(a)
#define _mm512_cvtepu8_epi16(a) ft_emu::cvtepu8_epi16(a)
#define _mm512_reduce_add_ps(a) ft_emu::reduce_add_ps(a)
#define _mm_maskz_loadu_epi8(k, p) ft_emu::maskz_loadu_epi8(k, p)
#define _mm512_cvtne2ps_pbh(a, b) ft_emu::cvtne2ps_pbh(a, b)
