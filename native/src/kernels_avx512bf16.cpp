// AVX-512-BF16 kernel for bf16 weights: vdpbf16ps on bf16 weights x bf16 activations, 32 elements
// per instruction (the layer rounds x and the hidden activations to bf16 for this path). Other
// formats on this ISA use the AVX-512F kernels (moe_layer.cpp decides).
#include "avx512_target.h"

#include "common.h"

#if defined(__x86_64__)
FT_AVX512_BEGIN("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")

namespace ft {
namespace {

inline void prefetch(const uint8_t* p) {
    if (g_prefetch_bytes > 0) _mm_prefetch(reinterpret_cast<const char*>(p) + g_prefetch_bytes, _MM_HINT_T0);
}
inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }

template <int R, int TT>
void tile(const Mat& m, int64_t r0, const uint16_t* const* X, int K, float* out, size_t ldo) {
    const uint8_t* W[R];
    for (int r = 0; r < R; ++r) W[r] = m.w + (r0 + r) * m.ld;
    __m512 acc[R][TT];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512i xv[TT];
        for (int t = 0; t < TT; ++t) xv[t] = _mm512_loadu_si512(X[t] + k);
        for (int r = 0; r < R; ++r) {
            prefetch(W[r] + 2 * k);
            __m512i wv = _mm512_loadu_si512(W[r] + 2 * k);
            for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], as_bh(wv), as_bh(xv[t]));
        }
    }
    if (k < K) {
        const __mmask32 mk = static_cast<__mmask32>((1ull << (K - k)) - 1ull);
        __m512i xv[TT];
        for (int t = 0; t < TT; ++t) xv[t] = _mm512_maskz_loadu_epi16(mk, X[t] + k);
        for (int r = 0; r < R; ++r) {
            __m512i wv = _mm512_maskz_loadu_epi16(mk, W[r] + 2 * k);
            for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], as_bh(wv), as_bh(xv[t]));
        }
    }
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) out[t * ldo + r] = _mm512_reduce_add_ps(acc[r][t]);
}

using TileFn = void (*)(const Mat&, int64_t, const uint16_t* const*, int, float*, size_t);

void gemv(const Mat& m, int64_t r0, int nrows, const void* const* Xv, int ntok, int K, float* out, size_t ldo) {
    static const TileFn fns[4][4] = {
        {tile<1, 1>, tile<1, 2>, tile<1, 3>, tile<1, 4>},
        {tile<2, 1>, tile<2, 2>, tile<2, 3>, tile<2, 4>},
        {tile<3, 1>, tile<3, 2>, tile<3, 3>, tile<3, 4>},
        {tile<4, 1>, tile<4, 2>, tile<4, 3>, tile<4, 4>},
    };
    auto X = reinterpret_cast<const uint16_t* const*>(Xv);
    for (int t = 0; t < ntok; t += 4) {
        const int tt = ntok - t < 4 ? ntok - t : 4;
        fns[nrows - 1][tt - 1](m, r0, X + t, K, out + t * ldo, ldo);
    }
}

}  // namespace

void register_avx512bf16(GemvFn table[kNumFmts]) { table[int(Fmt::bf16)] = gemv; }

}  // namespace ft

FT_AVX512_END
#else
namespace ft {
void register_avx512bf16(GemvFn*) {}
}  // namespace ft
#endif
