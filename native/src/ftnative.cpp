// freetoken native CPU expert executor (first cut).
//
// One call runs a whole MoE layer's CPU share: for T tokens, each routed to k experts (flat row ids
// into the expert banks), out[t] = sum_j w[t,j] * down_e(silu(gate_e(x_t)) * up_e(x_t)).
// Weights are bf16; activations bf16 or float32; accumulation is float32.
//
// Not linked against libtorch: everything arrives as raw addresses plus shapes/strides, validated by
// native/ftnative.py. SIMD paths are chosen at run time (CPUID) and compiled with
// `#pragma GCC target` regions, so the .so itself is built for baseline x86-64.
//
// Work split: a persistent pool of threads (the calling thread is worker 0). Phase 1 splits the
// gate/up rows of all distinct experts of the call across threads; after a barrier, phase 2 splits
// the hidden (down-projection output) rows across threads, each thread looping over all experts for
// its rows, so no two threads write the same output element.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace py = pybind11;

namespace {

// ----------------------------------------------------------------------------------------------
// bf16 helpers
// ----------------------------------------------------------------------------------------------

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

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

// A gemv tile: out[t * ldo + r] = dot(W + r * ldw, X[t]) for r < nrows (<= 4), t < ntok.
// X[t] points at float32 (or, for the bf16 path, bf16) vectors of length K.
using GemvFn = void (*)(const uint16_t* W, size_t ldw, int nrows, const void* const* X, int ntok, int K,
                        float* out, size_t ldo);

constexpr int kRows = 4;  // weight rows per tile
#ifndef FT_PREFETCH
#define FT_PREFETCH 1024  // bytes ahead on each weight row (software prefetch; 0 = off)
#endif
#define FT_PF(p) \
    do { \
        if (FT_PREFETCH) _mm_prefetch(reinterpret_cast<const char*>(p) + FT_PREFETCH, _MM_HINT_T0); \
    } while (0)

// ----------------------------------------------------------------------------------------------
// scalar path
// ----------------------------------------------------------------------------------------------
namespace scalar {
void gemv(const uint16_t* W, size_t ldw, int nrows, const void* const* X, int ntok, int K, float* out,
          size_t ldo) {
    for (int r = 0; r < nrows; ++r) {
        const uint16_t* w = W + r * ldw;
        for (int t = 0; t < ntok; ++t) {
            const float* x = static_cast<const float*>(X[t]);
            float acc = 0.f;
            for (int i = 0; i < K; ++i) acc += bf16_to_f32(w[i]) * x[i];
            out[t * ldo + r] = acc;
        }
    }
}
}  // namespace scalar

// ----------------------------------------------------------------------------------------------
// AVX2 + FMA path: 8 floats per vector, tiles of 4 rows x 2 tokens
// ----------------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
inline __m256 load_bf16(const uint16_t* p) {
    __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
template <int R, int TT>
void tile(const uint16_t* W, size_t ldw, const float* const* X, int K, float* out, size_t ldo) {
    __m256 acc[R][TT];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) acc[r][t] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 xv[TT];
        for (int t = 0; t < TT; ++t) xv[t] = _mm256_loadu_ps(X[t] + k);
        for (int r = 0; r < R; ++r) {
            if ((k & 31) == 0) FT_PF(W + r * ldw + k);
            __m256 wv = load_bf16(W + r * ldw + k);
            for (int t = 0; t < TT; ++t) acc[r][t] = _mm256_fmadd_ps(wv, xv[t], acc[r][t]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) {
            float s = hsum(acc[r][t]);
            for (int i = k; i < K; ++i) s += bf16_to_f32(W[r * ldw + i]) * X[t][i];
            out[t * ldo + r] = s;
        }
}
template <int R>
void rows(const uint16_t* W, size_t ldw, const float* const* X, int ntok, int K, float* out, size_t ldo) {
    int t = 0;
    for (; t + 2 <= ntok; t += 2) tile<R, 2>(W, ldw, X + t, K, out + t * ldo, ldo);
    if (t < ntok) tile<R, 1>(W, ldw, X + t, K, out + t * ldo, ldo);
}
void gemv(const uint16_t* W, size_t ldw, int nrows, const void* const* Xv, int ntok, int K, float* out,
          size_t ldo) {
    auto X = reinterpret_cast<const float* const*>(Xv);
    switch (nrows) {
        case 4: rows<4>(W, ldw, X, ntok, K, out, ldo); break;
        case 3: rows<3>(W, ldw, X, ntok, K, out, ldo); break;
        case 2: rows<2>(W, ldw, X, ntok, K, out, ldo); break;
        default: rows<1>(W, ldw, X, ntok, K, out, ldo); break;
    }
}
}  // namespace avx2
#pragma GCC pop_options

// ----------------------------------------------------------------------------------------------
// AVX-512F path (+BW/VL for masked 16-bit loads): 16 floats per vector, tiles of 4 rows x 4 tokens
// ----------------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma")
namespace avx512 {
inline float hsum512(__m512 v) {
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
    __m128 s = _mm512_castps512_ps128(v);
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
inline __m512 load_bf16(const uint16_t* p) {
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline __m512 load_bf16_mask(const uint16_t* p, __mmask16 m) {
    __m256i v = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
template <int R, int TT>
void tile(const uint16_t* W, size_t ldw, const float* const* X, int K, float* out, size_t ldo) {
    __m512 acc[R][TT];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) {
        __m512 xv[TT];
        for (int t = 0; t < TT; ++t) xv[t] = _mm512_loadu_ps(X[t] + k);
        for (int r = 0; r < R; ++r) {
            if ((k & 31) == 0) FT_PF(W + r * ldw + k);
            __m512 wv = load_bf16(W + r * ldw + k);
            for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
        }
    }
    if (k < K) {
        __mmask16 m = static_cast<__mmask16>((1u << (K - k)) - 1u);
        __m512 xv[TT];
        for (int t = 0; t < TT; ++t) xv[t] = _mm512_maskz_loadu_ps(m, X[t] + k);
        for (int r = 0; r < R; ++r) {
            __m512 wv = load_bf16_mask(W + r * ldw + k, m);
            for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) out[t * ldo + r] = hsum512(acc[r][t]);
}
template <int R>
void rows(const uint16_t* W, size_t ldw, const float* const* X, int ntok, int K, float* out, size_t ldo) {
    int t = 0;
    for (; t + 4 <= ntok; t += 4) tile<R, 4>(W, ldw, X + t, K, out + t * ldo, ldo);
    switch (ntok - t) {
        case 3: tile<R, 3>(W, ldw, X + t, K, out + t * ldo, ldo); break;
        case 2: tile<R, 2>(W, ldw, X + t, K, out + t * ldo, ldo); break;
        case 1: tile<R, 1>(W, ldw, X + t, K, out + t * ldo, ldo); break;
        default: break;
    }
}
void gemv(const uint16_t* W, size_t ldw, int nrows, const void* const* Xv, int ntok, int K, float* out,
          size_t ldo) {
    auto X = reinterpret_cast<const float* const*>(Xv);
    switch (nrows) {
        case 4: rows<4>(W, ldw, X, ntok, K, out, ldo); break;
        case 3: rows<3>(W, ldw, X, ntok, K, out, ldo); break;
        case 2: rows<2>(W, ldw, X, ntok, K, out, ldo); break;
        default: rows<1>(W, ldw, X, ntok, K, out, ldo); break;
    }
}
}  // namespace avx512
#pragma GCC pop_options

// ----------------------------------------------------------------------------------------------
// AVX-512-BF16 path: vdpbf16ps on bf16 weights x bf16 activations, 32 elements per instruction
// ----------------------------------------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")
namespace avx512bf16 {
inline float hsum512(__m512 v) {
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
    __m128 s = _mm512_castps512_ps128(v);
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh&>(v); }
template <int R, int TT>
void tile(const uint16_t* W, size_t ldw, const uint16_t* const* X, int K, float* out, size_t ldo) {
    __m512 acc[R][TT];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512i xv[TT];
        for (int t = 0; t < TT; ++t) xv[t] = _mm512_loadu_si512(X[t] + k);
        for (int r = 0; r < R; ++r) {
            FT_PF(W + r * ldw + k);
            __m512i wv = _mm512_loadu_si512(W + r * ldw + k);
            for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], as_bh(wv), as_bh(xv[t]));
        }
    }
    if (k < K) {
        __mmask32 m = static_cast<__mmask32>((1ull << (K - k)) - 1ull);
        __m512i xv[TT];
        for (int t = 0; t < TT; ++t) xv[t] = _mm512_maskz_loadu_epi16(m, X[t] + k);
        for (int r = 0; r < R; ++r) {
            __m512i wv = _mm512_maskz_loadu_epi16(m, W + r * ldw + k);
            for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], as_bh(wv), as_bh(xv[t]));
        }
    }
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) out[t * ldo + r] = hsum512(acc[r][t]);
}
template <int R>
void rows(const uint16_t* W, size_t ldw, const uint16_t* const* X, int ntok, int K, float* out,
          size_t ldo) {
    int t = 0;
    for (; t + 4 <= ntok; t += 4) tile<R, 4>(W, ldw, X + t, K, out + t * ldo, ldo);
    switch (ntok - t) {
        case 3: tile<R, 3>(W, ldw, X + t, K, out + t * ldo, ldo); break;
        case 2: tile<R, 2>(W, ldw, X + t, K, out + t * ldo, ldo); break;
        case 1: tile<R, 1>(W, ldw, X + t, K, out + t * ldo, ldo); break;
        default: break;
    }
}
void gemv(const uint16_t* W, size_t ldw, int nrows, const void* const* Xv, int ntok, int K, float* out,
          size_t ldo) {
    auto X = reinterpret_cast<const uint16_t* const*>(Xv);
    switch (nrows) {
        case 4: rows<4>(W, ldw, X, ntok, K, out, ldo); break;
        case 3: rows<3>(W, ldw, X, ntok, K, out, ldo); break;
        case 2: rows<2>(W, ldw, X, ntok, K, out, ldo); break;
        default: rows<1>(W, ldw, X, ntok, K, out, ldo); break;
    }
}
}  // namespace avx512bf16
#pragma GCC pop_options

// ----------------------------------------------------------------------------------------------
// ISA selection
// ----------------------------------------------------------------------------------------------
enum class Isa { scalar = 0, avx2 = 1, avx512 = 2, avx512bf16 = 3 };

const char* isa_name(Isa i) {
    switch (i) {
        case Isa::avx512bf16: return "avx512bf16";
        case Isa::avx512: return "avx512";
        case Isa::avx2: return "avx2";
        default: return "scalar";
    }
}

bool isa_supported(Isa i) {
    __builtin_cpu_init();
    switch (i) {
        case Isa::avx512bf16:
            return isa_supported(Isa::avx512) && __builtin_cpu_supports("avx512bf16");
        case Isa::avx512:
            return isa_supported(Isa::avx2) && __builtin_cpu_supports("avx512f") &&
                   __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
        case Isa::avx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        default: return true;
    }
}

Isa parse_isa(const std::string& s) {
    for (Isa i : {Isa::avx512bf16, Isa::avx512, Isa::avx2, Isa::scalar})
        if (s == isa_name(i)) return i;
    throw std::invalid_argument("unknown ISA '" + s + "' (known: avx512bf16, avx512, avx2, scalar)");
}

Isa best_isa() {
    for (Isa i : {Isa::avx512bf16, Isa::avx512, Isa::avx2})
        if (isa_supported(i)) return i;
    return Isa::scalar;
}

std::atomic<int> g_isa{static_cast<int>(Isa::scalar)};

void set_isa(const std::string& name) {
    Isa i = name == "auto" ? best_isa() : parse_isa(name);
    if (!isa_supported(i))
        throw std::invalid_argument(std::string("ISA '") + isa_name(i) + "' is not supported by this CPU");
    g_isa.store(static_cast<int>(i));
}

GemvFn gemv_for(Isa i) {
    switch (i) {
        case Isa::avx512bf16: return avx512bf16::gemv;
        case Isa::avx512: return avx512::gemv;
        case Isa::avx2: return avx2::gemv;
        default: return scalar::gemv;
    }
}

// ----------------------------------------------------------------------------------------------
// Thread pool: persistent workers, calling thread is worker 0, calls serialized by a mutex.
// ----------------------------------------------------------------------------------------------
class Pool {
  public:
    Pool(int n, bool pin) : n_(std::max(1, n)), pid_(getpid()) {
        std::vector<int> cpus;
        cpu_set_t set;
        if (pin && sched_getaffinity(0, sizeof(set), &set) == 0)
            for (int c = 0; c < CPU_SETSIZE; ++c)
                if (CPU_ISSET(c, &set)) cpus.push_back(c);
        for (int i = 1; i < n_; ++i) {
            threads_.emplace_back([this, i] { worker(i); });
            if (!cpus.empty()) {  // best effort; worker i -> i-th allowed CPU (worker 0 is the caller)
                cpu_set_t one;
                CPU_ZERO(&one);
                CPU_SET(cpus[i % cpus.size()], &one);
                pinned_ += pthread_setaffinity_np(threads_.back().native_handle(), sizeof(one), &one) == 0;
            }
        }
    }
    ~Pool() {
        {
            std::lock_guard<std::mutex> lk(m_);
            stop_ = true;
        }
        cv_.notify_all();
        for (auto& t : threads_) t.join();
    }
    int size() const { return n_; }
    int pinned() const { return pinned_; }
    pid_t pid() const { return pid_; }

    // Runs job(worker_index) on all n workers; returns when all are done. Caller holds call_mutex.
    void run(const std::function<void(int)>& job) {
        job_ = &job;
        done_.store(0, std::memory_order_relaxed);
        {
            std::lock_guard<std::mutex> lk(m_);
            gen_.fetch_add(1, std::memory_order_seq_cst);
        }
        cv_.notify_all();
        std::exception_ptr err;
        try {
            job(0);
        } catch (...) {
            err = std::current_exception();
        }
        spin_until([&] { return done_.load(std::memory_order_acquire) == n_ - 1; });
        job_ = nullptr;
        if (err) std::rethrow_exception(err);
    }

    // All n workers must call this the same number of times inside a job.
    void barrier() {
        if (n_ == 1) return;
        uint64_t g = bar_gen_.load(std::memory_order_acquire);
        if (bar_count_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
            bar_count_.store(0, std::memory_order_relaxed);
            bar_gen_.fetch_add(1, std::memory_order_release);
        } else {
            spin_until([&] { return bar_gen_.load(std::memory_order_acquire) != g; });
        }
    }

    std::mutex call_mutex;

  private:
    template <class F>
    static void spin_until(F done) {
        for (int i = 0; !done(); ++i) {
            if (i < 4000) _mm_pause();
            else std::this_thread::yield();
        }
    }
    void worker(int i) {
        uint64_t seen = 0;
        for (;;) {
            // spin briefly for low wake-up latency between back-to-back layer calls, then sleep
            bool got = false;
            for (int s = 0; s < 20000; ++s) {
                if (gen_.load(std::memory_order_acquire) != seen) {
                    got = true;
                    break;
                }
                _mm_pause();
            }
            if (!got) {
                std::unique_lock<std::mutex> lk(m_);
                cv_.wait(lk, [&] { return stop_ || gen_.load() != seen; });
                if (stop_) return;
            }
            seen = gen_.load(std::memory_order_acquire);
            try {
                (*job_)(i);
            } catch (...) {  // kernels do not throw; never let an exception kill the process
            }
            done_.fetch_add(1, std::memory_order_acq_rel);
        }
    }

    int n_;
    pid_t pid_;
    int pinned_ = 0;
    std::vector<std::thread> threads_;
    std::mutex m_;
    std::condition_variable cv_;
    bool stop_ = false;
    std::atomic<uint64_t> gen_{0};
    std::atomic<int> done_{0};
    const std::function<void(int)>* job_ = nullptr;
    std::atomic<int> bar_count_{0};
    std::atomic<uint64_t> bar_gen_{0};
};

std::mutex g_pool_mutex;           // guards g_pool replacement
std::shared_ptr<Pool> g_pool;      // callers hold a reference for the duration of a call
int g_requested_threads = 0;       // 0 = all CPUs in the affinity mask
bool g_pin = true;

int default_threads() {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
    return std::max(1u, std::thread::hardware_concurrency());
}

std::shared_ptr<Pool> pool() {
    std::lock_guard<std::mutex> lk(g_pool_mutex);
    if (g_pool && g_pool->pid() != getpid()) {
        // forked child: the parent's worker threads do not exist here; leak the object, never join
        new std::shared_ptr<Pool>(std::move(g_pool));
        g_pool.reset();
    }
    if (!g_pool)
        g_pool = std::make_shared<Pool>(g_requested_threads > 0 ? g_requested_threads : default_threads(), g_pin);
    return g_pool;
}

// Drops the global pool; its threads are joined when the last in-flight call releases it.
void shutdown_pool() {
    std::shared_ptr<Pool> p;
    {
        std::lock_guard<std::mutex> lk(g_pool_mutex);
        p.swap(g_pool);
    }
    if (p && p->pid() != getpid()) new std::shared_ptr<Pool>(std::move(p));  // forked child: leak
}

void set_num_threads(int n, bool pin) {
    if (n < 0) throw std::invalid_argument("num_threads must be >= 0 (0 = all allowed CPUs)");
    std::shared_ptr<Pool> old;
    {
        std::lock_guard<std::mutex> lk(g_pool_mutex);
        g_requested_threads = n;
        g_pin = pin;
        old.swap(g_pool);
    }
}

struct PoolInfo {
    int threads;
    int pinned;
};
PoolInfo pool_info() {
    auto p = pool();
    return {p->size(), p->pinned()};
}

// ----------------------------------------------------------------------------------------------
// The MoE layer
// ----------------------------------------------------------------------------------------------
struct Group {
    int64_t row;      // flat expert row in the banks
    int begin, end;   // entry range [begin, end) in the sorted entry list
};

void moe_layer(uintptr_t x_ptr, bool x_bf16, int64_t x_ld, uintptr_t out_ptr, bool out_bf16, int64_t out_ld,
               int64_t T, int64_t H, int64_t I, uintptr_t ids_ptr, uintptr_t wts_ptr, int64_t k,
               uintptr_t w13_ptr, int64_t w13_es, int64_t w13_ld, uintptr_t w2_ptr, int64_t w2_es,
               int64_t w2_ld, int64_t num_rows) {
    if (T < 0 || H <= 0 || I <= 0 || k <= 0) throw std::invalid_argument("bad sizes");
    if (H > INT32_MAX || I > INT32_MAX) throw std::invalid_argument("dims too large");
    if (T == 0) return;
    auto ids = reinterpret_cast<const int64_t*>(ids_ptr);
    auto wts = reinterpret_cast<const float*>(wts_ptr);
    for (int64_t i = 0; i < T * k; ++i)
        if (ids[i] < 0 || ids[i] >= num_rows)
            throw std::invalid_argument("expert id " + std::to_string(ids[i]) + " out of range [0, " +
                                        std::to_string(num_rows) + ")");

    const Isa isa = static_cast<Isa>(g_isa.load());
    const GemvFn gemv = gemv_for(isa);
    const bool act_bf16 = isa == Isa::avx512bf16;  // activations fed to the kernel as bf16
    const size_t act_size = act_bf16 ? 2 : 4;

    // entries sorted by expert (stable in token order)
    const int64_t N = T * k;
    std::vector<int> order(N);
    for (int64_t i = 0; i < N; ++i) order[i] = static_cast<int>(i);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return ids[a] < ids[b]; });
    std::vector<Group> groups;
    for (int64_t i = 0; i < N; ++i) {
        int64_t row = ids[order[i]];
        if (groups.empty() || groups.back().row != row) groups.push_back({row, int(i), int(i)});
        groups.back().end = int(i) + 1;
    }
    std::vector<int> entry_token(N);
    std::vector<float> entry_w(N);
    for (int64_t i = 0; i < N; ++i) {
        entry_token[i] = static_cast<int>(order[i] / k);
        entry_w[i] = wts[order[i]];
    }

    // activations in the kernel's input format (contiguous [T, H]), hidden h in [N, I]
    std::vector<char> xbuf(static_cast<size_t>(T * H) * act_size);
    std::vector<char> hbuf(static_cast<size_t>(N * I) * act_size);
    std::vector<float> acc(static_cast<size_t>(T * H));
    std::vector<const void*> xptr(N), hptr(N);
    for (int64_t i = 0; i < N; ++i) {
        xptr[i] = xbuf.data() + static_cast<size_t>(entry_token[i] * H) * act_size;
        hptr[i] = hbuf.data() + static_cast<size_t>(i * I) * act_size;
    }

    // Phases 1 and 2 hand out chunks of rows through atomic counters (dynamic scheduling), so a
    // thread that shares its core with another process, or the unpinned caller, just takes fewer.
    constexpr int64_t kChunk = 4 * kRows;  // rows per chunk
    const int64_t chunks_per_group = (I + kChunk - 1) / kChunk;
    const int64_t chunks1 = chunks_per_group * static_cast<int64_t>(groups.size());
    const int64_t chunks2 = (H + kChunk - 1) / kChunk;
    std::atomic<int64_t> next1{0}, next2{0};

    const uint16_t* w13 = reinterpret_cast<const uint16_t*>(w13_ptr);
    const uint16_t* w2 = reinterpret_cast<const uint16_t*>(w2_ptr);

    std::shared_ptr<Pool> pool_ref = pool();
    Pool& p = *pool_ref;
    std::lock_guard<std::mutex> call(p.call_mutex);
    const int nt = p.size();

    auto job = [&](int tid) {
        // phase 0: convert activations, token rows split across threads
        for (int64_t t = tid; t < T; t += nt) {
            if (x_bf16) {
                const uint16_t* src = reinterpret_cast<const uint16_t*>(x_ptr) + t * x_ld;
                if (act_bf16) std::memcpy(xbuf.data() + t * H * 2, src, H * 2);
                else {
                    float* dst = reinterpret_cast<float*>(xbuf.data()) + t * H;
                    for (int64_t i = 0; i < H; ++i) dst[i] = bf16_to_f32(src[i]);
                }
            } else {
                const float* src = reinterpret_cast<const float*>(x_ptr) + t * x_ld;
                if (act_bf16) {
                    uint16_t* dst = reinterpret_cast<uint16_t*>(xbuf.data()) + t * H;
                    for (int64_t i = 0; i < H; ++i) dst[i] = f32_to_bf16(src[i]);
                } else {
                    std::memcpy(xbuf.data() + t * H * 4, src, H * 4);
                }
            }
        }
        p.barrier();

        // phase 1: gate/up rows of every group; chunk c = rows [c % cpg * kChunk, +kChunk) of group c / cpg
        {
            float gbuf[kRows * 64], ubuf[kRows * 64];
            for (int64_t c; (c = next1.fetch_add(1, std::memory_order_relaxed)) < chunks1;) {
                const Group& gr = groups[c / chunks_per_group];
                const int64_t c0 = (c % chunks_per_group) * kChunk, c1 = std::min(I, c0 + kChunk);
                const int ntok = gr.end - gr.begin;
                const uint16_t* W = w13 + gr.row * w13_es;
                for (int64_t r0 = c0; r0 < c1; r0 += kRows) {
                    const int nr = static_cast<int>(std::min<int64_t>(kRows, c1 - r0));
                    for (int tb = 0; tb < ntok; tb += 64) {
                        const int nb = std::min(64, ntok - tb);
                        const void* const* X = xptr.data() + gr.begin + tb;
                        gemv(W + r0 * w13_ld, w13_ld, nr, X, nb, int(H), gbuf, kRows);
                        gemv(W + (I + r0) * w13_ld, w13_ld, nr, X, nb, int(H), ubuf, kRows);
                        for (int t = 0; t < nb; ++t) {
                            const int64_t e = gr.begin + tb + t;
                            for (int r = 0; r < nr; ++r) {
                                float hv = silu(gbuf[t * kRows + r]) * ubuf[t * kRows + r];
                                if (act_bf16)
                                    reinterpret_cast<uint16_t*>(hbuf.data())[e * I + r0 + r] = f32_to_bf16(hv);
                                else
                                    reinterpret_cast<float*>(hbuf.data())[e * I + r0 + r] = hv;
                            }
                        }
                    }
                }
            }
        }
        p.barrier();

        // phase 2: chunks of down-projection output rows; the thread holding a chunk loops over all
        // experts for it, so it owns those output columns (no atomics on the output)
        {
            float dbuf[kRows * 64];
            for (int64_t c; (c = next2.fetch_add(1, std::memory_order_relaxed)) < chunks2;) {
                const int64_t h0 = c * kChunk, h1 = std::min(H, h0 + kChunk);
                for (int64_t t = 0; t < T; ++t) std::fill(&acc[t * H + h0], &acc[t * H + h1], 0.f);
                for (const Group& gr : groups) {
                    const uint16_t* W = w2 + gr.row * w2_es;
                    const int ntok = gr.end - gr.begin;
                    for (int64_t r0 = h0; r0 < h1; r0 += kRows) {
                        const int nr = static_cast<int>(std::min<int64_t>(kRows, h1 - r0));
                        for (int tb = 0; tb < ntok; tb += 64) {
                            const int nb = std::min(64, ntok - tb);
                            gemv(W + r0 * w2_ld, w2_ld, nr, hptr.data() + gr.begin + tb, nb, int(I), dbuf, kRows);
                            for (int t = 0; t < nb; ++t) {
                                const int64_t e = gr.begin + tb + t;
                                float* a = &acc[entry_token[e] * H + r0];
                                const float w = entry_w[e];
                                for (int r = 0; r < nr; ++r) a[r] += w * dbuf[t * kRows + r];
                            }
                        }
                    }
                }
                for (int64_t t = 0; t < T; ++t) {
                    const float* a = &acc[t * H];
                    if (out_bf16) {
                        uint16_t* o = reinterpret_cast<uint16_t*>(out_ptr) + t * out_ld;
                        for (int64_t i = h0; i < h1; ++i) o[i] = f32_to_bf16(a[i]);
                    } else {
                        float* o = reinterpret_cast<float*>(out_ptr) + t * out_ld;
                        for (int64_t i = h0; i < h1; ++i) o[i] = a[i];
                    }
                }
            }
        }
    };
    std::function<void(int)> fn = job;
    p.run(fn);
}

// Reads nbytes from ptr with the pool's threads (bandwidth reference for the same bytes); returns a
// checksum so the reads cannot be optimized away.
#pragma GCC push_options
#pragma GCC target("avx2")
uint64_t read_chunk_avx2(const char* p, size_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        a0 = _mm256_xor_si256(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
        a1 = _mm256_xor_si256(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    }
    a0 = _mm256_xor_si256(a0, a1);
    uint64_t s = _mm256_extract_epi64(a0, 0) ^ _mm256_extract_epi64(a0, 1) ^ _mm256_extract_epi64(a0, 2) ^
                 _mm256_extract_epi64(a0, 3);
    for (; i < n; ++i) s ^= static_cast<unsigned char>(p[i]);
    return s;
}
#pragma GCC pop_options

uint64_t read_chunk_scalar(const char* p, size_t n) {
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

uint64_t read_bytes(uintptr_t ptr, int64_t nbytes) {
    if (nbytes < 0) throw std::invalid_argument("nbytes must be >= 0");
    const bool v = isa_supported(Isa::avx2);
    std::shared_ptr<Pool> pool_ref = pool();
    Pool& p = *pool_ref;
    std::lock_guard<std::mutex> call(p.call_mutex);
    const int nt = p.size();
    std::vector<uint64_t> sums(nt);
    std::function<void(int)> fn = [&](int tid) {
        size_t a = static_cast<size_t>(nbytes) * tid / nt / 64 * 64;
        size_t b = tid == nt - 1 ? static_cast<size_t>(nbytes) : static_cast<size_t>(nbytes) * (tid + 1) / nt / 64 * 64;
        const char* base = reinterpret_cast<const char*>(ptr) + a;
        sums[tid] = v ? read_chunk_avx2(base, b - a) : read_chunk_scalar(base, b - a);
    };
    p.run(fn);
    uint64_t s = 0;
    for (uint64_t x : sums) s ^= x;
    return s;
}

}  // namespace

PYBIND11_MODULE(_ftnative, m) {
    m.doc() = "freetoken native CPU MoE expert executor (raw-pointer API; use native/ftnative.py)";
    g_isa.store(static_cast<int>(best_isa()));
    if (const char* env = std::getenv("FREETOKEN_NATIVE_ISA"); env && *env) set_isa(env);

    m.def("moe_layer", &moe_layer, py::call_guard<py::gil_scoped_release>(), py::arg("x_ptr"),
          py::arg("x_bf16"), py::arg("x_ld"), py::arg("out_ptr"), py::arg("out_bf16"), py::arg("out_ld"),
          py::arg("T"), py::arg("H"), py::arg("I"), py::arg("ids_ptr"), py::arg("weights_ptr"), py::arg("k"),
          py::arg("w13_ptr"), py::arg("w13_expert_stride"), py::arg("w13_row_stride"), py::arg("w2_ptr"),
          py::arg("w2_expert_stride"), py::arg("w2_row_stride"), py::arg("num_rows"),
          "Raw MoE layer call; all checking of pointers/shapes is the caller's job (see ftnative.py).");
    m.def("read_bytes", &read_bytes, py::call_guard<py::gil_scoped_release>(), py::arg("ptr"),
          py::arg("nbytes"), "Read nbytes with the pool threads (bandwidth reference); returns a checksum.");
    m.def("set_isa", &set_isa, py::arg("name"), "Force an ISA path: avx512bf16|avx512|avx2|scalar|auto.");
    m.def("get_isa", [] { return std::string(isa_name(static_cast<Isa>(g_isa.load()))); });
    m.def("supported_isas", [] {
        std::vector<std::string> out;
        for (Isa i : {Isa::avx512bf16, Isa::avx512, Isa::avx2, Isa::scalar})
            if (isa_supported(i)) out.push_back(isa_name(i));
        return out;
    });
    m.def("set_num_threads", &set_num_threads, py::call_guard<py::gil_scoped_release>(), py::arg("n"),
          py::arg("pin") = true, "Stop the pool; the next call starts n threads (0 = all allowed CPUs).");
    m.def("num_threads", [] { return pool_info().threads; }, py::call_guard<py::gil_scoped_release>());
    m.def("num_pinned", [] { return pool_info().pinned; }, py::call_guard<py::gil_scoped_release>());
    m.def("shutdown", &shutdown_pool, py::call_guard<py::gil_scoped_release>(),
          "Join the worker threads (restarted lazily by the next call).");
}
