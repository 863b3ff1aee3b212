// A MoE layer call prepared once (all pointers fixed: page-locked buffers the GPU copies into and
// out of) and run later by the doorbell poller (poller.h): the CPU branch of a graph-captured
// decode step. `ft_host_task_run` must not throw (it runs on the poller thread), so a failure is
// counted and its message kept for the caller.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "dma_fetch.h"
#include "moe_layer.h"
#include "moe_packed.h"

namespace ft {

struct HostTask {
    LayerArgs args;
    std::atomic<int64_t> runs{0}, failures{0};
    std::mutex error_mutex;
    std::string error;  // the first failure's message
    std::unique_ptr<DmaFetch> fetch;  // set before the task is registered with the poller, or never
    std::unique_ptr<PackedBanks> packed;  // set: the layer runs over packed banks (moe_packed)
};

}  // namespace ft

extern "C" void ft_host_task_run(void* task) noexcept;
// The task's host-issued fetch (dma_fetch.h), when it has one: the poller calls it before
// ft_host_task_run. A failure is
// counted and kept as the task's error, like a failed run.
void ft_host_task_fetch(void* task) noexcept;
bool ft_host_task_has_fetch(void* task) noexcept;
// Nanoseconds spent inside ft_host_task_run since the process started, every task together: the
// CPU branch's in-situ time (under the PCIe traffic it overlaps), which benchmarks set against
// the step's wall time.
int64_t ft_host_task_busy_ns();
// Failed runs and fetches so far, every task together: one read tells a caller whether any task
// has a new failure to report.
int64_t ft_host_task_failures();
