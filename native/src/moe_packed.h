// One MoE layer over packed expert banks (packed.h formats): the layer call of moe_layer.h with
// per-matrix block formats. Banks, per expert e (bytes):
//   gate_up: rows [0, I) gate, [I, 2I) up, each K = H values in rows of gu_row_bytes, row r of
//            expert e at gu + e * gu_expert_stride + r * gu_row_bytes;
//   down:    H rows of K = I values, row r of expert e at d + e * d_expert_stride + r * d_row_bytes;
//   gscale:  float32 [E, 3] (gate, up, down global scales; null = all 1).
// Per expert: h = act(gs_g * gate x + b_gu[:I], gs_u * up x + b_gu[I:]), y = gs_d * down h + b_d.
#pragma once

#include <cstdint>
#include <string>

#include "moe_layer.h"
#include "packed.h"

namespace ft {

struct PackedBanks {
    const uint8_t* gu = nullptr;
    int64_t gu_expert_stride = 0, gu_row_bytes = 0;
    int fmt_gu = 0;  // QFmt
    const uint8_t* d = nullptr;
    int64_t d_expert_stride = 0, d_row_bytes = 0;
    int fmt_d = 0;
    const float* gscale = nullptr;  // [E, 3] contiguous, or null
    // the epilogue (moe_layer.h LayerPlan): biases [E, 2I] (gate, then up) and [E, H], float32
    // contiguous, or null; the activation and its constants (gpt-oss: swiglu_clamped, 1.702, 7)
    const float* b_gu = nullptr;
    const float* b_d = nullptr;
    Act act = Act::silu;
    float alpha = 1.702f, limit = 7.0f;
};

// a's x / out / sizes / ids / weights / num_rows (= E) / accumulate / skip_negative are used; its
// dense-format fields are ignored. Throws std::invalid_argument on bad formats or sizes.
void moe_packed(const LayerArgs& a, const PackedBanks& b);

// The packed format named `name` (packed.h), or -1.
int packed_format(const std::string& name);

}  // namespace ft
