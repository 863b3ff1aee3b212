// The bandwidth reference: a plain multi-threaded read of a set of byte ranges with the same pool
// and the same dynamic chunk hand-out as the MoE layer, so "kernel GB/s / read GB/s" compares the
// kernel with the fastest way to merely touch the same bytes on the same threads.
#include "read_bound.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "common.h"
#include "moe_layer.h"
#include "pool.h"

namespace ft {

namespace {

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2")
uint64_t read_avx2(const char* p, size_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0;
    size_t i = 0;
    const int pf = g_prefetch_bytes;  // the kernels' software prefetch, so the bound is not handicapped
    for (; i + 64 <= n; i += 64) {
        if (pf > 0) _mm_prefetch(p + i + pf, _MM_HINT_T0);
        a0 = _mm256_xor_si256(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
        a1 = _mm256_xor_si256(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    }
    a0 = _mm256_xor_si256(a0, a1);
    uint64_t s = static_cast<uint64_t>(_mm256_extract_epi64(a0, 0) ^ _mm256_extract_epi64(a0, 1) ^
                                       _mm256_extract_epi64(a0, 2) ^ _mm256_extract_epi64(a0, 3));
    for (; i < n; ++i) s ^= static_cast<unsigned char>(p[i]);
    return s;
}
#pragma GCC pop_options
#endif

uint64_t read_scalar(const char* p, size_t n) {
    uint64_t s = 0;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v;
        std::memcpy(&v, p + i, 8);
        s ^= v;
    }
    for (; i < n; ++i) s ^= static_cast<unsigned char>(p[i]);
    return s;
}

struct Piece {
    const char* p;
    size_t n;
};

}  // namespace

uint64_t read_ranges(const uintptr_t* ptrs, const int64_t* sizes, int64_t count) {
    constexpr size_t kPiece = 16 * 1024;  // the layer's chunks are 16 rows: 16 x 4 KiB for H = 2048 bf16
    std::vector<Piece> pieces;
    for (int64_t i = 0; i < count; ++i) {
        if (sizes[i] < 0) throw std::invalid_argument("negative range size");
        const char* base = reinterpret_cast<const char*>(ptrs[i]);
        for (size_t off = 0; off < static_cast<size_t>(sizes[i]); off += kPiece)
            pieces.push_back({base + off, std::min(kPiece, static_cast<size_t>(sizes[i]) - off)});
    }
#if defined(__x86_64__)
    const bool v = isa_supported(Isa::avx2);
#else
    const bool v = false;
#endif
    std::shared_ptr<Pool> pool_ref = pool();
    Pool& p = *pool_ref;
    std::lock_guard<std::mutex> call(p.call_mutex);
    std::vector<uint64_t> sums(p.size());
    std::atomic<size_t> next{0};
    std::function<void(int)> fn = [&](int tid) {
        uint64_t s = 0;
        for (size_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < pieces.size();) {
#if defined(__x86_64__)
            s ^= v ? read_avx2(pieces[c].p, pieces[c].n) : read_scalar(pieces[c].p, pieces[c].n);
#else
            s ^= read_scalar(pieces[c].p, pieces[c].n);
#endif
        }
        sums[tid] = s;
    };
    p.run(fn);
    uint64_t s = 0;
    for (uint64_t x : sums) s ^= x;
    return s;
}

}  // namespace ft
