// The packed formats' byte work, shared by the SIMD kernel files (kernels_packed_simd.h's AVX2 and
// AVX-512 instantiations): per format, scales(b, d, m) gives every
// group's scale d and offset m of a block (value = code * d + m), once per block and row, and
// codes(b, j, q) the int8 codes of sub-block j (q[0]: values 0..15, q[1]: 16..31), built in 128-bit
// registers (SSE4 / AVX2 / F16C, which every includer's target enables). Included inside the
// includer's target region and anonymous namespace; no include guard, no includes (it needs
// <immintrin.h> and packed.h).

inline __m128i ld16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m128i low4(__m128i b) { return _mm_and_si128(b, _mm_set1_epi8(15)); }
inline __m128i high4(__m128i b) { return _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15)); }
inline __m128i shr_mask(__m128i b, int shift, int mask) {  // (byte >> shift) & mask, per byte
    return _mm_and_si128(_mm_srl_epi16(b, _mm_cvtsi32_si128(shift)), _mm_set1_epi8(static_cast<char>(mask)));
}
inline __m128i bit_set(__m128i b, int bit) {  // 0xff where bit `bit` of the byte is set
    const __m128i sel = _mm_set1_epi8(static_cast<char>(1 << bit));
    return _mm_cmpeq_epi8(_mm_and_si128(b, sel), sel);
}
inline __m128i bits16(uint32_t bits) {  // 0xff in byte i where bit i of the low 16 bits is set
    const __m128i v = _mm_shuffle_epi8(_mm_cvtsi32_si128(static_cast<int>(bits)),
                                       _mm_set_epi8(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0));
    const __m128i sel = _mm_set_epi8(-128, 64, 32, 16, 8, 4, 2, 1, -128, 64, 32, 16, 8, 4, 2, 1);
    return _mm_cmpeq_epi8(_mm_and_si128(v, sel), sel);
}
inline __m128i lut(__m128i idx, const int8_t* table) { return _mm_shuffle_epi8(ld16(reinterpret_cast<const uint8_t*>(table)), idx); }
inline float h2f(const uint8_t* p) { return _cvtsh_ss(load_u16(p)); }
// 8 bytes at p widened to int32 lanes: their low nibbles, or (hi) their high ones
inline __m256i nib8(const uint8_t* p, bool hi) {
    const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return hi ? _mm256_srli_epi32(w, 4) : _mm256_and_si256(w, _mm256_set1_epi32(15));
}
// out[i] = mul * float(code i) for n (a multiple of 8) unsigned / signed byte codes, 8 lanes at a time
inline void scale_u8(const uint8_t* codes, int n, float mul, float* out) {
    for (int i = 0; i < n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)))),
                                                _mm256_set1_ps(mul)));
}
inline void scale_i8(const uint8_t* codes, int n, float mul, float* out) {
    for (int i = 0; i < n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)))),
                                                _mm256_set1_ps(mul)));
}
// The 4-bit formats' codes as the 16 floats a nibble stands for (a vector kernel's table lookup, nib16 below)
struct NibTable {
    alignas(64) float v[16];
};
constexpr NibTable nib_table(const int8_t (&codes)[16], int offset) {  // codes[i] + offset as floats
    NibTable t{};
    for (int i = 0; i < 16; ++i) t.v[i] = static_cast<float>(codes[i] + offset);
    return t;
}
constexpr int8_t kNibIndex[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
constexpr NibTable kNibUnsigned = nib_table(kNibIndex, 0), kNibSigned = nib_table(kNibIndex, -8),
                   kNibIq4nl = nib_table(kIq4nlValues, 0), kNibE2m1 = nib_table(kE2m1Doubled, 0);
// Where the 16 nibbles of values [16v, 16v + 16) of a sub-block are: the low (hi false) or high nibbles
// of the 16 bytes at p, in order.
struct Nib16 {
    const uint8_t* p;
    bool hi;
};

// ---- formats: B values in `bytes` bytes, one scale d (and offset m) per kGroup values ----
// scales(b, d, m): every group's d and m (value = code * d + m), once per block and row;
// codes(b, j, q): the int8 codes of sub-block j (q[0]: values 0..15, q[1]: 16..31);
// the 4-bit formats also nib16(b, j, v) (Nib16 above) and kNib, the table of their code values.

struct DQ8_0 {
    static constexpr QFmt kFmt = QFmt::q8_0;
    static constexpr int kGroup = 32;
    static constexpr bool kOffset = false;
    static void scales(const uint8_t* b, float* d, float*) { d[0] = h2f(b); }
    static void codes(const uint8_t* b, int, __m128i* q) { q[0] = ld16(b + 2), q[1] = ld16(b + 18); }
};
struct DQ4_0 {
    static constexpr QFmt kFmt = QFmt::q4_0;
    static constexpr int kGroup = 32;
    static constexpr bool kOffset = false;
    static void scales(const uint8_t* b, float* d, float*) { d[0] = h2f(b); }
    static void codes(const uint8_t* b, int, __m128i* q) {
        const __m128i v = ld16(b + 2), eight = _mm_set1_epi8(8);
        q[0] = _mm_sub_epi8(low4(v), eight), q[1] = _mm_sub_epi8(high4(v), eight);
    }
    static __m256i lanes8(const uint8_t* b, int, int v) {
        return _mm256_sub_epi32(nib8(b + 2 + 8 * (v & 1), v >= 2), _mm256_set1_epi32(8));
    }
    static constexpr const float* kNib = kNibSigned.v;
    static Nib16 nib16(const uint8_t* b, int, int v) { return {b + 2, v == 1}; }
};
struct DQ4_1 {
    static constexpr QFmt kFmt = QFmt::q4_1;
    static constexpr int kGroup = 32;
    static constexpr bool kOffset = true;
    static void scales(const uint8_t* b, float* d, float* m) { d[0] = h2f(b), m[0] = h2f(b + 2); }
    static void codes(const uint8_t* b, int, __m128i* q) {
        const __m128i v = ld16(b + 4);
        q[0] = low4(v), q[1] = high4(v);
    }
    static __m256i lanes8(const uint8_t* b, int, int v) { return nib8(b + 4 + 8 * (v & 1), v >= 2); }
    static constexpr const float* kNib = kNibUnsigned.v;
    static Nib16 nib16(const uint8_t* b, int, int v) { return {b + 4, v == 1}; }
};
inline void q5_codes(const uint8_t* qh_p, const uint8_t* qs, int offset, __m128i* q) {
    const uint32_t qh = load_u32(qh_p);
    const __m128i v = ld16(qs), b4 = _mm_set1_epi8(16), off = _mm_set1_epi8(static_cast<char>(offset));
    q[0] = _mm_sub_epi8(_mm_or_si128(low4(v), _mm_and_si128(bits16(qh & 0xffffu), b4)), off);
    q[1] = _mm_sub_epi8(_mm_or_si128(high4(v), _mm_and_si128(bits16(qh >> 16), b4)), off);
}
struct DQ5_0 {
    static constexpr QFmt kFmt = QFmt::q5_0;
    static constexpr int kGroup = 32;
    static constexpr bool kOffset = false;
    static void scales(const uint8_t* b, float* d, float*) { d[0] = h2f(b); }
    static void codes(const uint8_t* b, int, __m128i* q) { q5_codes(b + 2, b + 6, 16, q); }
};
struct DQ5_1 {
    static constexpr QFmt kFmt = QFmt::q5_1;
    static constexpr int kGroup = 32;
    static constexpr bool kOffset = true;
    static void scales(const uint8_t* b, float* d, float* m) { d[0] = h2f(b), m[0] = h2f(b + 2); }
    static void codes(const uint8_t* b, int, __m128i* q) { q5_codes(b + 4, b + 8, 0, q); }
};
struct DQ2_K {
    static constexpr QFmt kFmt = QFmt::q2_k;
    static constexpr int kGroup = 16;
    static constexpr bool kOffset = true;
    static void scales(const uint8_t* b, float* d, float* m) {
        const __m128i v = ld16(b);
        alignas(16) uint8_t lo[16], hi[16];
        _mm_store_si128(reinterpret_cast<__m128i*>(lo), low4(v));
        _mm_store_si128(reinterpret_cast<__m128i*>(hi), high4(v));
        scale_u8(lo, 16, h2f(b + 80), d);
        scale_u8(hi, 16, -h2f(b + 82), m);
    }
    static void codes(const uint8_t* b, int j, __m128i* q) {
        const uint8_t* qs = b + 16 + 32 * (j >> 2);
        q[0] = shr_mask(ld16(qs), 2 * (j & 3), 3), q[1] = shr_mask(ld16(qs + 16), 2 * (j & 3), 3);
    }
};
struct DQ3_K {
    static constexpr QFmt kFmt = QFmt::q3_k;
    static constexpr int kGroup = 16;
    static constexpr bool kOffset = false;
    static void scales(const uint8_t* b, float* d, float*) {
        int8_t sc[16];
        q3k_scales(b + 96, sc);
        scale_i8(reinterpret_cast<const uint8_t*>(sc), 16, h2f(b + 108), d);
    }
    static void codes(const uint8_t* b, int j, __m128i* q) {
        const uint8_t* qs = b + 32 + 32 * (j >> 2);
        const int s = 2 * (j & 3);
        const __m128i four = _mm_set1_epi8(4);  // subtracted where the high-mask bit is clear
        q[0] = _mm_sub_epi8(shr_mask(ld16(qs), s, 3), _mm_andnot_si128(bit_set(ld16(b), j), four));
        q[1] = _mm_sub_epi8(shr_mask(ld16(qs + 16), s, 3), _mm_andnot_si128(bit_set(ld16(b + 16), j), four));
    }
};
inline void k45_scales(const uint8_t* b, float* d, float* m) {
    uint8_t sc[8], mn[8];
    kquant_scales_mins(b + 4, sc, mn);
    scale_u8(sc, 8, h2f(b), d);
    scale_u8(mn, 8, -h2f(b + 2), m);
}
inline void k45_codes(const uint8_t* qh, const uint8_t* qs, int j, __m128i* q) {
    const uint8_t* p = qs + 32 * (j >> 1);
    const __m128i v0 = ld16(p), v1 = ld16(p + 16);
    q[0] = (j & 1) ? high4(v0) : low4(v0), q[1] = (j & 1) ? high4(v1) : low4(v1);
    if (qh) {
        const __m128i b4 = _mm_set1_epi8(16);
        q[0] = _mm_or_si128(q[0], _mm_and_si128(bit_set(ld16(qh), j), b4));
        q[1] = _mm_or_si128(q[1], _mm_and_si128(bit_set(ld16(qh + 16), j), b4));
    }
}
struct DQ4_K {
    static constexpr QFmt kFmt = QFmt::q4_k;
    static constexpr int kGroup = 32;
    static constexpr bool kOffset = true;
    static void scales(const uint8_t* b, float* d, float* m) { k45_scales(b, d, m); }
    static void codes(const uint8_t* b, int j, __m128i* q) { k45_codes(nullptr, b + 16, j, q); }
    static __m256i lanes8(const uint8_t* b, int j, int v) { return nib8(b + 16 + 32 * (j >> 1) + 8 * v, j & 1); }
    static constexpr const float* kNib = kNibUnsigned.v;
    static Nib16 nib16(const uint8_t* b, int j, int v) { return {b + 16 + 32 * (j >> 1) + 16 * v, (j & 1) != 0}; }
};
struct DQ5_K {
    static constexpr QFmt kFmt = QFmt::q5_k;
    static constexpr int kGroup = 32;
    static constexpr bool kOffset = true;
    static void scales(const uint8_t* b, float* d, float* m) { k45_scales(b, d, m); }
    static void codes(const uint8_t* b, int j, __m128i* q) { k45_codes(b + 16, b + 48, j, q); }
};
struct DQ6_K {
    static constexpr QFmt kFmt = QFmt::q6_k;
    static constexpr int kGroup = 16;
    static constexpr bool kOffset = false;
    static void scales(const uint8_t* b, float* d, float*) {
        scale_i8(b + 192, 16, h2f(b + 208), d);
    }
    static void codes(const uint8_t* b, int j, __m128i* q) {
        const int g = j >> 2, jj = j & 3;
        const uint8_t *ql = b + 64 * g + 32 * (jj & 1), *qh = b + 128 + 32 * g;
        const int sl = 4 * (jj >> 1), sh = 2 * jj;
        const __m128i k32 = _mm_set1_epi8(32);
        q[0] = _mm_sub_epi8(_mm_or_si128(shr_mask(ld16(ql), sl, 15), _mm_slli_epi16(shr_mask(ld16(qh), sh, 3), 4)), k32);
        q[1] = _mm_sub_epi8(_mm_or_si128(shr_mask(ld16(ql + 16), sl, 15), _mm_slli_epi16(shr_mask(ld16(qh + 16), sh, 3), 4)),
                            k32);
    }
};
struct DIQ4_NL {
    static constexpr QFmt kFmt = QFmt::iq4_nl;
    static constexpr int kGroup = 32;
    static constexpr bool kOffset = false;
    static void scales(const uint8_t* b, float* d, float*) { d[0] = h2f(b); }
    static void codes(const uint8_t* b, int, __m128i* q) {
        const __m128i v = ld16(b + 2);
        q[0] = lut(low4(v), kIq4nlValues), q[1] = lut(high4(v), kIq4nlValues);
    }
    static constexpr const float* kNib = kNibIq4nl.v;
    static Nib16 nib16(const uint8_t* b, int, int v) { return {b + 2, v == 1}; }
};
struct DIQ4_XS {
    static constexpr QFmt kFmt = QFmt::iq4_xs;
    static constexpr int kGroup = 32;
    static constexpr bool kOffset = false;
    static void scales(const uint8_t* b, float* d, float*) {  // 6-bit scale j: nibble j of b[4..7], bits 2j.. of b[2..3]
        const __m256i lo = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(load_u32(b + 4))), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
        const __m256i hi = _mm256_srlv_epi32(_mm256_set1_epi32(load_u16(b + 2)), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
        const __m256i ls = _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(15)), _mm256_slli_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(3)), 4));
        _mm256_storeu_ps(d, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32))), _mm256_set1_ps(h2f(b))));
    }
    static void codes(const uint8_t* b, int j, __m128i* q) {
        const __m128i v = ld16(b + 8 + 16 * j);
        q[0] = lut(low4(v), kIq4nlValues), q[1] = lut(high4(v), kIq4nlValues);
    }
    static constexpr const float* kNib = kNibIq4nl.v;
    static Nib16 nib16(const uint8_t* b, int j, int v) { return {b + 8 + 16 * j, v == 1}; }
};
struct DMXFP4 {
    static constexpr QFmt kFmt = QFmt::mxfp4;
    static constexpr int kGroup = 32;
    static constexpr bool kOffset = false;
    static void scales(const uint8_t* b, float* d, float*) { d[0] = e8m0_half(b[0]); }
    static void codes(const uint8_t* b, int, __m128i* q) {
        const __m128i v = ld16(b + 1);
        q[0] = lut(low4(v), kE2m1Doubled), q[1] = lut(high4(v), kE2m1Doubled);
    }
    static constexpr const float* kNib = kNibE2m1.v;
    static Nib16 nib16(const uint8_t* b, int, int v) { return {b + 1, v == 1}; }
};
struct DNVFP4 {  // element 2i is the low nibble of byte i, 2i + 1 the high one
    static constexpr QFmt kFmt = QFmt::nvfp4;
    static constexpr int kGroup = 16;
    static constexpr bool kOffset = false;
    static void scales(const uint8_t* b, float* d, float*) { d[0] = 0.5f * kE4m3Table[b[0]]; }
    static void codes(const uint8_t* b, int, __m128i* q) {
        const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 1));
        q[0] = q[1] = lut(_mm_unpacklo_epi8(low4(v), high4(v)), kE2m1Doubled);
    }
};
struct DFP8 {  // no int8 form: widened from the e4m3 bits (V::fp8), whose fp16 reading is 2^-8 too small
    static constexpr QFmt kFmt = QFmt::fp8;
    static constexpr int kGroup = 128;
    static constexpr bool kOffset = false;
    static void scales(const uint8_t* b, float* d, float*) { d[0] = load_f32(b) * 256.0f; }
};
