// Scalar kernels for the packed formats: each block decoded element by element, straight from the
// layout's definitions (ggml's block structs for the GGUF types), into a block-sized buffer on the
// stack, then dotted with the activations. The portable fallback, and a second, independent
// decoding the SIMD paths (kernels_packed_simd.h) are tested against besides the float64 reference.
#include <cmath>

#include "packed.h"

namespace ft {

float kE4m3Table[256];

namespace {

struct FillE4m3 {
    FillE4m3() {
        for (int i = 0; i < 256; ++i) kE4m3Table[i] = fp8_to_f32(static_cast<uint8_t>(i));
    }} fill_e4m3;

inline float nib(const uint8_t* qs, int i, int half) { return static_cast<float>((qs[i] >> (4 * half)) & 15); }

void deq_q8_0(const uint8_t* b, float* o) {
    const float d = f16_to_f32(load_u16(b));
    for (int i = 0; i < 32; ++i) o[i] = d * static_cast<float>(static_cast<int8_t>(b[2 + i]));
}

void deq_q4_0(const uint8_t* b, float* o) {
    const float d = f16_to_f32(load_u16(b));
    for (int i = 0; i < 16; ++i) {
        o[i] = d * (nib(b + 2, i, 0) - 8.f);
        o[i + 16] = d * (nib(b + 2, i, 1) - 8.f);
    }
}

void deq_q4_1(const uint8_t* b, float* o) {
    const float d = f16_to_f32(load_u16(b)), m = f16_to_f32(load_u16(b + 2));
    for (int i = 0; i < 16; ++i) {
        o[i] = d * nib(b + 4, i, 0) + m;
        o[i + 16] = d * nib(b + 4, i, 1) + m;
    }
}

// q5: low nibbles as q4, bit i of the 32-bit qh is bit 4 of element i
void deq_q5(const uint8_t* qh_p, const uint8_t* qs, float d, float m, float offset, float* o) {
    const uint32_t qh = load_u32(qh_p);
    for (int i = 0; i < 16; ++i) {
        o[i] = d * (static_cast<float>((qs[i] & 15) | (((qh >> i) & 1) << 4)) - offset) + m;
        o[i + 16] = d * (static_cast<float>((qs[i] >> 4) | (((qh >> (i + 16)) & 1) << 4)) - offset) + m;
    }
}
void deq_q5_0(const uint8_t* b, float* o) { deq_q5(b + 2, b + 6, f16_to_f32(load_u16(b)), 0.f, 16.f, o); }
void deq_q5_1(const uint8_t* b, float* o) {
    deq_q5(b + 4, b + 8, f16_to_f32(load_u16(b)), f16_to_f32(load_u16(b + 2)), 0.f, o);
}

void deq_q2_k(const uint8_t* b, float* o) {
    const uint8_t *sc = b, *qs = b + 16;
    const float d = f16_to_f32(load_u16(b + 80)), dmin = f16_to_f32(load_u16(b + 82));
    for (int n = 0; n < 256; ++n) {
        const int h = n / 128, s = (n % 128) / 32, l = n % 32, sub = n / 16;
        const int q = (qs[32 * h + l] >> (2 * s)) & 3;
        o[n] = d * static_cast<float>(sc[sub] & 15) * static_cast<float>(q) - dmin * static_cast<float>(sc[sub] >> 4);
    }
}

void deq_q3_k(const uint8_t* b, float* o) {
    const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
    const float d = f16_to_f32(load_u16(b + 108));
    for (int n = 0; n < 256; ++n) {
        const int h = n / 128, s = (n % 128) / 32, l = n % 32;
        const int q = ((qs[32 * h + l] >> (2 * s)) & 3) - (((hm[l] >> (n / 32)) & 1) ? 0 : 4);
        o[n] = d * static_cast<float>(q3k_scale(sc, n / 16)) * static_cast<float>(q);
    }
}

// q4_k / q5_k: 8 sub-blocks of 32 with 6-bit scales and mins; q5_k adds bit j of qh[l] as bit 4
void deq_q45_k(const uint8_t* b, const uint8_t* qh, const uint8_t* qs, float* o) {
    const float d = f16_to_f32(load_u16(b)), dmin = f16_to_f32(load_u16(b + 2));
    for (int j = 0; j < 8; ++j) {
        int sc, mn;
        kquant_scale_min(b + 4, j, &sc, &mn);
        const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(mn);
        for (int l = 0; l < 32; ++l) {
            int q = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
            if (qh) q |= ((qh[l] >> j) & 1) << 4;
            o[32 * j + l] = dl * static_cast<float>(q) - ml;
        }
    }
}
void deq_q4_k(const uint8_t* b, float* o) { deq_q45_k(b, nullptr, b + 16, o); }
void deq_q5_k(const uint8_t* b, float* o) { deq_q45_k(b, b + 16, b + 48, o); }

void deq_q6_k(const uint8_t* b, float* o) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = f16_to_f32(load_u16(b + 208));
    for (int n = 0; n < 256; ++n) {
        const int g = n / 128, m = n % 128;
        const int lo = (ql[64 * g + m % 64] >> (4 * (m / 64))) & 15;
        const int hi = (qh[32 * g + m % 32] >> (2 * (m / 32))) & 3;
        o[n] = d * static_cast<float>(sc[n / 16]) * static_cast<float>((lo | (hi << 4)) - 32);
    }
}

void deq_iq4_nl(const uint8_t* b, float* o) {
    const float d = f16_to_f32(load_u16(b));
    for (int i = 0; i < 16; ++i) {
        o[i] = d * static_cast<float>(kIq4nlValues[b[2 + i] & 15]);
        o[i + 16] = d * static_cast<float>(kIq4nlValues[b[2 + i] >> 4]);
    }
}

void deq_iq4_xs(const uint8_t* b, float* o) {
    const float d = f16_to_f32(load_u16(b));
    const uint16_t sh = load_u16(b + 2);
    const uint8_t *sl = b + 4, *qs = b + 8;
    for (int j = 0; j < 8; ++j) {
        const int ls = ((sl[j / 2] >> (4 * (j % 2))) & 15) | (((sh >> (2 * j)) & 3) << 4);
        const float dl = d * static_cast<float>(ls - 32);
        for (int i = 0; i < 16; ++i) {
            o[32 * j + i] = dl * static_cast<float>(kIq4nlValues[qs[16 * j + i] & 15]);
            o[32 * j + 16 + i] = dl * static_cast<float>(kIq4nlValues[qs[16 * j + i] >> 4]);
        }
    }
}

void deq_mxfp4(const uint8_t* b, float* o) {
    const float d = e8m0_half(b[0]);
    for (int i = 0; i < 16; ++i) {
        o[i] = static_cast<float>(kE2m1Doubled[b[1 + i] & 15]) * d;
        o[i + 16] = static_cast<float>(kE2m1Doubled[b[1 + i] >> 4]) * d;
    }
}

void deq_fp8(const uint8_t* b, float* o) {
    const float s = load_f32(b);
    for (int i = 0; i < 128; ++i) o[i] = fp8_to_f32(b[4 + i]) * s;
}

void deq_nvfp4(const uint8_t* b, float* o) {
    const float s = 0.5f * kE4m3Table[b[0]];  // the table is e2m1 doubled
    for (int i = 0; i < 8; ++i) {
        o[2 * i] = static_cast<float>(kE2m1Doubled[b[1 + i] & 15]) * s;
        o[2 * i + 1] = static_cast<float>(kE2m1Doubled[b[1 + i] >> 4]) * s;
    }
}

using DeqFn = void (*)(const uint8_t*, float*);
constexpr DeqFn kDeq[kNumQ] = {deq_q8_0, deq_q4_0, deq_q4_1, deq_q5_0, deq_q5_1, deq_q2_k, deq_q3_k, deq_q4_k,
                               deq_q5_k, deq_q6_k, deq_iq4_nl, deq_iq4_xs, deq_mxfp4, deq_fp8, deq_nvfp4};

template <QFmt F>
void gemv(const Mat& m, int64_t r0, int nrows, const void* const* X, int ntok, int K, float* out, size_t ldo) {
    constexpr int B = kQInfo[int(F)].block, kBytes = kQInfo[int(F)].bytes;
    float w[B];
    float acc[kRows][64];  // the driver passes at most 64 tokens
    for (int r = 0; r < nrows; ++r) {
        const uint8_t* row = m.w + (r0 + r) * m.ld;
        for (int t = 0; t < ntok; ++t) acc[r][t] = 0.f;
        for (int b = 0; b < K / B; ++b) {
            kDeq[int(F)](row + b * kBytes, w);
            for (int t = 0; t < ntok; ++t) {
                const float* x = static_cast<const float*>(X[t]) + b * B;
                float s = 0.f;
                for (int i = 0; i < B; ++i) s += w[i] * x[i];
                acc[r][t] += s;
            }
        }
        for (int t = 0; t < ntok; ++t) out[t * ldo + r] = acc[r][t] * m.gs;
    }
}

}  // namespace

void dequant_block(QFmt fmt, const uint8_t* block, float* out) { kDeq[int(fmt)](block, out); }

void register_packed_scalar(GemvFn t[kNumQ]) {
    t[int(QFmt::q8_0)] = gemv<QFmt::q8_0>;
    t[int(QFmt::q4_0)] = gemv<QFmt::q4_0>;
    t[int(QFmt::q4_1)] = gemv<QFmt::q4_1>;
    t[int(QFmt::q5_0)] = gemv<QFmt::q5_0>;
    t[int(QFmt::q5_1)] = gemv<QFmt::q5_1>;
    t[int(QFmt::q2_k)] = gemv<QFmt::q2_k>;
    t[int(QFmt::q3_k)] = gemv<QFmt::q3_k>;
    t[int(QFmt::q4_k)] = gemv<QFmt::q4_k>;
    t[int(QFmt::q5_k)] = gemv<QFmt::q5_k>;
    t[int(QFmt::q6_k)] = gemv<QFmt::q6_k>;
    t[int(QFmt::iq4_nl)] = gemv<QFmt::iq4_nl>;
    t[int(QFmt::iq4_xs)] = gemv<QFmt::iq4_xs>;
    t[int(QFmt::mxfp4)] = gemv<QFmt::mxfp4>;
    t[int(QFmt::fp8)] = gemv<QFmt::fp8>;
    t[int(QFmt::nvfp4)] = gemv<QFmt::nvfp4>;
}

}  // namespace ft
