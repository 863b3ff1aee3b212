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
using CtxSetCurrent = CUresult (*)(void* ctx);
using StreamQuery = CUresult (*)(void* stream);
// the driver's CUDA_MEMCPY2D (cuda.h), for the split expert's pitched copy of w2's first columns
struct Memcpy2D {
    size_t src_x = 0, src_y = 0;
    int src_type = 0;  // CU_MEMORYTYPE_HOST = 1, CU_MEMORYTYPE_DEVICE = 2
    const void* src_host = nullptr;
    uint64_t src_device = 0;
    void* src_array = nullptr;
    size_t src_pitch = 0;
    size_t dst_x = 0, dst_y = 0;
    int dst_type = 0;
    void* dst_host = nullptr;
    uint64_t dst_device = 0;
    void* dst_array = nullptr;
    size_t dst_pitch = 0;
    size_t width = 0, height = 0;
};
using Memcpy2DAsync = CUresult (*)(const Memcpy2D* copy, void* stream);
constexpr CUresult kNotReady = 600;  // CUDA_ERROR_NOT_READY: the stream still has work

struct Driver {
    MemcpyHtoDAsync memcpy_htod = nullptr;
    CtxSetCurrent set_current = nullptr;
    StreamQuery query = nullptr;
    Memcpy2DAsync memcpy_2d = nullptr;
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
        d.set_current = reinterpret_cast<CtxSetCurrent>(sym("cuCtxSetCurrent", "cuCtxSetCurrent"));
        d.query = reinterpret_cast<StreamQuery>(sym("cuStreamQuery", "cuStreamQuery"));
        d.memcpy_2d = reinterpret_cast<Memcpy2DAsync>(sym("cuMemcpy2DAsync_v2", "cuMemcpy2DAsync"));
        if (d.memcpy_htod == nullptr || d.set_current == nullptr || d.query == nullptr || d.memcpy_2d == nullptr)
            d.error = "libcuda.so.1 lacks cuMemcpyHtoDAsync / cuMemcpy2DAsync / cuCtxSetCurrent / cuStreamQuery";
    });
    return d;
}

thread_local void* t_current = nullptr;  // the context made current on this thread

// The split expert's first r rows into the scratch slot: "" or why not.
std::string issue_split(const Driver& d, const DmaFetch& f) {
    const int64_t row = f.copy[2 * f.n], r = f.copy[2 * f.n + 1];
    if (row < 0) return {};
    if (row >= f.rows || r <= 0 || r >= f.inter)
        return "split entry (" + std::to_string(row) + ", " + std::to_string(r) + ") outside the banks / rows";
    const uint64_t part = static_cast<uint64_t>(r * f.hidden * f.elem);  // r rows of w13
    const uint64_t src13 = f.bank13 + static_cast<uint64_t>(row) * f.bytes13;
    const uint64_t dst13 = f.slot13 + static_cast<uint64_t>(f.scratch) * f.bytes13;
    const uint64_t up = static_cast<uint64_t>(f.inter * f.hidden * f.elem);  // the up rows' offset
    CUresult res = d.memcpy_htod(dst13, reinterpret_cast<const void*>(src13), part, f.stream);
    if (res == 0) res = d.memcpy_htod(dst13 + up, reinterpret_cast<const void*>(src13 + up), part, f.stream);
    if (res != 0) return "cuMemcpyHtoDAsync failed with CUDA driver error " + std::to_string(res);
    Memcpy2D c;
    c.src_type = 1;
    c.src_host = reinterpret_cast<const void*>(f.bank2 + static_cast<uint64_t>(row) * f.bytes2);
    c.src_pitch = static_cast<size_t>(f.inter * f.elem);
    c.dst_type = 2;
    c.dst_device = f.slot2 + static_cast<uint64_t>(f.scratch) * f.bytes2;
    c.dst_pitch = c.src_pitch;
    c.width = static_cast<size_t>(r * f.elem);
    c.height = static_cast<size_t>(f.hidden);
    if (const CUresult r2 = d.memcpy_2d(&c, f.stream); r2 != 0)
        return "cuMemcpy2DAsync failed with CUDA driver error " + std::to_string(r2);
    return {};
}

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
        const uint64_t stride13 = f.slot_stride ? f.slot_stride : f.bytes13;
        const uint64_t stride2 = f.slot_stride ? f.slot_stride : f.bytes2;
        for (int64_t i = 0; i < f.n; ++i) {
            const int64_t entry = f.copy[i], slot = f.copy[f.n + i];
            if (entry < 0) continue;
            const int64_t row = entry - f.row_offset;
            if (row < 0 || row >= f.rows || slot < 0 || slot >= f.slots)
                return "copy list entry (" + std::to_string(entry) + ", " + std::to_string(slot) +
                       ") outside the banks / slots";
            CUresult r = d.memcpy_htod(f.slot13 + static_cast<uint64_t>(slot) * stride13,
                                       reinterpret_cast<const void*>(f.bank13 + static_cast<uint64_t>(row) * f.bytes13),
                                       f.bytes13, f.stream);
            if (r == 0)
                r = d.memcpy_htod(f.slot2 + static_cast<uint64_t>(slot) * stride2,
                                  reinterpret_cast<const void*>(f.bank2 + static_cast<uint64_t>(row) * f.bytes2),
                                  f.bytes2, f.stream);
            if (r == 0 && f.gs_bank != 0)
                r = d.memcpy_htod(f.gs_slot + static_cast<uint64_t>(slot) * 12,
                                  reinterpret_cast<const void*>(f.gs_bank + static_cast<uint64_t>(row) * 12), 12,
                                  f.stream);
            if (r != 0) return "cuMemcpyHtoDAsync failed with CUDA driver error " + std::to_string(r);
        }
        if (f.scratch >= 0)
            if (std::string e = issue_split(d, f); !e.empty()) return e;
        // the copies have landed when the stream has drained; then the host's store releases the
        // GPU's GEMVs, as the poller's answer does (no stream waits on another's memop)
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
    } catch (...) {
        return "host-issued fetch failed";
    }
}

}  // namespace ft
