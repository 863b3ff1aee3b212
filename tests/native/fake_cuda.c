/* A stand-in for libcuda.so.1 with the driver calls native/src/dma_fetch.cpp makes, for
   tests on machines without a GPU (tests/native/test_dma_fetch.py): "device" addresses are host
   addresses, an asynchronous copy is a memcpy, a stream query answers
   "not ready" as often as the test asks, then done. It records the calls so
   the test can check what the poller asked of the driver. */
#include <stdint.h>
#include <string.h>

static void* g_ctx;
static void* g_stream;
static int g_copies;
static int g_fail_copy_at = -1; /* the n-th copy (from 0) returns an error */
static volatile int g_hold;
static int g_queries, g_pending; /* cuStreamQuery calls; answers "not ready" this many times first */ /* while set, a copy waits inside the call (a driver call that blocks) */

int cuCtxSetCurrent(void* ctx) {
    g_ctx = ctx;
    return 0;
}

int cuMemcpyHtoDAsync_v2(uint64_t dst, const void* src, size_t bytes, void* stream) {
    if (g_copies == g_fail_copy_at) return 700; /* CUDA_ERROR_ILLEGAL_ADDRESS */
    while (g_hold) __sync_synchronize();
    g_copies++;
    g_stream = stream;
    memcpy((void*)(uintptr_t)dst, src, bytes);
    return 0;
}

/* CUDA_MEMCPY2D's fields as the driver lays them out (host source, device destination here) */
struct memcpy2d {
    size_t src_x, src_y;
    int src_type;
    const void* src_host;
    uint64_t src_device;
    void* src_array;
    size_t src_pitch;
    size_t dst_x, dst_y;
    int dst_type;
    void* dst_host;
    uint64_t dst_device;
    void* dst_array;
    size_t dst_pitch;
    size_t width, height;
};

int cuMemcpy2DAsync_v2(const struct memcpy2d* c, void* stream) {
    if (g_copies == g_fail_copy_at) return 700;
    if (c->src_type != 1 || c->dst_type != 2) return 1; /* CUDA_ERROR_INVALID_VALUE */
    g_copies++;
    g_stream = stream;
    for (size_t y = 0; y < c->height; ++y)
        memcpy((char*)(uintptr_t)c->dst_device + y * c->dst_pitch, (const char*)c->src_host + y * c->src_pitch,
               c->width);
    return 0;
}

int cuStreamQuery(void* stream) {
    g_queries++;
    g_stream = stream;
    if (g_pending > 0) {
        g_pending--;
        return 600; /* CUDA_ERROR_NOT_READY */
    }
    return 0;
}

void* fake_ctx(void) { return g_ctx; }
void* fake_stream(void) { return g_stream; }
int fake_copies(void) { return g_copies; }
void fake_fail_copy_at(int n) { g_fail_copy_at = n; }
void fake_hold(int on) { g_hold = on; }
int fake_queries(void) { return g_queries; }
void fake_pending(int n) { g_pending = n; }
