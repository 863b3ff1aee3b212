// Scalar kernels: the portable fallback and the definition the SIMD paths are tested against
// (besides the float64 reference in the tests). Also owns the decode tables.
#include <cmath>

#include "common.h"

namespace ft {

const float kFp4Values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                              -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

float kE8m0Scale[256];
int g_prefetch_bytes = 1024;
int g_chunk_rows = 16;

namespace {
struct FillE8m0 {
    FillE8m0() {
        for (int i = 0; i < 255; ++i) kE8m0Scale[i] = std::ldexp(1.0f, i - 127);
        kE8m0Scale[255] = __builtin_nanf("");
    }
} fill_e8m0;
}  // namespace

namespace {

inline float dot_bf16(const uint8_t* w, const float* x, int K) {
    const uint16_t* p = reinterpret_cast<const uint16_t*>(w);
    float acc = 0.f;
    for (int i = 0; i < K; ++i) acc += bf16_to_f32(p[i]) * x[i];
    return acc;
}

inline float dot_f32(const uint8_t* w, const float* x, int K) {
    const float* p = reinterpret_cast<const float*>(w);
    float acc = 0.f;
    for (int i = 0; i < K; ++i) acc += p[i] * x[i];
    return acc;
}

void gemv_simple(const Mat& m, int64_t r0, int nrows, const void* const* X, int ntok, int K, float* out, size_t ldo,
                 float (*dot)(const uint8_t*, const float*, int)) {
    for (int r = 0; r < nrows; ++r)
        for (int t = 0; t < ntok; ++t)
            out[t * ldo + r] = dot(m.w + (r0 + r) * m.ld, static_cast<const float*>(X[t]), K);
}

void gemv_bf16(const Mat& m, int64_t r0, int nrows, const void* const* X, int ntok, int K, float* out, size_t ldo) {
    gemv_simple(m, r0, nrows, X, ntok, K, out, ldo, dot_bf16);
}

void gemv_f32(const Mat& m, int64_t r0, int nrows, const void* const* X, int ntok, int K, float* out, size_t ldo) {
    gemv_simple(m, r0, nrows, X, ntok, K, out, ldo, dot_f32);
}

void gemv_fp8(const Mat& m, int64_t r0, int nrows, const void* const* X, int ntok, int K, float* out, size_t ldo) {
    for (int r = 0; r < nrows; ++r) {
        const uint8_t* w = m.w + (r0 + r) * m.ld;
        const float* srow = m.fs + ((r0 + r) / m.bn) * m.fs_ld;
        for (int t = 0; t < ntok; ++t) {
            const float* x = static_cast<const float*>(X[t]);
            float acc = 0.f;
            for (int k0 = 0, kb = 0; k0 < K; k0 += m.bk, ++kb) {
                const int k1 = k0 + m.bk < K ? k0 + m.bk : K;
                float blk = 0.f;
                for (int i = k0; i < k1; ++i) blk += fp8_to_f32(w[i]) * x[i];
                acc += blk * srow[kb];
            }
            out[t * ldo + r] = acc;
        }
    }
}

void gemv_mxfp4(const Mat& m, int64_t r0, int nrows, const void* const* X, int ntok, int K, float* out,
                size_t ldo) {
    for (int r = 0; r < nrows; ++r) {
        const uint8_t* w = m.w + (r0 + r) * m.ld;
        const uint8_t* es = m.es + (r0 + r) * m.es_ld;
        for (int t = 0; t < ntok; ++t) {
            const float* x = static_cast<const float*>(X[t]);
            float acc = 0.f;
            for (int kb = 0; kb < K / 32; ++kb) {
                float blk = 0.f;
                for (int i = 0; i < 16; ++i) {
                    const uint8_t b = w[kb * 16 + i];
                    blk += kFp4Values[b & 15] * x[kb * 32 + 2 * i] + kFp4Values[b >> 4] * x[kb * 32 + 2 * i + 1];
                }
                acc += blk * kE8m0Scale[es[kb]];
            }
            out[t * ldo + r] = acc;
        }
    }
}

}  // namespace

void register_scalar(GemvFn table[kNumFmts]) {
    table[int(Fmt::bf16)] = gemv_bf16;
    table[int(Fmt::f32)] = gemv_f32;
    table[int(Fmt::fp8)] = gemv_fp8;
    table[int(Fmt::mxfp4)] = gemv_mxfp4;
}

}  // namespace ft
