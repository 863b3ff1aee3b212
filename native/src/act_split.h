// Activations split into bf16 pieces, for the packed kernels that multiply with vdpbf16ps
// (kernels_packed_avx512bf16.cpp). A float32 v is the exact sum of three bf16 values: p1 = v with
// its low 16 bits cleared (the top 8 significant bits), p2 the same of v - p1 (the next 8), and
// p3 = v - p1 - p2 (at most 8 bits left, so exact), all differences exact in float32. Products of a
// bf16 weight code with each piece are exact in float32, so a dot product over the pieces is a
// float32 dot product of the exact values, in another order of additions; a bf16 v has p2 = p3 = 0.
// (Pieces below 2^-126, from |v| < 2^-102, are flushed to zero by the instruction.)
//
// Layout of a row of K values (K a multiple of 32), from a 64-byte aligned base:
//   uint16 p1[K], p2[K], p3[K]; float s16[K / 16], s32[K / 32] (the sums of every 16 and every 32
//   values, float32, for the formats' offsets); int32 pieces (1: p2 and p3 are all zero, else 3).
#pragma once

#include <cstdint>
#include <cstring>

namespace ft {

inline int64_t split_row_bytes(int64_t K) {
    const int64_t n = 6 * K + 4 * (K / 16) + 4 * (K / 32) + 4;
    return (n + 63) / 64 * 64;
}

struct SplitRow {
    const uint16_t* p[3];
    const float* s16;
    const float* s32;
    int pieces;
};

inline SplitRow split_view(const void* base, int64_t K) {
    const uint8_t* b = static_cast<const uint8_t*>(base);
    SplitRow r;
    for (int i = 0; i < 3; ++i) r.p[i] = reinterpret_cast<const uint16_t*>(b) + i * K;
    r.s16 = reinterpret_cast<const float*>(b + 6 * K);
    r.s32 = r.s16 + K / 16;
    std::memcpy(&r.pieces, r.s32 + K / 32, 4);
    return r;
}

inline uint16_t split_hi(float v) {
    uint32_t u;
    std::memcpy(&u, &v, 4);
    return static_cast<uint16_t>(u >> 16);
}

inline float split_float(uint16_t h) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// Element i of the row at base: its three pieces.
inline void split_put(void* base, int64_t K, int64_t i, float v) {
    uint16_t* p = static_cast<uint16_t*>(base);
    const uint16_t a = split_hi(v);
    const float r = v - split_float(a);
    const uint16_t b = split_hi(r);
    p[i] = a, p[K + i] = b, p[2 * K + i] = split_hi(r - split_float(b));
}

// After every element is put: the sums and the piece count.
inline void split_finish(void* base, int64_t K) {
    uint8_t* b = static_cast<uint8_t*>(base);
    const uint16_t* p = reinterpret_cast<const uint16_t*>(b);
    float* s16 = reinterpret_cast<float*>(b + 6 * K);
    float* s32 = s16 + K / 16;
    int32_t pieces = 1;
    for (int64_t g = 0; g < K / 16; ++g) {
        float s = 0.f;
        for (int64_t i = 16 * g; i < 16 * g + 16; ++i) {
            s += split_float(p[i]) + split_float(p[K + i]) + split_float(p[2 * K + i]);
            if (p[K + i] | p[2 * K + i]) pieces = 3;
        }
        s16[g] = s;
    }
    for (int64_t g = 0; g < K / 32; ++g) s32[g] = s16[2 * g] + s16[2 * g + 1];
    std::memcpy(s32 + K / 32, &pieces, 4);
}

}  // namespace ft
