// The kernels' parallel loops, made for a machine that other processes also use (issue #19).
//
// at::parallel_for (OpenMP) gives each thread one fixed share of the loop and ends at a barrier.
// When the OS parks one thread (a busy box: two CPU hogs beside a 2-core server), the caller sits
// at the barrier for that thread's time slice and then for its whole share: GEMM calls crawled
// 20-40x in bursts. Here the loop is cut into several chunks per thread and every thread, the
// caller included, claims the next unclaimed chunk until none is left. The caller waits only for
// chunks already claimed, never for a thread that has not shown up: if the helpers are parked, the
// caller runs the whole loop itself, as fast as one thread can.
//
// Which thread runs a chunk, and where chunks start, never changes what an output element
// computes (every kernel's elements are independent, each one fixed reduction), so results stay
// bit-identical at any thread count, any M and under any load.
//
// One pool per kernel module (internal linkage): helpers = at::get_num_threads() - 1, started at
// the first parallel call; idle, they spin briefly (kernel calls of one step come back to back),
// then sleep on a condition variable.
#pragma once

#include <ATen/Parallel.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace conveyor_parallel {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

using Body = std::function<void(int64_t, int64_t)>;

// Chunks per thread: enough that a parked thread's unclaimed work is picked up by the others.
constexpr int64_t kChunksPerThread = 4;
// How long an idle helper spins before it sleeps: the next kernel call of a step is usually this close.
constexpr auto kSpin = std::chrono::microseconds(100);

class Pool {
 public:
  // body(begin, end) over [0, n) in chunks of at least `grain`; returns when every chunk is done.
  void run(int64_t n, int64_t grain, const Body& body) {
    const int64_t helpers = std::min<int64_t>(at::get_num_threads() - 1, kMaxHelpers);
    if (helpers <= 0 || n <= grain || n >= kClosed || at::in_parallel_region()) {
      body(0, n);  // without taking the pool: a one-thread caller (a model loading beside others that stream,
      return;      // its packing seconds long) must not leave every other caller's loops on one thread
    }
    std::unique_lock<std::mutex> owner(run_mu_, std::try_to_lock);  // busy (another caller): run inline
    if (!owner.owns_lock()) {
      body(0, n);
      return;
    }
    grow(helpers);
    const int64_t chunk = std::max(grain, (n + (helpers + 1) * kChunksPerThread - 1) / ((helpers + 1) * kChunksPerThread));
    // Publish: close the ticket under the new epoch, describe the job, open it (helpers check
    // that the epoch did not move while they read the description).
    const uint64_t epoch = ((ticket_.load() >> 32) + 1) & kClosed;  // 32 bits: wraps, never spills out of the word
    ticket_.store(epoch << 32 | kClosed);
    body_.store(&body);
    n_.store(n);
    chunk_.store(chunk);
    helpers_.store(helpers);
    done_.store(0);
    ticket_.store(epoch << 32);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_all();
    }
    work(epoch, n, chunk, body);
    // Only chunks that another thread holds are left; they are short.
    for (int spins = 0; done_.load(std::memory_order_acquire) < n; ++spins) {
      if (spins < 4096) cpu_relax(); else std::this_thread::yield();
    }
    if (error_) {
      std::exception_ptr error = nullptr;
      std::swap(error, error_);
      std::rethrow_exception(error);
    }
  }

 private:
  static constexpr uint64_t kClosed = 0xFFFFFFFFu;  // index half of the ticket while a job is being published
  static constexpr int64_t kMaxHelpers = 255;

  // Claim [i, i + chunk) of epoch `epoch` until none is left (or a newer job replaced it).
  void work(uint64_t epoch, int64_t n, int64_t chunk, const Body& body) {
    for (;;) {
      uint64_t t = ticket_.load();
      if ((t >> 32) != epoch) return;
      const int64_t begin = static_cast<int64_t>(t & kClosed);
      if (begin >= n) return;
      const int64_t end = std::min(n, begin + chunk);
      if (!ticket_.compare_exchange_weak(t, epoch << 32 | static_cast<uint64_t>(end))) continue;
      try {
        body(begin, end);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu_);
        if (!error_) error_ = std::current_exception();
      }
      done_.fetch_add(end - begin, std::memory_order_release);
    }
  }

  void grow(int64_t helpers) {
    while (static_cast<int64_t>(started_) < helpers) {
      std::thread([this, index = started_] { helper(index); }).detach();
      ++started_;
    }
  }

  // Wait until a job newer than `seen` is open: spin a little, then sleep.
  uint64_t next_job(uint64_t seen) {
    auto is_new = [&](uint64_t t) { return (t >> 32) != seen && (t & kClosed) != kClosed; };
    const auto until = std::chrono::steady_clock::now() + kSpin;
    for (int spins = 1;; ++spins) {
      const uint64_t t = ticket_.load();
      if (is_new(t)) return t;
      cpu_relax();
      if (spins % 64 == 0 && std::chrono::steady_clock::now() > until) break;
    }
    std::unique_lock<std::mutex> lock(mu_);
    sleepers_.fetch_add(1);
    cv_.wait(lock, [&] { return is_new(ticket_.load()); });
    sleepers_.fetch_sub(1);
    return ticket_.load();
  }

  void helper(int64_t index) {
    uint64_t seen = 0;
    for (;;) {
      const uint64_t epoch = next_job(seen) >> 32;
      const Body* body = body_.load();
      const int64_t n = n_.load(), chunk = chunk_.load(), helpers = helpers_.load();
      seen = epoch;
      // The description belongs to `epoch` only if no newer job was published while we read it.
      if ((ticket_.load() >> 32) != epoch || index >= helpers) continue;
      work(epoch, n, chunk, *body);
    }
  }

  std::mutex run_mu_;  // one job at a time; a concurrent caller runs its loop inline
  std::atomic<uint64_t> ticket_{0};  // epoch (high 32 bits) | next unclaimed index (low 32 bits)
  std::atomic<const Body*> body_{nullptr};
  std::atomic<int64_t> n_{0}, chunk_{1}, helpers_{0}, done_{0};
  std::atomic<int> sleepers_{0};
  std::mutex mu_;  // with cv_: sleeping helpers
  std::condition_variable cv_;
  std::mutex error_mu_;
  std::exception_ptr error_ = nullptr;
  int64_t started_ = 0;  // helper threads started (guarded by run_mu_)
};

// Never destroyed (detached helpers may still be waiting in it at exit); a forked child makes its own.
Pool*& pool_slot() {
  static Pool* pool = [] {
    pthread_atfork(nullptr, nullptr, [] { pool_slot() = new Pool(); });
    return new Pool();
  }();
  return pool;
}

}  // namespace

// One pool for every kernel module of a process: build.py's load_kernels hands the first module's pool
// to the others (adopt_pool). With a pool per module, a decode step's kernels (GEMM, fused ops,
// attention, in turn) each woke their own helper, which had fallen asleep since that module's last
// call a layer ago, while the other modules' helpers still spun: more spinning threads than cores.
// A C=1 decode step of SmolLM2 on 2 threads spent ~130 us per attention call waiting on that
// (19 us on 1 thread). The modules are built from these same headers by one compiler (the build key
// hashes every header), and pool_abi() lets the caller check it before sharing.
template <typename Module>
void def_pool_sharing(Module& m) {
  m.def("pool_handle", [] { return reinterpret_cast<uintptr_t>(pool_slot()); },
        "this module's parallel pool, for adopt_pool of the process's other kernel modules");
  m.def("pool_abi", [] { return std::string(__VERSION__) + "/" + std::to_string(sizeof(Pool)) + "/1"; },
        "the compiler and pool layout: modules share a pool only when these are equal");
  m.def("adopt_pool", [](uintptr_t handle) { pool_slot() = reinterpret_cast<Pool*>(handle); },
        "run this module's parallel loops on another module's pool (pool_handle)");
}

// at::parallel_for's contract (body(begin, end) over [begin, end), chunks of at least `grain`),
// scheduled by claiming rather than by static shares.
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (end <= begin) return;
  const Body body = [&](int64_t b, int64_t e) { f(begin + b, begin + e); };
  pool_slot()->run(end - begin, std::max<int64_t>(grain, 1), body);
}

}  // namespace conveyor_parallel
