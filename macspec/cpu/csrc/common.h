// What macspec's CPU kernels (cpu_linear.cpp, cpu_layer.cpp) share: the thread pool, one per
// process, and reading an input's rows.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "mlx/array.h"
#include "mlx/backend/common/utils.h"
#include "mlx/stream.h"

namespace macspec {

namespace mx = mlx::core;

// ---------------------------------------------------------------- a small thread pool
//
// A job is a number of chunks that threads claim one at a time, so a worker that is late (its
// core busy elsewhere) leaves its share to the others instead of holding everyone up. The
// chunks are cut into one contiguous part per thread, which its owner claims from the front and
// the others, once their own part is done, from the back: each thread then streams adjacent
// weight rows, which the kernels' prefetch of the next block and the hardware prefetchers
// follow (docs/cpu.md, "Each thread its own stretch of rows"). Workers
// spin briefly between jobs (a decode step calls a product every few microseconds), then sleep
// on a futex, so an idle process costs nothing.

class Pool {
 public:
  static Pool& get() {
    static Pool pool;
    pool.check_fork();
    return pool;
  }

  int threads() const {
    return nthreads_;
  }

  void set_threads(int n) {
    std::lock_guard<std::mutex> lock(run_mutex_);
    stop_workers();
    nthreads_ = n < 1 ? 1 : n;
    start_workers();
  }

  void set_spin_us(int us) {
    spin_us_ = us < 0 ? 0 : us;
  }

  // Runs fn(c) for every chunk c in [0, chunks) and returns when all are done (chunks < 2^16).
  void run(int chunks, const std::function<void(int)>& fn) {
    std::unique_lock<std::mutex> lock(run_mutex_, std::try_to_lock);
    if (!lock.owns_lock() || nthreads_ == 1 || chunks == 1) {  // inline (or another stream
      for (int c = 0; c < chunks; c++) {                       // holds the pool)
        fn(c);
      }
      return;
    }
    job_ = &fn;
    done_.store(0, std::memory_order_relaxed);
    uint64_t gen = (state_.load(std::memory_order_relaxed) >> 32) + 1;
    for (int t = 0; t < nthreads_; t++) {
      const uint64_t first = (uint64_t)chunks * t / nthreads_;
      const uint64_t end = (uint64_t)chunks * (t + 1) / nthreads_;
      parts_[t].store(gen << 32 | end << 16 | first, std::memory_order_relaxed);
    }
    state_.store(gen << 32 | uint64_t(chunks) << 16);  // publishes job_, done_ and parts_
    wake();
    int mine = claim_all(gen, 0);
    int spins = 0;
    while (done_.load(std::memory_order_acquire) + mine < chunks) {
      if (++spins < 4096) {
        pause();
      } else {
        sched_yield();  // a worker holds a chunk but lost its core
      }
    }
  }

 private:
  Pool() {
    nthreads_ = default_threads();
    start_workers();
  }
  ~Pool() {
    stop_workers();
  }

  static int default_threads() {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
      return CPU_COUNT(&set) > 0 ? CPU_COUNT(&set) : 1;
    }
    return 1;
  }

  static inline void pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  // Claims and runs chunks of job `gen` until none is left, its own part (`self`) first, then
  // the others' from their ends; returns how many it ran. A claim is a compare-and-swap on a
  // part's whole word, its job's generation included, so a thread late from an earlier job can
  // neither take a chunk of the next one unknowingly nor read its bounds out of date.
  int claim_all(uint64_t gen, int self) {
    int ran = 0, chunk;
    while (claim(parts_[self], gen, true, chunk)) {
      (*job_)(chunk);
      ran++;
    }
    for (int i = 1; i < nthreads_; i++) {
      std::atomic<uint64_t>& part = parts_[(self + i) % nthreads_];
      while (claim(part, gen, false, chunk)) {
        (*job_)(chunk);
        ran++;
      }
    }
    return ran;
  }

  // One chunk of `part` (generation << 32 | end << 16 | next): its next one (`front`), or its
  // last one; false where the part is empty or of another job.
  static bool claim(std::atomic<uint64_t>& part, uint64_t gen, bool front, int& chunk) {
    uint64_t s = part.load(std::memory_order_acquire);
    while (true) {
      const uint64_t end = (s >> 16) & 0xffff, next = s & 0xffff;
      if ((s >> 32) != gen || next >= end) {
        return false;
      }
      const uint64_t claimed = front ? s + 1 : s - (uint64_t(1) << 16);
      if (part.compare_exchange_weak(s, claimed, std::memory_order_acq_rel)) {
        chunk = (int)(front ? next : end - 1);
        return true;
      }
    }
  }

  // Sleeping and waking (seq_cst on both sides: either the waker sees a sleeper, or the
  // sleeper sees the new job before it waits).
  void sleep_until_changed(uint64_t seen) {
    std::unique_lock<std::mutex> lock(sleep_mutex_);
    sleepers_.fetch_add(1);
    wake_cv_.wait(lock, [&] { return (state_.load() >> 32) != seen; });
    sleepers_.fetch_sub(1);
  }

  void wake() {
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_cv_.notify_all();
    }
  }

  void check_fork() {
    if (pid_ != getpid()) {  // a forked child has no workers: start its own
      for (auto& t : workers_) {
        t.detach();
      }
      workers_.clear();
      start_workers();
    }
  }

  void start_workers() {
    pid_ = getpid();
    stop_ = false;
    // The generation is read here, not in the new thread: a stop that comes before the thread
    // runs must still be seen as a change.
    uint64_t seen = state_.load() >> 32;
    parts_ = std::vector<std::atomic<uint64_t>>(nthreads_);  // all 0: generation 0, empty
    for (int i = 1; i < nthreads_; i++) {
      workers_.emplace_back([this, seen, i] { work(seen, i); });
    }
  }

  void stop_workers() {
    stop_ = true;
    state_.fetch_add(uint64_t(1) << 32);
    wake();
    for (auto& t : workers_) {
      if (t.joinable()) {
        t.join();
      }
    }
    workers_.clear();
  }

  void work(uint64_t seen, int self) {
    while (true) {
      auto start = std::chrono::steady_clock::now();
      int spins = 0;
      uint64_t s;
      while (((s = state_.load(std::memory_order_acquire)) >> 32) == seen) {
        if ((++spins & 255) == 0 &&
            std::chrono::steady_clock::now() - start > std::chrono::microseconds(spin_us_)) {
          sleep_until_changed(seen);
          start = std::chrono::steady_clock::now();
        }
        pause();
      }
      if (stop_) {
        return;
      }
      seen = s >> 32;
      int ran = claim_all(seen, self);
      if (ran) {
        done_.fetch_add(ran, std::memory_order_acq_rel);
      }
    }
  }

  int nthreads_ = 1;
  // Short: on a 2-core CPU a spinning worker takes the core Python builds the graph on.
  int spin_us_ = 20;
  pid_t pid_ = 0;
  std::atomic<bool> stop_{false};
  // job generation << 32 | its number of chunks << 16
  std::atomic<uint64_t> state_{0};
  // thread t's part of the job's chunks: generation << 32 | end << 16 | the next to claim
  std::vector<std::atomic<uint64_t>> parts_;
  std::atomic<int> done_{0};  // chunks the workers finished
  const std::function<void(int)>* job_ = nullptr;
  std::vector<std::thread> workers_;
  std::mutex run_mutex_;
  std::mutex sleep_mutex_;
  std::condition_variable wake_cv_;
  std::atomic<int> sleepers_{0};
};


// Rows per chunk: ~64 KB of weights (a few microseconds), a multiple of 16 rows, and at
// least four chunks for the threads to share when the matrix allows.
inline int chunk_rows(int N, int row_bytes) {
  int rows = std::max(16, (65536 / std::max(row_bytes, 1)) / 16 * 16);
  while (rows > 16 && (N + rows - 1) / rows < 4) {
    rows -= 16;
  }
  while ((N + rows - 1) / rows > 65535) {  // the pool counts chunks in 16 bits
    rows *= 2;
  }
  return rows;
}

// Several products as one job of the pool: fn(j, n0, n1) computes rows [n0, n1) of product j
// (N[j] rows of row_bytes[j] bytes of weights). Each is split as it would be alone, so its
// results are the same; the threads wait for each other once instead of once per product.
template <class Fn>
void run_joined(const int* N, const int* row_bytes, int count, const Fn& fn) {
  constexpr int MAX = 8;
  if (count < 1 || count > MAX) {
    throw std::invalid_argument("[macspec products] 1 to 8 products in one job");
  }
  int rows[MAX], first[MAX + 1] = {0};
  for (int j = 0; j < count; j++) {
    rows[j] = chunk_rows(N[j], row_bytes[j]);
    first[j + 1] = first[j] + (N[j] + rows[j] - 1) / rows[j];
  }
  if (count > 1 && first[count] > 65535) {  // the pool counts chunks in 16 bits: one by one
    for (int j = 0; j < count; j++) {
      Pool::get().run(first[j + 1] - first[j], [&](int c) {
        fn(j, c * rows[j], std::min(N[j], (c + 1) * rows[j]));
      });
    }
    return;
  }
  Pool::get().run(first[count], [&](int c) {
    int j = 0;
    while (c >= first[j + 1]) {
      j++;
    }
    const int n0 = (c - first[j]) * rows[j];
    fn(j, n0, std::min(N[j], n0 + rows[j]));
  });
}

// Rows and columns of a weight matrix stored as `w`: float32 (N, K), MLX's affine layout
// (N, K * bits / 32), or weights repacked at load (N / 16, K / G, G * bits / 2 for groups of
// G = 32 or 64 and 4 or 8 bits; cpu_q4packed.cpp).
inline int matrix_rows(const mx::array& w) {
  return w.ndim() == 3 ? w.shape(0) * 16 : w.shape(0);
}
inline int matrix_cols(const mx::array& w, int bits) {
  return w.ndim() == 3 ? w.shape(1) * w.shape(2) * 2 / bits
                       : bits == 32 ? w.shape(1) : w.shape(1) * 32 / bits;
}

// Weights and scales (or biases) in the shapes cpu_q4packed.cpp's repacking gives them.
// Scales (and biases) factored (int8; cpu_q4packed.cpp) take half as many rows again a block.
inline bool packed_shapes(const mx::array& w, const mx::array& scales) {
  if (w.ndim() != 3 || !(w.shape(2) == 64 || w.shape(2) == 128 || w.shape(2) == 256)) {
    return false;
  }
  const int groups = w.shape(1);
  if (scales.dtype() == mx::int8) {
    return groups % 8 == 0 && scales.shape() == mx::Shape{w.shape(0), groups + groups / 2, 16};
  }
  return scales.shape() == mx::Shape{w.shape(0), groups, 16};
}

// The stream every macspec primitive runs on.
inline mx::Stream cpu_stream() {
  return mx::default_stream(mx::Device(mx::Device::cpu));
}

// Room for n floats that this thread keeps for its next call, one per `Slot` (a use), neither
// cleared nor shrunk; rooms over KEPT_BYTES are lent for the call only. A 512-id prompt chunk's
// MLP rows pass 32 MiB, past which glibc's malloc maps fresh pages at every call and the kernel
// zeroes each one (docs/cpu.md, "Prompt chunks past 32 MiB of scratch").
constexpr size_t KEPT_BYTES = size_t(128) << 20;

template <int Slot>
class Room {
 public:
  explicit Room(size_t n) {
    thread_local std::unique_ptr<float[]> kept;
    thread_local size_t size = 0;
    if (n * sizeof(float) > KEPT_BYTES) {
      lent_.reset(new float[n]);
      data_ = lent_.get();
      return;
    }
    if (size < n) {
      kept.reset();  // the old room goes back before the new one is taken
      kept.reset(new float[n]);
      size = n;
    }
    data_ = kept.get();
  }
  float* data() const {
    return data_;
  }

 private:
  std::unique_ptr<float[]> lent_;
  float* data_ = nullptr;
};

// The slots: one per buffer that may be in use at the same time as another.
enum RoomSlot { MLP_ROWS, ATTENDED_ROWS, QKV_ROWS, ATTENTION_PIECES };

// A row-contiguous float32 copy of x (or x itself), as (rows, K).
inline const float* rows_of(const mx::array& x, std::vector<float>& scratch) {
  if (x.flags().row_contiguous) {
    return x.data<float>();
  }
  scratch.resize(x.size());
  const float* src = x.data<float>();
  for (size_t i = 0; i < x.size(); i++) {
    scratch[i] = src[mx::elem_to_loc(static_cast<int>(i), x)];
  }
  return scratch.data();
}

}  // namespace macspec
