// Shared declarations of the native expert executor: weight formats, the matrix view a kernel
// reads, scalar decoders (the exact definitions every SIMD path must agree with) and the kernel
// table. Kernel files include only this header plus <immintrin.h> before their `#pragma GCC
// target` region, and use no std templates inside it: a template instantiated under an AVX-512
// target could be merged by the linker into code that runs on a CPU without AVX-512.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace ft {

enum class Fmt : int { bf16 = 0, f32 = 1, fp8 = 2, mxfp4 = 3 };
constexpr int kNumFmts = 4;

enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2, avx512bf16 = 3 };
constexpr int kNumIsas = 4;

// One expert matrix [rows, K] in any format. Row r starts at w + r * ld (bytes).
//  fp8:   e4m3 bytes; scale of (row r, column k) = fs[(r / bn) * fs_ld + k / bk] (float32).
//  mxfp4: two e2m1 values per byte (element 2i in the low nibble); scale of (row r, column k) =
//         2^(es[r * es_ld + k / 32] - 127) (e8m0). K must be a multiple of 32.
//  packed formats (packed.h): rows of K / B blocks, ld = the row's bytes; the result times gs.
struct Mat {
    const uint8_t* w = nullptr;
    size_t ld = 0;
    const float* fs = nullptr;
    size_t fs_ld = 0;
    const uint8_t* es = nullptr;
    size_t es_ld = 0;
    int bn = 128, bk = 128;
    float gs = 1.0f;  // packed formats: the matrix's global scale (nvfp4's weight_scale_2; 1 otherwise)
};

// out[t * ldo + r] = dot(row r0 + r of m, X[t]) for r < nrows (1..4), t < ntok.
// X[t] points at K activations: float32, or bf16 for the avx512bf16 path's bf16 kernel.
using GemvFn = void (*)(const Mat& m, int64_t r0, int nrows, const void* const* X, int ntok, int K, float* out,
                        size_t ldo);

constexpr int kRows = 4;  // weight rows per tile: a tile of rows never straddles an fp8 block row (bn % 4 == 0)

inline float bf16_to_f32(uint16_t v) {
    uint32_t u = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN stays NaN
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

// e4m3 (OCP "fn": no infinities; 0x7f/0xff are NaN) -> float, exact.
inline float fp8_to_f32(uint8_t b) {
    const int e = (b >> 3) & 15, m = b & 7;
    float v;
    if (e == 15 && m == 7) v = __builtin_nanf("");
    else if (e == 0) v = static_cast<float>(m) * (1.0f / 512.0f);  // subnormal: m * 2^-9
    else {
        uint32_t u = static_cast<uint32_t>(e + 120) << 23 | static_cast<uint32_t>(m) << 20;
        std::memcpy(&v, &u, 4);
    }
    return (b & 0x80) ? -v : v;
}

// Software prefetch distance on each weight row, in bytes (0 = off); set_prefetch_bytes sets it
// (engine option native_prefetch: a tuning knob for benchmarks, not for users).
extern int g_prefetch_bytes;

// Rows of a work chunk the layer call hands a thread at a time (a multiple of 4; set_chunk_rows sets
// it): a tuning knob for benchmarks, not for users.
extern int g_chunk_rows;

extern const float kFp4Values[16];   // e2m1 code -> value
extern float kE8m0Scale[256];        // e8m0 code -> 2^(code - 127) (255 -> NaN); filled at load

// kernels_<isa>.cpp each fill their row of the table (nullptr where the ISA has no own kernel).
void register_scalar(GemvFn table[kNumFmts]);
void register_avx2(GemvFn table[kNumFmts]);
void register_avx512(GemvFn table[kNumFmts]);
void register_avx512bf16(GemvFn table[kNumFmts]);

}  // namespace ft
