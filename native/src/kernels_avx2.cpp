// AVX2 + FMA (+F16C) kernels for every weight format: 8 float lanes, tiles of up to 4 weight rows x
// 2 tokens (1 for mxfp4, whose decoded block needs more registers), scalar tails. Same in-register
// widening as the AVX-512 path (see kernels_avx512.cpp).
#include <immintrin.h>

#include "common.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace ft {
namespace {

inline void prefetch(const uint8_t* p) {
    if (g_prefetch_bytes > 0) _mm_prefetch(reinterpret_cast<const char*>(p) + g_prefetch_bytes, _MM_HINT_T0);
}

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

struct Bf16 {
    static constexpr int kBytes = 2;
    static __m256 load(const uint8_t* p) {
        __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
    }
    static float one(const uint8_t* p, int i) { return bf16_to_f32(reinterpret_cast<const uint16_t*>(p)[i]); }
};
struct F32 {
    static constexpr int kBytes = 4;
    static __m256 load(const uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
    static float one(const uint8_t* p, int i) { return reinterpret_cast<const float*>(p)[i]; }
};

template <class L, int R, int TT>
void tile_plain(const Mat& m, int64_t r0, const float* const* X, int K, float* out, size_t ldo) {
    const uint8_t* W[R];
    for (int r = 0; r < R; ++r) W[r] = m.w + (r0 + r) * m.ld;
    __m256 acc[R][TT];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) acc[r][t] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 xv[TT];
        for (int t = 0; t < TT; ++t) xv[t] = _mm256_loadu_ps(X[t] + k);
        for (int r = 0; r < R; ++r) {
            if ((k & 31) == 0) prefetch(W[r] + k * L::kBytes);
            __m256 wv = L::load(W[r] + k * L::kBytes);
            for (int t = 0; t < TT; ++t) acc[r][t] = _mm256_fmadd_ps(wv, xv[t], acc[r][t]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) {
            float s = hsum(acc[r][t]);
            for (int i = k; i < K; ++i) s += L::one(W[r], i) * X[t][i];
            out[t * ldo + r] = s;
        }
}

inline __m256 fp8x8_bits(const uint8_t* p) {  // 8 e4m3 bytes -> 8 floats / 256
    __m128i h = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    __m128i sign = _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x80)), 8);
    __m128i mag = _mm_slli_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7f)), 7);
    return _mm256_cvtph_ps(_mm_or_si128(sign, mag));
}

template <int R, int TT>
void tile_fp8(const Mat& m, int64_t r0, const float* const* X, int K, float* out, size_t ldo) {
    const uint8_t* W[R];
    for (int r = 0; r < R; ++r) W[r] = m.w + (r0 + r) * m.ld;
    const float* srow = m.fs + (r0 / m.bn) * m.fs_ld;
    __m256 acc[R][TT];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) acc[r][t] = _mm256_setzero_ps();
    float tail[R][TT];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) tail[r][t] = 0.f;
    for (int k0 = 0, kb = 0; k0 < K; k0 += m.bk, ++kb) {
        const int k1 = k0 + m.bk < K ? k0 + m.bk : K;
        const __m256 s = _mm256_set1_ps(srow[kb] * 256.0f);
        int k = k0;
        for (; k + 8 <= k1; k += 8) {
            __m256 xv[TT];
            for (int t = 0; t < TT; ++t) xv[t] = _mm256_loadu_ps(X[t] + k);
            for (int r = 0; r < R; ++r) {
                if ((k & 63) == 0) prefetch(W[r] + k);
                __m256 wv = _mm256_mul_ps(fp8x8_bits(W[r] + k), s);
                for (int t = 0; t < TT; ++t) acc[r][t] = _mm256_fmadd_ps(wv, xv[t], acc[r][t]);
            }
        }
        for (; k < k1; ++k)  // last block only (bk % 16 == 0)
            for (int r = 0; r < R; ++r)
                for (int t = 0; t < TT; ++t) tail[r][t] += fp8_to_f32(W[r][k]) * srow[kb] * X[t][k];
    }
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) out[t * ldo + r] = hsum(acc[r][t]) + tail[r][t];
}

template <int R, int TT>
void tile_mxfp4(const Mat& m, int64_t r0, const float* const* X, int K, float* out, size_t ldo) {
    static_assert(TT == 1, "mxfp4 tiles take one token");
    const uint8_t* W[R];
    const uint8_t* E[R];
    for (int r = 0; r < R; ++r) {
        W[r] = m.w + (r0 + r) * m.ld;
        E[r] = m.es + (r0 + r) * m.es_ld;
    }
    const __m256 mag = _mm256_loadu_ps(kFp4Values);  // codes 0..7; bit 3 is the sign
    const __m128i low4 = _mm_set1_epi8(0x0f);
    const __m256i sbit = _mm256_set1_epi32(8);
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    const float* x = X[0];
    for (int kb = 0; kb < K / 32; ++kb) {
        __m256 xv[4];
        for (int g = 0; g < 4; ++g) xv[g] = _mm256_loadu_ps(x + kb * 32 + g * 8);
        for (int r = 0; r < R; ++r) {
            if ((kb & 3) == 0) prefetch(W[r] + kb * 16);
            const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(W[r] + kb * 16));
            const __m128i lo = _mm_and_si128(b, low4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
            const __m128i n0 = _mm_unpacklo_epi8(lo, hi), n1 = _mm_unpackhi_epi8(lo, hi);
            const __m128i parts[4] = {n0, _mm_srli_si128(n0, 8), n1, _mm_srli_si128(n1, 8)};
            const __m256 s = _mm256_set1_ps(kE8m0Scale[E[r][kb]]);
            for (int g = 0; g < 4; ++g) {
                const __m256i idx = _mm256_cvtepu8_epi32(parts[g]);
                __m256 v = _mm256_permutevar8x32_ps(mag, idx);  // uses idx & 7
                v = _mm256_xor_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(idx, sbit), 28)));
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(v, s), xv[g], acc[r]);
            }
        }
    }
    for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

using TileFn = void (*)(const Mat&, int64_t, const float* const*, int, float*, size_t);

template <template <int, int> class Tile, int TMAX>
void gemv_tiles(const Mat& m, int64_t r0, int nrows, const void* const* Xv, int ntok, int K, float* out, size_t ldo) {
    static const TileFn big[4] = {Tile<1, TMAX>::run, Tile<2, TMAX>::run, Tile<3, TMAX>::run, Tile<4, TMAX>::run};
    static const TileFn one[4] = {Tile<1, 1>::run, Tile<2, 1>::run, Tile<3, 1>::run, Tile<4, 1>::run};
    auto X = reinterpret_cast<const float* const*>(Xv);
    int t = 0;
    for (; t + TMAX <= ntok; t += TMAX) big[nrows - 1](m, r0, X + t, K, out + t * ldo, ldo);
    for (; t < ntok; ++t) one[nrows - 1](m, r0, X + t, K, out + t * ldo, ldo);
}

template <int R, int TT> struct Bf16Tile { static void run(const Mat& m, int64_t r0, const float* const* X, int K, float* o, size_t l) { tile_plain<Bf16, R, TT>(m, r0, X, K, o, l); } };
template <int R, int TT> struct F32Tile { static void run(const Mat& m, int64_t r0, const float* const* X, int K, float* o, size_t l) { tile_plain<F32, R, TT>(m, r0, X, K, o, l); } };
template <int R, int TT> struct Fp8Tile { static void run(const Mat& m, int64_t r0, const float* const* X, int K, float* o, size_t l) { tile_fp8<R, TT>(m, r0, X, K, o, l); } };
template <int R, int TT> struct Mx4Tile { static void run(const Mat& m, int64_t r0, const float* const* X, int K, float* o, size_t l) { tile_mxfp4<R, TT>(m, r0, X, K, o, l); } };

}  // namespace

void register_avx2(GemvFn table[kNumFmts]) {
    table[int(Fmt::bf16)] = gemv_tiles<Bf16Tile, 2>;
    table[int(Fmt::f32)] = gemv_tiles<F32Tile, 2>;
    table[int(Fmt::fp8)] = gemv_tiles<Fp8Tile, 2>;
    table[int(Fmt::mxfp4)] = gemv_tiles<Mx4Tile, 1>;
}

}  // namespace ft

#pragma GCC pop_options
#else
namespace ft {
void register_avx2(GemvFn*) {}
}  // namespace ft
#endif
