// The SIMD kernels of the packed formats, written once over the vector width: included by
// kernels_packed_avx2.cpp (V = 8 float lanes) and kernels_packed_avx512.cpp (V = 16 lanes), each
// inside its own `#pragma GCC target` region and anonymous namespace (internal linkage, so the
// linker cannot merge an AVX-512 instantiation into the AVX2 path). No include guard, no includes:
// it needs <immintrin.h>, packed.h and, from the includer, a struct V with
//   W (lanes), TMAX (tokens per tile), F (float vector), zero(), set1(f), load(const float*),
//   fmadd(a, b, c) = a * b + c, mul(a, b), hsum(F), i8(__m128i q, int off) (int8 lanes
//   [off, off + W) of q as floats; off a multiple of W below 16), fp8(p) (W e4m3 bytes at p, as
//   floats / 256), and prefetch(p) (p itself, when software prefetch is on).
//
// Per block and row, the scales of every group of values are decoded once (value = code * d + m);
// then the block is decoded in sub-blocks of S values (32; nvfp4: its 16) straight into registers:
// the byte work (nibbles, high bits, code tables) in 128-bit registers shared by both widths gives
// int8 codes, widened to S / W float vectors, scaled, and multiplied into the accumulators of R
// rows x TT tokens. fp8 has no int8 form: its sub-blocks are widened from the e4m3 bits directly.
// Prefetch: a tile reads its R consecutive rows side by side, and the next tiles read the rows that
// follow, so each block is prefetched kPfTiles tiles ahead (the same block of the rows kPfTiles * R
// further on): a fixed distance along the row would land in the tile's own next row once rows are
// shorter than it, as expert rows of 2-4k values in 4-bit formats are.

#include "packed_formats_simd.h"

template <class Q>
constexpr int sub_size() { return kQInfo[int(Q::kFmt)].block < 32 ? kQInfo[int(Q::kFmt)].block : 32; }

// Sub-block j of the block at b as S / W float vectors, with the block's group scales d, m.
template <class Q>
inline void decode_floats(const uint8_t* b, int j, const float* d, const float* m, typename V::F* w) {
    constexpr int S = sub_size<Q>();
    if constexpr (Q::kFmt == QFmt::fp8) {
        const typename V::F s = V::set1(d[0]);
        for (int v = 0; v < S / V::W; ++v) w[v] = V::mul(V::fp8(b + 4 + 32 * j + v * V::W), s);
    } else {
        __m128i q[2];
        Q::codes(b, j, q);
        for (int v = 0; v < S / V::W; ++v) {
            const int e = v * V::W, g = (j * S + e) / Q::kGroup;
            const typename V::F f = V::i8(q[e / 16], e % 16);
            w[v] = Q::kOffset ? V::fmadd(f, V::set1(d[g]), V::set1(m[g])) : V::mul(f, V::set1(d[g]));
        }
    }
}

constexpr int kPfTiles = 2;  // prefetch distance, in tiles (see the top of this file)

// R rows x TT tokens: each decoded vector is used for every token of the tile.
template <class Q, int R, int TT>
void tile(const Mat& m, int64_t r0, const float* const* X, int K, float* out, size_t ldo) {
    constexpr int B = kQInfo[int(Q::kFmt)].block, kBytes = kQInfo[int(Q::kFmt)].bytes, S = sub_size<Q>();
    constexpr int NV = S / V::W, kPfEvery = kBytes >= 64 ? 1 : 64 / kBytes;  // one prefetch per <= 64 bytes
    const uint8_t* W[R];
    for (int r = 0; r < R; ++r) W[r] = m.w + (r0 + r) * m.ld;
    const size_t ahead = kPfTiles * R * m.ld;
    typename V::F acc[R][TT];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) acc[r][t] = V::zero();
    constexpr int NG = B / Q::kGroup;
    float ds[R][NG], ms[R][NG];  // group scales and offsets of the current block, per row
    const int nb = K / B;
    for (int b = 0; b < nb; ++b) {
        if (b % kPfEvery == 0)
            for (int r = 0; r < R; ++r)
                for (int o = 0; o < kBytes; o += 64) V::prefetch(W[r] + ahead + b * kBytes + o);
        for (int r = 0; r < R; ++r) Q::scales(W[r] + b * kBytes, ds[r], ms[r]);
#pragma GCC unroll 8
        for (int j = 0; j < B / S; ++j) {  // unrolled: j's shifts, masks and scale indices become constants
            const int k0 = b * B + j * S;
            for (int r = 0; r < R; ++r) {
                typename V::F w[NV];
                decode_floats<Q>(W[r] + b * kBytes, j, ds[r], ms[r], w);
                for (int t = 0; t < TT; ++t)
                    for (int v = 0; v < NV; ++v) acc[r][t] = V::fmadd(w[v], V::load(X[t] + k0 + v * V::W), acc[r][t]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) out[t * ldo + r] = V::hsum(acc[r][t]) * m.gs;
}

using PackedTileFn = void (*)(const Mat&, int64_t, const float* const*, int, float*, size_t);

// Rows 1..4 x tokens in tiles of TMAX, then one at a time.
template <class Q>
void gemv(const Mat& m, int64_t r0, int nrows, const void* const* Xv, int ntok, int K, float* out, size_t ldo) {
    static const PackedTileFn big[4] = {tile<Q, 1, V::TMAX>, tile<Q, 2, V::TMAX>, tile<Q, 3, V::TMAX>, tile<Q, 4, V::TMAX>};
    static const PackedTileFn one[4] = {tile<Q, 1, 1>, tile<Q, 2, 1>, tile<Q, 3, 1>, tile<Q, 4, 1>};
    auto X = reinterpret_cast<const float* const*>(Xv);
    int t = 0;
    for (; t + V::TMAX <= ntok; t += V::TMAX) big[nrows - 1](m, r0, X + t, K, out + t * ldo, ldo);
    for (; t < ntok; ++t) one[nrows - 1](m, r0, X + t, K, out + t * ldo, ldo);
}

inline void fill_table(GemvFn t[kNumQ]) {
    t[int(QFmt::q8_0)] = gemv<DQ8_0>;
    t[int(QFmt::q4_0)] = gemv<DQ4_0>;
    t[int(QFmt::q4_1)] = gemv<DQ4_1>;
    t[int(QFmt::q5_0)] = gemv<DQ5_0>;
    t[int(QFmt::q5_1)] = gemv<DQ5_1>;
    t[int(QFmt::q2_k)] = gemv<DQ2_K>;
    t[int(QFmt::q3_k)] = gemv<DQ3_K>;
    t[int(QFmt::q4_k)] = gemv<DQ4_K>;
    t[int(QFmt::q5_k)] = gemv<DQ5_K>;
    t[int(QFmt::q6_k)] = gemv<DQ6_K>;
    t[int(QFmt::iq4_nl)] = gemv<DIQ4_NL>;
    t[int(QFmt::iq4_xs)] = gemv<DIQ4_XS>;
    t[int(QFmt::mxfp4)] = gemv<DMXFP4>;
    t[int(QFmt::fp8)] = gemv<DFP8>;
    t[int(QFmt::nvfp4)] = gemv<DNVFP4>;
}
