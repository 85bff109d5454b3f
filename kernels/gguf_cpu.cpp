// GGUF blocks read as stored, on the CPU: y = x W^T for W a GGUF tensor's raw blocks (one row of
// blocks per output row), and W's float32 dequantization. Built at first use by
// kernels/gguf_cpu.py (torch.utils.cpp_extension, -O3 -march=native); the oracle is
// kernels/gguf_ref.py (the gguf package's dequantization and F.linear).
//
// Each block is dequantized exactly as ggml does (float32 products of its float16 scales and its
// integers) and multiplied by x in float32: the result is the dequantized weight's F.linear up to
// the order of the float32 sums. At one row of x (batch-1 decode) the dot products read the
// blocks once (Q4_0, Q4_1, Q8_0 without writing the dequantized values: a block's 32 products
// summed, then scaled); up to kTiledRows rows, each group of 4 rows of W is dequantized once into
// a buffer the rows of x share; more rows dequantize the weight to float32 and run one matmul.
// DecodePlan runs a whole decode step of a Llama model in one call.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#include <pthread.h>
#if defined(__x86_64__) || defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// ggml's type ids (gguf.GGMLQuantizationType)
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14;
constexpr int kLanes = 16;
// rows of x past which a matmul dequantizes W whole and multiplies with torch's (on the 2-core
// machine the tiles were 1.5-7x faster up to here, and as fast at 128 rows); also the rows a decode
// step in one call (DecodePlan) takes
constexpr int64_t kTiledRows = 64;

// The kernels' own threads. torch's OpenMP threads serve every thread that runs torch ops (the
// engine's: its main thread loads the model, another runs the steps), and libgomp, with more
// threads than cores, lets its idle workers sleep at once: each parallel region then waits for a
// wake-up, a few hundred a decode step. These workers spin a while for the next matmul (~0.2 ms:
// a decode step's matmuls come every few tens of microseconds), then sleep.
class Pool {
 public:
  void resize(int threads) {
    std::lock_guard<std::mutex> one_run(run_mu_);
    threads = std::min(threads, 0xffff);  // (a run's parts are counted in 16 bits)
    stop();
    std::lock_guard<std::mutex> lock(mu_);
    quit_ = false;
    const uint64_t now = generation_.load();  // (read here: a run may come before a worker starts)
    for (int i = 1; i < threads; ++i) workers_.emplace_back([this, now] { work(now); });
    size_ = std::max(1, threads);
  }
  int size() const { return size_; }

  // in a child forked from this process: its workers are not there (made again at the next run)
  void forget_threads() { forked_ = true; }

  // f(begin, end) over [0, n) in size() parts (fewer for small n) that the caller and the workers
  // claim one at a time: a worker the OS has not scheduled yet (more threads than cores, another
  // process busy) leaves its part to the caller instead of holding the run up until it wakes.
  void run(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& f) {
    if (forked_) {  // (the child of a fork: one thread here, nothing held that it can release)
      forked_ = false;
      new std::vector<std::thread>(std::move(workers_));  // (kept: not joinable here)
      workers_.clear();
      new (&run_mu_) std::mutex();
      new (&mu_) std::mutex();
      new (&cv_) std::condition_variable();
      resize(size_);
    }
    // one run at a time: callers (engines of one process, each calling without the GIL) wait
    std::lock_guard<std::mutex> one_run(run_mu_);
    const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(size_, (n + grain - 1) / grain));
    if (parts == 1) {
      f(0, n);
      return;
    }
    task_ = &f;
    n_ = n;
    parts_ = parts;
    done_.store(0, std::memory_order_relaxed);
    uint64_t gen;
    {
      std::lock_guard<std::mutex> lock(mu_);
      gen = generation_.load() + 1;
      // the run's tickets: its generation, its count of parts, the next part to claim
      ticket_.store((gen & 0xffffffffu) << 32 | static_cast<uint64_t>(parts) << 16,
                    std::memory_order_release);
      generation_.store(gen, std::memory_order_release);
    }
    cv_.notify_all();
    claim(gen);
    while (done_.load(std::memory_order_acquire) < parts) std::this_thread::yield();
  }

  ~Pool() { stop(); }

 private:
  // run the parts of generation `gen` left to claim; a part claimed is not done yet, so the run
  // (its task_, n_ and parts_) stays as it is until the claimer finishes it
  void claim(uint64_t gen) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    while ((t >> 32) == (gen & 0xffffffffu) && (t & 0xffff) < ((t >> 16) & 0xffff)) {
      if (ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) {
        const int64_t part = static_cast<int64_t>(t & 0xffff);
        const int64_t per = (n_ + parts_ - 1) / parts_;
        const int64_t begin = part * per, end = std::min(n_, begin + per);
        if (begin < end) (*task_)(begin, end);
        done_.fetch_add(1, std::memory_order_acq_rel);
        t = ticket_.load(std::memory_order_acquire);
      }
    }
  }

  void work(uint64_t seen) {
    while (true) {
      const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
      while (generation_.load(std::memory_order_acquire) == seen && !quit_.load() &&
             std::chrono::steady_clock::now() < spin_until) {
#if defined(__x86_64__)
        _mm_pause();
#endif
      }
      if (generation_.load(std::memory_order_acquire) == seen && !quit_.load()) {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return generation_.load() != seen || quit_.load(); });
      }
      if (quit_.load()) return;
      seen = generation_.load(std::memory_order_acquire);
      claim(seen);
    }
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      quit_ = true;
    }
    cv_.notify_all();
    for (auto& w : workers_) w.join();
    workers_.clear();
  }

  std::vector<std::thread> workers_;
  std::mutex run_mu_;  // held for a whole run, and while resizing
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<bool> quit_{false};
  const std::function<void(int64_t, int64_t)>* task_ = nullptr;
  int64_t n_ = 0, parts_ = 1;
  int size_ = 1;
  bool forked_ = false;
};

Pool* g_pool = nullptr;

Pool& pool() {
  static Pool* p = [] {
    auto* made = new Pool();  // (never destroyed: its threads may outlive static destructors)
    made->resize(at::get_num_threads());
    g_pool = made;
    pthread_atfork(nullptr, nullptr, [] { g_pool->forget_threads(); });
    return made;
  }();
  return *p;
}

template <class F>
void parallel_rows(int64_t n, int64_t grain, const F& f) {
  const std::function<void(int64_t, int64_t)> fn = f;
  pool().run(n, grain, fn);
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

struct Q4_0 {
  static constexpr int QK = 32, BYTES = 18;
  static inline void dequant(const uint8_t* b, float* y) {
    const float d = half_at(b);
    const uint8_t* q = b + 2;
    for (int l = 0; l < 16; ++l) {
      y[l] = d * static_cast<float>((q[l] & 15) - 8);
      y[l + 16] = d * static_cast<float>((q[l] >> 4) - 8);
    }
  }
};

struct Q4_1 {
  static constexpr int QK = 32, BYTES = 20;
  static inline void dequant(const uint8_t* b, float* y) {
    const float d = half_at(b), m = half_at(b + 2);
    const uint8_t* q = b + 4;
    for (int l = 0; l < 16; ++l) {
      y[l] = d * static_cast<float>(q[l] & 15) + m;
      y[l + 16] = d * static_cast<float>(q[l] >> 4) + m;
    }
  }
};

struct Q8_0 {
  static constexpr int QK = 32, BYTES = 34;
  static inline void dequant(const uint8_t* b, float* y) {
    const float d = half_at(b);
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int l = 0; l < 32; ++l) y[l] = d * static_cast<float>(q[l]);
  }
};

// ggml's get_scale_min_k4: sub-block j's 6-bit scale and minimum
inline void scale_min_k4(int j, const uint8_t* q, int* sc, int* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

struct Q4_K {
  static constexpr int QK = 256, BYTES = 144;
  static inline void dequant(const uint8_t* b, float* y) {
    const float d = half_at(b), dmin = half_at(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* q = b + 16;
    for (int j = 0, is = 0; j < QK; j += 64, is += 2, q += 32) {
      int sc, m;
      scale_min_k4(is, scales, &sc, &m);
      const float d1 = d * sc, m1 = dmin * m;
      scale_min_k4(is + 1, scales, &sc, &m);
      const float d2 = d * sc, m2 = dmin * m;
      for (int l = 0; l < 32; ++l) y[j + l] = d1 * static_cast<float>(q[l] & 0xF) - m1;
      for (int l = 0; l < 32; ++l) y[j + 32 + l] = d2 * static_cast<float>(q[l] >> 4) - m2;
    }
  }
};

struct Q6_K {
  static constexpr int QK = 256, BYTES = 210;
  static inline void dequant(const uint8_t* b, float* y) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_at(b + 208);
    for (int n = 0; n < QK; n += 128, ql += 64, qh += 32, sc += 8) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = static_cast<int>((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = static_cast<int>((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = static_cast<int>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = static_cast<int>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[n + l] = d * sc[is] * q1;
        y[n + l + 32] = d * sc[is + 2] * q2;
        y[n + l + 64] = d * sc[is + 4] * q3;
        y[n + l + 96] = d * sc[is + 6] * q4;
      }
    }
  }
};

// Blocks of 32 (Q4_0, Q4_1, Q8_0): each row's dot product reads its blocks once, four rows at a
// time (four independent sums: the adds of one row wait on each other). A block adds
// d * (its integers . x) into 16 lanes; Q4_1 adds m * xs too, xs the block's two halves of x
// summed lane by lane (computed once a call), so the lanes' total holds m * sum(x).
#if defined(__AVX512F__)
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline float vsum(Vec a) { return _mm512_reduce_add_ps(a); }

inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }

// a block of 32 (Q4_0, Q4_1, Q8_0) dequantized into y
template <int Type>
inline void dequant32(const uint8_t* b, float* y) {
  const __m512 d = _mm512_set1_ps(half_at(b));
  if constexpr (Type == kQ8_0) {
    const __m128i* q = reinterpret_cast<const __m128i*>(b + 2);
    _mm512_storeu_ps(y, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)))));
    _mm512_storeu_ps(y + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)))));
  } else {
    constexpr int start = Type == kQ4_1 ? 4 : 2;
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + start)));
    __m512i lo = _mm512_and_si512(v, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(v, 4);
    if constexpr (Type == kQ4_0) {
      lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(8));
      hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(8));
    }
    if constexpr (Type == kQ4_1) {
      const __m512 m = _mm512_set1_ps(half_at(b + 2));
      _mm512_storeu_ps(y, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(lo), m));
      _mm512_storeu_ps(y + 16, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(hi), m));
    } else {
      _mm512_storeu_ps(y, _mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)));
      _mm512_storeu_ps(y + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)));
    }
  }
}

// Q4_K and Q6_K blocks (256 values) dequantized 16 lanes at a time: the same products as the
// block types' scalar `dequant` (d * scale, then times q; Q4_K less dmin * min)
inline void dequant_q4_k(const uint8_t* b, float* y) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
    int sc, m;
    scale_min_k4(is, scales, &sc, &m);
    const __m512 d1 = _mm512_set1_ps(d * sc), m1 = _mm512_set1_ps(-(dmin * m));
    scale_min_k4(is + 1, scales, &sc, &m);
    const __m512 d2 = _mm512_set1_ps(d * sc), m2 = _mm512_set1_ps(-(dmin * m));
    for (int h = 0; h < 32; h += 16) {
      const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + h)));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
      _mm512_storeu_ps(y + j + h, _mm512_fmadd_ps(d1, lo, m1));
      _mm512_storeu_ps(y + j + 32 + h, _mm512_fmadd_ps(d2, hi, m2));
    }
  }
}

inline void dequant_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_at(b + 208);
  const __m512i three = _mm512_set1_epi32(3), fifteen = _mm512_set1_epi32(15);
  const __m512i thirty_two = _mm512_set1_epi32(32);
  auto load = [](const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  };
  auto put = [&](float* out, float scale, __m512i q) {
    _mm512_storeu_ps(out, _mm512_mul_ps(_mm512_set1_ps(scale), _mm512_cvtepi32_ps(_mm512_sub_epi32(q, thirty_two))));
  };
  for (int n = 0; n < 256; n += 128, ql += 64, qh += 32, sc += 8) {
    for (int c = 0; c < 2; ++c) {  // values l = 16c .. 16c + 15 of each quarter: scale index c
      const __m512i a = load(ql + 16 * c), a2 = load(ql + 32 + 16 * c), h = load(qh + 16 * c);
      const __m512i h1 = _mm512_slli_epi32(_mm512_and_si512(h, three), 4);
      const __m512i h2 = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 2), three), 4);
      const __m512i h3 = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 4), three), 4);
      const __m512i h4 = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, 6), three), 4);
      put(y + n + 16 * c, d * sc[c], _mm512_or_si512(_mm512_and_si512(a, fifteen), h1));
      put(y + n + 32 + 16 * c, d * sc[c + 2], _mm512_or_si512(_mm512_and_si512(a2, fifteen), h2));
      put(y + n + 64 + 16 * c, d * sc[c + 4], _mm512_or_si512(_mm512_srli_epi32(a, 4), h3));
      put(y + n + 96 + 16 * c, d * sc[c + 6], _mm512_or_si512(_mm512_srli_epi32(a2, 4), h4));
    }
  }
}

template <int Type>
inline Vec block_dot(const uint8_t* b, Vec x0, Vec x1, Vec xs, Vec acc) {
  if constexpr (Type == kQ8_0) {
    const __m128i* q = reinterpret_cast<const __m128i*>(b + 2);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
    return _mm512_fmadd_ps(_mm512_set1_ps(half_at(b)), _mm512_fmadd_ps(hi, x1, _mm512_mul_ps(lo, x0)), acc);
  } else {
    constexpr int start = Type == kQ4_1 ? 4 : 2;
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + start)));
    __m512i lo_i = _mm512_and_si512(v, _mm512_set1_epi32(15));
    __m512i hi_i = _mm512_srli_epi32(v, 4);
    if constexpr (Type == kQ4_0) {
      lo_i = _mm512_sub_epi32(lo_i, _mm512_set1_epi32(8));
      hi_i = _mm512_sub_epi32(hi_i, _mm512_set1_epi32(8));
    }
    const __m512 s = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi_i), x1, _mm512_mul_ps(_mm512_cvtepi32_ps(lo_i), x0));
    acc = _mm512_fmadd_ps(_mm512_set1_ps(half_at(b)), s, acc);
    if constexpr (Type == kQ4_1) acc = _mm512_fmadd_ps(_mm512_set1_ps(half_at(b + 2)), xs, acc);
    return acc;
  }
}
#else
struct Vec {
  float v[kLanes];
};
inline Vec vzero() { return Vec{}; }
inline Vec vload(const float* p) {
  Vec r;
  for (int l = 0; l < kLanes; ++l) r.v[l] = p[l];
  return r;
}
inline float vsum(const Vec& a) {
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += a.v[l];
  return s;
}

inline Vec vfma(const Vec& a, const Vec& b, Vec c) {
  for (int l = 0; l < kLanes; ++l) c.v[l] += a.v[l] * b.v[l];
  return c;
}

template <int Type>
inline void dequant32(const uint8_t* b, float* y);  // (below: the block types' own)

template <int Type>
inline Vec block_dot(const uint8_t* b, const Vec& x0, const Vec& x1, const Vec& xs, Vec acc) {
  const float d = half_at(b);
  if constexpr (Type == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
    for (int l = 0; l < 16; ++l)
      acc.v[l] += d * (static_cast<float>(q[l]) * x0.v[l] + static_cast<float>(q[l + 16]) * x1.v[l]);
  } else {
    constexpr int start = Type == kQ4_1 ? 4 : 2, offset = Type == kQ4_0 ? 8 : 0;
    const uint8_t* q = b + start;
    for (int l = 0; l < 16; ++l)
      acc.v[l] += d * (static_cast<float>((q[l] & 15) - offset) * x0.v[l] +
                       static_cast<float>((q[l] >> 4) - offset) * x1.v[l]);
    if constexpr (Type == kQ4_1) {
      const float m = half_at(b + 2);
      for (int l = 0; l < 16; ++l) acc.v[l] += m * xs.v[l];
    }
  }
  return acc;
}
#endif

#if !defined(__AVX512F__)
template <int Type>
inline void dequant32(const uint8_t* b, float* y) {
  if constexpr (Type == kQ4_0) Q4_0::dequant(b, y);
  else if constexpr (Type == kQ4_1) Q4_1::dequant(b, y);
  else Q8_0::dequant(b, y);
}
#endif

// one block of any type dequantized into y
template <int Type, class B>
inline void dequant_block(const uint8_t* b, float* y) {
  if constexpr (Type == kQ4_0 || Type == kQ4_1 || Type == kQ8_0) {
    dequant32<Type>(b, y);
  } else {
#if defined(__AVX512F__)
    if constexpr (Type == kQ4_K) dequant_q4_k(b, y);
    else dequant_q6_k(b, y);
#else
    B::dequant(b, y);
#endif
  }
}

// four rows' lanes summed into y[0..3]
inline void store4(float* y, const Vec& a0, const Vec& a1, const Vec& a2, const Vec& a3) {
  y[0] = vsum(a0);
  y[1] = vsum(a1);
  y[2] = vsum(a2);
  y[3] = vsum(a3);
}

constexpr int64_t kAheadGroups = 4;  // how far ahead the dot products prefetch, in groups of 4 rows

// A group of rows is a few short streams (a row of the LM head is 10 cache lines), too short for
// the hardware's prefetcher to pick up: the memory of the group kAheadGroups ahead is asked for
// while this one is read, a few lines a block, in the order it is stored. (On the 2-core machine
// the LM head's matmul read 10 GB/s without, 20-30 with.)
struct Prefetch {
  Prefetch(const uint8_t* group, int64_t group_bytes, const uint8_t* end, int64_t blocks)
      : at_(reinterpret_cast<const char*>(group + kAheadGroups * group_bytes)),
        end_(reinterpret_cast<const char*>(end)),
        per_(((group_bytes + 63) / 64 + blocks - 1) / blocks) {}  // (group_bytes 0: none)
  inline void block(int64_t b) const {
    for (int64_t l = 0; l < per_; ++l) {
      const char* p = at_ + (b * per_ + l) * 64;
      if (p < end_) __builtin_prefetch(p, 0, 3);
    }
  }
  const char* at_;
  const char* end_;
  int64_t per_;
};

template <int Type, int Bytes>
void dot_fused(const uint8_t* w, int64_t n_rows, int64_t k, const float* x, int64_t t_rows,
               float* y) {
  const int64_t nb = k / 32, row_bytes = nb * Bytes;
  std::vector<float> xs(Type == kQ4_1 ? t_rows * nb * kLanes : 0);
  for (int64_t i = 0; i < static_cast<int64_t>(xs.size()); ++i)
    xs[i] = x[(i / kLanes) * 32 + i % kLanes] + x[(i / kLanes) * 32 + i % kLanes + 16];
  constexpr int64_t R = 4;
  // a group's blocks are read from memory once, for the first row of x, and from the L1 cache
  // for the others
  parallel_rows((n_rows + R - 1) / R, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n = g * R;
      for (int64_t t = 0; t < t_rows; ++t) {
        const float* xt = x + t * k;
        const float* xst = xs.data() + t * nb * kLanes;
        if (n + R <= n_rows) {
          const uint8_t* row = w + n * row_bytes;
          const Prefetch ahead(row, t == 0 ? R * row_bytes : 0,
                               w + std::min(n_rows, g1 * R + kAheadGroups * R) * row_bytes, nb);
          Vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
          for (int64_t b = 0; b < nb; ++b) {
            ahead.block(b);
            const Vec x0 = vload(xt + b * 32), x1 = vload(xt + b * 32 + 16);
            const Vec xsb = Type == kQ4_1 ? vload(xst + b * kLanes) : x0;
            const uint8_t* blk = row + b * Bytes;
            a0 = block_dot<Type>(blk, x0, x1, xsb, a0);
            a1 = block_dot<Type>(blk + row_bytes, x0, x1, xsb, a1);
            a2 = block_dot<Type>(blk + 2 * row_bytes, x0, x1, xsb, a2);
            a3 = block_dot<Type>(blk + 3 * row_bytes, x0, x1, xsb, a3);
          }
          store4(y + t * n_rows + n, a0, a1, a2, a3);
        } else {
          for (int64_t r = n; r < n_rows; ++r) {
            const uint8_t* row = w + r * row_bytes;
            Vec a = vzero();
            for (int64_t b = 0; b < nb; ++b) {
              const Vec x0 = vload(xt + b * 32), x1 = vload(xt + b * 32 + 16);
              const Vec xsb = Type == kQ4_1 ? vload(xst + b * kLanes) : x0;
              a = block_dot<Type>(row + b * Bytes, x0, x1, xsb, a);
            }
            y[t * n_rows + r] = vsum(a);
          }
        }
      }
    }
  });
}

// one row of x, blocks of 256 (Q4_K, Q6_K): each block dequantized into a buffer, then its dot
// product with x, the rows ahead prefetched
template <int Type, class B>
void dot_generic(const uint8_t* w, int64_t n_rows, int64_t k, const float* x, float* y) {
  const int64_t nb = k / B::QK, row_bytes = nb * B::BYTES;
  parallel_rows(n_rows, 16, [&](int64_t n0, int64_t n1) {
    alignas(64) float buf[B::QK];
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = w + n * row_bytes;
      const Prefetch ahead(row, row_bytes, w + std::min(n_rows, n1 + kAheadGroups) * row_bytes, nb);
      Vec a = vzero();
      for (int64_t b = 0; b < nb; ++b) {
        ahead.block(b);
        dequant_block<Type, B>(row + b * B::BYTES, buf);
        const float* xb = x + b * B::QK;
        for (int j = 0; j < B::QK; j += kLanes) a = vfma(vload(buf + j), vload(xb + j), a);
      }
      y[n] = vsum(a);
    }
  });
}

// Several rows of x (2 to kTiledRows): each group of 4 rows of W dequantized once into a buffer
// that stays in the L1 cache, then multiplied by every row of x (the dot products above decode
// each block again for every row of x).
template <int Type, class B>
void dot_tiled(const uint8_t* w, int64_t n_rows, int64_t k, const float* x, int64_t t_rows,
               float* y) {
  const int64_t nb = k / B::QK, row_bytes = nb * B::BYTES;
  constexpr int64_t R = 4;
  parallel_rows((n_rows + R - 1) / R, 4, [&](int64_t g0, int64_t g1) {
    std::vector<float> tile(R * k);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * R, rows = std::min(R, n_rows - n0);
      const Prefetch ahead(w + n0 * row_bytes, rows == R ? R * row_bytes : 0,
                           w + std::min(n_rows, g1 * R + kAheadGroups * R) * row_bytes, nb);
      for (int64_t b = 0; b < nb; ++b) {
        ahead.block(b);
        for (int64_t r = 0; r < rows; ++r)
          dequant_block<Type, B>(w + (n0 + r) * row_bytes + b * B::BYTES, &tile[r * k + b * B::QK]);
      }
      for (int64_t t = 0; t < t_rows; ++t) {
        const float* xt = x + t * k;
        if (rows == R) {
          Vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
          for (int64_t j = 0; j < k; j += kLanes) {
            const Vec xv = vload(xt + j);
            a0 = vfma(vload(&tile[j]), xv, a0);
            a1 = vfma(vload(&tile[k + j]), xv, a1);
            a2 = vfma(vload(&tile[2 * k + j]), xv, a2);
            a3 = vfma(vload(&tile[3 * k + j]), xv, a3);
          }
          store4(y + t * n_rows + n0, a0, a1, a2, a3);
        } else {
          for (int64_t r = 0; r < rows; ++r) {
            Vec a = vzero();
            for (int64_t j = 0; j < k; j += kLanes) a = vfma(vload(&tile[r * k + j]), vload(xt + j), a);
            y[t * n_rows + n0 + r] = vsum(a);
          }
        }
      }
    }
  });
}

template <class B>
void dequant_rows(const uint8_t* w, int64_t n_rows, int64_t k, float* out) {
  const int64_t nb = k / B::QK, row_bytes = nb * B::BYTES;
  parallel_rows(n_rows, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < nb; ++b)
        B::dequant(w + n * row_bytes + b * B::BYTES, out + n * k + b * B::QK);
  });
}

int block_size(int64_t type) {
  switch (type) {
    case kQ4_0: case kQ4_1: case kQ8_0: return 32;
    case kQ4_K: case kQ6_K: return 256;
  }
  TORCH_CHECK(false, "GGUF block type ", type, " has no CPU kernel");
}

int block_bytes(int64_t type) {
  switch (type) {
    case kQ4_0: return Q4_0::BYTES;
    case kQ4_1: return Q4_1::BYTES;
    case kQ8_0: return Q8_0::BYTES;
    case kQ4_K: return Q4_K::BYTES;
    case kQ6_K: return Q6_K::BYTES;
  }
  TORCH_CHECK(false, "GGUF block type ", type, " has no CPU kernel");
}

void check_weight(const at::Tensor& w, int64_t type, int64_t k) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 &&
                  w.is_contiguous(),
              "a GGUF weight is a contiguous CPU uint8 tensor of (rows, bytes a row)");
  TORCH_CHECK(k > 0 && k % block_size(type) == 0 && w.size(1) == k / block_size(type) * block_bytes(type),
              "a GGUF weight's rows hold ", w.size(1), " bytes, not whole blocks of ", k,
              " columns");
}

// W (N, K) float32 from its blocks
at::Tensor dequantize(const at::Tensor& w, int64_t type, int64_t k) {
  check_weight(w, type, k);
  const int64_t n = w.size(0);
  at::Tensor out = at::empty({n, k}, w.options().dtype(at::kFloat));
  const uint8_t* p = w.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  switch (type) {
    case kQ4_0: dequant_rows<Q4_0>(p, n, k, o); break;
    case kQ4_1: dequant_rows<Q4_1>(p, n, k, o); break;
    case kQ8_0: dequant_rows<Q8_0>(p, n, k, o); break;
    case kQ4_K: dequant_rows<Q4_K>(p, n, k, o); break;
    case kQ6_K: dequant_rows<Q6_K>(p, n, k, o); break;
  }
  return out;
}

// y (T, N) = x (T, K) W^T, T <= kTiledRows, for W's blocks of `type`
void gemv(const uint8_t* p, int64_t type, int64_t n, int64_t k, const float* xp, int64_t t,
          float* yp) {
  if (t > 1) {
    switch (type) {
      case kQ4_0: dot_tiled<kQ4_0, Q4_0>(p, n, k, xp, t, yp); break;
      case kQ4_1: dot_tiled<kQ4_1, Q4_1>(p, n, k, xp, t, yp); break;
      case kQ8_0: dot_tiled<kQ8_0, Q8_0>(p, n, k, xp, t, yp); break;
      case kQ4_K: dot_tiled<kQ4_K, Q4_K>(p, n, k, xp, t, yp); break;
      case kQ6_K: dot_tiled<kQ6_K, Q6_K>(p, n, k, xp, t, yp); break;
    }
    return;
  }
  switch (type) {
    case kQ4_0: dot_fused<kQ4_0, Q4_0::BYTES>(p, n, k, xp, t, yp); break;
    case kQ4_1: dot_fused<kQ4_1, Q4_1::BYTES>(p, n, k, xp, t, yp); break;
    case kQ8_0: dot_fused<kQ8_0, Q8_0::BYTES>(p, n, k, xp, t, yp); break;
    case kQ4_K: dot_generic<kQ4_K, Q4_K>(p, n, k, xp, yp); break;
    case kQ6_K: dot_generic<kQ6_K, Q6_K>(p, n, k, xp, yp); break;
  }
}

// x (..., K) times W^T: (..., N) float32
at::Tensor matmul(const at::Tensor& x_in, const at::Tensor& w, int64_t type, int64_t k) {
  check_weight(w, type, k);
  TORCH_CHECK(x_in.size(-1) == k, "x has ", x_in.size(-1), " columns for a GGUF weight of ", k);
  std::vector<int64_t> out_shape = x_in.sizes().vec();
  out_shape.back() = w.size(0);
  at::Tensor xc = x_in.reshape({-1, k}).to(at::kFloat).contiguous();
  const int64_t t = xc.size(0), n = w.size(0);
  if (t > kTiledRows) return at::matmul(xc, dequantize(w, type, k).t()).view(out_shape);
  at::Tensor y = at::empty(out_shape, xc.options());
  gemv(w.data_ptr<uint8_t>(), type, n, k, xc.data_ptr<float>(), t, y.data_ptr<float>());
  return y;
}

// A step of at most kTiledRows token rows (decodes, verify steps, short prompt chunks) of a
// Llama decoder whose linear layers are GGUF blocks, in one call: the layers' norms, matmuls,
// rotary embedding, K/V store and attention, and the final norm and LM head, with float32
// activations and a float32 K/V pool (runtime/quantization/gguf.py `FusedDecode` decides when it
// applies and is checked against the model's own forward). Each op is the plain path's
// (kernels/fused_ref.py, kernels/attention_ref.py) in the same float32
// arithmetic; the matmuls are `gemv`'s, the rest runs on the calling thread.
// a linear layer: its parts' blocks (rows one after the other; a fused projection's parts may be
// of different block types, as a Q4_K_M file's Q6_K v beside Q4_K q and k)
struct Linear {
  std::vector<at::Tensor> w;
  std::vector<int64_t> type;
  int64_t n = 0, k = 0;
};

class DecodePlan {
 public:
  DecodePlan(std::vector<at::Tensor> norms, std::vector<std::vector<at::Tensor>> linears,
             std::vector<std::vector<int64_t>> types, std::vector<at::Tensor> k_pools,
             std::vector<at::Tensor> v_pools, at::Tensor cos, at::Tensor sin, int64_t heads,
             int64_t kv_heads, int64_t head_dim, double eps, double scale)
      : norms_(std::move(norms)), k_pools_(std::move(k_pools)), v_pools_(std::move(v_pools)),
        cos_(std::move(cos)), sin_(std::move(sin)), heads_(heads), kv_heads_(kv_heads),
        head_dim_(head_dim), eps_(static_cast<float>(eps)), scale_(static_cast<float>(scale)) {
    // norms: 2 per layer, then the final one; linears: qkv, o, gate_up, down per layer, then the
    // head, each (weight, k)
    layers_ = static_cast<int64_t>(k_pools_.size());
    TORCH_CHECK(static_cast<int64_t>(norms_.size()) == 2 * layers_ + 1, "2 norms a layer and the final one");
    TORCH_CHECK(static_cast<int64_t>(linears.size()) == 4 * layers_ + 1 && types.size() == linears.size(),
                "4 linear layers a layer and the head");
    for (size_t i = 0; i < linears.size(); ++i) {
      TORCH_CHECK(linears[i].size() >= 2 && linears[i].size() == types[i].size() + 1,
                  "a linear layer: its columns, then each part's blocks, a type a part");
      Linear l;
      l.k = linears[i][0].item<int64_t>();
      for (size_t j = 1; j < linears[i].size(); ++j) {
        l.w.push_back(linears[i][j]);
        l.type.push_back(types[i][j - 1]);
        check_weight(l.w.back(), l.type.back(), l.k);
        l.n += l.w.back().size(0);
      }
      linears_.push_back(l);
    }
    hidden_ = norms_[0].numel();
    inter_ = linears_[2].n / 2;
    TORCH_CHECK(head_dim_ % 2 == 0 && heads_ % kv_heads_ == 0, "head_dim even, heads a multiple of kv_heads");
    // every buffer of a step is sized from these: each layer's shapes are checked against them
    const int64_t q_size = heads_ * head_dim_;
    const auto shape = [&](const Linear& l, int64_t n, int64_t k, const char* what) {
      TORCH_CHECK(l.n == n && l.k == k, what, "'s shape (", l.n, ", ", l.k, ") is not (", n, ", ", k, ")");
    };
    for (int64_t l = 0; l < layers_; ++l) {
      shape(linears_[4 * l], q_size + 2 * kv_heads_ * head_dim_, hidden_, "qkv_proj");
      shape(linears_[4 * l + 1], hidden_, q_size, "o_proj");
      shape(linears_[4 * l + 2], 2 * inter_, hidden_, "gate_up_proj");
      shape(linears_[4 * l + 3], hidden_, inter_, "down_proj");
      TORCH_CHECK(norms_[2 * l].numel() == hidden_ && norms_[2 * l + 1].numel() == hidden_,
                  "a norm's weight of hidden_size");
      for (const at::Tensor& pool : {k_pools_[l], v_pools_[l]})
        TORCH_CHECK(pool.scalar_type() == at::kFloat && pool.is_contiguous() && pool.dim() == 3 &&
                        pool.size(0) == k_pools_[0].size(0) && pool.size(1) == kv_heads_ &&
                        pool.size(2) == head_dim_,
                    "a float32 K/V pool of (slots, kv_heads, head_dim)");
    }
    TORCH_CHECK(linears_.back().k == hidden_ && norms_.back().numel() == hidden_, "the LM head's shape");
    for (const at::Tensor& norm : norms_)
      TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.is_contiguous(), "float32 norm weights");
    for (const at::Tensor& table : {cos_, sin_})
      TORCH_CHECK(table.scalar_type() == at::kFloat && table.is_contiguous() && table.dim() == 2 &&
                      table.size(1) == head_dim_ / 2 && table.size(0) == cos_.size(0),
                  "rotary tables of (positions, head_dim / 2) float32");
  }

  // T <= kTiledRows token rows, each a request's next token, or several of one request at
  // consecutive positions (a prompt chunk, a verify step: each row stores its K/V before it
  // attends, and its keys end at its own slot): x (T, hidden) their embeddings; each row's
  // position, the slot its K/V go to, and the slots of its request's keys (keys[i, :lens[i]], its
  // new slot last); the rows that need logits: their logits (L, N of the head), float32
  // With `keep_hidden`, also the final norm's output (T, hidden), what the LM head reads (for a
  // drafter's heads); else an empty tensor.
  std::tuple<at::Tensor, at::Tensor> run(const at::Tensor& x_in, const at::Tensor& positions_in,
                                         const at::Tensor& slots_in, const at::Tensor& keys_in,
                                         const at::Tensor& lens_in,
                                         const at::Tensor& logit_rows_in, bool keep_hidden) {
    const int64_t t = x_in.size(0);
    TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == hidden_ && x_in.scalar_type() == at::kFloat,
                "x (T, hidden) float32");
    TORCH_CHECK(t >= 1 && t <= kTiledRows, "1 to ", kTiledRows, " rows a step");
    const at::Tensor x = x_in.contiguous();
    const at::Tensor positions = positions_in.to(at::kLong).contiguous();
    const at::Tensor slots = slots_in.to(at::kLong).contiguous();
    const at::Tensor keys = keys_in.to(at::kLong).contiguous();
    const at::Tensor lens = lens_in.to(at::kLong).contiguous();
    TORCH_CHECK(positions.numel() == t && slots.numel() == t && lens.numel() == t &&
                    keys.dim() == 2 && keys.size(0) == t,
                "a position, a slot, a row of keys and a length a row");
    const int64_t* len = lens.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t slots_in_pool = k_pools_[0].size(0);
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int64_t* key = keys.data_ptr<int64_t>();
    for (int64_t i = 0; i < t; ++i) {
      TORCH_CHECK(pos[i] >= 0 && pos[i] < cos_.size(0), "position past the rotary tables");
      TORCH_CHECK(len[i] >= 1 && len[i] <= keys.size(1), "a row's keys past its row");
      TORCH_CHECK(slot[i] >= 0 && slot[i] < slots_in_pool, "a slot past the K/V pool");
      for (int64_t j = 0; j < len[i]; ++j)
        TORCH_CHECK(key[i * keys.size(1) + j] >= 0 && key[i * keys.size(1) + j] < slots_in_pool,
                    "a key's slot past the K/V pool");
    }
    const at::Tensor logit_rows = logit_rows_in.to(at::kLong).contiguous();
    const int64_t* rows = logit_rows.data_ptr<int64_t>();
    for (int64_t i = 0; i < logit_rows.numel(); ++i)
      TORCH_CHECK(rows[i] >= 0 && rows[i] < t, "a logits row past the step's rows");
    at::Tensor logits = at::empty({logit_rows.numel(), linears_.back().n}, x.options());
    {
      pybind11::gil_scoped_release unlocked;
      step(x.data_ptr<float>(), t, pos, slots.data_ptr<int64_t>(), keys.data_ptr<int64_t>(),
           keys.size(1), len, rows, logit_rows.numel(), logits.data_ptr<float>());
    }
    at::Tensor hidden = at::empty({keep_hidden ? t : 0, hidden_}, x.options());
    if (keep_hidden) std::memcpy(hidden.data_ptr<float>(), h_.data(), t * hidden_ * sizeof(float));
    return {logits, hidden};
  }

 private:
  void rms_norm(const float* x, const at::Tensor& w, float* out) const {
    float sf = 0.f;
    for (int64_t i = 0; i < hidden_; ++i) sf += x[i] * x[i];
    const float r = 1.f / std::sqrt(sf / static_cast<float>(hidden_) + eps_);
    const float* g = w.data_ptr<float>();
    for (int64_t i = 0; i < hidden_; ++i) out[i] = g[i] * (x[i] * r);
  }

  void rotate(float* v, int64_t n_heads, const float* c, const float* s) const {
    const int64_t half = head_dim_ / 2;
    for (int64_t h = 0; h < n_heads; ++h) {
      float* x = v + h * head_dim_;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        x[i] = x1 * c[i] - x2 * s[i];
        x[i + half] = x2 * c[i] + x1 * s[i];
      }
    }
  }

  void attend(int64_t layer, const float* q, const int64_t* keys, int64_t len, float* out) {
    const float* kp = k_pools_[layer].data_ptr<float>();
    const float* vp = v_pools_[layer].data_ptr<float>();
    const int64_t stride = kv_heads_ * head_dim_, group = heads_ / kv_heads_;
    auto one_head = [&](int64_t h, float* scores) {
      const float* qh = q + h * head_dim_;
      const int64_t kvh = h / group;
      float m = -INFINITY;
      for (int64_t j = 0; j < len; ++j) {
        const float* kj = kp + keys[j] * stride + kvh * head_dim_;
        float d = 0.f;
        for (int64_t i = 0; i < head_dim_; ++i) d += qh[i] * kj[i];
        scores[j] = d * scale_;
        m = std::max(m, scores[j]);
      }
      float total = 0.f;
      for (int64_t j = 0; j < len; ++j) total += (scores[j] = std::exp(scores[j] - m));
      float* o = out + h * head_dim_;
      std::fill(o, o + head_dim_, 0.f);
      for (int64_t j = 0; j < len; ++j) {
        const float* vj = vp + keys[j] * stride + kvh * head_dim_;
        const float p = scores[j] / total;
        for (int64_t i = 0; i < head_dim_; ++i) o[i] += p * vj[i];
      }
    };
    if (len < 256) {
      scores_.resize(len);
      for (int64_t h = 0; h < heads_; ++h) one_head(h, scores_.data());
    } else {  // (long contexts: the heads over the kernels' threads)
      parallel_rows(heads_, 1, [&](int64_t h0, int64_t h1) {
        std::vector<float> scores(len);
        for (int64_t h = h0; h < h1; ++h) one_head(h, scores.data());
      });
    }
  }

  void linear(int64_t i, const float* x, int64_t t, float* y) {
    const Linear& l = linears_[i];
    if (l.w.size() == 1) {
      gemv(l.w[0].data_ptr<uint8_t>(), l.type[0], l.n, l.k, x, t, y);
      return;
    }
    int64_t start = 0;  // each part's rows into their columns of y (T, N)
    for (size_t j = 0; j < l.w.size(); ++j) {
      const int64_t n = l.w[j].size(0);
      part_.resize(t * n);
      gemv(l.w[j].data_ptr<uint8_t>(), l.type[j], n, l.k, x, t, part_.data());
      for (int64_t r = 0; r < t; ++r)
        std::memcpy(y + r * l.n + start, &part_[r * n], n * sizeof(float));
      start += n;
    }
  }

  void step(const float* x_in, int64_t t, const int64_t* positions, const int64_t* slots,
            const int64_t* keys, int64_t keys_stride, const int64_t* lens,
            const int64_t* logit_rows, int64_t n_logits, float* logits) {
    const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
    const int64_t qkv_size = q_size + 2 * kv_size, half = head_dim_ / 2;
    residual_.assign(x_in, x_in + t * hidden_);
    h_.resize(t * hidden_);
    qkv_.resize(t * qkv_size);
    attn_.resize(t * q_size);
    out_.resize(t * hidden_);
    gate_up_.resize(t * 2 * inter_);
    act_.resize(t * inter_);
    const auto norm_rows = [&](const at::Tensor& w) {
      for (int64_t r = 0; r < t; ++r) rms_norm(&residual_[r * hidden_], w, &h_[r * hidden_]);
    };
    const auto add_out = [&] {
      for (int64_t i = 0; i < t * hidden_; ++i) residual_[i] += out_[i];
    };
    for (int64_t l = 0; l < layers_; ++l) {
      if (l > 0) add_out();
      norm_rows(norms_[2 * l]);
      linear(4 * l, h_.data(), t, qkv_.data());
      for (int64_t r = 0; r < t; ++r) {
        float* q = &qkv_[r * qkv_size];
        float* k = q + q_size;
        const float* v = k + kv_size;
        const float* c = cos_.data_ptr<float>() + positions[r] * half;
        const float* s = sin_.data_ptr<float>() + positions[r] * half;
        rotate(q, heads_, c, s);
        rotate(k, kv_heads_, c, s);
        std::memcpy(k_pools_[l].data_ptr<float>() + slots[r] * kv_size, k, kv_size * sizeof(float));
        std::memcpy(v_pools_[l].data_ptr<float>() + slots[r] * kv_size, v, kv_size * sizeof(float));
        attend(l, q, keys + r * keys_stride, lens[r], &attn_[r * q_size]);
      }
      linear(4 * l + 1, attn_.data(), t, out_.data());
      add_out();
      norm_rows(norms_[2 * l + 1]);
      linear(4 * l + 2, h_.data(), t, gate_up_.data());
      for (int64_t r = 0; r < t; ++r)
        for (int64_t i = 0; i < inter_; ++i) {
          const float g = gate_up_[r * 2 * inter_ + i];
          act_[r * inter_ + i] = g / (1.f + std::exp(-g)) * gate_up_[r * 2 * inter_ + inter_ + i];
        }
      linear(4 * l + 3, act_.data(), t, out_.data());
    }
    add_out();
    norm_rows(norms_[2 * layers_]);
    if (n_logits == 0) return;
    head_in_.resize(n_logits * hidden_);  // (the rows that need logits: the LM head reads those)
    for (int64_t i = 0; i < n_logits; ++i)
      std::memcpy(&head_in_[i * hidden_], &h_[logit_rows[i] * hidden_], hidden_ * sizeof(float));
    linear(4 * layers_, head_in_.data(), n_logits, logits);
  }

  std::vector<at::Tensor> norms_;
  std::vector<Linear> linears_;
  std::vector<at::Tensor> k_pools_, v_pools_;
  at::Tensor cos_, sin_;
  int64_t layers_ = 0, hidden_ = 0, inter_ = 0, heads_, kv_heads_, head_dim_;
  float eps_, scale_;
  std::vector<float> residual_, h_, qkv_, attn_, out_, gate_up_, act_, scores_, part_, head_in_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("matmul", &matmul, "x (T, K) float32 times a GGUF weight's transpose");
  m.attr("tiled_rows") = kTiledRows;
  py::class_<DecodePlan>(m, "DecodePlan")
      .def(py::init<std::vector<at::Tensor>, std::vector<std::vector<at::Tensor>>,
                    std::vector<std::vector<int64_t>>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                    at::Tensor, at::Tensor, int64_t, int64_t, int64_t, double, double>())
      .def("run", &DecodePlan::run, "(logits (T, vocab), final hidden or empty) of T <= 64 decode rows");
  m.def("dequantize", &dequantize, "a GGUF weight's float32 values (N, K)");
  m.def("set_threads", [](int64_t n) { pool().resize(static_cast<int>(n)); },
        "the kernels' threads (at first: torch's, at::get_num_threads())");
  m.def("threads", [] { return pool().size(); }, "the kernels' threads");
}
