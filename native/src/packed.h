// Packed expert blocks (the layout of QUANT_LAYOUT / native/README.md): the formats, their block
// geometry, the exact scalar helpers every path shares, and the packed kernel table. A matrix
// [N, K] is N rows of K / B blocks of `bytes` bytes each; Mat.ld is the row's byte count and the
// kernels multiply their result by Mat.gs (the matrix's global scale: nvfp4's, 1 otherwise).
// Like common.h, it declares no std templates (kernel files include it under target pragmas).
#pragma once

#include <cstdint>
#include <cstring>

#include "common.h"

namespace ft {

enum class QFmt : int {
    q8_0 = 0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl, iq4_xs, mxfp4, fp8, nvfp4
};
constexpr int kNumQ = 15;

struct QInfo {
    const char* name;
    int block;  // values per block (B)
    int bytes;  // bytes per block
};
constexpr QInfo kQInfo[kNumQ] = {
    {"q8_0", 32, 34},   {"q4_0", 32, 18},   {"q4_1", 32, 20},   {"q5_0", 32, 22},  {"q5_1", 32, 24},
    {"q2_k", 256, 84},  {"q3_k", 256, 110}, {"q4_k", 256, 144}, {"q5_k", 256, 176}, {"q6_k", 256, 210},
    {"iq4_nl", 32, 18}, {"iq4_xs", 256, 136}, {"mxfp4", 32, 17}, {"fp8", 128, 132}, {"nvfp4", 16, 9},
};

// int8 code tables: iq4_nl's non-linear values; e2m1 doubled (mxfp4's and nvfp4's nibbles)
alignas(16) constexpr int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                  1,    13,   25,  38,  53,  69,  89,  113};
alignas(16) constexpr int8_t kE2m1Doubled[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

extern float kE4m3Table[256];  // e4m3fn code -> value (NaN for 0x7f / 0xff); filled at load

// IEEE half -> float, exact (subnormals, infinities and NaN included).
inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 31u, m = h & 1023u, u;
    if (e == 31) u = sign | 0x7f800000u | (m << 13);
    else if (e != 0) u = sign | ((e + 112u) << 23) | (m << 13);
    else if (m == 0) u = sign;
    else {  // subnormal: normalise
        e = 113;
        while (!(m & 1024u)) m <<= 1, --e;
        u = sign | (e << 23) | ((m & 1023u) << 13);
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t load_u16(const uint8_t* p) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
}

inline uint32_t load_u32(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

inline float load_f32(const uint8_t* p) {
    float v;
    std::memcpy(&v, p, 4);
    return v;
}

// ggml's e8m0 "half" scale: 2^(e - 128), with the e < 2 cases as subnormal bit patterns.
inline float e8m0_half(uint8_t e) {
    const uint32_t u = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// K-quant 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes (q4_k, q5_k).
inline void kquant_scale_min(const uint8_t* s, int j, int* sc, int* mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

// All 8 K-quant scales and mins at once (the same values as kquant_scale_min, by 32-bit words).
inline void kquant_scales_mins(const uint8_t* s, uint8_t sc[8], uint8_t mn[8]) {
    const uint32_t u0 = load_u32(s), u1 = load_u32(s + 4), u2 = load_u32(s + 8);
    const uint32_t w[4] = {u0 & 0x3f3f3f3fu, ((u2 & 0x0f0f0f0fu) | (((u0 >> 6) & 0x03030303u) << 4)),
                           u1 & 0x3f3f3f3fu, (((u2 >> 4) & 0x0f0f0f0fu) | (((u1 >> 6) & 0x03030303u) << 4))};
    std::memcpy(sc, w, 8);
    std::memcpy(mn, w + 2, 8);
}

// All 16 q3_k scales at once, minus 32 (the same values as q3k_scale, by 32-bit words).
inline void q3k_scales(const uint8_t* s, int8_t out[16]) {
    const uint32_t a0 = load_u32(s), a1 = load_u32(s + 4), t = load_u32(s + 8);
    const uint32_t m2 = 0x0f0f0f0fu, m1 = 0x03030303u;
    const uint32_t w[4] = {(a0 & m2) | ((t & m1) << 4), (a1 & m2) | (((t >> 2) & m1) << 4),
                           ((a0 >> 4) & m2) | (((t >> 4) & m1) << 4), ((a1 >> 4) & m2) | (((t >> 6) & m1) << 4)};
    uint8_t u[16];
    std::memcpy(u, w, 16);
    for (int i = 0; i < 16; ++i) out[i] = static_cast<int8_t>(u[i] - 32);
}

// q3_k's signed 6-bit scale i (0..15) from its 12 packed bytes.
inline int q3k_scale(const uint8_t* s, int i) {
    return (((s[i % 8] >> (4 * (i / 8))) & 15) | (((s[8 + i % 4] >> (2 * (i / 4))) & 3) << 4)) - 32;
}

// kernels_packed_<isa>.cpp each fill their table (nullptr everywhere where the ISA has none).
void register_packed_scalar(GemvFn table[kNumQ]);
void register_packed_avx2(GemvFn table[kNumQ]);
void register_packed_avx512(GemvFn table[kNumQ]);

// One block of `fmt` dequantized into out[0 .. B) (the scalar path's decoder; gs not applied).
void dequant_block(QFmt fmt, const uint8_t* block, float* out);

}  // namespace ft
