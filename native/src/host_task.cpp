// See host_task.h.
#include "host_task.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>

namespace {
std::atomic<int64_t> g_busy_ns{0};  // wall time inside tasks, all tasks together
std::atomic<int64_t> g_failures{0};  // failed runs and fetches, all tasks together
}

int64_t ft_host_task_busy_ns() { return g_busy_ns.load(std::memory_order_relaxed); }
int64_t ft_host_task_failures() { return g_failures.load(std::memory_order_acquire); }

extern "C" void ft_host_task_run(void* task) noexcept {
    auto* t = static_cast<ft::HostTask*>(task);
    const auto t0 = std::chrono::steady_clock::now();
    try {
        if (t->packed) ft::moe_packed(t->args, *t->packed);
        else ft::moe_layer(t->args);
    } catch (const std::exception& e) {
        // a failed call leaves zeros, never stale numbers, in the output the GPU copies back
        const ft::LayerArgs& a = t->args;
        std::memset(a.out, 0, static_cast<size_t>(a.T * a.out_ld) * (a.out_bf16 ? 2 : 4));
        std::lock_guard<std::mutex> lock(t->error_mutex);
        if (t->failures.fetch_add(1) == 0) t->error = e.what();
        g_failures.fetch_add(1, std::memory_order_release);
    }
    t->runs.fetch_add(1);
    g_busy_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
                            .count(),
                        std::memory_order_relaxed);
}

bool ft_host_task_has_fetch(void* task) noexcept { return static_cast<ft::HostTask*>(task)->fetch != nullptr; }

void ft_host_task_fetch(void* task) noexcept {
    auto* t = static_cast<ft::HostTask*>(task);
    if (!t->fetch) return;
    std::string error = ft::dma_fetch_issue(*t->fetch);
    if (error.empty()) return;
    try {
        std::lock_guard<std::mutex> lock(t->error_mutex);
        if (t->failures.fetch_add(1) == 0) t->error = std::move(error);
    } catch (...) {
        t->failures.fetch_add(1);
    }
    g_failures.fetch_add(1, std::memory_order_release);
    ft::dma_fetch_release(*t->fetch);  // after the record: a check once the GPU went on sees it
}
