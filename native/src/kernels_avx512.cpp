// AVX-512F (+BW/VL for masked byte/word loads, F16C-style cvtph) kernels for every weight format:
// 16 float lanes, tiles of up to 4 weight rows x 4 tokens, so each weight vector is loaded once and
// used for all tokens of the tile. Weights are widened to float32 in registers (bf16: shift;
// fp8: bytes -> fp16 bit pattern -> cvtph, the 2^8 exponent-bias difference folded into the block
// scale; mxfp4: nibbles -> permutexvar lookup), never to a temporary copy.
#include "avx512_target.h"

#include "common.h"

#if defined(__x86_64__)
FT_AVX512_BEGIN("avx512f,avx512bw,avx512vl,avx2,fma,f16c")

namespace ft {
namespace {

inline void prefetch(const uint8_t* p) {
    if (g_prefetch_bytes > 0) _mm_prefetch(reinterpret_cast<const char*>(p) + g_prefetch_bytes, _MM_HINT_T0);
}

inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

inline __m512 bf16x16(const uint8_t* p) {
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline __m512 bf16x16_mask(const uint8_t* p, __mmask16 m) {
    __m256i v = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
// 16 e4m3 bytes -> 16 floats / 256 (exact: an e4m3 pattern shifted into fp16 has exponent bias 15, not 7)
inline __m512 fp8x16_bits(__m128i b) {
    __m256i h = _mm256_cvtepu8_epi16(b);
    __m256i sign = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x80)), 8);
    __m256i mag = _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x7f)), 7);
    return _mm512_cvtph_ps(_mm256_or_si256(sign, mag));
}

struct Bf16 {
    static constexpr int kBytes = 2;
    static __m512 load(const uint8_t* p) { return bf16x16(p); }
    static __m512 load_mask(const uint8_t* p, __mmask16 m) { return bf16x16_mask(p, m); }
};
struct F32 {
    static constexpr int kBytes = 4;
    static __m512 load(const uint8_t* p) { return _mm512_loadu_ps(p); }
    static __m512 load_mask(const uint8_t* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
};

// bf16 / f32: plain elementwise formats
template <class L, int R, int TT>
void tile_plain(const Mat& m, int64_t r0, const float* const* X, int K, float* out, size_t ldo) {
    const uint8_t* W[R];
    for (int r = 0; r < R; ++r) W[r] = m.w + (r0 + r) * m.ld;
    __m512 acc[R][TT];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 xv[TT];
        for (int t = 0; t < TT; ++t) xv[t] = _mm512_loadu_ps(X[t] + k);
        for (int r = 0; r < R; ++r) {
            if ((k & 31) == 0) prefetch(W[r] + k * L::kBytes);
            __m512 wv = L::load(W[r] + k * L::kBytes);
            for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
        }
    }
    if (k < K) {
        const __mmask16 mk = static_cast<__mmask16>((1u << (K - k)) - 1u);
        __m512 xv[TT];
        for (int t = 0; t < TT; ++t) xv[t] = _mm512_maskz_loadu_ps(mk, X[t] + k);
        for (int r = 0; r < R; ++r) {
            __m512 wv = L::load_mask(W[r] + k * L::kBytes, mk);
            for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) out[t * ldo + r] = hsum(acc[r][t]);
}

// fp8 e4m3 with [bn, bk] block scales; all R rows of a tile share one block row (bn % 4 == 0)
template <int R, int TT>
void tile_fp8(const Mat& m, int64_t r0, const float* const* X, int K, float* out, size_t ldo) {
    const uint8_t* W[R];
    for (int r = 0; r < R; ++r) W[r] = m.w + (r0 + r) * m.ld;
    const float* srow = m.fs + (r0 / m.bn) * m.fs_ld;
    __m512 acc[R][TT];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
    for (int k0 = 0, kb = 0; k0 < K; k0 += m.bk, ++kb) {
        const int k1 = k0 + m.bk < K ? k0 + m.bk : K;
        const __m512 s = _mm512_set1_ps(srow[kb] * 256.0f);
        int k = k0;
        for (; k + 16 <= k1; k += 16) {
            __m512 xv[TT];
            for (int t = 0; t < TT; ++t) xv[t] = _mm512_loadu_ps(X[t] + k);
            for (int r = 0; r < R; ++r) {
                if ((k & 63) == 0) prefetch(W[r] + k);
                __m512 wv = _mm512_mul_ps(fp8x16_bits(_mm_loadu_si128(reinterpret_cast<const __m128i*>(W[r] + k))), s);
                for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
            }
        }
        if (k < k1) {  // only in the last block: bk % 16 == 0
            const __mmask16 mk = static_cast<__mmask16>((1u << (k1 - k)) - 1u);
            __m512 xv[TT];
            for (int t = 0; t < TT; ++t) xv[t] = _mm512_maskz_loadu_ps(mk, X[t] + k);
            for (int r = 0; r < R; ++r) {
                __m512 wv = _mm512_mul_ps(fp8x16_bits(_mm_maskz_loadu_epi8(mk, W[r] + k)), s);
                for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) out[t * ldo + r] = hsum(acc[r][t]);
}

// mxfp4: per row, blocks of 32 e2m1 values (16 bytes) with one e8m0 scale; K % 32 == 0
template <int R, int TT>
void tile_mxfp4(const Mat& m, int64_t r0, const float* const* X, int K, float* out, size_t ldo) {
    const uint8_t* W[R];
    const uint8_t* E[R];
    for (int r = 0; r < R; ++r) {
        W[r] = m.w + (r0 + r) * m.ld;
        E[r] = m.es + (r0 + r) * m.es_ld;
    }
    const __m512 table = _mm512_loadu_ps(kFp4Values);
    const __m128i low4 = _mm_set1_epi8(0x0f);
    __m512 acc[R][TT];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
    for (int kb = 0; kb < K / 32; ++kb) {
        __m512 x0[TT], x1[TT];
        for (int t = 0; t < TT; ++t) {
            x0[t] = _mm512_loadu_ps(X[t] + kb * 32);
            x1[t] = _mm512_loadu_ps(X[t] + kb * 32 + 16);
        }
        for (int r = 0; r < R; ++r) {
            if ((kb & 3) == 0) prefetch(W[r] + kb * 16);
            const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(W[r] + kb * 16));
            const __m128i lo = _mm_and_si128(b, low4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
            const __m512 s = _mm512_set1_ps(kE8m0Scale[E[r][kb]]);
            const __m512 w0 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), table), s);
            const __m512 w1 = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)), table), s);
            for (int t = 0; t < TT; ++t) {
                acc[r][t] = _mm512_fmadd_ps(w0, x0[t], acc[r][t]);
                acc[r][t] = _mm512_fmadd_ps(w1, x1[t], acc[r][t]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) out[t * ldo + r] = hsum(acc[r][t]);
}

using TileFn = void (*)(const Mat&, int64_t, const float* const*, int, float*, size_t);

// rows x tokens dispatch shared by all formats: tokens in tiles of 4, then the remainder
template <template <int, int> class Tile>
void gemv_tiles(const Mat& m, int64_t r0, int nrows, const void* const* Xv, int ntok, int K, float* out, size_t ldo) {
    static const TileFn fns[4][4] = {
        {Tile<1, 1>::run, Tile<1, 2>::run, Tile<1, 3>::run, Tile<1, 4>::run},
        {Tile<2, 1>::run, Tile<2, 2>::run, Tile<2, 3>::run, Tile<2, 4>::run},
        {Tile<3, 1>::run, Tile<3, 2>::run, Tile<3, 3>::run, Tile<3, 4>::run},
        {Tile<4, 1>::run, Tile<4, 2>::run, Tile<4, 3>::run, Tile<4, 4>::run},
    };
    auto X = reinterpret_cast<const float* const*>(Xv);
    for (int t = 0; t < ntok; t += 4) {
        const int tt = ntok - t < 4 ? ntok - t : 4;
        fns[nrows - 1][tt - 1](m, r0, X + t, K, out + t * ldo, ldo);
    }
}

template <int R, int TT> struct Bf16Tile { static void run(const Mat& m, int64_t r0, const float* const* X, int K, float* o, size_t l) { tile_plain<Bf16, R, TT>(m, r0, X, K, o, l); } };
template <int R, int TT> struct F32Tile { static void run(const Mat& m, int64_t r0, const float* const* X, int K, float* o, size_t l) { tile_plain<F32, R, TT>(m, r0, X, K, o, l); } };
template <int R, int TT> struct Fp8Tile { static void run(const Mat& m, int64_t r0, const float* const* X, int K, float* o, size_t l) { tile_fp8<R, TT>(m, r0, X, K, o, l); } };
template <int R, int TT> struct Mx4Tile { static void run(const Mat& m, int64_t r0, const float* const* X, int K, float* o, size_t l) { tile_mxfp4<R, TT>(m, r0, X, K, o, l); } };

}  // namespace

void register_avx512(GemvFn table[kNumFmts]) {
    table[int(Fmt::bf16)] = gemv_tiles<Bf16Tile>;
    table[int(Fmt::f32)] = gemv_tiles<F32Tile>;
    table[int(Fmt::fp8)] = gemv_tiles<Fp8Tile>;
    table[int(Fmt::mxfp4)] = gemv_tiles<Mx4Tile>;
}

}  // namespace ft

FT_AVX512_END
#else
namespace ft {
void register_avx512(GemvFn*) {}
}  // namespace ft
#endif
