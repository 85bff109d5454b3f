// GGUF blocks read as stored, on the CPU: y = x W^T for W a GGUF tensor's raw blocks (one row of
// blocks per output row), and W's float32 dequantization. Built at first use by
// kernels/gguf_cpu.py (torch.utils.cpp_extension, -O3 -march=native); the oracle is
// kernels/gguf_ref.py (the gguf package's dequantization and F.linear).
//
// Each block is dequantized exactly as ggml does (float32 products of its float16 scales and its
// integers) and multiplied by x in float32: the result is the dequantized weight's F.linear up to
// the order of the float32 sums. At a few rows of x (decode) the dot products read the blocks
// once (Q4_0, Q4_1, Q8_0 without writing the dequantized values: a block's 32 products summed,
// then scaled); more rows dequantize the weight to float32 and run one matmul.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// ggml's type ids (gguf.GGMLQuantizationType)
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14;
constexpr int kLanes = 16;
constexpr int64_t kMaxRows = 8;  // rows of x the dot-product path takes at once

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

template <int Type, int Bytes>
void dot_fused(const uint8_t* w, int64_t n_rows, int64_t k, const float* x, int64_t t_rows,
               float* y) {
  const int64_t nb = k / 32, row_bytes = nb * Bytes;
  std::vector<float> xs(Type == kQ4_1 ? t_rows * nb * kLanes : 0);
  for (int64_t i = 0; i < static_cast<int64_t>(xs.size()); ++i)
    xs[i] = x[(i / kLanes) * 32 + i % kLanes] + x[(i / kLanes) * 32 + i % kLanes + 16];
  constexpr int64_t R = 4;
  at::parallel_for(0, (n_rows + R - 1) / R, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t t = 0; t < t_rows; ++t) {
      const float* xt = x + t * k;
      const float* xst = xs.data() + t * nb * kLanes;
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t n = g * R;
        if (n + R <= n_rows) {
          const uint8_t* row = w + n * row_bytes;
          Vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
          for (int64_t b = 0; b < nb; ++b) {
            const Vec x0 = vload(xt + b * 32), x1 = vload(xt + b * 32 + 16);
            const Vec xsb = Type == kQ4_1 ? vload(xst + b * kLanes) : x0;
            const uint8_t* blk = row + b * Bytes;
            a0 = block_dot<Type>(blk, x0, x1, xsb, a0);
            a1 = block_dot<Type>(blk + row_bytes, x0, x1, xsb, a1);
            a2 = block_dot<Type>(blk + 2 * row_bytes, x0, x1, xsb, a2);
            a3 = block_dot<Type>(blk + 3 * row_bytes, x0, x1, xsb, a3);
          }
          float* yt = y + t * n_rows + n;
          yt[0] = vsum(a0);
          yt[1] = vsum(a1);
          yt[2] = vsum(a2);
          yt[3] = vsum(a3);
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

// any block type (Q4_K, Q6_K): each block dequantized into a buffer, then its dot products
template <class B>
void dot_generic(const uint8_t* w, int64_t n_rows, int64_t k, const float* x, int64_t t_rows,
                 float* y) {
  const int64_t nb = k / B::QK, row_bytes = nb * B::BYTES;
  at::parallel_for(0, n_rows, 16, [&](int64_t n0, int64_t n1) {
    alignas(64) float buf[B::QK];
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = w + n * row_bytes;
      float acc[kMaxRows][kLanes] = {};
      for (int64_t b = 0; b < nb; ++b) {
        B::dequant(row + b * B::BYTES, buf);
        for (int64_t t = 0; t < t_rows; ++t) {
          const float* xt = x + t * k + b * B::QK;
          for (int j = 0; j < B::QK; j += kLanes)
            for (int l = 0; l < kLanes; ++l) acc[t][l] += buf[j + l] * xt[j + l];
        }
      }
      for (int64_t t = 0; t < t_rows; ++t) {
        float s = 0.f;
        for (int l = 0; l < kLanes; ++l) s += acc[t][l];
        y[t * n_rows + n] = s;
      }
    }
  });
}

template <class B>
void dequant_rows(const uint8_t* w, int64_t n_rows, int64_t k, float* out) {
  const int64_t nb = k / B::QK, row_bytes = nb * B::BYTES;
  at::parallel_for(0, n_rows, 16, [&](int64_t n0, int64_t n1) {
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
  TORCH_CHECK(k % block_size(type) == 0 && w.size(1) == k / block_size(type) * block_bytes(type),
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

// x (..., K) times W^T: (..., N) float32
at::Tensor matmul(const at::Tensor& x_in, const at::Tensor& w, int64_t type, int64_t k) {
  check_weight(w, type, k);
  TORCH_CHECK(x_in.size(-1) == k, "x has ", x_in.size(-1), " columns for a GGUF weight of ", k);
  std::vector<int64_t> out_shape = x_in.sizes().vec();
  out_shape.back() = w.size(0);
  at::Tensor xc = x_in.reshape({-1, k}).to(at::kFloat).contiguous();
  const int64_t t = xc.size(0), n = w.size(0);
  if (t > kMaxRows) return at::matmul(xc, dequantize(w, type, k).t()).view(out_shape);
  at::Tensor y = at::empty(out_shape, xc.options());
  const uint8_t* p = w.data_ptr<uint8_t>();
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (type) {
    case kQ4_0: dot_fused<kQ4_0, Q4_0::BYTES>(p, n, k, xp, t, yp); break;
    case kQ4_1: dot_fused<kQ4_1, Q4_1::BYTES>(p, n, k, xp, t, yp); break;
    case kQ8_0: dot_fused<kQ8_0, Q8_0::BYTES>(p, n, k, xp, t, yp); break;
    case kQ4_K: dot_generic<Q4_K>(p, n, k, xp, t, yp); break;
    case kQ6_K: dot_generic<Q6_K>(p, n, k, xp, t, yp); break;
  }
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("matmul", &matmul, "x (T, K) float32 times a GGUF weight's transpose");
  m.def("dequantize", &dequantize, "a GGUF weight's float32 values (N, K)");
}
