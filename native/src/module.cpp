// Python bindings of the native expert executor (raw addresses and sizes; native/ftnative.py checks
// every tensor before calling, because a bad pointer here is a crash, not an exception).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "host_task.h"
#include "poller.h"
#include "moe_layer.h"
#include "moe_packed.h"
#include "pool.h"
#include "read_bound.h"

namespace py = pybind11;
using namespace ft;

namespace {

LayerArgs make_args(uintptr_t x, bool x_bf16, int64_t x_ld, uintptr_t out, bool out_bf16, int64_t out_ld, int64_t T,
                    int64_t H, int64_t I, uintptr_t ids, uintptr_t weights, int64_t k, int fmt, uintptr_t w13,
                    int64_t w13_es, int64_t w13_ld, uintptr_t s13, int64_t s13_es, int64_t s13_ld, uintptr_t w2,
                    int64_t w2_es, int64_t w2_ld, uintptr_t s2, int64_t s2_es, int64_t s2_ld, int64_t bn, int64_t bk,
                    int64_t num_rows, int64_t id_offset, bool skip_negative) {
    LayerArgs a;
    a.x = reinterpret_cast<const void*>(x);
    a.x_bf16 = x_bf16;
    a.x_ld = x_ld;
    a.out = reinterpret_cast<void*>(out);
    a.out_bf16 = out_bf16;
    a.out_ld = out_ld;
    a.T = T, a.H = H, a.I = I, a.k = k;
    a.ids = reinterpret_cast<const int64_t*>(ids);
    a.weights = reinterpret_cast<const float*>(weights);
    a.fmt = fmt;
    a.w13 = {reinterpret_cast<const uint8_t*>(w13), w13_es, w13_ld, reinterpret_cast<const uint8_t*>(s13), s13_es, s13_ld};
    a.w2 = {reinterpret_cast<const uint8_t*>(w2), w2_es, w2_ld, reinterpret_cast<const uint8_t*>(s2), s2_es, s2_ld};
    a.bn = bn, a.bk = bk;
    a.num_rows = num_rows;
    a.id_offset = id_offset;
    a.skip_negative = skip_negative;
    return a;
}

void layer(uintptr_t x, bool x_bf16, int64_t x_ld, uintptr_t out, bool out_bf16, int64_t out_ld, int64_t T, int64_t H,
           int64_t I, uintptr_t ids, uintptr_t weights, int64_t k, int fmt, uintptr_t w13, int64_t w13_es,
           int64_t w13_ld, uintptr_t s13, int64_t s13_es, int64_t s13_ld, uintptr_t w2, int64_t w2_es, int64_t w2_ld,
           uintptr_t s2, int64_t s2_es, int64_t s2_ld, int64_t bn, int64_t bk, int64_t num_rows, int64_t id_offset,
           bool skip_negative, uintptr_t split) {
    LayerArgs a = make_args(x, x_bf16, x_ld, out, out_bf16, out_ld, T, H, I, ids, weights, k, fmt, w13, w13_es, w13_ld,
                            s13, s13_es, s13_ld, w2, w2_es, w2_ld, s2, s2_es, s2_ld, bn, bk, num_rows, id_offset,
                            skip_negative);
    a.split = reinterpret_cast<const int64_t*>(split);
    moe_layer(a);
}

// A heap HostTask (see host_task.h) for the same arguments; freed by host_task_free.
uintptr_t host_task_create(uintptr_t x, bool x_bf16, int64_t x_ld, uintptr_t out, bool out_bf16, int64_t out_ld,
                           int64_t T, int64_t H, int64_t I, uintptr_t ids, uintptr_t weights, int64_t k, int fmt,
                           uintptr_t w13, int64_t w13_es, int64_t w13_ld, uintptr_t s13, int64_t s13_es,
                           int64_t s13_ld, uintptr_t w2, int64_t w2_es, int64_t w2_ld, uintptr_t s2, int64_t s2_es,
                           int64_t s2_ld, int64_t bn, int64_t bk, int64_t num_rows, int64_t id_offset,
                           bool skip_negative) {
    auto* t = new HostTask;
    t->args = make_args(x, x_bf16, x_ld, out, out_bf16, out_ld, T, H, I, ids, weights, k, fmt, w13, w13_es, w13_ld,
                        s13, s13_es, s13_ld, w2, w2_es, w2_ld, s2, s2_es, s2_ld, bn, bk, num_rows, id_offset,
                        skip_negative);
    return reinterpret_cast<uintptr_t>(t);
}

// Gives a task a host-issued fetch (see dma_fetch.h); before the task serves a doorbell.
void host_task_set_fetch(uintptr_t task, uintptr_t copy, int64_t n, uintptr_t bank13, uintptr_t bank2,
                         uintptr_t slot13, uintptr_t slot2, int64_t bytes13, int64_t bytes2, int64_t rows,
                         int64_t slots, uintptr_t stream, uintptr_t context,
                         uintptr_t word_host, int64_t deadline_ms, int64_t scratch, int64_t inter,
                         int64_t hidden, int64_t elem, int64_t row_offset, uint64_t slot_stride,
                         uintptr_t gs_bank, uintptr_t gs_slot, uintptr_t bias_bank, uintptr_t bias_slot,
                         uint64_t bias_bytes) {
    auto f = std::make_unique<DmaFetch>();
    f->copy = reinterpret_cast<const int64_t*>(copy);
    f->n = n;
    f->bank13 = bank13;
    f->bank2 = bank2;
    f->slot13 = slot13;
    f->slot2 = slot2;
    f->bytes13 = static_cast<uint64_t>(bytes13);
    f->bytes2 = static_cast<uint64_t>(bytes2);
    f->rows = rows;
    f->slots = slots;
    f->stream = reinterpret_cast<void*>(stream);
    f->context = reinterpret_cast<void*>(context);
    f->word_host = reinterpret_cast<volatile uint32_t*>(word_host);
    f->deadline_ms = deadline_ms;
    f->scratch = scratch;
    f->inter = inter, f->hidden = hidden, f->elem = elem;
    f->row_offset = row_offset, f->slot_stride = slot_stride, f->gs_bank = gs_bank, f->gs_slot = gs_slot;
    f->bias_bank = bias_bank, f->bias_slot = bias_slot, f->bias_bytes = bias_bytes;
    auto* t = reinterpret_cast<HostTask*>(task);
    // the split expert's entry follows the copy list: the CPU computes that expert's other rows
    if (scratch >= 0) t->args.split = f->copy + 2 * n;
    t->fetch = std::move(f);
}

py::tuple host_task_status(uintptr_t task) {
    auto* t = reinterpret_cast<HostTask*>(task);
    std::lock_guard<std::mutex> lock(t->error_mutex);
    return py::make_tuple(t->runs.load(), t->failures.load(), t->error);
}

uint64_t read_ranges_py(const std::vector<uintptr_t>& ptrs, const std::vector<int64_t>& sizes) {
    if (ptrs.size() != sizes.size()) throw std::invalid_argument("ptrs and sizes differ in length");
    return read_ranges(ptrs.data(), sizes.data(), static_cast<int64_t>(ptrs.size()));
}

// Median wall time of `reps` back-to-back calls of a minimal layer (T=1, H=I=32, k=1, f32): the
// fixed cost of one call (pool wake-up, two barriers, bookkeeping) with the GIL released.
double call_overhead_us(int reps) {
    std::vector<float> x(32, 0.5f), out(32), w13(64 * 32, 0.01f), w2(32 * 32, 0.01f), wt(1, 1.0f);
    std::vector<int64_t> id(1, 0);
    LayerArgs a;
    a.x = x.data(), a.out = out.data(), a.x_ld = a.out_ld = 32;
    a.T = 1, a.H = 32, a.I = 32, a.k = 1, a.ids = id.data(), a.weights = wt.data(), a.fmt = int(Fmt::f32);
    a.w13 = {reinterpret_cast<const uint8_t*>(w13.data()), 64 * 32 * 4, 32 * 4, nullptr, 0, 0};
    a.w2 = {reinterpret_cast<const uint8_t*>(w2.data()), 32 * 32 * 4, 32 * 4, nullptr, 0, 0};
    a.num_rows = 1;
    std::vector<double> t(reps > 0 ? reps : 1);
    for (int i = 0; i < 10; ++i) moe_layer(a);
    for (auto& v : t) {
        auto t0 = std::chrono::steady_clock::now();
        moe_layer(a);
        v = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

// The arguments of one layer over packed banks (moe_packed.h).
void packed_args(LayerArgs& a, PackedBanks& b, uintptr_t x, bool x_bf16, int64_t x_ld, uintptr_t out, int64_t out_ld,
                 int64_t T, int64_t H, int64_t I, int64_t k, uintptr_t ids32, uintptr_t weights, int64_t E,
                 uintptr_t gu, int64_t gu_es, int64_t gu_rb, int fmt_gu, uintptr_t d, int64_t d_es, int64_t d_rb,
                 int fmt_d, uintptr_t gscale, uintptr_t b_gu, uintptr_t b_d, int act, float alpha, float limit) {
    a.x = reinterpret_cast<const void*>(x);
    a.x_bf16 = x_bf16;
    a.x_ld = x_ld;
    a.out = reinterpret_cast<void*>(out);
    a.out_ld = out_ld;
    a.accumulate = true;
    a.T = T, a.H = H, a.I = I, a.k = k;
    a.ids32 = reinterpret_cast<const int32_t*>(ids32);
    a.skip_negative = true;
    a.weights = reinterpret_cast<const float*>(weights);
    a.num_rows = E;
    b.gu = reinterpret_cast<const uint8_t*>(gu), b.gu_expert_stride = gu_es, b.gu_row_bytes = gu_rb, b.fmt_gu = fmt_gu;
    b.d = reinterpret_cast<const uint8_t*>(d), b.d_expert_stride = d_es, b.d_row_bytes = d_rb, b.fmt_d = fmt_d;
    b.gscale = reinterpret_cast<const float*>(gscale);
    b.b_gu = reinterpret_cast<const float*>(b_gu), b.b_d = reinterpret_cast<const float*>(b_d);
    b.act = static_cast<Act>(act), b.alpha = alpha, b.limit = limit;
}

#define FT_PACKED_PARAMS                                                                                              \
    uintptr_t x, bool x_bf16, int64_t x_ld, uintptr_t out, int64_t out_ld, int64_t T, int64_t H, int64_t I, int64_t k, \
        uintptr_t ids32, uintptr_t weights, int64_t E, uintptr_t gu, int64_t gu_es, int64_t gu_rb, int fmt_gu,       \
        uintptr_t d, int64_t d_es, int64_t d_rb, int fmt_d, uintptr_t gscale, uintptr_t b_gu, uintptr_t b_d, int act, \
        float alpha, float limit
#define FT_PACKED_ARGS x, x_bf16, x_ld, out, out_ld, T, H, I, k, ids32, weights, E, gu, gu_es, gu_rb, fmt_gu, d, d_es, \
                       d_rb, fmt_d, gscale, b_gu, b_d, act, alpha, limit

// One layer over packed banks; out (float32) += the layer's result.
void packed_layer(FT_PACKED_PARAMS) {
    LayerArgs a;
    PackedBanks b;
    packed_args(a, b, FT_PACKED_ARGS);
    moe_packed(a, b);
}

// A heap HostTask over packed banks (same arguments); its runs overwrite out (the GPU adds it).
uintptr_t host_task_create_packed(FT_PACKED_PARAMS) {
    auto* t = new HostTask;
    t->packed = std::make_unique<PackedBanks>();
    packed_args(t->args, *t->packed, FT_PACKED_ARGS);
    t->args.accumulate = false;
    return reinterpret_cast<uintptr_t>(t);
}

// n blocks of a packed format at src, dequantized (scalar decoder) to n * B floats at dst.
void packed_dequantize(int fmt, uintptr_t src, int64_t n, uintptr_t dst) {
    if (fmt < 0 || fmt >= kNumQ) throw std::invalid_argument("unknown packed format");
    const QInfo& q = kQInfo[fmt];
    for (int64_t i = 0; i < n; ++i)
        dequant_block(static_cast<QFmt>(fmt), reinterpret_cast<const uint8_t*>(src) + i * q.bytes,
                      reinterpret_cast<float*>(dst) + i * q.block);
}

}  // namespace

PYBIND11_MODULE(_ftnative, m) {
    m.doc() = "freetoken native CPU MoE expert executor (raw-address API; use native/ftnative.py)";

    m.def("moe_layer", &layer, py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("x_bf16"),
          py::arg("x_ld"), py::arg("out"), py::arg("out_bf16"), py::arg("out_ld"), py::arg("T"), py::arg("H"),
          py::arg("I"), py::arg("ids"), py::arg("weights"), py::arg("k"), py::arg("fmt"), py::arg("w13"),
          py::arg("w13_es"), py::arg("w13_ld"), py::arg("s13"), py::arg("s13_es"), py::arg("s13_ld"), py::arg("w2"),
          py::arg("w2_es"), py::arg("w2_ld"), py::arg("s2"), py::arg("s2_es"), py::arg("s2_ld"), py::arg("bn"),
          py::arg("bk"), py::arg("num_rows"), py::arg("id_offset") = 0, py::arg("skip_negative") = false,
          py::arg("split") = 0, "Raw MoE layer call (see native/src/moe_layer.h for layouts).");
    m.def("moe_packed", &packed_layer, py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("x_bf16"),
          py::arg("x_ld"), py::arg("out"), py::arg("out_ld"), py::arg("T"), py::arg("H"), py::arg("I"), py::arg("k"),
          py::arg("ids32"), py::arg("weights"), py::arg("E"), py::arg("gu"), py::arg("gu_es"), py::arg("gu_rb"),
          py::arg("fmt_gu"), py::arg("d"), py::arg("d_es"), py::arg("d_rb"), py::arg("fmt_d"), py::arg("gscale"),
          py::arg("b_gu"), py::arg("b_d"), py::arg("act"), py::arg("alpha"), py::arg("limit"),
          "Raw packed-bank MoE layer call, out += result (see native/src/moe_packed.h).");
    m.def("host_task_create_packed", &host_task_create_packed,
          "A prepared packed-bank layer call for the doorbell poller (moe_packed's arguments; out overwritten).");
    m.def("packed_formats", [] {
        std::vector<py::tuple> out;
        for (int f = 0; f < kNumQ; ++f) out.push_back(py::make_tuple(kQInfo[f].name, kQInfo[f].block, kQInfo[f].bytes));
        return out;
    }, "(name, values per block, bytes per block) of each packed format, by format code.");
    m.def("packed_dequantize", &packed_dequantize, py::call_guard<py::gil_scoped_release>(), py::arg("fmt"),
          py::arg("src"), py::arg("n"), py::arg("dst"), "n blocks at src -> n * B float32 at dst (scalar decoder).");
    m.def("host_task_create", &host_task_create, "A prepared layer call for the doorbell poller (same arguments).");
    m.def("host_task_free", [](uintptr_t t) { delete reinterpret_cast<HostTask*>(t); });
    m.def("host_task_run", [](uintptr_t t) { ft_host_task_run(reinterpret_cast<void*>(t)); },
          py::call_guard<py::gil_scoped_release>(), "Run a prepared call in this thread.");
    m.def("host_task_status", &host_task_status, "(runs, failures, first error message)");
    m.def("host_task_set_fetch", &host_task_set_fetch, "Give a task a host-issued fetch (see native/src/dma_fetch.h).");
    m.def("host_task_fetch", [](uintptr_t t) { ft_host_task_fetch(reinterpret_cast<void*>(t)); },
          py::call_guard<py::gil_scoped_release>(), "Issue a task's fetch in this thread (as the poller does).");
    m.def("poll_register", [](uintptr_t task, uintptr_t request, uintptr_t done, uintptr_t ready) {
        poll_register(reinterpret_cast<void*>(task), reinterpret_cast<volatile uint32_t*>(request),
                      reinterpret_cast<volatile uint32_t*>(done), reinterpret_cast<volatile uint32_t*>(ready));
    }, py::arg("task"), py::arg("request"), py::arg("done"), py::arg("ready") = 0,
          "Serve a prepared call whenever its request word becomes nonzero (see native/src/poller.h).");
    m.def("poll_lateness", [] {
        int64_t cpu = 0, gpu = 0;
        poll_lateness(&cpu, &gpu);
        return py::make_tuple(cpu, gpu);
    }, "(requests whose CPU branch finished last, requests whose GPU branch did), all tasks so far.");
    m.def("poll_unregister", [](uintptr_t task) { poll_unregister(reinterpret_cast<void*>(task)); },
          py::call_guard<py::gil_scoped_release>());
    m.def("poll_stop", &poll_stop, py::call_guard<py::gil_scoped_release>());
    m.def("poll_served", &poll_served);
    m.def("poll_timeline", [] {
        const PollTimeline t = poll_timeline();
        return py::make_tuple(t.served, t.cpu_ns, t.gaps, t.gap_ns, t.fetches, t.fetch_ns, t.fetch_late);
    }, "(served, cpu_ns, gaps, gap_ns, fetches, fetch_ns, fetch_late): sums since start (poller.h).");
    m.def("poll_copier_state", [] {
        bool up = false, pending = false, copying = false;
        poll_copier_state(&up, &pending, &copying);
        return py::make_tuple(up, pending, copying);
    }, "(the copier thread runs, a fetch handed to it and not yet taken, the copier inside a fetch).");
    m.def("host_task_busy_ns", &ft_host_task_busy_ns, "Nanoseconds inside host tasks so far, all tasks.");
    m.def("host_task_failures", &ft_host_task_failures, "Failed runs and fetches so far, all tasks.");
    m.def("read_ranges", &read_ranges_py, py::call_guard<py::gil_scoped_release>(), py::arg("ptrs"), py::arg("sizes"),
          "Read the byte ranges with the pool threads (bandwidth reference); returns a checksum.");
    m.def("call_overhead_us", &call_overhead_us, py::call_guard<py::gil_scoped_release>(), py::arg("reps") = 2000);
    m.def("set_isa", &set_isa, py::arg("name"), "Force an ISA path: avx512bf16|avx512|avx2|scalar|auto.");
    m.def("get_isa", [] { return std::string(isa_name(current_isa())); });
    m.def("set_prefetch_bytes", [](int bytes) {
        if (bytes < 0) throw std::invalid_argument("prefetch distance must be >= 0 bytes");
        g_prefetch_bytes = bytes;
    }, py::arg("bytes"), "Software prefetch distance on each weight row, in bytes (0 = off).");
    m.def("prefetch_bytes", [] { return g_prefetch_bytes; });
    m.def("supported_isas", [] {
        std::vector<std::string> out;
        for (Isa i : {Isa::avx512bf16, Isa::avx512, Isa::avx2, Isa::scalar})
            if (isa_supported(i)) out.push_back(isa_name(i));
        return out;
    });
#if defined(FT_EMULATE_AVX512)
    m.attr("emulated_avx512") = true;  // a test build: the AVX-512 paths run on SIMDe (avx512_target.h)
#else
    m.attr("emulated_avx512") = false;
#endif
    m.def("set_num_threads", &set_num_threads, py::call_guard<py::gil_scoped_release>(), py::arg("n"),
          py::arg("pin") = true, "Replace the pool; the next call starts n threads (0 = one per physical core).");
    m.def("num_threads", [] { return pool()->size(); }, py::call_guard<py::gil_scoped_release>());
    m.def("num_pinned", [] { return pool()->pinned(); }, py::call_guard<py::gil_scoped_release>());
    m.def("physical_cores", &physical_cores);
    m.def("set_worker_spin_us", &set_worker_spin_us, py::arg("us"),
          "How long idle pool workers spin before sleeping, in microseconds (process-wide).");
    m.def("worker_spin_us", &worker_spin_us);
    m.def("set_chunk_rows", [](int rows) {
        if (rows < 4 || rows > 4096 || rows % 4) throw std::invalid_argument("chunk rows must be a multiple of 4 in [4, 4096]");
        g_chunk_rows = rows;
    }, py::arg("rows"), "Rows of a layer call's work chunk (a benchmark knob; default 16).");
    m.def("chunk_rows", [] { return g_chunk_rows; });
    m.def("shutdown", &shutdown_pool, py::call_guard<py::gil_scoped_release>(),
          "Join the worker threads (restarted lazily by the next call).");
}
