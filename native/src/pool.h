// Persistent worker pool of the native executor. The calling thread is worker 0; workers 1..n-1
// are pinned (best effort) one per CPU of the process's affinity mask. `run(job)` runs job(i) on
// every worker and returns when all are done; `barrier()` synchronises the workers inside a job.
// Calls are serialized by `call_mutex`. Workers spin for `worker_spin_us()` between jobs (back-to-
// back MoE layers wake them in well under a microsecond), then sleep on a condition variable (a
// wake-up from there takes a futex call and the scheduler: tens of microseconds for the slowest of
// them). The default, 100 us, keeps the cores free for torch ops between the layers of a CPU
// engine; the GPU tier's CPU branch, whose calls come every few hundred microseconds while the
// GPU runs the rest of the layer, raises it (set_worker_spin_us).
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace ft {

// CPUs of the affinity mask ordered one per physical core first (by /sys topology), SMT siblings last.
std::vector<int> cpus_by_core();

// How long idle workers spin before sleeping (process-wide, read by each worker as it goes idle).
void set_worker_spin_us(int us);
int worker_spin_us();

inline void cpu_relax() {
#if defined(__x86_64__)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
}

class Pool {
  public:
    Pool(int n, bool pin) : n_(n > 1 ? n : 1), pid_(getpid()) {
        const std::vector<int> cpus = pin ? cpus_by_core() : std::vector<int>{};
        for (int i = 1; i < n_; ++i) {
            threads_.emplace_back([this, i] { worker(i); });
            pthread_setname_np(threads_.back().native_handle(), "ft-worker");  // what top -H and tests see
            if (!cpus.empty()) {  // worker i -> i-th CPU in core order (CPU 0 of that order is the caller's)
                cpu_set_t one;
                CPU_ZERO(&one);
                CPU_SET(cpus[i % cpus.size()], &one);
                pinned_ += pthread_setaffinity_np(threads_.back().native_handle(), sizeof(one), &one) == 0;
            }
        }
    }
    ~Pool() {
        {
            std::lock_guard<std::mutex> lk(m_);
            stop_ = true;
        }
        cv_.notify_all();
        for (auto& t : threads_) t.join();
    }
    int size() const { return n_; }
    int pinned() const { return pinned_; }
    pid_t pid() const { return pid_; }

    // Runs job(worker_index) on all n workers; returns when all are done. Caller holds call_mutex.
    void run(const std::function<void(int)>& job) {
        job_ = &job;
        done_.store(0, std::memory_order_relaxed);
        {
            std::lock_guard<std::mutex> lk(m_);
            gen_.fetch_add(1, std::memory_order_seq_cst);
        }
        cv_.notify_all();
        std::exception_ptr err;
        try {
            job(0);
        } catch (...) {
            err = std::current_exception();
        }
        spin_until([&] { return done_.load(std::memory_order_acquire) == n_ - 1; });
        job_ = nullptr;
        if (err) std::rethrow_exception(err);
    }

    // All n workers must call this the same number of times inside a job.
    void barrier() {
        if (n_ == 1) return;
        uint64_t g = bar_gen_.load(std::memory_order_acquire);
        if (bar_count_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
            bar_count_.store(0, std::memory_order_relaxed);
            bar_gen_.fetch_add(1, std::memory_order_release);
        } else {
            spin_until([&] { return bar_gen_.load(std::memory_order_acquire) != g; });
        }
    }

    std::mutex call_mutex;

  private:
    template <class F>
    static void spin_until(F done) {
        for (int i = 0; !done(); ++i) {
            if (i < 4000) cpu_relax();
            else std::this_thread::yield();
        }
    }
    void worker(int i) {
        uint64_t seen = 0;
        for (;;) {
            // spin for low wake-up latency between back-to-back layer calls, then sleep
            bool got = false;
            const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(worker_spin_us());
            for (int s = 0;; ++s) {
                if (gen_.load(std::memory_order_acquire) != seen) {
                    got = true;
                    break;
                }
                cpu_relax();
                if ((s & 63) == 63 && std::chrono::steady_clock::now() >= until) break;
            }
            if (!got) {
                std::unique_lock<std::mutex> lk(m_);
                cv_.wait(lk, [&] { return stop_ || gen_.load() != seen; });
                if (stop_) return;
            }
            seen = gen_.load(std::memory_order_acquire);
            try {
                (*job_)(i);
            } catch (...) {  // kernels do not throw; never let an exception kill the process
            }
            done_.fetch_add(1, std::memory_order_acq_rel);
        }
    }

    int n_;
    pid_t pid_;
    int pinned_ = 0;
    std::vector<std::thread> threads_;
    std::mutex m_;
    std::condition_variable cv_;
    bool stop_ = false;
    std::atomic<uint64_t> gen_{0};
    std::atomic<int> done_{0};
    const std::function<void(int)>* job_ = nullptr;
    std::atomic<int> bar_count_{0};
    std::atomic<uint64_t> bar_gen_{0};
};


// The process-wide pool, created lazily with the requested size; replaced by set_num_threads and
// dropped by shutdown_pool (its threads are joined when the last in-flight call releases it). A
// forked child never joins its parent's threads: it leaks that object and starts its own pool.
std::shared_ptr<Pool> pool();
int physical_cores();  // distinct physical cores in the affinity mask
void shutdown_pool();
void set_num_threads(int n, bool pin);
int default_threads();  // physical_cores()

}  // namespace ft
