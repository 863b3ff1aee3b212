// The doorbell that hands the CPU branch of a captured decode step to the host (it replaced CUDA
// host nodes, ~230 us per layer slower on the H200: docs/gpu-tier.md): one
// native thread polls a request word per registered HostTask in page-locked memory; the GPU
// writes 1 there (a stream memory operation, captured into the graph), the poller clears it, runs
// the task and writes 1 to the task's done word; the GPU waits for done == 1 and writes it back to
// 0. No CUDA driver thread and no driver lock is involved, so the CPU experts run beside the GPU's
// own work. The poller spins while requests keep coming and backs off to short sleeps when idle.
// A task with a host-issued fetch (dma_fetch.h) hands it to a second thread, the copier, before
// it runs: the copies are queued while the CPU experts already run.
#pragma once

#include <cstdint>

namespace ft {

// Registers (task, request word, done word, ready word or null); starts the poller thread on first
// use. With a ready word (the GPU writes 1 there when its own branch of the layer is done and 0
// after it has seen the answer), each served request counts which branch finished last.
void poll_register(void* task, volatile uint32_t* request, volatile uint32_t* done, volatile uint32_t* ready);
// Served requests so far whose CPU branch finished after the GPU's (cpu_late) or before (gpu_late).
void poll_lateness(int64_t* cpu_late, int64_t* gpu_late);
void poll_unregister(void* task);
void poll_stop();  // joins the poller (restarted by the next registration)
int64_t poll_served();

// The copier's state: its thread running (until then the poller issues fetches itself), a fetch
// handed over and not yet taken, and the copier inside one (a fetch that never ends shows as
// copying for good).
void poll_copier_state(bool* up, bool* pending, bool* copying);

// Sums since start, for deltas: served requests and the poller's time from seeing a doorbell to
// writing the answer; `gaps` answer-to-next-doorbell intervals between consecutively registered
// tasks (a step's layer l to l + 1: the GPU's part alone); fetches handed to the copier (or issued
// by the poller), the time from their doorbell until the copier was done (with the host-written
// word: until the copies had landed), and how many finished after the poller had answered.
struct PollTimeline {
    int64_t served = 0, cpu_ns = 0, gaps = 0, gap_ns = 0, fetches = 0, fetch_ns = 0, fetch_late = 0;
};
PollTimeline poll_timeline();

}  // namespace ft
