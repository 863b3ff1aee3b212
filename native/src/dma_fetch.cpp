// See dma_fetch.h.
#include "dma_fetch.h"

#include "pool.h"  // cpu_relax

#include <dlfcn.h>

#include <atomic>
#include <chrono>
#include <mutex>

namespace ft {
namespace {

using CUresult = int;
using MemcpyHtoDAsync = CUresult (*)(uint64_t dst, const void* src, size_t bytes, void* stream);
using WriteValue32 = CUresult (*)(void* stream, uint64_t addr, uint32_t value, unsigned flags);
using CtxSetCurrent = CUresult (*)(void* ctx);
using StreamQuery = CUresult (*)(void* stream);
constexpr CUresult kNotReady = 600;  // CUDA_ERROR_NOT_READY: the stream still has work

struct Driver {
    MemcpyHtoDAsync memcpy_htod = nullptr;
    WriteValue32 write_value = nullptr;
    CtxSetCurrent set_current = nullptr;
    StreamQuery query = nullptr;
    std::string error;
};

const Driver& driver() {
    static Driver d;
    static std::once_flag once;
    std::call_once(once, [] {
        void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (lib == nullptr) {
            d.error = "cannot open libcuda.so.1";
            return;
        }
        auto sym = [lib](const char* a, const char* b) {
            void* p = dlsym(lib, a);
            return p != nullptr ? p : dlsym(lib, b);
        };
        d.memcpy_htod = reinterpret_cast<MemcpyHtoDAsync>(sym("cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync"));
        d.write_value = reinterpret_cast<WriteValue32>(sym("cuStreamWriteValue32_v2", "cuStreamWriteValue32"));
        d.set_current = reinterpret_cast<CtxSetCurrent>(sym("cuCtxSetCurrent", "cuCtxSetCurrent"));
        d.query = reinterpret_cast<StreamQuery>(sym("cuStreamQuery", "cuStreamQuery"));
        if (d.memcpy_htod == nullptr || d.write_value == nullptr || d.set_current == nullptr || d.query == nullptr)
            d.error = "libcuda.so.1 lacks cuMemcpyHtoDAsync / cuStreamWriteValue32 / cuCtxSetCurrent / cuStreamQuery";
    });
    return d;
}

thread_local void* t_current = nullptr;  // the context made current on this thread

}  // namespace

void dma_fetch_release(const DmaFetch& f) noexcept {
    std::atomic_thread_fence(std::memory_order_release);  // the copies' completion / the failure's record first
    if (f.word_host != nullptr) *f.word_host = 1;
}

std::string dma_fetch_issue(const DmaFetch& f) noexcept {
    try {
        const Driver& d = driver();
        if (!d.error.empty()) return d.error;
        if (t_current != f.context) {
            if (const CUresult r = d.set_current(f.context); r != 0)
                return "cuCtxSetCurrent failed with CUDA driver error " + std::to_string(r);
            t_current = f.context;
        }
        for (int64_t i = 0; i < f.n; ++i) {
            const int64_t row = f.copy[i], slot = f.copy[f.n + i];
            if (row < 0) continue;
            if (row >= f.rows || slot < 0 || slot >= f.slots)
                return "copy list entry (" + std::to_string(row) + ", " + std::to_string(slot) +
                       ") outside the banks / slots";
            CUresult r = d.memcpy_htod(f.slot13 + static_cast<uint64_t>(slot) * f.bytes13,
                                       reinterpret_cast<const void*>(f.bank13 + static_cast<uint64_t>(row) * f.bytes13),
                                       f.bytes13, f.stream);
            if (r == 0)
                r = d.memcpy_htod(f.slot2 + static_cast<uint64_t>(slot) * f.bytes2,
                                  reinterpret_cast<const void*>(f.bank2 + static_cast<uint64_t>(row) * f.bytes2),
                                  f.bytes2, f.stream);
            if (r != 0) return "cuMemcpyHtoDAsync failed with CUDA driver error " + std::to_string(r);
        }
        if (f.host_word) {
            // the copies have landed when the stream has drained; then the host's store releases
            // the GPU's GEMVs, as the poller's answer does (no stream waits on another's memop)
            const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(f.deadline_ms);
            CUresult r;
            for (uint32_t spins = 0; (r = d.query(f.stream)) == kNotReady; ++spins) {
                // a query takes the driver's lock: ask every 1-2 us (32 pauses), not back to back, while the
                // copies take ~0.1-1 ms
                for (int i = 0; i < 32; ++i) cpu_relax();
                if ((spins & 255) == 255 && std::chrono::steady_clock::now() > deadline)
                    return "the host-issued copies did not land within " + std::to_string(f.deadline_ms) + " ms";
            }
            if (r != 0) return "cuStreamQuery failed with CUDA driver error " + std::to_string(r);
            dma_fetch_release(f);
            return {};
        }
        // after the copies in stream order: the GPU's wait on this word releases its GEMVs
        if (const CUresult r = d.write_value(f.stream, f.word_device, 1, 0); r != 0)
            return "cuStreamWriteValue32 failed with CUDA driver error " + std::to_string(r);
        return {};
    } catch (...) {
        return "host-issued fetch failed";
    }
}

}  // namespace ft
