// In-place SUM all-reduce between the tensor-parallel ranks of one CPU node through a
// shared-memory segment (worker/cpu/shm_allreduce.py creates, maps and removes the
// file; this file does the exchange). gloo over loopback TCP is the fallback.
//
// Segment layout (every rank maps the same file; offsets from its start):
//   [0, 64)          header: magic, world size, chunk bytes (checked on attach)
//   slot (r, b)      at kSlotBase + (2r + b) * kSlotStride: rank r's stamp for buffer b
//                    (64-bit sequence number), what the call was (bytes, dtype) and how
//                    many ranks sleep waiting for it (the futex: see wait). One
//                    slot per 128 bytes: no two ranks' stamps share a cache line (nor a
//                    pair of lines, which adjacent-line prefetchers fetch together).
//   buffer (r, b)    at data_offset + (2r + b) * chunk_bytes: rank r's copy of its chunk.
//
// Protocol. A rank's k-th chunk, over all its calls, has sequence number s = k (from 1)
// and uses buffer b = s & 1. For it the rank
//   1. copies its chunk into buffer (rank, b),
//   2. publishes stamp (rank, b) = s with a release (seq_cst) store,
//   3. waits until stamp (r, b) >= s for every other rank r (acquire loads),
//   4. sums the chunks of ranks 0, 1, ..., world - 1 in that order into its tensor.
// Why it is safe: step 3's acquire pairs with r's release in step 2, so r's chunk s is
// fully in its buffer when we read it. A rank overwrites buffer (rank, b) at step s + 2
// only after its step 3 of s + 1, i.e. after every rank published stamp s + 1; a rank
// publishes s + 1 only after its own step 4 of s, so nobody reads chunk s any more when
// chunk s + 2 replaces it. By the same argument no rank gets two chunks ahead: stamp
// (r, b) is s or s - 2 while anyone waits on s, and one buffer per parity suffices. The
// sequence advances per chunk, not per call, so a message of many chunks alternates
// buffers like many one-chunk calls. Every rank sums the same values in the same order
// (float32 accumulation, bfloat16 rounded once at the end): results are bit-identical
// across ranks.
//
// All ranks must make the same calls (same byte size and dtype) in the same order, as
// with any collective; the slot's byte size and dtype turn a mismatch into an error
// instead of a wrong sum. Waiting spins on a pause instruction for a while (a peer on
// its own core arrives within microseconds), then sleeps on a futex on the peer's stamp
// (ranks may share cores with each other or with other work: the sleeper's core goes to
// them, and the publisher wakes it), and throws ShmTimeout once a wait outlasts the
// timeout (a dead peer): the survivors raise instead of hanging. After any error the
// instance is out of step with its peers and refuses further calls.
//
// Why a futex rather than sched_yield between checks: a yield on a busy core hands it
// away for a whole time slice. On the 2-core VM with other work running, [1, 576]
// float32 calls between 2 ranks took ~115 us with ~100 us of spinning before the yields
// (several times more with less spinning), ~35 us with ~25 us of spinning before the
// futex (tests/bench/allreduce.py); ~2 us either way when the ranks have their cores.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <sched.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>

#include "cpu_math.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace {

using raydecode::from_float;
using raydecode::to_float;

constexpr uint64_t kMagic = 0x52445348'4D415231ull;  // "RDSHMAR1"
constexpr int64_t kSlotBase = 64, kSlotStride = 128, kPage = 4096;
// Pause-spins before sleeping: ~25 us where a pause takes ~25 ns (AMD Zen), ~50 us on
// recent Intel cores.
constexpr int64_t kSpins = 1024;
constexpr int64_t kMaxSleepNs = 100'000'000;  // longest single sleep (the deadline is checked after each)
constexpr int64_t kBlock = 256;      // elements summed per pass of the reduce
constexpr int64_t kGrain = 1 << 15;  // elements per thread: decode-sized calls stay on one

const char* const kDtypeNames[] = {"float32", "bfloat16"};  // a slot's dtype code

struct Header {
  uint64_t magic, world, chunk_bytes;
};

struct Slot {
  uint64_t seq;       // atomic: the publisher's seq_cst store, waiters' acquire loads
  uint64_t bytes;     // the call's total bytes and dtype: plain fields, ordered by seq
  uint64_t dtype;
  uint32_t sleepers;  // atomic: ranks asleep (or about to be) on this slot's futex word
};

// The futex word: seq's low 32 bits, which change with every publication (seq grows by
// 2 per use of a slot).
inline uint32_t* futex_word(Slot* slot) {
  return reinterpret_cast<uint32_t*>(&slot->seq) + (__BYTE_ORDER__ == __ORDER_BIG_ENDIAN__ ? 1 : 0);
}

// Sleeps until *word may differ from `seen` (a wake, or it already does), at most ns
// nanoseconds; elsewhere than Linux, a yield.
inline void futex_sleep(uint32_t* word, uint32_t seen, int64_t ns) {
#ifdef __linux__
  struct timespec ts = {time_t(ns / 1'000'000'000), long(ns % 1'000'000'000)};
  syscall(SYS_futex, word, FUTEX_WAIT, seen, &ts, nullptr, 0);  // not _PRIVATE: other processes wake it
#else
  sched_yield();
#endif
}

inline void futex_wake(uint32_t* word) {
#ifdef __linux__
  syscall(SYS_futex, word, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
#endif
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

int64_t data_offset(int64_t world) {
  return (kSlotBase + 2 * world * kSlotStride + kPage - 1) / kPage * kPage;
}

// out[i] = sum over r = 0 .. world - 1 of src[r][i], in that order, in float.
template <typename T>
void reduce(T* out, const T* const* src, int64_t world, int64_t n) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    float acc[kBlock];
    for (int64_t i0 = begin; i0 < end; i0 += kBlock) {
      const int64_t m = std::min(kBlock, end - i0);
      for (int64_t i = 0; i < m; ++i) acc[i] = to_float(src[0][i0 + i]);
      for (int64_t r = 1; r < world; ++r)
        for (int64_t i = 0; i < m; ++i) acc[i] += to_float(src[r][i0 + i]);
      for (int64_t i = 0; i < m; ++i) out[i0 + i] = from_float<T>(acc[i]);  // after every read of i0..i0+m
    }
  });
}

}  // namespace

// A wait outlasting the timeout (Python: a TimeoutError subclass).
struct ShmTimeout : std::runtime_error {
  using std::runtime_error::runtime_error;
};

int64_t shm_segment_bytes(int64_t world, int64_t chunk_bytes) {
  TORCH_CHECK(world >= 1 && world <= 1024, "shm all-reduce: world size ", world, " out of range");
  TORCH_CHECK(chunk_bytes >= 64 && chunk_bytes % 64 == 0, "shm all-reduce: chunk_bytes must be a positive multiple of 64");
  return data_offset(world) + 2 * world * chunk_bytes;
}

class ShmAllReduceSegment {
 public:
  // Maps the segment open on `fd` (the caller sized it: shm_segment_bytes). `create`:
  // this rank initializes the header (the file is new and zero-filled, so every stamp
  // is 0); otherwise the header must match this rank's world size and chunk size.
  ShmAllReduceSegment(int fd, int64_t rank, int64_t world, int64_t chunk_bytes, bool create)
      : rank_(rank), world_(world), chunk_bytes_(chunk_bytes), size_(shm_segment_bytes(world, chunk_bytes)) {
    TORCH_CHECK(rank >= 0 && rank < world, "shm all-reduce: rank ", rank, " not in [0, ", world, ")");
    struct stat st;
    TORCH_CHECK(fstat(fd, &st) == 0 && st.st_size == size_, "shm all-reduce: the segment file is not ", size_, " bytes");
    void* p = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    TORCH_CHECK(p != MAP_FAILED, "shm all-reduce: mmap failed: ", std::strerror(errno));
    base_ = static_cast<char*>(p);
    auto* h = reinterpret_cast<Header*>(base_);
    if (create) {
      h->world = world;
      h->chunk_bytes = chunk_bytes;
      __atomic_store_n(&h->magic, kMagic, __ATOMIC_RELEASE);
    } else if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != kMagic || h->world != uint64_t(world) ||
               h->chunk_bytes != uint64_t(chunk_bytes)) {
      unmap();
      TORCH_CHECK(false, "shm all-reduce: the segment was made for another group (world size or chunk size differ)");
    }
  }
  ~ShmAllReduceSegment() { unmap(); }

  void close() {  // waits for a call in flight on another thread
    std::lock_guard<std::mutex> lock(mutex_);
    unmap();
  }

  // tensor += every other rank's tensor, in place. Releases the GIL while it works.
  void all_reduce(torch::Tensor t, double timeout_s) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() &&
                    (t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16),
                "shm all-reduce: the tensor must be a contiguous float32 or bfloat16 CPU tensor");
    pybind11::gil_scoped_release no_gil;
    std::lock_guard<std::mutex> lock(mutex_);  // one call at a time per rank
    TORCH_CHECK(base_ != nullptr, "shm all-reduce: the segment is closed");
    TORCH_CHECK(!broken_, "shm all-reduce: an earlier call failed, so this rank is out of step with its peers");
    if (world_ == 1 || t.numel() == 0) return;
    broken_ = true;  // until this call completes
    if (t.scalar_type() == torch::kFloat32)
      run(t.data_ptr<float>(), t.numel(), 0, timeout_s);
    else
      run(t.data_ptr<c10::BFloat16>(), t.numel(), 1, timeout_s);
    broken_ = false;
  }

  uint64_t sequence() const { return seq_; }

 private:
  void unmap() {
    if (base_ != nullptr) munmap(base_, size_);
    base_ = nullptr;
  }

  Slot* slot(int64_t r, int64_t b) const { return reinterpret_cast<Slot*>(base_ + kSlotBase + (2 * r + b) * kSlotStride); }
  char* buffer(int64_t r, int64_t b) const { return base_ + data_offset(world_) + (2 * r + b) * chunk_bytes_; }

  template <typename T>
  void run(T* data, int64_t numel, uint64_t dtype, double timeout_s) {
    const int64_t per_chunk = chunk_bytes_ / int64_t(sizeof(T));
    const uint64_t total = uint64_t(numel) * sizeof(T);
    const T* src[1024];
    for (int64_t start = 0; start < numel; start += per_chunk) {
      const int64_t n = std::min(per_chunk, numel - start);
      const uint64_t s = ++seq_;
      const int64_t b = int64_t(s & 1);
      std::memcpy(buffer(rank_, b), data + start, n * sizeof(T));  // 1. our chunk
      Slot* mine = slot(rank_, b);
      mine->bytes = total;
      mine->dtype = dtype;
      // 2. publish. Store-then-load, both seq_cst, against the sleeper's increment-then-
      // load (wait): either it sees s and does not sleep, or we see it and wake it (and
      // a wake before its FUTEX_WAIT finds the word changed: no sleep either).
      __atomic_store_n(&mine->seq, s, __ATOMIC_SEQ_CST);
      if (__atomic_load_n(&mine->sleepers, __ATOMIC_SEQ_CST) != 0) futex_wake(futex_word(mine));
      for (int64_t r = 0; r < world_; ++r) {               // 3. everyone else's
        if (r != rank_) wait(r, b, s, total, dtype, timeout_s);
        src[r] = r == rank_ ? data + start : reinterpret_cast<const T*>(buffer(r, b));
      }
      reduce(data + start, src, world_, n);  // 4. ranks in order (ours: the same values, from the tensor)
    }
  }

  void wait(int64_t r, int64_t b, uint64_t s, uint64_t total, uint64_t dtype, double timeout_s) {
    Slot* other = slot(r, b);
    for (int64_t i = 0; i < kSpins; ++i) {
      if (__atomic_load_n(&other->seq, __ATOMIC_ACQUIRE) >= s) return check(other, r, total, dtype);
      cpu_relax();
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (true) {
      if (__atomic_load_n(&other->seq, __ATOMIC_ACQUIRE) >= s) return check(other, r, total, dtype);
      const int64_t left = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - std::chrono::steady_clock::now()).count();
      if (left <= 0)
        throw ShmTimeout(c10::str("shm all-reduce: timed out after ", timeout_s, " s waiting for rank ", r,
                                  " (a peer died or stopped calling)"));
      __atomic_fetch_add(&other->sleepers, 1, __ATOMIC_SEQ_CST);
      const uint64_t seen = __atomic_load_n(&other->seq, __ATOMIC_SEQ_CST);
      if (seen < s) futex_sleep(futex_word(other), uint32_t(seen), std::min(left, kMaxSleepNs));
      __atomic_fetch_sub(&other->sleepers, 1, __ATOMIC_SEQ_CST);
    }
  }

  void check(const Slot* other, int64_t r, uint64_t total, uint64_t dtype) const {
    if (other->bytes != total || other->dtype != dtype)
      throw std::runtime_error(c10::str("shm all-reduce: rank ", r, " reduces ", other->bytes, " bytes of dtype ",
                                        kDtypeNames[other->dtype & 1], ", this rank ", total, " of ", kDtypeNames[dtype],
                                        ": the ranks' calls differ"));
  }

  int64_t rank_, world_, chunk_bytes_, size_;
  char* base_ = nullptr;
  uint64_t seq_ = 0;  // chunks this rank has exchanged
  bool broken_ = false;
  std::mutex mutex_;
};

void register_shm_allreduce(pybind11::module_& m) {
  pybind11::register_exception<ShmTimeout>(m, "ShmAllReduceTimeout", PyExc_TimeoutError);
  m.def("shm_segment_bytes", &shm_segment_bytes, "bytes of the shm all-reduce segment for (world, chunk_bytes)");
  pybind11::class_<ShmAllReduceSegment>(m, "ShmAllReduceSegment")
      .def(pybind11::init<int, int64_t, int64_t, int64_t, bool>(), pybind11::arg("fd"), pybind11::arg("rank"),
           pybind11::arg("world"), pybind11::arg("chunk_bytes"), pybind11::arg("create"))
      .def("all_reduce", &ShmAllReduceSegment::all_reduce, "in-place SUM all-reduce through the segment",
           pybind11::arg("tensor"), pybind11::arg("timeout_s"))
      .def("close", &ShmAllReduceSegment::close, "unmaps the segment")
      .def_property_readonly("sequence", &ShmAllReduceSegment::sequence);
}
