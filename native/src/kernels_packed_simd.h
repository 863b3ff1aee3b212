// The SIMD kernels of the packed formats, written once over the vector width: included by
// kernels_packed_avx2.cpp (V = 8 float lanes) and kernels_packed_avx512.cpp (V = 16 lanes), each
// inside its own `#pragma GCC target` region and anonymous namespace (internal linkage, so the
// linker cannot merge an AVX-512 instantiation into the AVX2 path). No include guard, no includes:
// it needs <immintrin.h>, packed.h and, from the includer, a struct V with
//   W (lanes), TMAX (tokens per tile), F (float vector), zero(), set1(f), load(const float*),
//   fmadd(a, b, c) = a * b + c, mul(a, b), add(a, b), hsum(F), i8(__m128i q, int off) (int8 lanes
//   [off, off + W) of q as floats; off a multiple of W below 16), i8p(p) (W int8 at p as floats),
//   kI8FromMemory (widen decoded codes by i8p from a stack copy rather than by i8: AVX2, where
//   the upper 8 lanes of a register would cost a shift), kLut16 (W = 16 only: lut16(p, hi, table),
//   the low or high nibbles of the 16 bytes at p as table[nibble], and q6k16(b, j, v), q6_k's codes
//   of values [16v, 16v + 16) of sub-block j as floats), fp8(p) (W e4m3 bytes at p, as
//   floats / 256), and prefetch(p) (p itself, when software prefetch is on). The format helpers
//   (packed_formats_simd.h) use AVX2 (both includers enable it).
//
// Per block and row, the scales of every group of values are decoded once (value = code * d + m)
// into a small array that the inner loop reads back as broadcasts; then the block is decoded in
// sub-blocks of S values (32; nvfp4: its 16) straight into registers: the byte work (nibbles, high
// bits, code tables) in 128-bit registers shared by both widths gives int8 codes (q8_0: the bytes
// themselves, widened from memory), widened to S / W float vectors of the unscaled codes, which
// meet the activations of the R rows x TT tokens of the tile. At 16 lanes the 4-bit formats skip the
// int8 step: their nibbles, widened to int32 lanes, index a 16-float table (vpermps): the code values,
// or, where the scale is applied per vector (q4_k, q4_1), the group's own values code * d + m; q6_k
// joins its 4 + 2 bits in int32 lanes (no byte shuffles), then converts. The group scale is factored out where
// a group spans GV = kGroup / W >= 2 vectors: per group and token gs = sum(code * x), then
// acc += d * gs once, and for the formats with an offset acc += m * sum(x over the group), the x
// sums taken once per tile (shared by its rows); where a group is one vector (or two, with an
// offset) the vector is scaled in place (w = code * d + m, acc += w * x), which costs no more
// (factored() below). Activations are never quantized: every product is float32.
// fp8 has no int8 form: its sub-blocks are widened from the e4m3 bits directly.
// Prefetch: a tile reads its R consecutive rows side by side, and the next tiles read the rows that
// follow, so each block is prefetched kPfTiles tiles ahead (the same block of the rows kPfTiles * R
// further on): a fixed distance along the row would land in the tile's own next row once rows are
// shorter than it, as expert rows of 2-4k values in 4-bit formats are.

#include "packed_formats_simd.h"

// Formats with lanes8(b, j, v): the codes of values [8v, 8v + 8) of sub-block j as int32 lanes, decoded
// after widening the bytes (AVX2: one load-and-widen, a mask or shift a vector, no byte shuffles).
template <class Q>
constexpr auto has_lanes8(int) -> decltype(&Q::lanes8, true) { return true; }
template <class Q>
constexpr bool has_lanes8(long) { return false; }

// Formats with nib16(b, j, v) and kNib (the 4-bit ones), for vector units with V::kLut16: the 16 nibbles
// widened to int32 lanes and looked up in kNib as floats (AVX-512: vpmovzxbd and vpermps, which reads only
// each lane's low 4 bits, so the low nibbles need no mask and the high ones one shift; values [0, 16) and
// [16, 32) of a q4_k sub-block pair, or of a q4_0 block, share the widened bytes).
template <class Q>
constexpr auto has_nib16(int) -> decltype(&Q::nib16, true) { return true; }
template <class Q>
constexpr bool has_nib16(long) { return false; }
template <class Q, class VV>
inline typename VV::F nib_lookup(const uint8_t* b, int j, int v, typename VV::F table) {
    const Nib16 n = Q::nib16(b, j, v);
    return VV::lut16(n.p, n.hi, table);
}

template <class VV>
inline typename VV::F q6k_lanes(const uint8_t* b, int j, int v) { return VV::q6k16(b, j, v); }

template <class Q>
constexpr int sub_size() { return kQInfo[int(Q::kFmt)].block < 32 ? kQInfo[int(Q::kFmt)].block : 32; }

// Sub-block j of the block at b as S / W float vectors of its codes, unscaled (fp8: value / 256).
template <class Q>
inline void decode_codes(const uint8_t* b, int j, typename V::F* f) {
    constexpr int S = sub_size<Q>();
    if constexpr (Q::kFmt == QFmt::fp8) {
        for (int v = 0; v < S / V::W; ++v) f[v] = V::fp8(b + 4 + 32 * j + v * V::W);
    } else if constexpr (Q::kFmt == QFmt::q8_0) {  // the codes are the bytes: widened straight from memory
        for (int v = 0; v < S / V::W; ++v) f[v] = V::i8p(b + 2 + v * V::W);
    } else if constexpr (V::kLut16 && Q::kFmt == QFmt::q6_k) {  // 6-bit codes joined in int32 lanes
        for (int v = 0; v < S / V::W; ++v) f[v] = q6k_lanes<V>(b, j, v);
    } else if constexpr (V::kLut16 && has_nib16<Q>(0)) {
        for (int v = 0; v < S / V::W; ++v) f[v] = nib_lookup<Q, V>(b, j, v, V::load(Q::kNib));
    } else if constexpr (V::W == 8 && has_lanes8<Q>(0)) {  // AVX2: measured 1.3x on q4_k over the byte path
        for (int v = 0; v < S / V::W; ++v) f[v] = _mm256_cvtepi32_ps(Q::lanes8(b, j, v));
    } else {
        __m128i q[2];
        Q::codes(b, j, q);
        if constexpr (V::kI8FromMemory) {  // stored and widened from memory: no shift for the upper lanes
            alignas(16) uint8_t buf[32];
            _mm_store_si128(reinterpret_cast<__m128i*>(buf), q[0]);
            _mm_store_si128(reinterpret_cast<__m128i*>(buf + 16), q[1]);
            asm volatile("" : "+m"(buf));
            for (int v = 0; v < S / V::W; ++v) f[v] = V::i8p(buf + v * V::W);
        } else {
            for (int v = 0; v < S / V::W; ++v) f[v] = V::i8(q[v * V::W / 16], v * V::W % 16);
        }
    }
}

// How a tile applies the group scales (value = code * d + m), by the vectors per group GV = kGroup / W:
// factored (GV >= 2): per group and token, gs = sum(code * x) over the group's GV vectors, then
// acc += d * gs once; the offset's share m * sum(x) with sum(x) over the group taken once per tile and
// token (shared by its R rows), acc += m * sx. Inline (GV == 1, or GV == 2 with an offset, where
// factoring saves nothing): w = code * d + m per vector, acc += w * x.
template <class Q>
constexpr bool factored() {
    constexpr int GV = Q::kGroup / V::W;
    return GV >= 2 && !(Q::kOffset && GV < 4);
}
// Inline with a table lookup (4-bit formats where V::kLut16): the group's 16 values code * d + m are
// made once (one vector: kNib * d + m) and each vector of values is looked up in it, the same floats as
// code * d + m per vector.
template <class Q>
constexpr bool lut_inline() {
    if constexpr (V::kLut16 && has_nib16<Q>(0)) return !factored<Q>();
    return false;
}

constexpr int kPfTiles = 2;  // prefetch distance, in tiles (see the top of this file)

// R rows x TT tokens: each decoded vector is used for every token of the tile.
template <class Q, int R, int TT>
void tile(const Mat& m, int64_t r0, const float* const* X, int K, float* out, size_t ldo) {
    using F = typename V::F;
    constexpr int B = kQInfo[int(Q::kFmt)].block, kBytes = kQInfo[int(Q::kFmt)].bytes, S = sub_size<Q>();
    constexpr int NV = S / V::W, kPfEvery = kBytes >= 64 ? 1 : 64 / kBytes;  // one prefetch per <= 64 bytes
    constexpr int G = Q::kGroup, NG = B / G, kVG = G < S ? S / G : 1;  // groups per block, per sub-block
    constexpr bool kFact = factored<Q>(), kSx = kFact && Q::kOffset, kLutInline = lut_inline<Q>();
    const uint8_t* W[R];
    for (int r = 0; r < R; ++r) W[r] = m.w + (r0 + r) * m.ld;
    const size_t ahead = kPfTiles * R * m.ld;
    F acc[R][TT], gs[R][TT];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) acc[r][t] = V::zero();
    alignas(64) float ds[R][NG], ms[R][NG];  // group scales and offsets of the current block, per row
    const int nb = K / B;
    for (int b = 0; b < nb; ++b) {
        if (b % kPfEvery == 0)
            for (int r = 0; r < R; ++r)
                for (int o = 0; o < kBytes; o += 64) V::prefetch(W[r] + ahead + b * kBytes + o);
        for (int r = 0; r < R; ++r) Q::scales(W[r] + b * kBytes, ds[r], ms[r]);
        // the scales are read back from memory as broadcasts (a load each), not extracted from registers
        asm volatile("" : "+m"(ds), "+m"(ms));
#pragma GCC unroll 8
        for (int j = 0; j < B / S; ++j) {  // unrolled: j's shifts, masks and scale indices become constants
            const int k0 = b * B + j * S;
            F sx[TT][kVG];  // sum of x over each group of the sub-block (the offsets' share)
            if constexpr (kSx)
                for (int t = 0; t < TT; ++t)
                    for (int v = 0; v < NV; ++v) {
                        const F x = V::load(X[t] + k0 + v * V::W);
                        const int gi = v * V::W / G;
                        sx[t][gi] = v * V::W % G == 0 ? x : V::add(sx[t][gi], x);
                    }
            for (int r = 0; r < R; ++r) {
                F f[NV];
                if constexpr (!kLutInline) decode_codes<Q>(W[r] + b * kBytes, j, f);
                for (int v = 0; v < NV; ++v) {
                    const int e = j * S + v * V::W, g = e / G;  // value index in the block, its group
                    if constexpr (kFact) {
                        for (int t = 0; t < TT; ++t) {
                            const F x = V::load(X[t] + k0 + v * V::W);
                            gs[r][t] = e % G == 0 ? V::mul(f[v], x) : V::fmadd(f[v], x, gs[r][t]);
                        }
                        if ((e + V::W) % G == 0) {  // the group's last vector
                            const F d = V::set1(ds[r][g]);
                            for (int t = 0; t < TT; ++t) acc[r][t] = V::fmadd(gs[r][t], d, acc[r][t]);
                            if constexpr (kSx) {
                                const F mm = V::set1(ms[r][g]);
                                for (int t = 0; t < TT; ++t) acc[r][t] = V::fmadd(sx[t][(e % S) / G], mm, acc[r][t]);
                            }
                        }
                    } else if constexpr (kLutInline) {
                        const F c = V::load(Q::kNib);
                        const F tab = Q::kOffset ? V::fmadd(c, V::set1(ds[r][g]), V::set1(ms[r][g])) : V::mul(c, V::set1(ds[r][g]));
                        const F w = nib_lookup<Q, V>(W[r] + b * kBytes, j, v, tab);
                        for (int t = 0; t < TT; ++t) acc[r][t] = V::fmadd(w, V::load(X[t] + k0 + v * V::W), acc[r][t]);
                    } else {
                        const F w = Q::kOffset ? V::fmadd(f[v], V::set1(ds[r][g]), V::set1(ms[r][g]))
                                               : V::mul(f[v], V::set1(ds[r][g]));
                        for (int t = 0; t < TT; ++t) acc[r][t] = V::fmadd(w, V::load(X[t] + k0 + v * V::W), acc[r][t]);
                    }
                }
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
