// Host-issued expert fetches for the doorbell CPU branch: when a layer's
// doorbell rings, the poller hands the layer's fetch to its copier thread (poller.h) and runs the
// layer's CPU experts; the copier reads the copy list (bank row, slot) from page-locked memory,
// queues each fetched expert's two host-to-device copies on a copy stream (the copy engines move
// host memory at the bulk-copy rate; the SMs' own loads over PCIe reach ~80 % of it), then sets a
// page-locked word that the GPU's stream waits on to 1, from the host once the copy stream has
// drained (polled with cuStreamQuery). (A stream write queued after the copies instead hands the
// GPU's wait a dependency on another stream's work that CUDA cannot see, which its documentation
// warns may deadlock; on the H200, seventh session, unit steps with it stopped for good; it is
// gone since.) The CUDA driver is opened with dlopen on first use: the library
// builds and loads on machines without CUDA, and only a task that is given a fetch needs the driver.
#pragma once

#include <cstdint>
#include <string>

namespace ft {

struct DmaFetch {
    const int64_t* copy = nullptr;  // [2 * n]: n bank rows (-1 = nothing to copy), then n slots
    int64_t n = 0;
    uint64_t bank13 = 0, bank2 = 0;  // host addresses of the page-locked expert banks (row 0)
    uint64_t slot13 = 0, slot2 = 0;  // device addresses of the slot tensors (slot 0)
    uint64_t bytes13 = 0, bytes2 = 0;  // one row / slot of each
    int64_t rows = 0, slots = 0;  // bounds: a bank row or slot outside them is an error, never a copy
    void* stream = nullptr;  // CUstream of the copies
    void* context = nullptr;  // CUcontext the stream belongs to (made current on the poller thread)
    volatile uint32_t* word_host = nullptr;  // the page-locked word the GPU waits on (host address)
    // copies not landed after this long fail the fetch (and release the GPU) rather than hold the
    // step for good; a layer's copies take milliseconds at most
    int64_t deadline_ms = 5000;
    // The split expert (a partial fetch), when `scratch` >= 0: copy[2n] a bank row (-1: none this
    // call), copy[2n + 1] r; the first r intermediate rows of that expert land in slot `scratch`
    // (outside the table): gate rows [0, r) and up rows [I, I + r) of w13 ([2I, H]) as two copies,
    // columns [0, r) of w2 ([H, I]) as one pitched copy. Element size `elem` bytes.
    int64_t scratch = -1;
    int64_t inter = 0, hidden = 0, elem = 0;
    // Packed experts (engine/gpu/quant/slots.py): bank rows are one layer's, so a copy-list row r
    // names bank row r - row_offset; a slot is slot_stride bytes (0: bytes13 / bytes2, the bank
    // row's size); with gs_bank != 0 each fetched expert's 12 bytes of global scales also go from
    // gs_bank + row * 12 to gs_slot + slot * 12.
    int64_t row_offset = 0;
    uint64_t slot_stride = 0;
    uint64_t gs_bank = 0, gs_slot = 0;
};

// Queues the copies, waits for them, then sets the word (dma_fetch_release);
// returns "" or the reason it could not. On a failure the caller records it, then calls
// dma_fetch_release, which writes the word from the host so the GPU never waits forever (the
// slots may hold stale rows: the step raises the recorded failure, which is in place before the
// GPU can go on).
std::string dma_fetch_issue(const DmaFetch& f) noexcept;
void dma_fetch_release(const DmaFetch& f) noexcept;

}  // namespace ft
