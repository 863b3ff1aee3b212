// AVX-512-BF16 kernels for the packed formats: vdpbf16ps multiplies 32 codes by 32 activations an
// instruction. Each sub-block's 32 codes become 32 exact bf16 values: in one permute (vpermt2w: a
// code c in [-32, 32) indexes the bf16 of c at c & 63; iq4's nibbles index its value table), or for
// fp8 widened as the float kernels do (value / 256, the factor in its scale) and packed to bf16.
// The group scale is applied once per 32 products (acc += d * dot), the offsets once per block per
// row (acc += m . the activations' group sums). The activations arrive split into bf16 pieces whose
// sum is exact (act_split.h): one piece for a bf16 row, three for a float32 one, so every product
// is exact and the result is a float32 dot product of the same values in another order of
// additions. q8_0 (8-bit codes: no cheaper this way) and nvfp4 (16-value blocks) keep the AVX-512F
// float kernels (packed.h: packed_split_format).
#include "act_split.h"
#include "avx512_target.h"
#include "packed.h"

#if defined(__x86_64__)
FT_AVX512_BEGIN("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")

namespace ft {
namespace {

#include "packed_formats_simd.h"

constexpr uint16_t bf16_of_int(int c) {  // exact for |c| < 256
    if (c == 0) return 0;
    const int a = c < 0 ? -c : c;
    int e = 0;
    while ((a >> (e + 1)) != 0) ++e;
    return static_cast<uint16_t>((c < 0 ? 0x8000 : 0) | ((127 + e) << 7) | ((a << (7 - e)) & 0x7f));
}

struct CodeTable {
    alignas(64) uint16_t w[64];
};
constexpr CodeTable make_table(bool iq4) {
    CodeTable t{};
    for (int i = 0; i < 64; ++i)
        t.w[i] = iq4 ? (i < 16 ? bf16_of_int(kIq4nlValues[i]) : 0) : bf16_of_int(i < 32 ? i : i - 64);
    return t;
}
constexpr CodeTable kIntCodes = make_table(false), kIq4Codes = make_table(true);

template <class Q>
constexpr bool kIq4 = Q::kFmt == QFmt::iq4_nl || Q::kFmt == QFmt::iq4_xs;

// The table indices of sub-block j: the int8 codes, or iq4's nibbles (before its value table).
template <class Q>
inline void indices(const uint8_t* b, int j, __m128i* q) {
    if constexpr (Q::kFmt == QFmt::iq4_nl) {
        const __m128i v = ld16(b + 2);
        q[0] = low4(v), q[1] = high4(v);
    } else if constexpr (Q::kFmt == QFmt::iq4_xs) {
        const __m128i v = ld16(b + 8 + 16 * j);
        q[0] = low4(v), q[1] = high4(v);
    } else {
        Q::codes(b, j, q);
    }
}

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

template <class Q>
inline __m512i bf16_codes(const uint8_t* b, int j, __m512i lo, __m512i hi) {
    if constexpr (Q::kFmt == QFmt::fp8) {  // e4m3 bits as an fp16 pattern (value / 256, exact), then bf16 (exact)
        const __m512i h = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 4 + 32 * j)));
        const __m512i f16 = _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(h, _mm512_set1_epi16(0x80)), 8),
                                            _mm512_slli_epi16(_mm512_and_si512(h, _mm512_set1_epi16(0x7f)), 7));
        const __m512bh c = _mm512_cvtne2ps_pbh(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(f16, 1)),
                                               _mm512_cvtph_ps(_mm512_castsi512_si256(f16)));
        return reinterpret_cast<const __m512i&>(c);
    } else {
        __m128i q[2];
        indices<Q>(b, j, q);
        return _mm512_permutex2var_epi16(lo, _mm512_cvtepi8_epi16(_mm256_set_m128i(q[1], q[0])), hi);
    }
}

constexpr int kPfTiles = 2;  // prefetch distance in tiles, as the float kernels (kernels_packed_simd.h)

// R rows x TT tokens, NP activation pieces per token.
template <class Q, int R, int TT, int NP>
void tile(const Mat& m, int64_t r0, const void* const* X, int K, float* out, size_t ldo) {
    constexpr int B = kQInfo[int(Q::kFmt)].block, kBytes = kQInfo[int(Q::kFmt)].bytes, G = Q::kGroup, NG = B / G;
    static_assert(B % 32 == 0 && (G == 16 || G % 32 == 0) && NG <= 16, "32-value sub-blocks, 16 groups a block at most");
    constexpr int kPfEvery = kBytes >= 64 ? 1 : 64 / kBytes;
    const CodeTable& table = kIq4<Q> ? kIq4Codes : kIntCodes;
    const __m512i lo = _mm512_load_si512(table.w), hi = _mm512_load_si512(table.w + 32);
    SplitRow x[TT];
    for (int t = 0; t < TT; ++t) x[t] = split_view(X[t], K);
    const uint8_t* W[R];
    for (int r = 0; r < R; ++r) W[r] = m.w + (r0 + r) * m.ld;
    const size_t ahead = kPfTiles * R * m.ld;
    __m512 acc[R][TT], off[R][TT];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) acc[r][t] = off[r][t] = _mm512_setzero_ps();
    float ds[R][NG], ms[R][NG];
    const int nb = K / B;
    for (int b = 0; b < nb; ++b) {
        if (b % kPfEvery == 0)
            for (int r = 0; r < R; ++r)
                for (int o = 0; o < kBytes && g_prefetch_bytes > 0; o += 64)
                    _mm_prefetch(reinterpret_cast<const char*>(W[r] + ahead + b * kBytes + o), _MM_HINT_T0);
        for (int r = 0; r < R; ++r) Q::scales(W[r] + b * kBytes, ds[r], ms[r]);
#pragma GCC unroll 8
        for (int j = 0; j < B / 32; ++j) {
            const int k0 = b * B + 32 * j;
            __m512i xv[TT][NP];
            for (int t = 0; t < TT; ++t)
                for (int p = 0; p < NP; ++p) xv[t][p] = _mm512_loadu_si512(x[t].p[p] + k0);
            for (int r = 0; r < R; ++r) {
                const __m512i c = bf16_codes<Q>(W[r] + b * kBytes, j, lo, hi);
                // a lane holds the products of 2 neighbouring values: lanes 0-7 are values 0-15
                const __m512 d = G == 16 ? _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(ds[r][2 * j]), _mm512_set1_ps(ds[r][2 * j + 1]))
                                         : _mm512_set1_ps(ds[r][32 * j / G]);
                for (int t = 0; t < TT; ++t) {
                    __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), as_bh(c), as_bh(xv[t][0]));
                    for (int p = 1; p < NP; ++p) dot = _mm512_dpbf16_ps(dot, as_bh(c), as_bh(xv[t][p]));
                    acc[r][t] = _mm512_fmadd_ps(dot, d, acc[r][t]);
                }
            }
        }
        if constexpr (Q::kOffset) {  // sum over the block's groups of m * (sum of the group's activations)
            constexpr __mmask16 kGroups = static_cast<__mmask16>((1u << NG) - 1u);
            for (int t = 0; t < TT; ++t) {
                const __m512 sx = _mm512_maskz_loadu_ps(kGroups, (G == 16 ? x[t].s16 : x[t].s32) + b * NG);
                for (int r = 0; r < R; ++r) off[r][t] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(kGroups, ms[r]), sx, off[r][t]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) out[t * ldo + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][t], off[r][t])) * m.gs;
}

using TileFn = void (*)(const Mat&, int64_t, const void* const*, int, float*, size_t);

// Rows 1..4 x tokens in tiles of 4, then one at a time; three pieces where any token of the tile
// has them.
template <class Q>
void gemv(const Mat& m, int64_t r0, int nrows, const void* const* X, int ntok, int K, float* out, size_t ldo) {
    static const TileFn big[2][4] = {{tile<Q, 1, 4, 1>, tile<Q, 2, 4, 1>, tile<Q, 3, 4, 1>, tile<Q, 4, 4, 1>},
                                     {tile<Q, 1, 4, 3>, tile<Q, 2, 4, 3>, tile<Q, 3, 4, 3>, tile<Q, 4, 4, 3>}};
    static const TileFn one[2][4] = {{tile<Q, 1, 1, 1>, tile<Q, 2, 1, 1>, tile<Q, 3, 1, 1>, tile<Q, 4, 1, 1>},
                                     {tile<Q, 1, 1, 3>, tile<Q, 2, 1, 3>, tile<Q, 3, 1, 3>, tile<Q, 4, 1, 3>}};
    auto three = [&](int t0, int n) {
        for (int t = t0; t < t0 + n; ++t)
            if (split_view(X[t], K).pieces > 1) return 1;
        return 0;
    };
    int t = 0;
    for (; t + 4 <= ntok; t += 4) big[three(t, 4)][nrows - 1](m, r0, X + t, K, out + t * ldo, ldo);
    for (; t < ntok; ++t) one[three(t, 1)][nrows - 1](m, r0, X + t, K, out + t * ldo, ldo);
}

}  // namespace

// called only where the CPU has avx512bf16 (moe_packed.cpp): the fill may use its instructions
void register_packed_avx512bf16(GemvFn table[kNumQ]) {
    table[int(QFmt::q4_0)] = gemv<DQ4_0>;
    table[int(QFmt::q4_1)] = gemv<DQ4_1>;
    table[int(QFmt::q5_0)] = gemv<DQ5_0>;
    table[int(QFmt::q5_1)] = gemv<DQ5_1>;
    table[int(QFmt::q2_k)] = gemv<DQ2_K>;
    table[int(QFmt::q3_k)] = gemv<DQ3_K>;
    table[int(QFmt::q4_k)] = gemv<DQ4_K>;
    table[int(QFmt::q5_k)] = gemv<DQ5_K>;
    table[int(QFmt::q6_k)] = gemv<DQ6_K>;
    table[int(QFmt::iq4_nl)] = gemv<DIQ4_NL>;
    table[int(QFmt::iq4_xs)] = gemv<DIQ4_XS>;
    table[int(QFmt::mxfp4)] = gemv<DMXFP4>;
    table[int(QFmt::fp8)] = gemv<DFP8>;
}

}  // namespace ft

FT_AVX512_END
#else
namespace ft {
void register_packed_avx512bf16(GemvFn*) {}
}  // namespace ft
#endif
