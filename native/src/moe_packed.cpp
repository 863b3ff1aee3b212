// The packed-bank layer call: the shared driver (run_layer, moe_layer.cpp) with the packed kernel
// table of the current ISA and matrix views into the block rows.
#include "moe_packed.h"

#include <stdexcept>

namespace ft {

namespace {

struct Table {
    GemvFn fn[kNumIsas][kNumQ] = {};
    Table() {
        register_packed_scalar(fn[int(Isa::scalar)]);
        // the fills are compiled for their ISA (they may use its instructions): only where it runs
        if (isa_supported(Isa::avx2)) register_packed_avx2(fn[int(Isa::avx2)]);
        if (isa_supported(Isa::avx512)) register_packed_avx512(fn[int(Isa::avx512)]);
        // AVX-512-BF16 CPUs run the AVX-512F kernels: vdpbf16ps kernels on exact bf16 codes were 1.2-1.35x
        // slower at batch 1 on a Sapphire Rapids host (q4_k, q6_k; q8_0 even), and were removed
        for (int f = 0; f < kNumQ; ++f) fn[int(Isa::avx512bf16)][f] = fn[int(Isa::avx512)][f];
    }
};

const Table& table() {
    static const Table t;
    return t;
}

struct PackedPlan final : LayerPlan {
    const LayerArgs& a;
    const PackedBanks& b;
    PackedPlan(const LayerArgs& args, const PackedBanks& banks, Isa isa) : a(args), b(banks) {
        gemv_gu = table().fn[int(isa)][b.fmt_gu];
        gemv_d = table().fn[int(isa)][b.fmt_d];
        b_gu = b.b_gu, b_d = b.b_d, act = b.act, alpha = b.alpha, limit = b.limit;
        prefetch_next = true;
    }
    float gs(int64_t row, int which) const { return b.gscale ? b.gscale[row * 3 + which] : 1.0f; }
    Mat gate(int64_t row) const override {
        Mat m;
        m.w = b.gu + row * b.gu_expert_stride;
        m.ld = static_cast<size_t>(b.gu_row_bytes);
        m.gs = gs(row, 0);
        return m;
    }
    Mat up(int64_t row) const override {
        Mat m = gate(row);
        m.w += a.I * b.gu_row_bytes;
        m.gs = gs(row, 1);
        return m;
    }
    Mat down(int64_t row, int64_t) const override {
        Mat m;
        m.w = b.d + row * b.d_expert_stride;
        m.ld = static_cast<size_t>(b.d_row_bytes);
        m.gs = gs(row, 2);
        return m;
    }
};

void check_format(int fmt, const char* name, int64_t K, const char* dim, int64_t row_bytes) {
    if (fmt < 0 || fmt >= kNumQ) throw std::invalid_argument(std::string(name) + ": unknown packed format");
    const QInfo& q = kQInfo[fmt];
    if (K % q.block)
        throw std::invalid_argument(std::string(name) + ": " + q.name + " needs " + dim + " = " + std::to_string(K) +
                                    " to be a multiple of " + std::to_string(q.block));
    if (row_bytes < K / q.block * q.bytes)
        throw std::invalid_argument(std::string(name) + ": rows of " + std::to_string(row_bytes) + " bytes, " + q.name +
                                    " needs " + std::to_string(K / q.block * q.bytes));
}

}  // namespace

int packed_format(const std::string& name) {
    for (int f = 0; f < kNumQ; ++f)
        if (name == kQInfo[f].name) return f;
    return -1;
}

void moe_packed(const LayerArgs& a, const PackedBanks& b) {
    check_format(b.fmt_gu, "gate_up", a.H, "hidden", b.gu_row_bytes);
    check_format(b.fmt_d, "down", a.I, "intermediate", b.d_row_bytes);
    if (a.split != nullptr) throw std::invalid_argument("packed banks take no split expert");
    if (b.act != Act::silu && b.act != Act::swiglu_clamped) throw std::invalid_argument("activation: unknown");
    run_layer(a, PackedPlan(a, b, current_isa()));
}

}  // namespace ft
