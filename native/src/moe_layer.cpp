// One MoE layer's CPU share in one call, the SIMD path / ISA selection, and the plain-read
// bandwidth reference.
//
// For T tokens routed to k experts each (flat expert rows into the banks):
//   out[t] = sum_j w[t,j] * down_e(silu(gate_e(x_t)) * up_e(x_t)),  float32 accumulation
// (with the plan's epilogue, if any: biases and the clamped SwiGLU, moe_layer.h).
// Phase 0 converts x into the kernel's activation format; phase 1 splits the gate/up rows of all
// distinct experts of the call into chunks handed out by an atomic counter (dynamic scheduling: a
// batch-1 step with one expert still keeps every thread busy, and a thread sharing its core simply
// takes fewer chunks); phase 2 splits the hidden (down output) rows the same way, and the thread
// holding a chunk loops over all experts for it, so no two threads write the same output element.
#include "moe_layer.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "pool.h"

namespace ft {

namespace {

struct Table {
    GemvFn fn[kNumIsas][kNumFmts] = {};
    Table() {
        register_scalar(fn[int(Isa::scalar)]);
        register_avx2(fn[int(Isa::avx2)]);
        register_avx512(fn[int(Isa::avx512)]);
        register_avx512bf16(fn[int(Isa::avx512bf16)]);
        for (int f = 0; f < kNumFmts; ++f)  // avx512bf16 has only a bf16 kernel: other formats use avx512's
            if (!fn[int(Isa::avx512bf16)][f]) fn[int(Isa::avx512bf16)][f] = fn[int(Isa::avx512)][f];
    }
};
const Table& table() {
    static const Table t;
    return t;
}

std::atomic<int> g_isa{-1};

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

// h of one intermediate row from its gate and up projections (biases already added)
inline float activate(const LayerPlan& p, float g, float u) {
    if (p.act == Act::silu) return silu(g) * u;
    g = std::min(g, p.limit);
    u = std::min(std::max(u, -p.limit), p.limit);
    return (u + 1.0f) * (g / (1.0f + std::exp(-p.alpha * g)));
}

// Rows [r0, r1) of m into L2 ahead of their first use (software prefetch off: nothing). A tile's own
// prefetch runs two tiles ahead within the rows it is given; this covers the rows a thread moves to next.
inline void prefetch_rows(const Mat& m, int64_t r0, int64_t r1) {
    if (g_prefetch_bytes <= 0) return;
    const uint8_t* p = m.w + r0 * m.ld;
    for (size_t o = 0, n = static_cast<size_t>(r1 - r0) * m.ld; o < n; o += 64) __builtin_prefetch(p + o, 0, 2);
}

struct Group {
    int64_t row;     // flat expert row in the banks
    int begin, end;  // entry range [begin, end) in the sorted entry list
    int64_t first = 0;  // first intermediate row computed here (the split expert's; 0 otherwise)
};

// Per calling thread (calls from one thread never overlap), so steady-state calls allocate nothing.
struct Scratch {
    std::vector<int64_t> rows;  // ids + id_offset
    std::vector<int> order, entry_token;
    std::vector<float> entry_w, acc;
    std::vector<Group> groups;
    std::vector<char> xbuf, hbuf;
    std::vector<const void*> xptr, hptr;
};

}  // namespace

const char* isa_name(Isa i) {
    switch (i) {
        case Isa::avx512bf16: return "avx512bf16";
        case Isa::avx512: return "avx512";
        case Isa::avx2: return "avx2";
        default: return "scalar";
    }
}

bool isa_supported(Isa i) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    switch (i) {
#if defined(FT_EMULATE_AVX512)  // the AVX-512 kernels are SIMDe's emulation on AVX2 (avx512_target.h)
        case Isa::avx512bf16:
        case Isa::avx512: return isa_supported(Isa::avx2);
#else
        case Isa::avx512bf16: return isa_supported(Isa::avx512) && __builtin_cpu_supports("avx512bf16");
        case Isa::avx512:
            return isa_supported(Isa::avx2) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                   __builtin_cpu_supports("avx512vl");
#endif
        case Isa::avx2:
            return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
        default: return true;
    }
#else
    return i == Isa::scalar;
#endif
}

Isa best_isa() {
    for (Isa i : {Isa::avx512bf16, Isa::avx512, Isa::avx2})
        if (isa_supported(i)) return i;
    return Isa::scalar;
}

Isa current_isa() {
    int v = g_isa.load();
    return v < 0 ? best_isa() : static_cast<Isa>(v);
}

void set_isa(const std::string& name) {
    Isa i = Isa::scalar;
    if (name == "auto") i = best_isa();
    else {
        bool found = false;
        for (Isa c : {Isa::avx512bf16, Isa::avx512, Isa::avx2, Isa::scalar})
            if (name == isa_name(c)) i = c, found = true;
        if (!found) throw std::invalid_argument("unknown ISA '" + name + "' (known: avx512bf16, avx512, avx2, scalar)");
    }
    if (!isa_supported(i)) throw std::invalid_argument(std::string("ISA '") + isa_name(i) + "' is not supported by this CPU");
    g_isa.store(static_cast<int>(i));
}

namespace {

// Dense banks (bf16 / f32 / fp8 / mxfp4 in moe_layer.h's layouts): gate rows [0, I) and up rows
// [I, 2I) of w13 are two matrices; fp8 scale rows of the up half start at block row ceil(I / bn).
struct DensePlan final : LayerPlan {
    const LayerArgs& a;
    Fmt fmt;
    int64_t nbI;
    DensePlan(const LayerArgs& args, Fmt f, Isa isa) : a(args), fmt(f), nbI((args.I + args.bn - 1) / args.bn) {
        gemv_gu = gemv_d = table().fn[int(isa)][int(f)];
        act_bf16 = isa == Isa::avx512bf16 && f == Fmt::bf16;  // the kernel reads bf16 activations
    }
    Mat view(const WeightArgs& w, int64_t row, int64_t row_off, int64_t block_row_off) const {
        Mat m;
        m.w = w.ptr + row * w.expert_stride + row_off * w.row_stride;
        m.ld = static_cast<size_t>(w.row_stride);
        if (fmt == Fmt::fp8) {
            m.fs = reinterpret_cast<const float*>(w.scale_ptr) + row * w.scale_expert_stride + block_row_off * w.scale_row_stride;
            m.fs_ld = static_cast<size_t>(w.scale_row_stride);
        } else if (fmt == Fmt::mxfp4) {
            m.es = w.scale_ptr + row * w.scale_expert_stride + row_off * w.scale_row_stride;
            m.es_ld = static_cast<size_t>(w.scale_row_stride);
        }
        m.bn = static_cast<int>(a.bn);
        m.bk = static_cast<int>(a.bk);
        return m;
    }
    Mat gate(int64_t row) const override { return view(a.w13, row, 0, 0); }
    Mat up(int64_t row) const override { return view(a.w13, row, a.I, nbI); }
    Mat down(int64_t row, int64_t first) const override {
        Mat m = view(a.w2, row, 0, 0);
        m.w += first * (fmt == Fmt::bf16 ? 2 : 4);  // columns [first, I) (a split expert: bf16 / f32 only)
        return m;
    }
};

}  // namespace

void moe_layer(const LayerArgs& a) {
    if (a.fmt < 0 || a.fmt >= kNumFmts) throw std::invalid_argument("unknown weight format");
    const Fmt fmt = static_cast<Fmt>(a.fmt);
    if (fmt == Fmt::fp8 && (a.bn <= 0 || a.bk <= 0 || a.bn % kRows || a.bk % 16))
        throw std::invalid_argument("fp8 block sizes must be positive, bn % 4 == 0 and bk % 16 == 0");
    if (fmt == Fmt::mxfp4 && (a.H % 32 || a.I % 32))
        throw std::invalid_argument("mxfp4 needs hidden and expert sizes that are multiples of 32");
    if (a.split != nullptr && a.split[0] >= 0 && fmt != Fmt::bf16 && fmt != Fmt::f32)
        throw std::invalid_argument("a split expert needs bf16 or f32 weights");
    run_layer(a, DensePlan(a, fmt, current_isa()));
}

void run_layer(const LayerArgs& a, const LayerPlan& plan) {
    const int64_t T = a.T, H = a.H, I = a.I, k = a.k;
    if (T < 0 || H <= 0 || I <= 0 || k <= 0) throw std::invalid_argument("bad sizes");
    if (H > INT32_MAX / 2 || I > INT32_MAX / 2) throw std::invalid_argument("dims too large");
    if (a.accumulate && a.out_bf16) throw std::invalid_argument("accumulating needs a float32 out");
    if (T == 0) return;
    const int64_t N = T * k;
    if (N > INT32_MAX) throw std::invalid_argument("too many entries");
    thread_local Scratch tls;  // named inside the job lambda it would be each worker's own (empty) instance
    Scratch& s = tls;
    s.rows.resize(N);
    s.order.clear();
    for (int64_t i = 0; i < N; ++i) {
        const int64_t id = a.ids32 != nullptr ? a.ids32[i] : a.ids[i];
        if (a.skip_negative && id < 0) {
            s.rows[i] = -1;
            continue;
        }
        const int64_t row = id + a.id_offset;
        if (row < 0 || row >= a.num_rows)
            throw std::invalid_argument("ids: expert row " + std::to_string(row) + " out of range [0, " +
                                        std::to_string(a.num_rows) + ")");
        s.rows[i] = row;
        s.order.push_back(static_cast<int>(i));
    }
    const int64_t* ids = s.rows.data();
    const int64_t M = static_cast<int64_t>(s.order.size());  // entries computed here
    if (M == 0) {  // every entry runs elsewhere: zeros (or nothing to add), without waking the pool
        for (int64_t t = 0; t < T && !a.accumulate; ++t) {
            if (a.out_bf16) std::memset(reinterpret_cast<uint16_t*>(a.out) + t * a.out_ld, 0, H * 2);
            else std::memset(reinterpret_cast<float*>(a.out) + t * a.out_ld, 0, H * 4);
        }
        return;
    }

    int64_t split_row = -1, split_first = 0;
    if (a.split != nullptr && a.split[0] >= 0) {
        split_row = a.split[0], split_first = a.split[1];
        if (plan.b_gu != nullptr || plan.b_d != nullptr) throw std::invalid_argument("a split expert takes no biases");
        if (split_first <= 0 || split_first >= I || split_first % (4 * kRows))
            throw std::invalid_argument("split expert row " + std::to_string(split_first) + " outside (0, " +
                                        std::to_string(I) + ") or not a multiple of " + std::to_string(4 * kRows));
    }
    const bool act_bf16 = plan.act_bf16;
    const size_t act = act_bf16 ? 2 : 4;

    std::stable_sort(s.order.begin(), s.order.end(), [&](int x, int y) { return ids[x] < ids[y]; });
    s.groups.clear();
    s.entry_token.resize(M);
    s.entry_w.resize(M);
    for (int64_t i = 0; i < M; ++i) {
        const int e = s.order[i];
        if (s.groups.empty() || s.groups.back().row != ids[e])
            s.groups.push_back({ids[e], int(i), int(i), ids[e] == split_row ? split_first : 0});
        s.groups.back().end = int(i) + 1;
        s.entry_token[i] = static_cast<int>(e / k);
        s.entry_w[i] = a.weights[e];
    }
    const size_t xs = static_cast<size_t>(H) * act, hs = static_cast<size_t>(I) * act;  // bytes per x row, per h row
    s.xbuf.resize(static_cast<size_t>(T) * xs);
    s.hbuf.resize(static_cast<size_t>(M) * hs);
    s.acc.resize(static_cast<size_t>(T * H));
    s.xptr.resize(M);
    s.hptr.resize(M);
    for (const Group& gr : s.groups)  // the split expert's down projection reads rows [first, I) of h
        for (int i = gr.begin; i < gr.end; ++i) {
            s.xptr[i] = s.xbuf.data() + static_cast<size_t>(s.entry_token[i]) * xs;
            s.hptr[i] = s.hbuf.data() + static_cast<size_t>(i) * hs + static_cast<size_t>(gr.first) * act;
        }

    const int64_t chunk = g_chunk_rows;  // rows per work chunk
    const int64_t cpg = (I + chunk - 1) / chunk;
    const int64_t chunks1 = cpg * static_cast<int64_t>(s.groups.size());
    const int64_t chunks2 = (H + chunk - 1) / chunk;
    std::atomic<int64_t> next1{0}, next2{0};

    std::shared_ptr<Pool> pool_ref = pool();
    Pool& p = *pool_ref;
    std::lock_guard<std::mutex> call(p.call_mutex);
    const int nt = p.size();

    auto job = [&](int tid) {
        for (int64_t t = tid; t < T; t += nt) {  // phase 0
            if (a.x_bf16) {
                const uint16_t* src = reinterpret_cast<const uint16_t*>(a.x) + t * a.x_ld;
                if (act_bf16) std::memcpy(s.xbuf.data() + t * H * 2, src, H * 2);
                else {
                    float* dst = reinterpret_cast<float*>(s.xbuf.data()) + t * H;
                    for (int64_t i = 0; i < H; ++i) dst[i] = bf16_to_f32(src[i]);
                }
            } else {
                const float* src = reinterpret_cast<const float*>(a.x) + t * a.x_ld;
                if (act_bf16) {
                    uint16_t* dst = reinterpret_cast<uint16_t*>(s.xbuf.data()) + t * H;
                    for (int64_t i = 0; i < H; ++i) dst[i] = f32_to_bf16(src[i]);
                } else {
                    std::memcpy(s.xbuf.data() + t * H * 4, src, H * 4);
                }
            }
        }
        p.barrier();

        {  // phase 1: gate/up
            float gbuf[kRows * 64], ubuf[kRows * 64];
            for (int64_t c; (c = next1.fetch_add(1, std::memory_order_relaxed)) < chunks1;) {
                const Group& gr = s.groups[c / cpg];
                // the split expert's rows before `first` run elsewhere (first is a multiple of kRows)
                const int64_t c0 = std::max((c % cpg) * chunk, gr.first), c1 = std::min(I, (c % cpg + 1) * chunk);
                if (c0 >= c1) continue;
                const int ntok = gr.end - gr.begin;
                const Mat gate = plan.gate(gr.row), up = plan.up(gr.row);
                // the chunk's first two tiles: the tiles' own prefetch reaches only the rows after them
                if (plan.prefetch_next) {
                    prefetch_rows(gate, c0, std::min(c1, c0 + 2 * kRows));
                    prefetch_rows(up, c0, std::min(c1, c0 + 2 * kRows));
                }
                const float* bias = plan.b_gu != nullptr ? plan.b_gu + gr.row * 2 * I : nullptr;
                for (int64_t r0 = c0; r0 < c1; r0 += kRows) {
                    const int nr = static_cast<int>(std::min<int64_t>(kRows, c1 - r0));
                    for (int tb = 0; tb < ntok; tb += 64) {
                        const int nb = std::min(64, ntok - tb);
                        const void* const* X = s.xptr.data() + gr.begin + tb;
                        plan.gemv_gu(gate, r0, nr, X, nb, int(H), gbuf, kRows);
                        plan.gemv_gu(up, r0, nr, X, nb, int(H), ubuf, kRows);
                        for (int t = 0; t < nb; ++t) {
                            const int64_t e = gr.begin + tb + t;
                            for (int r = 0; r < nr; ++r) {
                                float g = gbuf[t * kRows + r], u = ubuf[t * kRows + r];
                                if (bias != nullptr) g += bias[r0 + r], u += bias[I + r0 + r];
                                const float hv = activate(plan, g, u);
                                if (act_bf16) reinterpret_cast<uint16_t*>(s.hbuf.data())[e * I + r0 + r] = f32_to_bf16(hv);
                                else reinterpret_cast<float*>(s.hbuf.data())[e * I + r0 + r] = hv;
                            }
                        }
                    }
                }
            }
        }
        p.barrier();

        {  // phase 2: down projection, output rows owned by the chunk's thread
            float dbuf[kRows * 64];
            for (int64_t c; (c = next2.fetch_add(1, std::memory_order_relaxed)) < chunks2;) {
                const int64_t h0 = c * chunk, h1 = std::min(H, h0 + chunk);
                for (int64_t t = 0; t < T; ++t) std::fill(&s.acc[t * H + h0], &s.acc[t * H + h1], 0.f);
                for (size_t gi = 0; gi < s.groups.size(); ++gi) {
                    const Group& gr = s.groups[gi];
                    if (plan.prefetch_next && gi + 1 < s.groups.size())  // the next expert's rows of this chunk
                        prefetch_rows(plan.down(s.groups[gi + 1].row, s.groups[gi + 1].first), h0, h1);
                    const Mat down = plan.down(gr.row, gr.first);
                    const float* bias = plan.b_d != nullptr ? plan.b_d + gr.row * H : nullptr;
                    const int64_t K = I - gr.first;
                    const int ntok = gr.end - gr.begin;
                    for (int64_t r0 = h0; r0 < h1; r0 += kRows) {
                        const int nr = static_cast<int>(std::min<int64_t>(kRows, h1 - r0));
                        for (int tb = 0; tb < ntok; tb += 64) {
                            const int nb = std::min(64, ntok - tb);
                            plan.gemv_d(down, r0, nr, s.hptr.data() + gr.begin + tb, nb, int(K), dbuf, kRows);
                            for (int t = 0; t < nb; ++t) {
                                const int64_t e = gr.begin + tb + t;
                                float* acc = &s.acc[s.entry_token[e] * H + r0];
                                const float w = s.entry_w[e];
                                if (bias == nullptr)
                                    for (int r = 0; r < nr; ++r) acc[r] += w * dbuf[t * kRows + r];
                                else
                                    for (int r = 0; r < nr; ++r) acc[r] += w * (dbuf[t * kRows + r] + bias[r0 + r]);
                            }
                        }
                    }
                }
                for (int64_t t = 0; t < T; ++t) {
                    const float* acc = &s.acc[t * H];
                    if (a.out_bf16) {
                        uint16_t* o = reinterpret_cast<uint16_t*>(a.out) + t * a.out_ld;
                        for (int64_t i = h0; i < h1; ++i) o[i] = f32_to_bf16(acc[i]);
                    } else {
                        float* o = reinterpret_cast<float*>(a.out) + t * a.out_ld;
                        if (a.accumulate) for (int64_t i = h0; i < h1; ++i) o[i] += acc[i];
                        else for (int64_t i = h0; i < h1; ++i) o[i] = acc[i];
                    }
                }
            }
        }
    };
    std::function<void(int)> fn = job;
    p.run(fn);
}

}  // namespace ft
