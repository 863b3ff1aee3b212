// See poller.h.
#include "poller.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

#include "host_task.h"
#include "pool.h"

namespace ft {
namespace {

struct Entry {
    void* task;
    volatile uint32_t* request;
    volatile uint32_t* done;
    volatile uint32_t* ready;  // the GPU's "my branch is done" word, or null
};

std::mutex g_mutex;  // guards g_entries / g_thread changes
std::vector<Entry> g_entries;
std::atomic<int> g_version{0};
std::atomic<int> g_picked{-1};  // the list version the poller works from
std::atomic<bool> g_stop{false};
std::atomic<int64_t> g_served{0};
std::atomic<int64_t> g_cpu_late{0}, g_gpu_late{0};  // which branch finished last, per served request
std::thread g_thread;
// The copier: a layer's host-issued fetch (dma_fetch.h) handed over by the poller, which then
// starts the layer's CPU experts at once rather than after the driver calls that queue the copies.
std::atomic<void*> g_fetch{nullptr};  // the task whose fetch waits for the copier, or null
std::atomic<bool> g_copying{false};  // the copier is inside a fetch
std::atomic<bool> g_copier_up{false};  // the copier thread runs (else the poller fetches itself)
std::thread g_copier;
// The timeline (poll_timeline): sums over served requests and fetches, read as deltas. A layer's
// wall time is the poller's share (doorbell seen -> answer written), then the GPU's alone (answer
// -> the next layer's doorbell seen: the wait for the answer's visibility, the combine, the fetched
// experts' GEMVs if the copies were late, the next layer's dense part, plan and hand-off).
std::atomic<int64_t> g_cpu_ns{0};
std::atomic<int64_t> g_gap_ns{0}, g_gaps{0};  // counted only from one entry to the next registered one
std::atomic<int64_t> g_fetch_ns{0}, g_fetches{0}, g_fetch_late{0};  // doorbell seen -> the copier done
std::atomic<int64_t> g_fetch_t0{0}, g_fetch_seq{0};  // the handed fetch's doorbell time and request number

int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

// A fetch issued (and, with the host-written word, landed) `t0` after its doorbell; late when the
// poller had already answered request `seq` (the CPU branch finished first).
void count_fetch(int64_t t0, int64_t seq) {
    g_fetch_ns.fetch_add(now_ns() - t0, std::memory_order_relaxed);
    g_fetches.fetch_add(1, std::memory_order_relaxed);
    if (g_served.load() > seq) g_fetch_late.fetch_add(1, std::memory_order_relaxed);
}

// Between requests: spin, then (20 ms after the last one) poll every 50 us, then every 1 ms
// (decode steps come every few hundred microseconds).
void idle(uint32_t& spins, std::chrono::steady_clock::time_point last_work) {
    if (++spins < 4096) {
        cpu_relax();
        return;
    }
    spins = 0;
    const auto idle_for = std::chrono::steady_clock::now() - last_work;
    if (idle_for > std::chrono::seconds(1)) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    else if (idle_for > std::chrono::milliseconds(20)) std::this_thread::sleep_for(std::chrono::microseconds(50));
}

void copier_loop() {
    auto last_work = std::chrono::steady_clock::now();
    uint32_t spins = 0;
    g_copier_up.store(true);
    while (!g_stop.load(std::memory_order_relaxed)) {
        if (void* task = g_fetch.load(); task != nullptr) {
            const int64_t t0 = g_fetch_t0.load(), seq = g_fetch_seq.load();
            g_copying.store(true);
            g_fetch.store(nullptr);
            ft_host_task_fetch(task);
            count_fetch(t0, seq);
            g_copying.store(false);
            last_work = std::chrono::steady_clock::now();
            spins = 0;
            continue;
        }
        idle(spins, last_work);
    }
    if (void* task = g_fetch.exchange(nullptr); task != nullptr) ft_host_task_fetch(task);  // never strand one
    g_copier_up.store(false);
}

void loop() {
    std::vector<Entry> local;
    int seen_version = -1;
    auto last_work = std::chrono::steady_clock::now();
    uint32_t spins = 0;
    constexpr size_t kNone = static_cast<size_t>(-1);
    size_t last_served = kNone;  // index in `local` of the last request answered, and when
    int64_t last_answer = 0;
    while (!g_stop.load(std::memory_order_relaxed)) {
        if (const int v = g_version.load(std::memory_order_acquire); v != seen_version) {
            std::lock_guard<std::mutex> lock(g_mutex);
            local = g_entries;
            seen_version = g_version.load();
            g_picked.store(seen_version, std::memory_order_release);
            last_served = kNone;
        }
        bool any = false;
        for (size_t i = 0; i < local.size(); ++i) {
            const Entry& e = local[i];
            if (*e.request == 0) continue;
            std::atomic_thread_fence(std::memory_order_acquire);  // the GPU's copies landed before the doorbell
            *e.request = 0;
            const int64_t seen = now_ns();
            if (last_served != kNone && i == last_served + 1) {  // a step's next layer (registered in order)
                g_gap_ns.fetch_add(seen - last_answer, std::memory_order_relaxed);
                g_gaps.fetch_add(1, std::memory_order_relaxed);
            }
            if (ft_host_task_has_fetch(e.task)) {
                if (g_copier_up.load()) {
                    // the copies start while the CPU experts run (the copier has long finished the
                    // previous layer's: the GPU waited for its word before this layer's doorbell)
                    while (g_fetch.load() != nullptr) cpu_relax();
                    g_fetch_t0.store(seen);
                    g_fetch_seq.store(g_served.load());
                    g_fetch.store(e.task);
                } else {
                    ft_host_task_fetch(e.task);  // no copier (yet): queue the copies here first
                    count_fetch(seen, g_served.load());
                }
            }
            ft_host_task_run(e.task);
            if (e.ready != nullptr) {
                // the GPU sets it when its branch is done and clears it after it has seen ours, so
                // it reads 1 here exactly when the GPU is already waiting for this answer
                if (*e.ready != 0) g_cpu_late.fetch_add(1, std::memory_order_relaxed);
                else g_gpu_late.fetch_add(1, std::memory_order_relaxed);
            }
            std::atomic_thread_fence(std::memory_order_release);  // the output is written before done
            *e.done = 1;
            last_answer = now_ns();
            last_served = i;
            g_cpu_ns.fetch_add(last_answer - seen, std::memory_order_relaxed);
            g_served.fetch_add(1);  // after done: a copier still copying this layer's experts counts late
            any = true;
        }
        if (any) {
            last_work = std::chrono::steady_clock::now();
            spins = 0;
            continue;
        }
        idle(spins, last_work);
    }
}

}  // namespace

void poll_register(void* task, volatile uint32_t* request, volatile uint32_t* done, volatile uint32_t* ready) {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_entries.push_back({task, request, done, ready});
    g_version.fetch_add(1, std::memory_order_release);
    if (!g_thread.joinable()) {
        g_stop.store(false);
        g_thread = std::thread(loop);
    }
    if (ft_host_task_has_fetch(task) && !g_copier.joinable()) g_copier = std::thread(copier_loop);
}

void poll_unregister(void* task) {
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        for (size_t i = 0; i < g_entries.size(); ++i)
            if (g_entries[i].task == task) {
                g_entries.erase(g_entries.begin() + static_cast<long>(i));
                break;
            }
        g_version.fetch_add(1, std::memory_order_release);
    }
    // the poller may be running the task from its old list: wait until it has picked up the new one
    const int want = g_version.load();
    for (int i = 0; i < 20000 && g_thread.joinable() && g_picked.load(std::memory_order_acquire) < want; ++i)
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    // and the copier may be inside a fetch the poller handed it
    for (int i = 0; i < 20000 && g_copier.joinable() && (g_fetch.load() != nullptr || g_copying.load()); ++i)
        std::this_thread::sleep_for(std::chrono::microseconds(50));
}

void poll_stop() {
    std::thread t, c;
    {
        std::lock_guard<std::mutex> lock(g_mutex);
        g_stop.store(true);
        t = std::move(g_thread);
        c = std::move(g_copier);
    }
    if (t.joinable()) t.join();
    if (c.joinable()) c.join();
    g_picked.store(-1);
}

int64_t poll_served() { return g_served.load(); }

void poll_copier_state(bool* up, bool* pending, bool* copying) {
    *up = g_copier_up.load();
    *pending = g_fetch.load() != nullptr;
    *copying = g_copying.load();
}

PollTimeline poll_timeline() {
    PollTimeline t;
    t.served = g_served.load();
    t.cpu_ns = g_cpu_ns.load();
    t.gaps = g_gaps.load();
    t.gap_ns = g_gap_ns.load();
    t.fetches = g_fetches.load();
    t.fetch_ns = g_fetch_ns.load();
    t.fetch_late = g_fetch_late.load();
    return t;
}

void poll_lateness(int64_t* cpu_late, int64_t* gpu_late) {
    *cpu_late = g_cpu_late.load(std::memory_order_relaxed);
    *gpu_late = g_gpu_late.load(std::memory_order_relaxed);
}

}  // namespace ft
