// The process-wide pool (see pool.h).
#include "pool.h"

#include <algorithm>
#include <cstdio>
#include <set>
#include <string>
#include <utility>
#include <stdexcept>

namespace ft {

namespace {
std::mutex g_pool_mutex;           // guards g_pool replacement
std::shared_ptr<Pool> g_pool;      // callers hold a reference for the duration of a call
int g_requested_threads = 0;       // 0 = all CPUs in the affinity mask
bool g_pin = true;

}  // namespace

namespace {
// stdio, not iostreams: a std::ifstream here crashed in a process whose libstdc++ (loaded by torch)
// differs from the compiler's (locale facets are shared process state).
int read_int(const std::string& path, int fallback) {
    std::FILE* f = std::fopen(path.c_str(), "r");
    if (!f) return fallback;
    int v = fallback;
    if (std::fscanf(f, "%d", &v) != 1) v = fallback;
    std::fclose(f);
    return v;
}
}  // namespace

std::vector<int> cpus_by_core() {
    cpu_set_t set;
    std::vector<int> allowed;
    if (sched_getaffinity(0, sizeof(set), &set) == 0)
        for (int c = 0; c < CPU_SETSIZE; ++c)
            if (CPU_ISSET(c, &set)) allowed.push_back(c);
    std::vector<int> first, rest;
    std::set<std::pair<int, int>> seen;  // (package, core)
    for (int c : allowed) {
        const std::string base = "/sys/devices/system/cpu/cpu" + std::to_string(c) + "/topology/";
        const std::pair<int, int> core{read_int(base + "physical_package_id", 0), read_int(base + "core_id", c)};
        (seen.insert(core).second ? first : rest).push_back(c);
    }
    first.insert(first.end(), rest.begin(), rest.end());
    return first;
}

int physical_cores() {
    const std::vector<int> cpus = cpus_by_core();
    std::set<std::pair<int, int>> cores;
    for (int c : cpus) {
        const std::string base = "/sys/devices/system/cpu/cpu" + std::to_string(c) + "/topology/";
        cores.insert({read_int(base + "physical_package_id", 0), read_int(base + "core_id", c)});
    }
    return cores.empty() ? std::max(1u, std::thread::hardware_concurrency()) : static_cast<int>(cores.size());
}

int default_threads() { return physical_cores(); }

namespace {
std::atomic<int> g_spin_us{100};
}

void set_worker_spin_us(int us) { g_spin_us.store(us < 0 ? 0 : us, std::memory_order_relaxed); }
int worker_spin_us() { return g_spin_us.load(std::memory_order_relaxed); }

std::shared_ptr<Pool> pool() {
    std::lock_guard<std::mutex> lk(g_pool_mutex);
    if (g_pool && g_pool->pid() != getpid()) {
        // forked child: the parent's worker threads do not exist here; leak the object, never join
        new std::shared_ptr<Pool>(std::move(g_pool));
        g_pool.reset();
    }
    if (!g_pool)
        g_pool = std::make_shared<Pool>(g_requested_threads > 0 ? g_requested_threads : default_threads(), g_pin);
    return g_pool;
}

// Drops the global pool; its threads are joined when the last in-flight call releases it.
void shutdown_pool() {
    std::shared_ptr<Pool> p;
    {
        std::lock_guard<std::mutex> lk(g_pool_mutex);
        p.swap(g_pool);
    }
    if (p && p->pid() != getpid()) new std::shared_ptr<Pool>(std::move(p));  // forked child: leak
}

void set_num_threads(int n, bool pin) {
    if (n < 0) throw std::invalid_argument("num_threads must be >= 0 (0 = all allowed CPUs)");
    std::shared_ptr<Pool> old;
    {
        std::lock_guard<std::mutex> lk(g_pool_mutex);
        g_requested_threads = n;
        g_pin = pin;
        old.swap(g_pool);
    }
}

}  // namespace ft
