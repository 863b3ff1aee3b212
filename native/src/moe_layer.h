// The MoE layer call and the ISA switch (see moe_layer.cpp). Layouts, per expert row e of a bank:
//   w13: [2I, H] (gate rows, then up rows), w2: [H, I]; row r of expert e at
//        ptr + e * expert_stride + r * row_stride (bytes; elements of a row are contiguous).
//   bf16 / f32: no scales.
//   fp8 (e4m3): float32 block scales, w13: [2 * ceil(I/bn), ceil(H/bk)] (gate block rows, then up),
//        w2: [ceil(H/bn), ceil(I/bk)]; element (i, j) of a scale matrix at
//        scale_ptr + e * scale_expert_stride + i * scale_row_stride + j (float elements).
//   mxfp4: rows of K/2 bytes (two e2m1 codes per byte, element 2i in the low nibble), uint8 e8m0
//        scales [rows, K/32] at scale_ptr + e * scale_expert_stride + r * scale_row_stride (bytes).
#pragma once

#include <cstdint>
#include <string>

#include "common.h"

namespace ft {

struct WeightArgs {
    const uint8_t* ptr = nullptr;
    int64_t expert_stride = 0, row_stride = 0;  // bytes
    const uint8_t* scale_ptr = nullptr;
    int64_t scale_expert_stride = 0, scale_row_stride = 0;  // scale elements
};

struct LayerArgs {
    const void* x = nullptr;  // [T, H] float32 or bf16, row stride x_ld elements
    bool x_bf16 = false;
    int64_t x_ld = 0;
    void* out = nullptr;  // [T, H] float32 or bf16, row stride out_ld elements; overwritten
    bool out_bf16 = false;
    int64_t out_ld = 0;
    int64_t T = 0, H = 0, I = 0, k = 0;
    const int64_t* ids = nullptr;  // [T, k] expert ids; bank row = id + id_offset
    const int32_t* ids32 = nullptr;  // the same as int32, used instead of `ids` when set
    int64_t id_offset = 0;
    bool skip_negative = false;  // entries with id < 0 are not computed (run elsewhere)
    const float* weights = nullptr;  // [T, k]
    int fmt = 0;  // Fmt
    WeightArgs w13, w2;
    int64_t bn = 128, bk = 128;  // fp8 block (rows, columns)
    int64_t num_rows = 0;  // expert rows in the banks (ids must be below)
    // The split expert (bf16 / f32 only), or null: split[0] a bank row (-1: none this call), split[1]
    // the first of its intermediate rows computed here (a multiple of 16 in (0, I)); the rows
    // before it run elsewhere (the GPU), and both partial outputs are added. Read once per call.
    const int64_t* split = nullptr;
    bool accumulate = false;  // out += the layer's result (float32 out only) instead of out = it
};

void moe_layer(const LayerArgs& a);

// What one layer call runs with besides its arguments: the gate/up and down kernels, the
// activation type they read, and the matrix views of an expert row (dense banks: moe_layer;
// packed blocks: moe_packed). `first` is the first intermediate row computed here (split expert).
// The experts' activation: h = silu(g) * u, or gpt-oss's clamped SwiGLU g = min(g, limit),
// u = clamp(u, -limit, limit), h = (u + 1) * g * sigmoid(alpha * g).
enum class Act : int { silu = 0, swiglu_clamped = 1 };

struct LayerPlan {
    GemvFn gemv_gu = nullptr, gemv_d = nullptr;
    bool act_bf16 = false;
    // the driver prefetches the rows a thread moves to next (moe_layer.cpp: prefetch_rows); the packed
    // kernels' prefetch runs tiles ahead within a tile's rows and needs it, the float kernels' runs
    // along each row (and reaches the read bound without it)
    bool prefetch_next = false;
    // Epilogue, per bank row: b_gu [rows, 2I] float32 (gate biases, then up biases) added to the
    // projections before the activation; b_d [rows, H] float32 added to the down projection before
    // the routing weight. Null: none. A split expert takes no biases.
    const float* b_gu = nullptr;
    const float* b_d = nullptr;
    Act act = Act::silu;
    float alpha = 1.702f, limit = 7.0f;
    virtual Mat gate(int64_t row) const = 0;
    virtual Mat up(int64_t row) const = 0;
    virtual Mat down(int64_t row, int64_t first) const = 0;  // columns [first, I)
    virtual ~LayerPlan() = default;
};

// The shared driver (entries sorted by expert, gate/up phase, down phase on the pool); `a`'s
// format fields are not read (the plan carries them); a.num_rows bounds the bank rows.
void run_layer(const LayerArgs& a, const LayerPlan& plan);

const char* isa_name(Isa i);
bool isa_supported(Isa i);
Isa best_isa();
Isa current_isa();
void set_isa(const std::string& name);

}  // namespace ft
