// The CPU row step: a step of decode rows and verify blocks (every row row-exact) through every layer of a
// Llama-family model in one call, over the sessions' own fp32 K/V slabs (kv/stores.SlabStore).
//
// Why: driven from Python, a decode step of a 30-layer model is ~6,000 aten calls; at 128 tokens of
// context the matmuls are under half its time, the rest is dispatch and small elementwise ops
// (results/research/native_step.json). Here the small work (RMSNorm, RoPE, the K/V writes, attention,
// SiLU x up, the residual adds) is plain loops, and the matmuls are the same torch weight-only kernels
// the Python pieces call (_weight_int4pack_mm_for_cpu / _weight_int8pack_mm, bf16 activations).
//
// Row-exactness (a verify block's rows equal one-token steps bit for bit; a session batched with others
// gets the bits it gets alone): every row's arithmetic is its own, in an order that does not depend on the
// other rows of the call, on the threads, or on columns the row does not see. Attention visits a row's
// visible columns in column order (two passes: max, then exp / sum / weighted V), so hidden columns never
// enter its sums; torch's weight-only kernels are row-independent (tests/backends/test_weight_formats.py).
//
// Written for this project (no code from elsewhere).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "q4_matmul.h"

namespace {

constexpr int kLanes = 16;  // fixed accumulator lanes: the sums' order never depends on the machine's vector width

enum Kind : int64_t { kDense = 0, kInt8 = 1, kInt4 = 2, kQ4x16 = 3, kQ4x16OnePlane = 4, kQ4x16Outliers = 5 };

struct Linear {
  int64_t kind = kDense;
  // dense: w (N, K); int8: q (N, K), scales (N,) bf16; int4: torch's packed, scale_zero (K/32, N, 2) bf16;
  // q4x16: q4::pack's blocks (fp32 activations in, quantized inside to two int8 planes, or one; fp32 out);
  // q4x16 with outliers: a the blocks, b the outlier input channels (C,) int64, ascending (one plane for the rest:
  // q4_matmul.h)
  at::Tensor a, b;

  bool bf16_input() const { return kind == kInt8 || kind == kInt4; }

  at::Tensor operator()(const at::Tensor& x) const {
    switch (kind) {
      case kInt4: return at::_weight_int4pack_mm_for_cpu(x, a, 32, b);
      case kInt8: return at::_weight_int8pack_mm(x, a, b);
      case kQ4x16: return q4::matmul(x, a);
      case kQ4x16OnePlane: return q4::matmul(x, a, q4::kNone, 1);
      case kQ4x16Outliers: return q4::matmul(x, a, q4::kNone, 1, b);
      default: return at::linear(x, a);
    }
  }
};

// exp(x) in plain float arithmetic (Cephes' expf polynomial after a round-to-even range reduction, ~1 ulp; inputs
// clamped to [-87.3, 88.3]): no libm call, so the loops that use it vectorize, and its bits depend on x alone.
inline float exp_f(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  const float n = __builtin_rintf(x * 1.44269504088896341f);  // to nearest even (the default rounding mode)
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

inline float dot(const float* a, const float* b, int64_t n) {  // n % kLanes == 0
  float acc[kLanes] = {0};
  for (int64_t i = 0; i < n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  for (int w = kLanes / 2; w > 0; w /= 2)  // a fixed pairwise tree (vector adds), not a serial chain
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  return acc[0];
}

typedef float v16f __attribute__((vector_size(64), aligned(4)));
typedef float v8f __attribute__((vector_size(32), aligned(4)));
typedef float v4f __attribute__((vector_size(16), aligned(4)));

// 16 K/V elements as floats: fp32 slabs as they are; fp16 ones (AVX-512 builds) converted in the register, exactly, so
// the 16-lane attention computes on the same floats as over a converted copy of the chunk (what other builds make).
inline v16f load16(const float* p) { return *reinterpret_cast<const v16f*>(p); }
#if defined(__AVX512F__)
#define KAKEYA_HALF16 1
inline v16f load16(const c10::Half* p) {
  return (v16f)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// dot of D floats (D % 16 == 0) in 16 lanes, then a fixed tree over the lanes, kept in registers.
template <int D, class T = float>
inline float dot_d(const float* a, const T* b) {
  v16f acc = *reinterpret_cast<const v16f*>(a) * load16(b);
  for (int i = 16; i < D; i += 16) acc += *reinterpret_cast<const v16f*>(a + i) * load16(b + i);
  const v8f h8 = __builtin_shufflevector(acc, acc, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4f h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

inline float sum_squares(const float* a, int64_t n) { return dot(a, a, n); }

// A (R, N) bf16 or fp32 matmul output as fp32 (R, N).
at::Tensor as_float(const at::Tensor& y) {
  if (y.scalar_type() == at::kFloat) return y.contiguous();
  auto out = at::empty(y.sizes(), y.options().dtype(at::kFloat));
  const auto* src = reinterpret_cast<const c10::BFloat16*>(y.contiguous().data_ptr());
  float* dst = out.data_ptr<float>();
  const int64_t n = y.numel();
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
  return out;
}

// rows of src (R, K) fp32, each scaled by `scale[r]` and weighted by w (K,) (RMSNorm when scale = 1/rms),
// written as the linear layer's input dtype (bf16 for the weight-only kernels: round to nearest even).
at::Tensor linear_input(const float* src, const float* scale, const float* w, int64_t rows, int64_t k, bool bf16,
                        const at::TensorOptions& opts) {
  if (bf16) {
    auto out = at::empty({rows, k}, opts.dtype(at::kBFloat16));
    auto* dst = reinterpret_cast<c10::BFloat16*>(out.data_ptr());
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < k; ++i) {
        const float v = src[r * k + i] * (scale ? scale[r] : 1.f);
        dst[r * k + i] = c10::BFloat16(w ? w[i] * v : v);
      }
    return out;
  }
  auto out = at::empty({rows, k}, opts.dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < k; ++i) {
      const float v = src[r * k + i] * (scale ? scale[r] : 1.f);
      dst[r * k + i] = w ? w[i] * v : v;
    }
  return out;
}

// Attention of one query row is split into chunks of kChunk columns, fixed by column index: a chunk's partial
// result (its max score, the sum of exp(score - max) and the exp-weighted sum of V, per head) is computed alone,
// then the row's chunks are merged in column order. Chunks are what threads share out; since their bounds never
// depend on the row's column count, the thread count or the other rows, a verify block's rows still equal one-token
// steps bit for bit. One chunk (up to kChunk columns) merges to exactly its own acc / sum.
constexpr int64_t kChunk = 256;
// Rows whose attention runs together (threads share out their chunks): bounds the partial results a long prefill
// chunk keeps at once (64 rows x Hkv x N / 256 chunks x G heads x (D + 2) floats: 5 MB for SmolLM2 at 8k).
constexpr int64_t kRowBlock = 64;

// fp16 K/V slabs (`--kv-dtype fp16`: half the bytes a step reads): n halves -> floats, exactly (every fp16 value is
// a float), so the attention below computes on the same float values whichever code converts them (attend_chunk_pick);
// and floats -> halves when a row's k and v are written (round to nearest even, as torch's .half()).
inline void halves_to_floats(const c10::Half* __restrict src, int64_t n, float* __restrict dst) {
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
inline void floats_to_halves(const float* __restrict src, int64_t n, c10::Half* __restrict dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::Half(src[i]);
}

// The G query heads that share a KV head (GQA), one query row, over columns [j0, j1) of its session's slab, visible
// ones only (each key and value read once for all G heads): per head, scores in column order, their max, exp, then
// the sum and the weighted V in column order. part: per head [max, sum, acc (D)].
template <int D, int G, class T = float>
inline void attend_chunk(const float* __restrict q, const T* __restrict kb, const T* __restrict vb,
                         const bool* __restrict m, int64_t j0, int64_t j1, float scale, float* __restrict scores,
                         float* __restrict part) {
  constexpr int V = D / 16;
  const int64_t n = j1 - j0;
  float mx[G];
  for (int g = 0; g < G; ++g) mx[g] = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    if (!m[j0 + j]) {
      for (int g = 0; g < G; ++g) scores[g * n + j] = -INFINITY;
      continue;
    }
    for (int g = 0; g < G; ++g) {
      const float sc = dot_d<D, T>(q + g * D, kb + (j0 + j) * D) * scale;
      scores[g * n + j] = sc;
      mx[g] = sc > mx[g] ? sc : mx[g];
    }
  }
  v16f acc[G][V];
  float sum[G];
  for (int g = 0; g < G; ++g) {
    sum[g] = 0.f;
    for (int i = 0; i < V; ++i) acc[g][i] = v16f{};
    float* sg = scores + g * n;
    const float top = mx[g] == -INFINITY ? 0.f : mx[g];
    for (int64_t j = 0; j < n; ++j) sg[j] = exp_f(sg[j] - top);  // masked: exp of a clamped -inf, never read
  }
  for (int64_t j = 0; j < n; ++j) {
    if (!m[j0 + j]) continue;
    const T* vj = vb + (j0 + j) * D;
    v16f v[V];
    for (int i = 0; i < V; ++i) v[i] = load16(vj + 16 * i);
    for (int g = 0; g < G; ++g) {
      const float p = scores[g * n + j];
      sum[g] += p;
      for (int i = 0; i < V; ++i) acc[g][i] += p * v[i];
    }
  }
  for (int g = 0; g < G; ++g) {
    float* pg = part + g * (D + 2);
    pg[0] = mx[g];
    pg[1] = sum[g];
    for (int i = 0; i < V; ++i) *reinterpret_cast<v16f*>(pg + 2 + 16 * i) = acc[g][i];
  }
}

#if KAKEYA_X86
// The same chunk in explicit AVX2 8-float vectors: what runs where the build (-march=native) has AVX2 and no AVX-512.
// GCC lowers the 64-byte v16f code above to 32-byte halves with most accumulators spilled to the stack and a scalar
// exp, which made attention ~70 % of a decode step at 4k on an AVX2 EPYC. Here: scores with two accumulators per
// dot, exp 8 columns at a time (the chunk's scores padded to whole vectors, so every column's exp is the same vector
// code whatever its place), and the weighted V in blocks of columns of D sized so the G heads' accumulators stay in
// registers. A row's arithmetic still depends on nothing but its own columns, so rows stay exact; the bits differ
// from the 16-lane code's (different sum orders), which no result compares across machines. Built on every x86 CPU
// (the functions carry their own target), so the tests check both kernels wherever AVX2 runs (`row_attention`).
#define KAKEYA_AVX2_FN __attribute__((target("avx2,fma,f16c")))
KAKEYA_AVX2_FN inline __m256 exp8(__m256 x) {  // exp_f's steps, lane by lane
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// SiLU(g) * u for 8 elements at a time (gu: the gate/up matmul's row, g = gu[0, n), u = gu[n, 2n)); returns how many
// it did (whole vectors). exp8 is exp_f's steps lane by lane, fused where AVX2 fuses them, so an element's bits differ
// from the plain loop's by rounding but depend only on the element and its index: rows stay exact.
KAKEYA_AVX2_FN inline int64_t silu_mul_avx2(const float* __restrict gu, int64_t n, float* __restrict out) {
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gu + i), u = _mm256_loadu_ps(gu + n + i);
    const __m256 e = exp8(_mm256_sub_ps(zero, g));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u));
  }
  return i;
}

KAKEYA_AVX2_FN inline float hsum8(__m256 v) {  // a fixed tree
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// 8 K/V elements as floats: fp32 slabs as they are, fp16 ones converted in the register (exactly)
template <class T>
KAKEYA_AVX2_FN inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) return _mm256_loadu_ps(p);
  else return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <int D, class T>
KAKEYA_AVX2_FN inline float dot8(const float* __restrict a, const T* __restrict b) {
  if constexpr (D == 16) {
    return hsum8(_mm256_fmadd_ps(_mm256_loadu_ps(a + 8), load8(b + 8), _mm256_mul_ps(_mm256_loadu_ps(a), load8(b))));
  } else {
    __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(a), load8(b));
    __m256 s1 = _mm256_mul_ps(_mm256_loadu_ps(a + 8), load8(b + 8));
    for (int i = 16; i < D; i += 16) {
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8(b + i + 8), s1);
    }
    return hsum8(_mm256_add_ps(s0, s1));
  }
}

// 8-float vectors of D per block of the weighted-V pass: the largest divisor of D / 8 with G x it <= 12 registers
constexpr int pv_block(int D, int G) {
  int b = D / 8;
  while (b > 1 && (G * b > 12 || (D / 8) % b)) --b;
  return b;
}

template <int D, int G, class T = float>
KAKEYA_AVX2_FN void attend_chunk_avx2(const float* __restrict q, const T* __restrict kb, const T* __restrict vb,
                              const bool* __restrict m, int64_t j0, int64_t j1, float scale, float* __restrict scores,
                              float* __restrict part) {
  const int64_t n = j1 - j0, n8 = (n + 7) / 8 * 8;  // scores: G rows of stride kChunk (>= n8)
  float mx[G];
  for (int g = 0; g < G; ++g) mx[g] = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    if (!m[j0 + j]) {
      for (int g = 0; g < G; ++g) scores[g * kChunk + j] = -INFINITY;
      continue;
    }
    const T* k = kb + (j0 + j) * D;
    for (int g = 0; g < G; ++g) {
      const float sc = dot8<D>(q + g * D, k) * scale;
      scores[g * kChunk + j] = sc;
      mx[g] = sc > mx[g] ? sc : mx[g];
    }
  }
  for (int g = 0; g < G; ++g) {
    float* sg = scores + g * kChunk;
    for (int64_t j = n; j < n8; ++j) sg[j] = -INFINITY;  // padding: computed, never read
    const __m256 top = _mm256_set1_ps(mx[g] == -INFINITY ? 0.f : mx[g]);
    for (int64_t j = 0; j < n8; j += 8) _mm256_storeu_ps(sg + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + j), top)));
  }
  float sum[G];
  for (int g = 0; g < G; ++g) sum[g] = 0.f;
  for (int64_t j = 0; j < n; ++j)
    if (m[j0 + j])
      for (int g = 0; g < G; ++g) sum[g] += scores[g * kChunk + j];
  constexpr int B = pv_block(D, G);
  for (int d0 = 0; d0 < D; d0 += 8 * B) {
    __m256 acc[G][B];
    for (int g = 0; g < G; ++g)
      for (int b = 0; b < B; ++b) acc[g][b] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; ++j) {
      if (!m[j0 + j]) continue;
      const T* v = vb + (j0 + j) * D + d0;
      __m256 vv[B];
      for (int b = 0; b < B; ++b) vv[b] = load8(v + 8 * b);
      for (int g = 0; g < G; ++g) {
        const __m256 p = _mm256_broadcast_ss(scores + g * kChunk + j);
        for (int b = 0; b < B; ++b) acc[g][b] = _mm256_fmadd_ps(p, vv[b], acc[g][b]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int b = 0; b < B; ++b) _mm256_storeu_ps(part + g * (D + 2) + 2 + d0 + 8 * b, acc[g][b]);
  }
  for (int g = 0; g < G; ++g) {
    part[g * (D + 2)] = mx[g];
    part[g * (D + 2) + 1] = sum[g];
  }
}
#endif

// Which attention chunk code runs: 0 the 16-lane vector code, 1 the AVX2 one. Default: AVX2 where the build has it
// and no AVX-512 (there the 16-lane code compiles to whole 64-byte registers); `row_attention` sets it (tests, research).
inline int64_t& attention_kernel() {
  static int64_t kernel = [] {
#if KAKEYA_X86 && !defined(__AVX512F__)
    return static_cast<int64_t>(q4::best_isa() != q4::kNone);
#else
    return static_cast<int64_t>(0);
#endif
  }();
  return kernel;
}

// T: the slab's element type. fp16 slabs: the AVX2 code converts each key and value in its registers, and so does the
// 16-lane code in an AVX-512 build; elsewhere it gets the chunk's rows converted to floats first (the same float values
// every way: exact conversions).
template <int D, int G, class T>
inline void attend_chunk_pick(const float* q, const T* kb, const T* vb, const bool* m, int64_t j0, int64_t j1,
                              float scale, float* scores, float* part) {
#if KAKEYA_X86
  if (attention_kernel() == 1) return attend_chunk_avx2<D, G, T>(q, kb, vb, m, j0, j1, scale, scores, part);
#endif
  if constexpr (std::is_same_v<T, float>) {
    attend_chunk<D, G>(q, kb, vb, m, j0, j1, scale, scores, part);
#if defined(KAKEYA_HALF16)
  } else if constexpr (std::is_same_v<T, c10::Half>) {
    attend_chunk<D, G, T>(q, kb, vb, m, j0, j1, scale, scores, part);
#endif
  } else {
    thread_local std::vector<float> kf, vf;
    const int64_t n = (j1 - j0) * D;
    kf.resize(n), vf.resize(n);
    halves_to_floats(kb + j0 * D, n, kf.data());
    halves_to_floats(vb + j0 * D, n, vf.data());
    attend_chunk<D, G>(q, kf.data(), vf.data(), m + j0, 0, j1 - j0, scale, scores, part);
  }
}

// the chunk for G query heads; G past 8 head by head (G = 1 each)
template <int D, class T>
inline void attend_chunk_d(int64_t G, const float* q, const T* kb, const T* vb, const bool* m, int64_t j0,
                           int64_t j1, float scale, float* scores, float* part) {
  switch (G) {
    case 1: return attend_chunk_pick<D, 1, T>(q, kb, vb, m, j0, j1, scale, scores, part);
    case 2: return attend_chunk_pick<D, 2, T>(q, kb, vb, m, j0, j1, scale, scores, part);
    case 3: return attend_chunk_pick<D, 3, T>(q, kb, vb, m, j0, j1, scale, scores, part);
    case 4: return attend_chunk_pick<D, 4, T>(q, kb, vb, m, j0, j1, scale, scores, part);
    case 5: return attend_chunk_pick<D, 5, T>(q, kb, vb, m, j0, j1, scale, scores, part);
    case 6: return attend_chunk_pick<D, 6, T>(q, kb, vb, m, j0, j1, scale, scores, part);
    case 7: return attend_chunk_pick<D, 7, T>(q, kb, vb, m, j0, j1, scale, scores, part);
    case 8: return attend_chunk_pick<D, 8, T>(q, kb, vb, m, j0, j1, scale, scores, part);
    default:
      for (int64_t g = 0; g < G; ++g) attend_chunk_pick<D, 1, T>(q + g * D, kb, vb, m, j0, j1, scale, scores, part + g * (D + 2));
  }
}

template <class T = float>
inline void attend_chunk_any(int64_t D, int64_t G, const float* q, const T* kb, const T* vb, const bool* m,
                             int64_t j0, int64_t j1, float scale, float* scores, float* part) {
  switch (D) {
    case 16: return attend_chunk_d<16, T>(G, q, kb, vb, m, j0, j1, scale, scores, part);
    case 32: return attend_chunk_d<32, T>(G, q, kb, vb, m, j0, j1, scale, scores, part);
    case 64: return attend_chunk_d<64, T>(G, q, kb, vb, m, j0, j1, scale, scores, part);
    default: return attend_chunk_d<128, T>(G, q, kb, vb, m, j0, j1, scale, scores, part);
  }
}

// A head's chunks (parts[c], c in column order) -> its output: weights exp(max_c - max), the sums and accs merged in
// chunk order, divided once.
inline void merge_chunks(const float* parts, int64_t chunks, int64_t stride, int64_t D, float* out) {
  float top = -INFINITY;
  for (int64_t c = 0; c < chunks; ++c) top = parts[c * stride] > top ? parts[c * stride] : top;
  for (int64_t d = 0; d < D; ++d) out[d] = 0.f;
  if (top == -INFINITY) return;  // sees nothing (never a real row): zeros
  float total = 0.f;
  for (int64_t c = 0; c < chunks; ++c) {
    const float* p = parts + c * stride;
    if (p[0] == -INFINITY) continue;
    const float w = exp_f(p[0] - top);
    total += p[1] * w;
    for (int64_t d = 0; d < D; ++d) out[d] += p[2 + d] * w;
  }
  const float rs = 1.f / total;
  for (int64_t d = 0; d < D; ++d) out[d] *= rs;
}

// Scores of keys [c0, c1) of one (b, m): qs holds the G query rows as the codes lay out their dimensions (4-bit: the
// even dimensions, then the odd ones, per row; 8-bit: as they are). G and the code width are compile-time, so the G
// accumulators stay in registers (AVX2: 8 floats each; elsewhere plain loops). With AVX2, NK keys at a time: each
// key's sums are the same operations in the same order as alone (so the same bits), but NK keys' accumulator chains
// run side by side (one key's 2 D / 16 dependent FMAs per query row left the FMA units waiting on their latency).
#if defined(__AVX2__)
// The G accumulators of keys c .. c + NK - 1 (acc[k][g]: 8 lanes of partial sums of key c + k's dot with query row g).
template <int G, bool FOUR, int NK>
inline void key_accs(const float* qs, int64_t D, const uint8_t* codes, int64_t c, __m256 (*acc)[G]) {
  const int64_t row_bytes = FOUR ? D / 2 : D;
  for (int k = 0; k < NK; ++k)
    for (int g = 0; g < G; ++g) acc[k][g] = _mm256_setzero_ps();
  if (FOUR) {
    const int64_t half = D / 2;
    const __m256i eight = _mm256_set1_epi32(8), fifteen = _mm256_set1_epi32(15);
    for (int64_t i = 0; i < half; i += 8) {
      __m256 lo[NK], hi[NK];
      for (int k = 0; k < NK; ++k) {
        const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + (c + k) * row_bytes + i)));
        lo[k] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(x, fifteen), eight));
        hi[k] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(x, 4), eight));
      }
      for (int g = 0; g < G; ++g) {
        const __m256 ql = _mm256_loadu_ps(qs + g * D + i), qh = _mm256_loadu_ps(qs + g * D + half + i);
        for (int k = 0; k < NK; ++k) {
          acc[k][g] = _mm256_fmadd_ps(ql, lo[k], acc[k][g]);
          acc[k][g] = _mm256_fmadd_ps(qh, hi[k], acc[k][g]);
        }
      }
    }
  } else {
    for (int64_t i = 0; i < D; i += 8) {
      __m256 kk[NK];
      for (int k = 0; k < NK; ++k)
        kk[k] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + (c + k) * row_bytes + i))));
      for (int g = 0; g < G; ++g) {
        const __m256 qv = _mm256_loadu_ps(qs + g * D + i);
        for (int k = 0; k < NK; ++k) acc[k][g] = _mm256_fmadd_ps(qv, kk[k], acc[k][g]);
      }
    }
  }
}

// A key's dot from its accumulator: lanes j + (j + 4), then (0 + 2) + (1 + 3).
inline float key_dot(__m256 a) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// key_dot of eight accumulators at once, the same adds of the same values (so the same bits), in a third of the
// instructions (the one-at-a-time sums were about a quarter of the scoring's time). Lanes out: a0 a2 a4 a6 a1 a3 a5 a7.
inline __m256 key_dots8(const __m256* a) {
  __m256 s[4], t[2];
  for (int p = 0; p < 4; ++p)  // [a.lo + a.hi, b.lo + b.hi] for the pair (a, b) = (a[2p], a[2p + 1])
    s[p] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x20),
                         _mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x31));
  for (int p = 0; p < 2; ++p) {  // per accumulator: lanes 0 + 2 and 1 + 3
    const __m256d x = _mm256_castps_pd(s[2 * p]), y = _mm256_castps_pd(s[2 * p + 1]);
    t[p] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  return _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], 0x88), _mm256_shuffle_ps(t[0], t[1], 0xDD));
}

template <int G, bool FOUR, int NK>
inline void score_keys_block(const float* qs, int64_t D, const uint8_t* codes, const c10::Half* sc, int64_t c, float* out) {
  __m256 acc[NK][G];
  key_accs<G, FOUR, NK>(qs, D, codes, c, acc);
  for (int k = 0; k < NK; ++k) {
    float best = -INFINITY;
    for (int g = 0; g < G; ++g) {
      const float dot = key_dot(acc[k][g]);
      best = dot > best ? dot : best;
    }
    out[c + k] = best * static_cast<float>(sc[c + k]);
  }
}

// Eight keys: their accumulators NK keys at a time, then the dots of each query row's eight at once; the max over
// the rows as score_keys_block takes it (vmaxps(a, b) = a > b ? a : b), so every key's score is its bits alone.
template <int G, bool FOUR, int NK>
inline void score_keys_8(const float* qs, int64_t D, const uint8_t* codes, const c10::Half* sc, int64_t c, float* out) {
  __m256 acc[8][G];
  for (int k = 0; k < 8; k += NK) key_accs<G, FOUR, NK>(qs, D, codes, c + k, acc + k);
  constexpr int order[8] = {0, 4, 1, 5, 2, 6, 3, 7};  // so that key_dots8's lanes come out as keys 0..7
  __m256 best = _mm256_set1_ps(-INFINITY);
  for (int g = 0; g < G; ++g) {
    __m256 a[8];
    for (int j = 0; j < 8; ++j) a[j] = acc[order[j]][g];
    best = _mm256_max_ps(key_dots8(a), best);
  }
  alignas(32) float b[8];
  _mm256_store_ps(b, best);
  for (int k = 0; k < 8; ++k) out[c + k] = b[k] * static_cast<float>(sc[c + k]);
}
#endif

// Whether attend_into runs a step's tasks by the data they read (1, the default: a column chunk's keys and values read
// from memory once for every row of the step that sees them) or row by row (0: research scripts time the difference;
// the same bits either way). Measured: a 5-row verify block 1.06-1.07x faster at 1k and 4k tokens, `full`'s prefill
// to 7,680 tokens 1.06x (results/research/verify_cost_attention_order_avx2.json, paged_prefill_attention_order.json).
// The same ordering of a paged step's page scoring and attention measured no faster (0.98x prefill) and was not kept.
inline int64_t& order_by_data() {
  static int64_t on = 1;
  return on;
}

// A step of several rows shares its rows' small per-row loops (RoPE and the slab writes, SiLU) out to the threads, and
// its attention's tasks once they hold attend_threshold() multiply-adds (columns x heads x head_dim, summed over the
// rows): those ran on one thread, ~0.8 ms a row of an 8-session step on an AVX2 EPYC (attention over 33 keys 3.4 ms,
// SiLU 1.7 ms, RoPE 0.75 ms of a 24.6 ms step; the matmuls, already shared, the rest). Every row's and every task's
// arithmetic is its own, so the same bits on any thread. `rows_apart(0)` (research scripts time the difference) runs
// them on one thread and puts the attention's threshold back at 1 << 18: the step before.
inline int64_t& rows_apart_on() {
  static int64_t on = 1;
  return on;
}
inline int64_t& silu_vectors() {  // the MLP's SiLU in AVX2 vectors (1, where the CPU has AVX2) or plain floats (0)
  static int64_t on = q4::best_isa() != q4::kNone;
  return on;
}
inline int64_t& trim_columns() {  // RowStep::run's rows end at their last visible column (1) or scan all (0)
  static int64_t on = 1;
  return on;
}
inline int64_t attend_threshold() { return rows_apart_on() ? 1 << 16 : 1 << 18; }
template <class F>
inline void rows_apart(int64_t R, const F& fn) {
  if (R < 2 || !rows_apart_on()) {
    for (int64_t r = 0; r < R; ++r) fn(r);
    return;
  }
  at::parallel_for(0, R, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) fn(r);
  });
}

// Whether score_keys sums eight keys at once (key_dots8; 1, the default) or one or two at a time (0: research scripts
// time the difference; the bits are the same either way).
inline int64_t& score_eight() {
  static int64_t on = 1;
  return on;
}

template <int G, bool FOUR>
inline void score_keys(const float* qs, int64_t D, const uint8_t* codes, const c10::Half* sc, int64_t c0, int64_t c1,
                       float* out) {
#if defined(__AVX2__)
  constexpr int NK = G <= 3 ? 2 : 1;  // 2 G accumulators + decoded codes + query rows within the 16 ymm registers
  int64_t c = c0;
  if (score_eight())
    for (; c + 8 <= c1; c += 8) score_keys_8<G, FOUR, NK>(qs, D, codes, sc, c, out);
  for (; c + NK <= c1; c += NK) score_keys_block<G, FOUR, NK>(qs, D, codes, sc, c, out);
  for (; c < c1; ++c) score_keys_block<G, FOUR, 1>(qs, D, codes, sc, c, out);
#else
  const int64_t row_bytes = FOUR ? D / 2 : D;
  for (int64_t c = c0; c < c1; ++c) {
    const uint8_t* row = codes + c * row_bytes;
    float dots[G];
    for (int g = 0; g < G; ++g) dots[g] = 0.f;
    for (int64_t i = 0; i < (FOUR ? D / 2 : D); ++i) {
      if (FOUR) {
        const float lo = static_cast<float>(static_cast<int>(row[i] & 15) - 8);
        const float hi = static_cast<float>(static_cast<int>(row[i] >> 4) - 8);
        for (int g = 0; g < G; ++g) dots[g] += qs[g * D + i] * lo + qs[g * D + D / 2 + i] * hi;
      } else {
        const float k = static_cast<float>(reinterpret_cast<const int8_t*>(row)[i]);
        for (int g = 0; g < G; ++g) dots[g] += qs[g * D + i] * k;
      }
    }
    float best = -INFINITY;
    for (int g = 0; g < G; ++g) best = dots[g] > best ? dots[g] : best;
    out[c] = best * static_cast<float>(sc[c]);
  }
#endif
}

// Any G: groups of up to 4 query rows, the max carried across them.
template <bool FOUR>
inline void score_keys_any(const float* qs, int64_t G, int64_t D, const uint8_t* codes, const c10::Half* sc, int64_t c0,
                           int64_t c1, float* out) {
  switch (G) {
    case 1: return score_keys<1, FOUR>(qs, D, codes, sc, c0, c1, out);
    case 2: return score_keys<2, FOUR>(qs, D, codes, sc, c0, c1, out);
    case 3: return score_keys<3, FOUR>(qs, D, codes, sc, c0, c1, out);
    case 4: return score_keys<4, FOUR>(qs, D, codes, sc, c0, c1, out);
    default: {
      std::vector<float> part(c1);
      for (int64_t c = c0; c < c1; ++c) out[c] = -INFINITY;
      const c10::Half one(1.f);
      std::vector<c10::Half> ones(c1, one);
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t gn = std::min<int64_t>(4, G - g0);
        score_keys_any<FOUR>(qs + g0 * D, gn, D, codes, ones.data(), c0, c1, part.data());
        for (int64_t c = c0; c < c1; ++c) out[c] = part[c] > out[c] ? part[c] : out[c];
      }
      for (int64_t c = c0; c < c1; ++c) out[c] *= static_cast<float>(sc[c]);
    }
  }
}

// Compact keys scored against the query quantized to int8 (kv/paged_store.RowQuant.group_max_scores, `query_int8`):
// per (row, KV head) one scale over its G query rows, s = max |q| / 127 (at least 1e-30), a = round-half-even(q / s)
// in [-127, 127]; a key's score is (max over g of the integer dot a[g] . code) * s * its scale. Integer sums are exact
// in any order, so every path (this one, torch's float or int8 matmuls, any thread count or vector width) gives the
// same bits; the query's rounding (2^-8 of its largest element) is far below the 4-bit codes' own (1/7 of a key's).
// qs: the G rows in the codes' layout (score_layout); a, sums: G x D int8 and the G sums of a[g]; returns s.
inline float quantize_query(const float* qs, int64_t G, int64_t D, int8_t* a, int32_t* sums) {
  float amax = 0.f;
  for (int64_t i = 0; i < G * D; ++i) amax = std::max(amax, std::fabs(qs[i]));
  float s = amax / 127.f;
  s = s < 1e-30f ? 1e-30f : s;
  for (int64_t g = 0; g < G; ++g) {
    int32_t sum = 0;
    for (int64_t d = 0; d < D; ++d) {
      float v = std::nearbyint(qs[g * D + d] / s);
      v = v > 127.f ? 127.f : (v < -127.f ? -127.f : v);
      a[g * D + d] = static_cast<int8_t>(v);
      sum += static_cast<int32_t>(v);
    }
    sums[g] = sum;
  }
  return s;
}

// Whether score_keys_q8 scores 4-bit codes of 64 dimensions two keys a vector with AVX-512 VNNI where the build has it
// (1, the default) or with the AVX2 code (0: before; research scripts time it); the same bits either way.
inline int64_t& score_keys_avx512() {
  static int64_t on = 1;
  return on;
}

// Scores of keys [c0, c1) against one (row, KV head)'s quantized query (a, sums, s: quantize_query). 4-bit codes are
// read as unsigned nibbles u = code + 8 (so dot = u . a - 8 sum(a)). With AVX2: 4-bit codes 32 bytes (64 dimensions)
// per u8 x s8 multiply-add (vpmaddubsw: pairs of products <= 2 * 15 * 127, no saturation), int8 codes 16 dimensions
// per int16 multiply-add; eight keys' sums reduced at once.
template <int G, bool FOUR>
inline void score_keys_q8(const int8_t* a, const int32_t* sums, float s, int64_t D, const uint8_t* codes,
                          const c10::Half* sc, int64_t c0, int64_t c1, float* out) {
  const int64_t row_bytes = FOUR ? D / 2 : D;
  int64_t c = c0;
#if defined(__AVX2__)
  if (FOUR ? (D / 2) % 32 == 0 : D % 16 == 0) {
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
    // the query rows in registers when they fit (4-bit codes of 64 dimensions: two vectors a row)
    const bool held = FOUR && D == 64;
    __m256i qe[G], qo[G];
    if (held)
      for (int g = 0; g < G; ++g) {
        qe[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + g * D));
        qo[g] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + g * D + 32));
      }
    alignas(32) __m256i acc[G][8];
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    // AVX-512 VNNI (4-bit codes of 64 dimensions): two keys a vector, each pair of nibble vectors one vpdpbusd per
    // query row; lane i of a key's half holds the same sum of 4 byte products as the AVX2 code's lane i (both exact
    // integers), so the reduction below gives the same bits (score_keys_avx512)
    __m512i qe2[G], qo2[G];
    if (held && score_keys_avx512())
      for (int g = 0; g < G; ++g) {
        qe2[g] = _mm512_broadcast_i64x4(qe[g]);
        qo2[g] = _mm512_broadcast_i64x4(qo[g]);
      }
#endif
    for (; c < c1; c += 8) {
      const int nk = static_cast<int>(std::min<int64_t>(8, c1 - c));
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      if (held && nk == 8 && score_keys_avx512()) {
        const __m512i low2 = _mm512_set1_epi8(0x0F);
        for (int j = 0; j < 4; ++j) {
          const __m512i x = _mm512_loadu_si512(codes + (c + 2 * j) * row_bytes);
          const __m512i lo = _mm512_and_si512(x, low2), hi = _mm512_and_si512(_mm512_srli_epi16(x, 4), low2);
          for (int g = 0; g < G; ++g) {
            const __m512i r = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, qe2[g]), hi, qo2[g]);
            acc[g][2 * j] = _mm512_castsi512_si256(r);
            acc[g][2 * j + 1] = _mm512_extracti64x4_epi64(r, 1);
          }
        }
      } else
#endif
      for (int k = 0; k < 8; ++k) {
        __m256i r[G];
        for (int g = 0; g < G; ++g) r[g] = _mm256_setzero_si256();
        if (k < nk) {
          const uint8_t* row = codes + (c + k) * row_bytes;
          if (held) {
            const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
            const __m256i lo = _mm256_and_si256(x, low), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), low);
            for (int g = 0; g < G; ++g)
              r[g] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, qe[g]), _mm256_maddubs_epi16(hi, qo[g])), ones);
          } else if (FOUR) {
            for (int64_t i = 0; i < D / 2; i += 32) {
              const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i));
              const __m256i lo = _mm256_and_si256(x, low), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), low);
              for (int g = 0; g < G; ++g) {
                const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + g * D + i));
                const __m256i o = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + g * D + D / 2 + i));
                r[g] = _mm256_add_epi32(
                    r[g], _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, e), _mm256_maddubs_epi16(hi, o)), ones));
              }
            }
          } else {
            for (int64_t i = 0; i < D; i += 16) {
              const __m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i)));
              for (int g = 0; g < G; ++g) {
                const __m256i q = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + g * D + i)));
                r[g] = _mm256_add_epi32(r[g], _mm256_madd_epi16(x, q));
              }
            }
          }
        }
        for (int g = 0; g < G; ++g) acc[g][k] = r[g];
      }
      __m256i best = _mm256_set1_epi32(std::numeric_limits<int32_t>::min());
      for (int g = 0; g < G; ++g) {  // lanes k: key c + k's dot with row g (key_dots8's shuffles, integer adds)
        constexpr int order[8] = {0, 4, 1, 5, 2, 6, 3, 7};
        __m256i t4[4];
        for (int q = 0; q < 4; ++q) {
          const __m256i x = acc[g][order[2 * q]], y = acc[g][order[2 * q + 1]];
          t4[q] = _mm256_add_epi32(_mm256_permute2x128_si256(x, y, 0x20), _mm256_permute2x128_si256(x, y, 0x31));
        }
        __m256i t2[2];
        for (int q = 0; q < 2; ++q)
          t2[q] = _mm256_add_epi32(_mm256_unpacklo_epi64(t4[2 * q], t4[2 * q + 1]), _mm256_unpackhi_epi64(t4[2 * q], t4[2 * q + 1]));
        const __m256 f0 = _mm256_castsi256_ps(t2[0]), f1 = _mm256_castsi256_ps(t2[1]);
        __m256i dots = _mm256_add_epi32(_mm256_castps_si256(_mm256_shuffle_ps(f0, f1, 0x88)),
                                        _mm256_castps_si256(_mm256_shuffle_ps(f0, f1, 0xDD)));
        if (FOUR) dots = _mm256_sub_epi32(dots, _mm256_set1_epi32(8 * sums[g]));
        best = _mm256_max_epi32(best, dots);
      }
      // (float(best) * s) * scale, as the scalar loop below rounds it (the scales widened exactly, F16C or not)
      __m256 sv;
#if defined(__F16C__)
      if (nk == 8) {
        sv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + c)));
      } else
#endif
      {
        alignas(32) float w[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int k = 0; k < nk; ++k) w[k] = static_cast<float>(sc[c + k]);
        sv = _mm256_load_ps(w);
      }
      const __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(best), _mm256_set1_ps(s)), sv);
      if (nk == 8) {
        _mm256_storeu_ps(out + c, v);
      } else {
        alignas(32) float w[8];
        _mm256_store_ps(w, v);
        for (int k = 0; k < nk; ++k) out[c + k] = w[k];
      }
    }
    return;
  }
#endif
  for (; c < c1; ++c) {
    const uint8_t* row = codes + c * row_bytes;
    int32_t best = std::numeric_limits<int32_t>::min();
    for (int g = 0; g < G; ++g) {
      int32_t dot = 0;
      if (FOUR)
        for (int64_t i = 0; i < D / 2; ++i)
          dot += (static_cast<int32_t>(row[i] & 15) - 8) * a[g * D + i] + (static_cast<int32_t>(row[i] >> 4) - 8) * a[g * D + D / 2 + i];
      else
        for (int64_t i = 0; i < D; ++i) dot += static_cast<int32_t>(reinterpret_cast<const int8_t*>(row)[i]) * a[g * D + i];
      best = dot > best ? dot : best;
    }
    out[c] = static_cast<float>(best) * s * static_cast<float>(sc[c]);
  }
}

// Any G: groups of up to 4 query rows, the integer max carried across them (the same as one group's: exact).
template <bool FOUR>
inline void score_keys_q8_any(const int8_t* a, const int32_t* sums, float s, int64_t G, int64_t D, const uint8_t* codes,
                              const c10::Half* sc, int64_t c0, int64_t c1, float* out) {
  switch (G) {
    case 1: return score_keys_q8<1, FOUR>(a, sums, s, D, codes, sc, c0, c1, out);
    case 2: return score_keys_q8<2, FOUR>(a, sums, s, D, codes, sc, c0, c1, out);
    case 3: return score_keys_q8<3, FOUR>(a, sums, s, D, codes, sc, c0, c1, out);
    case 4: return score_keys_q8<4, FOUR>(a, sums, s, D, codes, sc, c0, c1, out);
    default: {  // float(int) * s * scale is monotone in the int for a fixed s * scale > 0: the max of the groups' scores
      std::vector<float> part(c1);
      for (int64_t k = c0; k < c1; ++k) out[k] = -INFINITY;
      for (int64_t g0 = 0; g0 < G; g0 += 4) {
        const int64_t gn = std::min<int64_t>(4, G - g0);
        score_keys_q8_any<FOUR>(a + g0 * D, sums + g0, s, gn, D, codes, sc, c0, c1, part.data());
        for (int64_t k = c0; k < c1; ++k) out[k] = part[k] > out[k] ? part[k] : out[k];
      }
    }
  }
}

// Whether compact keys are scored against the int8 query (1, the default) or the fp32 one (0: the choice before; kv/
// paged_store.query_int8 sets it with its own paths, so every path of a process scores alike).
inline int64_t& score_q8() {
  static int64_t on = 1;
  return on;
}

// kv/paged_store.RowQuant.group_max_scores in one pass: q (B, G, M, D) fp32, compact keys (B, C, D/2) uint8 (two
// 4-bit codes a byte, low nibble = even dimension, value = code - 8) or (B, C, D) int8, scale (B, C, 1) fp16 ->
// (B, M, C) fp32: max over g of q[b, g, m] . codes[b, c], times scale[b, c], q quantized to int8 per (b, m) first
// (score_q8, the default: quantize_query, score_keys_q8) or as it is. Each key's codes are read once per query row
// set, straight from the packed bytes, and dotted with the G query rows in vectors; nothing else is read or written. The page choice of a decode step scores thousands of keys per layer with it (torch's path:
// unpack, convert, two batched matmuls, a max: ~10 calls and a float copy of every code).
// kv/paged_store.RowQuant(8).encode written in place (paged archives a decode step's evicted row with it): x (A, B, C,
// N, D) fp32 or fp16, any strides with the last dimension contiguous -> codes (A, B, C, N, D) int8 and scale (A, B, C,
// N, 1) fp16, views into the key table. Per row: s = max |x| / 127, at least fp16's smallest normal (2^-14), rounded to
// fp16 (nearest even); code = round-half-even(x / s) in [-127, 127]. Every step is one IEEE operation as torch's, so
// the same bits as RowQuant.encode.
template <typename T>
void row_quant8_rows(const at::Tensor& x, at::Tensor& codes, at::Tensor& scale) {
  const int64_t D = x.size(4);
  const T* xp = x.data_ptr<T>();
  int8_t* cp = codes.data_ptr<int8_t>();
  c10::Half* sp = scale.data_ptr<c10::Half>();
  for (int64_t a = 0; a < x.size(0); ++a)
    for (int64_t b = 0; b < x.size(1); ++b)
      for (int64_t c = 0; c < x.size(2); ++c)
        for (int64_t n = 0; n < x.size(3); ++n) {
          const T* row = xp + a * x.stride(0) + b * x.stride(1) + c * x.stride(2) + n * x.stride(3);
          float amax = 0.f;
          for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(static_cast<float>(row[d])));
          float s = amax / 127.f;
          s = s < 6.103515625e-05f ? 6.103515625e-05f : s;
          const c10::Half h(s);
          const float sf = static_cast<float>(h);
          sp[a * scale.stride(0) + b * scale.stride(1) + c * scale.stride(2) + n * scale.stride(3)] = h;
          int8_t* out = cp + a * codes.stride(0) + b * codes.stride(1) + c * codes.stride(2) + n * codes.stride(3);
          for (int64_t d = 0; d < D; ++d) {
            float v = std::nearbyint(static_cast<float>(row[d]) / sf);
            out[d] = static_cast<int8_t>(v > 127.f ? 127.f : (v < -127.f ? -127.f : v));
          }
        }
}

void row_quant8_into(const at::Tensor& x, at::Tensor codes, at::Tensor scale) {
  TORCH_CHECK(x.dim() == 5 && codes.dim() == 5 && scale.dim() == 5, "row_quant8_into: 5-dimensional x, codes, scale");
  TORCH_CHECK(x.stride(4) == 1 && codes.stride(4) == 1, "row_quant8_into: the last dimension must be contiguous");
  for (int64_t i = 0; i < 4; ++i)
    TORCH_CHECK(codes.size(i) == x.size(i) && scale.size(i) == x.size(i), "row_quant8_into: shapes differ");
  TORCH_CHECK(codes.size(4) == x.size(4) && scale.size(4) == 1, "row_quant8_into: codes (..., D), scale (..., 1)");
  TORCH_CHECK(codes.scalar_type() == at::kChar && scale.scalar_type() == at::kHalf,
              "row_quant8_into: codes int8, scale fp16");
  if (x.scalar_type() == at::kFloat) row_quant8_rows<float>(x, codes, scale);
  else if (x.scalar_type() == at::kHalf) row_quant8_rows<c10::Half>(x, codes, scale);
  else TORCH_CHECK(false, "row_quant8_into: x must be fp32 or fp16");
}

at::Tensor group_max_scores(const at::Tensor& q, const at::Tensor& codes, const at::Tensor& scale) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat, "group_max_scores: q must be (B, G, M, D) fp32");
  const int64_t B = q.size(0), G = q.size(1), M = q.size(2), D = q.size(3);
  TORCH_CHECK(D % kLanes == 0 && D <= 256, "group_max_scores: D must be a multiple of 16, at most 256");
  TORCH_CHECK(codes.dim() == 3 && codes.size(0) == B, "group_max_scores: codes must be (B, C, D/2) uint8 or (B, C, D) int8");
  const bool four = codes.scalar_type() == at::kByte;
  TORCH_CHECK((four && codes.size(2) * 2 == D) || (codes.scalar_type() == at::kChar && codes.size(2) == D),
              "group_max_scores: codes must be (B, C, D/2) uint8 or (B, C, D) int8");
  const int64_t C = codes.size(1);
  TORCH_CHECK(scale.numel() == B * C && scale.scalar_type() == at::kHalf, "group_max_scores: scale must be (B, C, 1) fp16");
  auto cc = codes.contiguous(), sc = scale.contiguous();
  // the query rows per (b, m), G x D: 4-bit codes hold even dimensions in low nibbles, odd ones in high ones
  auto qs = q.permute({0, 2, 1, 3}).contiguous();  // (B, M, G, D)
  if (four) qs = at::cat({qs.slice(3, 0, D, 2), qs.slice(3, 1, D, 2)}, 3).contiguous();
  auto out = at::empty({B, M, C}, q.options());
  const float* qp = qs.data_ptr<float>();
  const uint8_t* cp = reinterpret_cast<const uint8_t*>(cc.data_ptr());
  const c10::Half* sp = sc.data_ptr<c10::Half>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = four ? D / 2 : D, block = 512;
  const int64_t blocks = (C + block - 1) / block;
  const int64_t tasks = B * M * blocks;
  at::parallel_for(0, tasks, C * G * M * D < (1 << 21) ? tasks : 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t bm = t / blocks, b = bm / M, c0 = (t % blocks) * block, c1 = std::min(C, c0 + block);
      const float* qrow = qp + bm * G * D;
      const uint8_t* crow = cp + b * C * row_bytes;
      if (score_q8()) {
        std::vector<int8_t> a(G * D);
        std::vector<int32_t> sums(G);
        const float s = quantize_query(qrow, G, D, a.data(), sums.data());
        if (four) score_keys_q8_any<true>(a.data(), sums.data(), s, G, D, crow, sp + b * C, c0, c1, op + bm * C);
        else score_keys_q8_any<false>(a.data(), sums.data(), s, G, D, crow, sp + b * C, c0, c1, op + bm * C);
      } else if (four) {
        score_keys_any<true>(qrow, G, D, crow, sp + b * C, c0, c1, op + bm * C);
      } else {
        score_keys_any<false>(qrow, G, D, crow, sp + b * C, c0, c1, op + bm * C);
      }
    }
  });
  return out;
}

// linear.RefinedHead in one call: x (M, K) fp32, 4-bit copies of the head as q4::pack's blocks, its fp32 rows w (N, K)
// -> (M, N) fp32 logits: each row's `refine` best scores recomputed exactly from w, every other logit the kernel's
// score. The blocks hold N columns (the greedy path: one int8 activation plane, only which candidates the exact
// rescoring sees depends on it) or 2N (the sampled path: the head and its residual after 4-bit quantization, w ~ w1 +
// w2, the copy scored with `planes`, the residual with one, summed: ~8-bit weights, whose logits, unlike the argmax,
// are used). Replaces the kernel call plus topk, a gather of the chosen rows, an einsum and a scatter from Python
// (greedy: ~1.5 -> 0.9 ms a decode step for SmolLM2's 49,152 x 576 head; sampled: torch's int8 kernel with bf16
// activations, ~5.5 ms where bf16 is emulated). A row's choice (a bounded min-heap, an earlier column kept on a tie)
// and its dot products (dot: fixed lanes) depend on that row alone, so rows stay row-exact.
at::Tensor refined_head(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& w, int64_t refine,
                        int64_t planes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "refined_head: x must be (M, K) fp32");
  auto xc = x.contiguous();
  const int64_t K = xc.size(1), N = w.dim() == 2 ? w.size(0) : -1;
  TORCH_CHECK(w.dim() == 2 && w.size(1) == K && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "refined_head: w must be the head's (N, K) fp32 rows, contiguous");
  const int64_t columns = packed.dim() == 3 ? packed.size(0) * q4::kCols : -1;
  TORCH_CHECK(columns == N || columns == 2 * N, "refined_head: the blocks must hold the head's ", N, " columns (or ",
              2 * N, ": a head and its residual), got ", columns);
  at::Tensor y;
  if (columns == 2 * N) {  // w1 x + w2 x: the copy with `planes`, the residual with one (its activations' rounding is
    // scaled by the residual's small weights: the same logits to 4 decimals on SmolLM2's head as with two)
    const int64_t half = N / q4::kCols;
    y = q4::matmul(xc, packed.narrow(0, 0, half), 0, planes) + q4::matmul(xc, packed.narrow(0, half, half), 0, 1);
  } else {
    y = q4::matmul(xc, packed, 0, planes);
  }
  const int64_t M = y.size(0);
  TORCH_CHECK(K % kLanes == 0 && refine >= 1, "refined_head: K must be a multiple of 16 and refine >= 1");
  const int64_t r = std::min(refine, N);
  float* yp = y.data_ptr<float>();
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t lo, int64_t hi) {
    std::vector<std::pair<float, int64_t>> heap;  // the row's best r so far, the lowest score on top
    const auto better = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    };
    for (int64_t m = lo; m < hi; ++m) {
      float* row = yp + m * N;
      heap.clear();
      for (int64_t j = 0; j < r; ++j) heap.emplace_back(row[j], j);
      std::make_heap(heap.begin(), heap.end(), better);
      for (int64_t j = r; j < N; ++j) {
        if (row[j] > heap.front().first) {
          std::pop_heap(heap.begin(), heap.end(), better);
          heap.back() = {row[j], j};
          std::push_heap(heap.begin(), heap.end(), better);
        }
      }
      const float* xr = xp + m * K;
      for (const auto& [score, j] : heap) row[j] = dot(xr, wp + j * K, K);
    }
  });
  return y;
}

#include "paged_rows.h"

class RowStep {
 public:
  RowStep(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter, double eps, double attn_scale,
          std::vector<int64_t> kinds, std::vector<at::Tensor> tensors)
      : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), inter_(inter),
        eps_(static_cast<float>(eps)), scale_(static_cast<float>(attn_scale)) {
    // per layer: ln_in, ln_post_attn, then (a, b) for wqkv, wo, w_gate_up, w_down (kinds: 4 per layer); last: final norm
    TORCH_CHECK((head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128) && hidden % kLanes == 0,
                "row step: head_dim must be 16, 32, 64 or 128 and hidden a multiple of 16");
    TORCH_CHECK(heads % kv_heads == 0, "row step: heads must be a multiple of kv_heads");
    TORCH_CHECK(kinds.size() % 4 == 0 && tensors.size() == kinds.size() / 4 * 10 + 1, "row step: bad weight list");
    layers_ = static_cast<int64_t>(kinds.size() / 4);
    for (int64_t l = 0; l < layers_; ++l) {
      const at::Tensor* t = &tensors[l * 10];
      ln_in_.push_back(t[0].contiguous());
      ln_post_.push_back(t[1].contiguous());
      for (int j = 0; j < 4; ++j) lin_.push_back(Linear{kinds[l * 4 + j], t[2 + 2 * j], t[3 + 2 * j]});
    }
    final_norm_ = tensors.back().contiguous();
  }

  // x (R, hidden) fp32: the rows' embeddings; cos, sin (R, head_dim) fp32: RoPE tables at the rows' positions;
  // k_slabs, v_slabs: per session, per layer, (Hkv, capacity, D) fp32 contiguous; row_session, row_slot (R,) int64:
  // each row's session and the slab column its k, v go to; mask (R, N) bool and row_keys (R,) int64: the columns
  // each row sees, among its session's first row_keys[r]. Writes every layer's k, v into the slabs; returns the
  // final-normed hidden states (R, hidden) fp32.
  //
  // capture: layers whose output (the residual stream after them) to keep, in this order (engine StepInput.capture:
  // a drafter's conditioning features); the second result is then (R, len(capture) * hidden), else empty.
  std::tuple<at::Tensor, at::Tensor> run(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                 const std::vector<std::vector<at::Tensor>>& k_slabs, const std::vector<std::vector<at::Tensor>>& v_slabs,
                 const at::Tensor& row_session, const at::Tensor& row_slot, const at::Tensor& mask,
                 const at::Tensor& row_keys, const std::vector<int64_t>& capture,
                 const std::vector<int64_t>& paged_sessions = {}, const std::vector<PagedView>& paged_views = {}) {
    at::NoGradGuard no_grad;
    const int64_t R = x.size(0), H = heads_, Hkv = kv_heads_, D = head_dim_;
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_ && x.scalar_type() == at::kFloat, "row step: x must be (R, hidden) fp32");
    TORCH_CHECK(cos.size(0) == R && cos.size(1) == D && sin.sizes() == cos.sizes(), "row step: cos/sin must be (R, D)");
    TORCH_CHECK(mask.dim() == 2 && mask.size(0) == R && mask.scalar_type() == at::kBool, "row step: mask must be (R, N) bool");
    x = x.contiguous().clone();
    auto cs = cos.contiguous(), sn = sin.contiguous(), msk = mask.contiguous();
    auto sess = row_session.contiguous(), slot = row_slot.contiguous(), nkeys = row_keys.contiguous();
    const int64_t* sess_p = sess.data_ptr<int64_t>();
    const int64_t* slot_p = slot.data_ptr<int64_t>();
    const int64_t* nk_p = nkeys.data_ptr<int64_t>();
    const bool* mask_p = msk.data_ptr<bool>();
    const int64_t N = msk.size(1);
    for (int64_t r = 0; r < R; ++r) {
      TORCH_CHECK(sess_p[r] >= 0 && sess_p[r] < static_cast<int64_t>(k_slabs.size()), "row step: bad session index");
      TORCH_CHECK(nk_p[r] >= 0 && nk_p[r] <= N, "row step: row_keys out of range");
    }
    const auto slab_type = k_slabs.empty() || k_slabs[0].empty() ? at::kFloat : k_slabs[0][0].scalar_type();
    TORCH_CHECK(slab_type == at::kFloat || slab_type == at::kHalf, "row step: slabs must be fp32 or fp16");
    for (size_t s = 0; s < k_slabs.size(); ++s) {
      TORCH_CHECK(static_cast<int64_t>(k_slabs[s].size()) == layers_ && static_cast<int64_t>(v_slabs[s].size()) == layers_,
                  "row step: one slab per layer");
      for (int64_t l = 0; l < layers_; ++l)
        for (const at::Tensor* t : {&k_slabs[s][l], &v_slabs[s][l]})
          TORCH_CHECK(t->dim() == 3 && t->size(0) == Hkv && t->size(2) == D && t->scalar_type() == slab_type &&
                          t->is_contiguous() && t->size(1) == k_slabs[s][l].size(1),
                      "row step: slabs must be (Hkv, capacity, D) contiguous, fp32 or fp16 (every session's alike), "
                      "K and V alike");
    }
    const bool half = slab_type == at::kHalf;
    TORCH_CHECK(!half || D <= 256, "row step: fp16 slabs need head_dim <= 256");
    const auto opts = x.options();
    float* xp = x.data_ptr<float>();
    std::vector<float> inv(R), q(R * H * D), att(R * H * D), parts;
    const float* cp = cs.data_ptr<float>();
    const float* sp = sn.data_ptr<float>();
    const int64_t half_d = D / 2, nq = H * D, nkv = Hkv * D;

    // paged sessions (paged_rows.h): their rows attend through their PagedView; attend_into gives them no columns
    TORCH_CHECK(paged_sessions.size() == paged_views.size(), "row step: one PagedView per paged session");
    std::vector<int64_t> nk_rest(nk_p, nk_p + R), paged_first, paged_rows_n;
    // Each row's columns end at its last visible one. A ring not yet full (sink_window's first window of tokens: 33
    // visible of 1,040 columns in an 8-session bench) and a prefill chunk's causal mask leave the rest masked, and
    // a masked column never enters a row's sums (attend_chunk*: not its max, sum or weighted V; a chunk with none
    // visible is skipped by merge_chunks), so the same bits without scanning them (was ~15 us a row and layer there).
    if (trim_columns())
      for (int64_t r = 0; r < R; ++r) {
        const bool* mr = mask_p + r * N;
        int64_t n = nk_rest[r];
        while (n > 0 && !mr[n - 1]) --n;
        nk_rest[r] = n;
      }
    for (size_t i = 0; i < paged_sessions.size(); ++i) {
      const int64_t s = paged_sessions[i];
      TORCH_CHECK(s >= 0 && s < static_cast<int64_t>(k_slabs.size()), "row step: bad paged session index");
      int64_t first = -1, n = 0;
      for (int64_t r = 0; r < R; ++r)
        if (sess_p[r] == s) {
          TORCH_CHECK(first < 0 || first + n == r, "row step: a paged session's rows must be contiguous");
          if (first < 0) first = r;
          ++n;
          nk_rest[r] = 0;
        }
      paged_views[i].check(n, Hkv, D, layers_, k_slabs[s][0].size(1));
      paged_first.push_back(first);
      paged_rows_n.push_back(n);
    }
    for (const int64_t l : capture) TORCH_CHECK(l >= 0 && l < layers_, "row step: captured layer out of range");
    const int64_t nc = static_cast<int64_t>(capture.size());
    auto captured = at::empty({nc ? R : 0, nc * hidden_}, opts.dtype(at::kFloat));

    for (int64_t l = 0; l < layers_; ++l) {
      // input norm -> fused q, k, v
      auto qkv = project(l, xp, R, inv.data(), opts);
      const float* qkv_p = qkv.data_ptr<float>();
      // RoPE (rotate-half) on q and k; k, v into each row's slab column (rows apart on the threads: each row's own
      // arithmetic and its own slab column, so the same bits)
      for (int64_t r = 0; r < R; ++r)
        TORCH_CHECK(slot_p[r] >= 0 && slot_p[r] < k_slabs[sess_p[r]][l].size(1), "row step: slot out of the slab");
      rows_apart(R, [&](int64_t r) {
        const float* c = cp + r * D;
        const float* s = sp + r * D;
        const float* row = qkv_p + r * (nq + 2 * nkv);
        for (int64_t h = 0; h < H; ++h) rope(row + h * D, c, s, &q[(r * H + h) * D], half_d);
        const auto& ks = k_slabs[sess_p[r]][l];
        const auto& vs = v_slabs[sess_p[r]][l];
        const int64_t cap = ks.size(1);
        for (int64_t h = 0; h < Hkv; ++h) {
          const float* v = row + nq + nkv + h * D;
          const int64_t at_slot = (h * cap + slot_p[r]) * D;
          if (half) {  // k rotated in floats, then both rounded to fp16 into the slab
            float kr[256];
            rope(row + nq + h * D, c, s, kr, half_d);
            floats_to_halves(kr, D, ks.data_ptr<c10::Half>() + at_slot);
            floats_to_halves(v, D, vs.data_ptr<c10::Half>() + at_slot);
          } else {
            rope(row + nq + h * D, c, s, ks.data_ptr<float>() + at_slot, half_d);
            float* vdst = vs.data_ptr<float>() + at_slot;
            for (int64_t d = 0; d < D; ++d) vdst[d] = v[d];
          }
        }
      });
      std::vector<int64_t> caps(R);
      for (int64_t r = 0; r < R; ++r) caps[r] = k_slabs[sess_p[r]][l].size(1);
      if (half) {
        std::vector<const c10::Half*> kp(R), vp(R);
        for (int64_t r = 0; r < R; ++r) {
          kp[r] = k_slabs[sess_p[r]][l].data_ptr<c10::Half>();
          vp[r] = v_slabs[sess_p[r]][l].data_ptr<c10::Half>();
        }
        attend_into(q.data(), R, kp, vp, caps, mask_p, N, nk_rest.data(), att.data(), parts);
      } else {
        std::vector<const float*> kp(R), vp(R);
        for (int64_t r = 0; r < R; ++r) {
          kp[r] = k_slabs[sess_p[r]][l].data_ptr<float>();
          vp[r] = v_slabs[sess_p[r]][l].data_ptr<float>();
        }
        attend_into(q.data(), R, kp, vp, caps, mask_p, N, nk_rest.data(), att.data(), parts);
      }
      for (size_t i = 0; i < paged_sessions.size(); ++i) {
        const int64_t s = paged_sessions[i], r0 = paged_first[i];
        paged_attend(l, &q[r0 * H * D], paged_rows_n[i], paged_views[i], {}, k_slabs[s][l], v_slabs[s][l], &att[r0 * H * D]);
      }
      finish(l, xp, R, att.data(), inv.data(), opts);
      for (int64_t c = 0; c < nc; ++c)
        if (capture[c] == l) {
          float* dst = captured.data_ptr<float>();
          for (int64_t r = 0; r < R; ++r)
            std::memcpy(dst + (r * nc + c) * hidden_, xp + r * hidden_, hidden_ * sizeof(float));
        }
    }
    return {final_norm(xp, R, inv.data(), opts), captured};
  }

  // -- the same step in segments, attention left to the caller (engine/steps._forward_plain's runner: the strategies
  // whose keys the kv layer chooses per query, such as paged recall). Each piece is the fused run's own code, so the
  // dense work is the same arithmetic; the caller attends. Tensors are fp32, rows independent.

  // Layer l's input norm, fused q/k/v projection and RoPE over the residual stream x (R, hidden): returns q (H, R, D)
  // rotated, q before RoPE (H, R, D), k (Hkv, R, D) rotated, v (Hkv, R, D) (views of row-major memory); cos, sin
  // (R, D) at the rows' positions.
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_qkv(int64_t l, const at::Tensor& x, const at::Tensor& cos,
                                                                       const at::Tensor& sin) const {
    at::NoGradGuard no_grad;
    const int64_t R = x.size(0), H = heads_, Hkv = kv_heads_, D = head_dim_, half = D / 2;
    check_rows(l, x, layers_);
    TORCH_CHECK(cos.dim() == 2 && cos.size(0) == R && cos.size(1) == D && sin.sizes() == cos.sizes() &&
                    cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
                "row step: cos/sin must be (R, D) fp32");
    auto xc = x.contiguous(), cs = cos.contiguous(), sn = sin.contiguous();
    const auto opts = xc.options();
    std::vector<float> inv(R);
    auto qkv = project(l, xc.data_ptr<float>(), R, inv.data(), opts);
    // row-major (R, heads, D) memory, returned as (heads, R, D) views: the layout the Python pieces give (their
    // rotations of a transposed projection), so the kv layer's attention sees the strides it sees from them
    auto q = at::empty({R, H, D}, opts), q_raw = at::empty({R, H, D}, opts), k = at::empty({R, Hkv, D}, opts),
         v = at::empty({R, Hkv, D}, opts);
    const float* qkv_p = qkv.data_ptr<float>();
    const float* cp = cs.data_ptr<float>();
    const float* sp = sn.data_ptr<float>();
    float *qp = q.data_ptr<float>(), *qr = q_raw.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
    const int64_t nq = H * D, nkv = Hkv * D;
    for (int64_t r = 0; r < R; ++r) {
      const float* row = qkv_p + r * (nq + 2 * nkv);
      for (int64_t h = 0; h < H; ++h) rope(row + h * D, cp + r * D, sp + r * D, qp + (r * H + h) * D, half);
      std::memcpy(qr + r * nq, row, nq * sizeof(float));
      for (int64_t h = 0; h < Hkv; ++h) rope(row + nq + h * D, cp + r * D, sp + r * D, kp + (r * Hkv + h) * D, half);
      std::memcpy(vp + r * nkv, row + nq + nkv, nkv * sizeof(float));
    }
    return {q.transpose(0, 1), q_raw.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)};
  }

  // Layer l's attention output o (H, R, D) into a new residual stream: x + o Wo, then the MLP block.
  at::Tensor layer_finish(int64_t l, const at::Tensor& x, const at::Tensor& o) const {
    at::NoGradGuard no_grad;
    const int64_t R = x.size(0), H = heads_, D = head_dim_;
    check_rows(l, x, layers_);
    TORCH_CHECK(o.dim() == 3 && o.size(0) == H && o.size(1) == R && o.size(2) == D && o.scalar_type() == at::kFloat,
                "row step: o must be (H, R, D) fp32");
    auto out = x.contiguous().clone();
    auto att = o.transpose(0, 1).contiguous();  // (R, H, D): the fused step's layout
    std::vector<float> inv(R);
    finish(l, out.data_ptr<float>(), R, att.data_ptr<float>(), inv.data(), out.options());
    return out;
  }

  // The final norm of the residual stream x (R, hidden).
  at::Tensor final_hidden(const at::Tensor& x) const {
    at::NoGradGuard no_grad;
    check_rows(0, x, 1);
    auto xc = x.contiguous();
    std::vector<float> inv(x.size(0));
    return final_norm(xc.data_ptr<float>(), x.size(0), inv.data(), xc.options());
  }

  // The fused step's attention for R rows of one session, q (H, R, D), over its slab (Hkv, capacity, D) fp32 or fp16
  // under mask (R, N) among its first row_keys[r] columns -> (H, R, D): what the whole-step call computes for those
  // rows (kv/paged.py's rows that recall nothing, so a paged verify row equals the one-token step, which takes that
  // call).
  at::Tensor attend_rows(const at::Tensor& q, const at::Tensor& k_slab, const at::Tensor& v_slab, const at::Tensor& mask,
                         const at::Tensor& row_keys) const {
    at::NoGradGuard no_grad;
    const int64_t H = heads_, Hkv = kv_heads_, D = head_dim_, R = q.size(1);
    TORCH_CHECK(q.dim() == 3 && q.size(0) == H && q.size(2) == D && q.scalar_type() == at::kFloat,
                "row step: q must be (H, R, D) fp32");
    check_slabs(k_slab, v_slab);
    TORCH_CHECK(mask.dim() == 2 && mask.size(0) == R && mask.scalar_type() == at::kBool, "row step: mask must be (R, N) bool");
    auto msk = mask.contiguous(), nk = row_keys.contiguous();
    TORCH_CHECK(nk.scalar_type() == at::kLong && nk.numel() == R, "row step: row_keys must be (R,) int64");
    const int64_t N = msk.size(1);
    for (int64_t r = 0; r < R; ++r)
      TORCH_CHECK(nk.data_ptr<int64_t>()[r] >= 0 && nk.data_ptr<int64_t>()[r] <= std::min(N, k_slab.size(1)),
                  "row step: row_keys out of range");
    auto qr = q.transpose(0, 1).contiguous();  // (R, H, D)
    auto att = at::empty({R, H, D}, qr.options());
    std::vector<int64_t> caps(R, k_slab.size(1));
    std::vector<float> parts;
    auto attend = [&](auto* kslab, auto* vslab) {
      using T = std::remove_cv_t<std::remove_pointer_t<decltype(kslab)>>;
      std::vector<const T*> kp(R, kslab), vp(R, vslab);
      attend_into(qr.data_ptr<float>(), R, kp, vp, caps, msk.data_ptr<bool>(), N, nk.data_ptr<int64_t>(),
                  att.data_ptr<float>(), parts);
    };
    if (k_slab.scalar_type() == at::kHalf)
      attend(k_slab.data_ptr<c10::Half>(), v_slab.data_ptr<c10::Half>());
    else
      attend(k_slab.data_ptr<float>(), v_slab.data_ptr<float>());
    return att.transpose(0, 1);
  }

  // One row's attention over its recalled rows kr, vr (Hkv, E, D) fp32 under mask_r (Hkv, E) bool, then its
  // session's slab (Hkv, capacity, D) under mask_w (N,) bool among its first n_keys columns, as one softmax: each
  // (KV head, chunk) alone, the recalled chunks first, merged in that order (kv/paged.py's rows that recall pages: a
  // verify row and the one-token step at its position read the same rows and columns, so they get the same bits).
  // q (H, D) -> (H, D).
  at::Tensor attend_recalled(const at::Tensor& q, const at::Tensor& kr, const at::Tensor& vr, const at::Tensor& mask_r,
                             const at::Tensor& k_slab, const at::Tensor& v_slab, const at::Tensor& mask_w,
                             int64_t n_keys) const {
    at::NoGradGuard no_grad;
    const int64_t H = heads_, Hkv = kv_heads_, D = head_dim_, G = H / Hkv;
    TORCH_CHECK(q.numel() == H * D && q.scalar_type() == at::kFloat, "row step: q must be (H, D) fp32");
    TORCH_CHECK(kr.dim() == 3 && kr.size(0) == Hkv && kr.size(2) == D && kr.scalar_type() == at::kFloat &&
                    vr.sizes() == kr.sizes() && vr.scalar_type() == at::kFloat,
                "row step: recalled rows must be (Hkv, E, D) fp32, K and V alike");
    const int64_t E = kr.size(1);
    TORCH_CHECK(mask_r.scalar_type() == at::kBool && mask_r.numel() == Hkv * E, "row step: mask_r must be (Hkv, E) bool");
    check_slabs(k_slab, v_slab);
    TORCH_CHECK(mask_w.scalar_type() == at::kBool && n_keys >= 0 && n_keys <= mask_w.numel() && n_keys <= k_slab.size(1),
                "row step: mask_w must be (N,) bool, n_keys <= N");
    auto qc = q.contiguous(), krc = kr.contiguous(), vrc = vr.contiguous(), mr = mask_r.contiguous(),
         mw = mask_w.contiguous();
    const int64_t cap = k_slab.size(1), nr = (E + kChunk - 1) / kChunk, nw = (n_keys + kChunk - 1) / kChunk;
    const int64_t nch = nr + nw, stride = D + 2;
    std::vector<float> parts(Hkv * nch * G * stride), scores(G * kChunk);
    const float* qp = qc.data_ptr<float>();
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t c = 0; c < nch; ++c) {
        float* part = &parts[(h * nch + c) * G * stride];
        if (c < nr)
          attend_chunk_any(D, G, qp + h * G * D, krc.data_ptr<float>() + h * E * D, vrc.data_ptr<float>() + h * E * D,
                           mr.data_ptr<bool>() + h * E, c * kChunk, std::min(E, (c + 1) * kChunk), scale_, scores.data(),
                           part);
        else if (k_slab.scalar_type() == at::kHalf)
          attend_chunk_any(D, G, qp + h * G * D, k_slab.data_ptr<c10::Half>() + h * cap * D,
                           v_slab.data_ptr<c10::Half>() + h * cap * D, mw.data_ptr<bool>(), (c - nr) * kChunk,
                           std::min(n_keys, (c - nr + 1) * kChunk), scale_, scores.data(), part);
        else
          attend_chunk_any(D, G, qp + h * G * D, k_slab.data_ptr<float>() + h * cap * D,
                           v_slab.data_ptr<float>() + h * cap * D, mw.data_ptr<bool>(), (c - nr) * kChunk,
                           std::min(n_keys, (c - nr + 1) * kChunk), scale_, scores.data(), part);
      }
    auto out = at::empty({H, D}, qc.options());
    for (int64_t h = 0; h < Hkv; ++h)
      for (int64_t g = 0; g < G; ++g)
        merge_chunks(&parts[(h * nch * G + g) * stride], nch, G * stride, D, out.data_ptr<float>() + (h * G + g) * D);
    return out;
  }

  // A paged session's rows at layer l (paged_rows.h): q (H, T, D) rotated at the rows' positions, over its
  // PagedView; fresh: the step's still-resident candidates as the tables would hold them (codes (Hkv, nf, Dc), scales
  // (Hkv, nf, 1), far codes, far scales, K/V (2, Hkv, nf, D)) or empty. -> (H, T, D).
  at::Tensor paged_rows(int64_t l, const at::Tensor& q, const PagedView& view, const std::vector<at::Tensor>& fresh,
                        const at::Tensor& k_slab, const at::Tensor& v_slab) const {
    at::NoGradGuard no_grad;
    TORCH_CHECK(l >= 0 && l < layers_, "paged rows: layer out of range");
    TORCH_CHECK(q.dim() == 3 && q.size(0) == heads_ && q.size(2) == head_dim_ && q.scalar_type() == at::kFloat,
                "paged rows: q must be (H, T, D) fp32");
    check_slabs(k_slab, v_slab);
    view.check(q.size(1), kv_heads_, head_dim_, layers_, k_slab.size(1));
    auto qr = q.transpose(0, 1).contiguous();  // (T, H, D)
    auto out = at::empty_like(qr);
    paged_attend(l, qr.data_ptr<float>(), q.size(1), view, fresh, k_slab, v_slab, out.data_ptr<float>());
    return out.transpose(0, 1);
  }

 private:
  // PagedView rows (T of them, q (T, H, D) row-major) at layer l -> out (T, H, D): page choice, reads, attention. The
  // callers check the view against the model and the slab once (run: once a step; paged_rows: once a call).
  void paged_attend(int64_t l, const float* qp, int64_t T, const PagedView& view, const std::vector<at::Tensor>& fresh,
                    const at::Tensor& k_slab, const at::Tensor& v_slab, float* op) const {
    TORCH_CHECK(view.tables[8].scalar_type() == k_slab.scalar_type(),
                "paged rows: the page store must hold K/V in the slab's dtype (fp32 or fp16 alike)");
    if (k_slab.scalar_type() == at::kHalf)
      paged_attend_as<c10::Half>(l, qp, T, view, fresh, k_slab, v_slab, op);
    else
      paged_attend_as<float>(l, qp, T, view, fresh, k_slab, v_slab, op);
  }

  // paged_attend with the slab's and the page store's element type E (float or c10::Half)
  template <class E>
  void paged_attend_as(int64_t l, const float* qp, int64_t T, const PagedView& view, const std::vector<at::Tensor>& fresh,
                       const at::Tensor& k_slab, const at::Tensor& v_slab, float* op) const {
    const int64_t H = heads_, Hkv = kv_heads_, D = head_dim_, G = H / Hkv;
    TORCH_CHECK(fresh.empty() || fresh.size() == 5, "paged rows: fresh is codes, scales, far codes, far scales, K/V");
    const PagedConfig& cf = view.cf;
    std::vector<at::Tensor> fc;
    for (const auto& f : fresh) fc.push_back(f.contiguous());
    auto rows_of = [&](int t, int m, int f) {
      PagedRows pr{PagedTier(view.tables[t], view.tables[t + 2], cf.P, view.meta[m], view.meta[m + 1], view.meta[m + 2]),
                   nullptr, 0};
      if (!fc.empty()) {
        const at::Tensor& x = fc[f];
        TORCH_CHECK(x.dim() >= 2 && x.element_size() * x.size(-1) == pr.tier.width &&
                        x.numel() == pr.tier.S * Hkv * x.size(-2) * x.size(-1),
                    "paged rows: the step's resident rows must be (S, Hkv, n, ...) as their table's rows");
        pr.fresh = static_cast<const uint8_t*>(x.data_ptr());
        pr.fresh_n = x.size(-2);
      }
      return pr;
    };
    // tables: the keys' ring codes, ring scales, file codes, file scales at 0..3 (a ring's file two places on), the
    // same of far_keys at 4..7, the page store's ring and file at 8, 9, the bounds at 10
    const PagedRows codes = rows_of(0, 0, 0), scales = rows_of(1, 0, 1), far_codes = rows_of(4, 3, 2),
                    far_scales = rows_of(5, 3, 3);
    PagedRows kv{PagedTier(view.tables[8], view.tables[9], cf.P, view.meta[6], view.meta[7], view.meta[8]), nullptr, 0};
    if (!fc.empty()) {
      TORCH_CHECK(fc[4].dim() == 4 && fc[4].size(0) == 2 && fc[4].size(1) == Hkv && fc[4].size(3) == D &&
                      fc[4].scalar_type() == k_slab.scalar_type(),
                  "paged rows: the step's resident K/V must be (2, Hkv, n, D) in the slab's dtype");
      kv.fresh = static_cast<const uint8_t*>(fc[4].data_ptr());
      kv.fresh_n = fc[4].size(2);
    }
    const int64_t N = view.mask.size(1), cap = k_slab.size(1);
    const int64_t* rp = view.rows.data_ptr<int64_t>();
    const bool* mp = view.mask.data_ptr<bool>();
    const float* freq = view.inv_freq.data_ptr<float>();
    const E *ks = k_slab.data_ptr<E>(), *vs = v_slab.data_ptr<E>();
    const c10::Half* bp = view.tables[10].data_ptr<c10::Half>();
    const int64_t bcap = view.tables[10].size(3), stride = D + 2;
    std::vector<PagedTask> tasks(T * Hkv);
    for (int64_t i = 0; i < T * Hkv; ++i) {
      PagedTask& t = tasks[i];
      t.row = i / Hkv, t.h = i % Hkv, t.pos = rp[t.row * 3], t.c = rp[t.row * 3 + 1], t.nk = rp[t.row * 3 + 2];
      t.far = t.pos >= cf.far_from;
      t.q = qp + (t.row * H + t.h * G) * D;
    }
    // 1: each task's candidates (its query turned for scoring; past shortlist_from the bounds ranked, kRankPages
    // pages an item, every task's items shared out together; then the shortlist)
    std::vector<PagedRank> ranks(T * Hkv);
    std::vector<std::pair<int64_t, int64_t>> items;  // (task, first page / candidate / part)
    // per-task work with no shared state: on the threads when a step has many tasks (a prefill chunk's rows), on this
    // one for a decode step's few (the same bits either way: each task's arithmetic is its own)
    const auto each_task = [&](auto&& fn) {
      if (!tasks_apart() || T * Hkv < kTasksApart) {
        for (int64_t i = 0; i < T * Hkv; ++i) fn(i);
        return;
      }
      at::parallel_for(0, T * Hkv, 1, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) fn(i);
      });
    };
    // choice_every > 1: the tasks that take another position's pages (their source task here, or -2: the kept choice)
    // choose nothing themselves
    std::vector<int64_t> source(T * Hkv, -1);
    if (cf.choice_every > 1)
      for (int64_t i = 0; i < T * Hkv; ++i) {
        const int64_t p0 = cf.choice_source(tasks[i].pos);
        if (p0 == tasks[i].pos) continue;
        const int64_t r0 = p0 - rp[0];
        if (r0 >= 0 && r0 < T && rp[r0 * 3] == p0)
          source[i] = r0 * Hkv + tasks[i].h;
        else if (p0 == cf.kept_pos && view.tables[11].numel() > 0)
          source[i] = -2;
        // else its source's choice is not held (kv/paged.py: a history written without attention): it chooses itself
      }
    each_task([&](int64_t i) {
      if (source[i] == -1) plan_begin(cf, tasks[i], ranks[i], G, D, tasks[i].far ? far_codes : codes, freq);
    });
    for (int64_t i = 0; i < T * Hkv; ++i)
      for (int64_t j = 0; j < static_cast<int64_t>(ranks[i].ranked.size()); j += kRankPages) items.push_back({i, j});
    // the whole pages past the bounds table that several rows rank (a prefill chunk's own): their bounds made once
    MadeBounds made_b;
    made_b.lo = made_b.hi = cf.bounds_rows;
    int64_t ranking = 0;  // tasks that rank from the table
    for (int64_t i = 0; i < T * Hkv; ++i)
      if (ranks[i].shortlist && cf.bounds_far == tasks[i].far) {
        made_b.hi = std::max<int64_t>(made_b.hi, ranks[i].ranked.size());
        ++ranking;
      }
    if (made_bounds() && ranking > Hkv && made_b.hi > made_b.lo) {  // else each page is ranked by one task at most: made where it is read
      const int64_t n = made_b.hi - made_b.lo;
      const PagedRows &mc = cf.bounds_far ? far_codes : codes, &ms = cf.bounds_far ? far_scales : scales;
      const bool four = mc.tier.width * 2 == D;
      made_b.b.resize(Hkv * n * 2 * D);
      // on this thread: a few pages (up to a chunk's worth a KV head, ~20 us a layer), where a parallel pass's barrier
      // measured a loss on an oversubscribed CPU (one more wait a layer on a descheduled thread)
      std::vector<uint8_t> cbuf, sbuf;
      for (int64_t it = 0; it < Hkv * n; ++it) {
        const int64_t h = it / n, j = made_b.lo + it % n;
        const uint8_t* cp = mc.run(l, 0, h, j * cf.P, cf.P, cbuf);
        const auto* sp = reinterpret_cast<const c10::Half*>(ms.run(l, 0, h, j * cf.P, cf.P, sbuf));
        c10::Half* out = made_b.b.data() + it * 2 * D;
        page_bound(cp, sp, cf.P, D, four, out, out + D);
      }
    } else {
      made_b.hi = made_b.lo;
    }
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t lo, int64_t hi) {
      for (int64_t it = lo; it < hi; ++it) {
        const int64_t i = items[it].first, j0 = items[it].second;
        const PagedTask& t = tasks[i];
        const int64_t j1 = std::min<int64_t>(j0 + kRankPages, ranks[i].ranked.size());
        rank_pages(cf, l, t, ranks[i], j0, j1, G, D, t.far ? far_codes : codes, t.far ? far_scales : scales, bp, bcap, Hkv,
                   made_b);
      }
    });
    at::parallel_for(0, T * Hkv, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) plan_end(cf, tasks[i], ranks[i]);
    });
    // 2: the candidates' keys scored, kScorePages pages an item, every task's items shared out together
    constexpr int64_t kScorePages = 8;
    items.clear();
    for (int64_t i = 0; i < T * Hkv; ++i)
      for (int64_t k = 0; k < static_cast<int64_t>(tasks[i].cand.size()); k += kScorePages) items.push_back({i, k});
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t lo, int64_t hi) {
      for (int64_t it = lo; it < hi; ++it) {
        PagedTask& t = tasks[items[it].first];
        const int64_t k0 = items[it].second, k1 = std::min<int64_t>(k0 + kScorePages, t.cand.size());
        score_candidates(cf, l, t, k0, k1, G, D, t.far ? far_codes : codes, t.far ? far_scales : scales);
      }
    });
    // 3: the chosen pages; 4: the attention's parts, every task's shared out together; 5: each row's parts merged
    items.clear();
    each_task([&](int64_t i) {
      if (source[i] == -1) finish_choice(cf, tasks[i], G, D, view.sinks);
    });
    if (cf.choice_every > 1) {  // the others take their source's pages (final above), then what follows from them
      const int64_t* kept = view.tables[11].numel() ? view.tables[11].data_ptr<int64_t>() : nullptr;
      each_task([&](int64_t i) {
        if (source[i] == -1) return;
        PagedTask& t = tasks[i];
        if (source[i] >= 0) {
          t.pages = tasks[source[i]].pages;
        } else {
          const int64_t* k = kept + (l * Hkv + t.h) * cf.M;
          t.pages.assign(k, k + cf.M);
        }
        finish_choice(cf, t, G, D, view.sinks);
      });
      int64_t* out = view.tables[12].data_ptr<int64_t>();
      for (int64_t i = 0; i < T * Hkv; ++i) {  // every row's pages, for the commit
        const PagedTask& t = tasks[i];
        int64_t* o = out + ((l * T + t.row) * Hkv + t.h) * cf.M;
        for (int64_t m = 0; m < cf.M; ++m) o[m] = m < static_cast<int64_t>(t.pages.size()) ? t.pages[m] : -1;
      }
    }
    for (int64_t i = 0; i < T * Hkv; ++i)
      for (int64_t c = 0; c < part_count(tasks[i]); ++c) items.push_back({i, c});
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t lo, int64_t hi) {
      std::vector<float> scores(G * kChunk);
      for (int64_t it = lo; it < hi; ++it) {
        PagedTask& t = tasks[items[it].first];
        const int64_t c = items[it].second;
        attend_part(cf, l, t, c, G, D, scale_, kv, ks, vs, cap, mp + t.row * N, view.sinks, freq, scores,
                    &t.parts[c * G * stride]);
      }
    });
    each_task([&](int64_t i) {
      const PagedTask& t = tasks[i];
      for (int64_t g = 0; g < G; ++g)
        merge_chunks(&t.parts[g * stride], part_count(t), G * stride, D, op + (t.row * H + t.h * G + g) * D);
    });
  }

  void check_slabs(const at::Tensor& k_slab, const at::Tensor& v_slab) const {
    const auto dt = k_slab.scalar_type();
    for (const at::Tensor* t : {&k_slab, &v_slab})
      TORCH_CHECK(t->dim() == 3 && t->size(0) == kv_heads_ && t->size(2) == head_dim_ &&
                      (dt == at::kFloat || (dt == at::kHalf && head_dim_ <= 256)) && t->scalar_type() == dt &&
                      t->is_contiguous() && t->size(1) == k_slab.size(1),
                  "row step: slabs must be (Hkv, capacity, D) contiguous, fp32 or fp16 (head_dim <= 256), K and V alike");
  }

  // Attention of R rows: q (R, H, D) row-major, row r over its K/V slab (kp[r], vp[r]: (Hkv, caps[r], D)), the
  // columns mask[r] (N wide) marks among its first nk[r] -> att (R, H, D). Each (row, kv head, chunk of columns) alone,
  // then each row's chunks merged in column order; rows in blocks of kRowBlock, so a long prefill chunk's partial
  // results stay small (a row's result does not depend on its block, nor on columns it does not see).
  // T: the slabs' element type, float or c10::Half (fp16 slabs: attend_chunk_pick).
  template <class T>
  void attend_into(const float* q, int64_t R, const std::vector<const T*>& kp, const std::vector<const T*>& vp,
                   const std::vector<int64_t>& caps, const bool* mask_p, int64_t N, const int64_t* nk_p, float* att,
                   std::vector<float>& parts) const {
    const int64_t H = heads_, Hkv = kv_heads_, D = head_dim_, G = H / Hkv;
    for (int64_t r0 = 0; r0 < R; r0 += kRowBlock) {
      const int64_t rb = std::min(R - r0, kRowBlock);
      std::vector<int64_t> first(rb + 1, 0);  // block row i's tasks: [first[i], first[i + 1]), Hkv x its chunks
      int64_t cols = 0;
      for (int64_t i = 0; i < rb; ++i) {
        first[i + 1] = first[i] + Hkv * ((nk_p[r0 + i] + kChunk - 1) / kChunk);
        cols += nk_p[r0 + i];
      }
      const int64_t tasks = first[rb], stride = D + 2;
      parts.resize(tasks * G * stride);
      // The tasks in (KV head, chunk, row) order: a chunk's keys and values (kChunk x D fp32 each) are read from
      // memory once and stay in cache for every row of the block that sees them (a verify block's rows, a prefill
      // chunk's), where row by row each row streamed its whole slab again. A task's arithmetic and where its part
      // goes do not depend on the order, so the bits are the same.
      int64_t most = 0;
      for (int64_t i = 0; i < rb; ++i) most = std::max(most, (first[i + 1] - first[i]) / Hkv);
      std::vector<int64_t> order;  // task indices (into parts) in that order
      order.reserve(tasks);
      if (!order_by_data()) {
        for (int64_t t = 0; t < tasks; ++t) order.push_back(t);  // row by row (research scripts time the difference)
      } else {
        for (int64_t h = 0; h < Hkv; ++h)
          for (int64_t c = 0; c < most; ++c)
            for (int64_t i = 0; i < rb; ++i) {
              const int64_t nch = (first[i + 1] - first[i]) / Hkv;
              if (c < nch) order.push_back(first[i] + h * nch + c);
            }
      }
      // small steps stay on this thread (a one-row step at up to ~100 keys); a step of several rows, even over short
      // histories, shares its tasks out (rows_apart_on)
      const int64_t grain = cols * H * D < attend_threshold() ? std::max<int64_t>(tasks, 1) : 1;
      at::parallel_for(0, tasks, grain, [&](int64_t lo, int64_t hi) {
        std::vector<float> scores(G * kChunk);
        for (int64_t o = lo; o < hi; ++o) {
          const int64_t t = order[o];
          const int64_t i = std::upper_bound(first.begin(), first.end(), t) - first.begin() - 1;
          const int64_t r = r0 + i;
          const int64_t idx = t - first[i], nch = (first[i + 1] - first[i]) / Hkv;
          const int64_t h = idx / nch, c = idx % nch;
          const int64_t cap = caps[r];
          const int64_t j0 = c * kChunk, j1 = std::min(nk_p[r], j0 + kChunk);
          attend_chunk_any<T>(D, G, q + (r * H + h * G) * D, kp[r] + h * cap * D, vp[r] + h * cap * D, mask_p + r * N,
                              j0, j1, scale_, scores.data(), &parts[t * G * stride]);
        }
      });
      for (int64_t i = 0; i < rb; ++i) {
        const int64_t r = r0 + i, nch = (first[i + 1] - first[i]) / Hkv;
        for (int64_t h = 0; h < Hkv; ++h)
          for (int64_t g = 0; g < G; ++g)
            merge_chunks(&parts[((first[i] + h * nch) * G + g) * stride], nch, G * stride, D, &att[(r * H + h * G + g) * D]);
      }
    }
  }

  void check_rows(int64_t l, const at::Tensor& x, int64_t layers) const {
    TORCH_CHECK(l >= 0 && l < layers, "row step: layer out of range");
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_ && x.scalar_type() == at::kFloat, "row step: x must be (R, hidden) fp32");
  }

  // input norm -> fused q, k, v (R, (H + 2 Hkv) D), before RoPE
  at::Tensor project(int64_t l, const float* xp, int64_t R, float* inv, const at::TensorOptions& opts) const {
    const Linear& wqkv = lin_[l * 4];
    norms(xp, R, inv);
    return as_float(wqkv(linear_input(xp, inv, ln_in_[l].data_ptr<float>(), R, hidden_, wqkv.bf16_input(), opts)));
  }

  // the attention output att (R, H * D) -> output projection + residual; post-attention norm -> gate/up ->
  // SiLU(gate) * up -> down + residual, into xp
  void finish(int64_t l, float* xp, int64_t R, const float* att, float* inv, const at::TensorOptions& opts) const {
    const Linear &wo = lin_[l * 4 + 1], &wgu = lin_[l * 4 + 2], &wdown = lin_[l * 4 + 3];
    add_into(xp, as_float(wo(linear_input(att, nullptr, nullptr, R, heads_ * head_dim_, wo.bf16_input(), opts))), R * hidden_);
    norms(xp, R, inv);
    auto gu = as_float(wgu(linear_input(xp, inv, ln_post_[l].data_ptr<float>(), R, hidden_, wgu.bf16_input(), opts)));
    const float* gup = gu.data_ptr<float>();
    std::vector<float> act(R * inter_);
    rows_apart(R, [&](int64_t r) {  // each element alone: the same bits on any thread
      const float* gr = gup + r * 2 * inter_;
      float* ar = act.data() + r * inter_;
      int64_t i = 0;
#if KAKEYA_X86
      if (silu_vectors()) i = silu_mul_avx2(gr, inter_, ar);  // 8 rows: 31.0 -> 29.5 ms a step (batch_rows_avx2.json)
#endif
      for (; i < inter_; ++i) {
        const float g = gr[i], u = gr[inter_ + i];
        ar[i] = g / (1.f + exp_f(-g)) * u;
      }
    });
    add_into(xp, as_float(wdown(linear_input(act.data(), nullptr, nullptr, R, inter_, wdown.bf16_input(), opts))),
             R * hidden_);
  }

  at::Tensor final_norm(const float* xp, int64_t R, float* inv, const at::TensorOptions& opts) const {
    norms(xp, R, inv);
    auto out = at::empty({R, hidden_}, opts.dtype(at::kFloat));
    const float* fw = final_norm_.data_ptr<float>();
    float* op = out.data_ptr<float>();
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = 0; i < hidden_; ++i) op[r * hidden_ + i] = fw[i] * (xp[r * hidden_ + i] * inv[r]);
    return out;
  }

  void norms(const float* x, int64_t rows, float* inv) const {
    for (int64_t r = 0; r < rows; ++r)
      inv[r] = 1.f / std::sqrt(sum_squares(x + r * hidden_, hidden_) / static_cast<float>(hidden_) + eps_);
  }

  static void rope(const float* x, const float* c, const float* s, float* out, int64_t half) {
    for (int64_t d = 0; d < half; ++d) {
      out[d] = x[d] * c[d] - x[d + half] * s[d];
      out[d + half] = x[d + half] * c[d + half] + x[d] * s[d + half];
    }
  }

  static void add_into(float* x, const at::Tensor& y, int64_t n) {
    const float* yp = y.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) x[i] += yp[i];
  }

  int64_t hidden_, heads_, kv_heads_, head_dim_, inter_, layers_ = 0;
  float eps_, scale_;
  std::vector<at::Tensor> ln_in_, ln_post_;
  std::vector<Linear> lin_;
  at::Tensor final_norm_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_pack", &q4::pack, "codes (N, K) uint8, d, m (N, K/32) -> q4x16 blocks");
  m.def("q4_matmul",
        [](const at::Tensor& x, const at::Tensor& w, int64_t isa, int64_t planes, std::optional<at::Tensor> channels) {
          return q4::matmul(x, w, isa, planes, channels.value_or(at::Tensor()));
        },
        "x (M, K) fp32 @ q4x16 blocks -> (M, N) fp32; isa 0 = best, 1 AVX2, 2 AVX-512 VNNI; planes 2 (~16-bit "
        "activations) or 1 (int8); channels (C,) int64, ascending: outlier input channels taken out of the "
        "quantized activations and added exactly",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("isa") = 0, pybind11::arg("planes") = 2,
        pybind11::arg("channels") = pybind11::none(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("q4_quantize", [](const at::Tensor& x, int64_t planes) {
    auto [qx, scales] = q4::quantize(x, planes);
    return std::make_tuple(qx, scales[0], scales[1]);
  }, "the kernel's activation quantization: x (M, K) fp32 -> planes (M, P, K) int8, scale (M, K/32), scale * sum",
        pybind11::arg("x"), pybind11::arg("planes") = 2);
  m.def("q4_prefetch", [](int64_t bytes) {
    const int64_t was = q4::prefetch_ahead();
    if (bytes >= 0) q4::prefetch_ahead() = bytes;
    return was;
  }, "bytes ahead the int4 kernel prefetches (0 = none); returns the previous value (-1: only read it)",
        pybind11::arg("bytes") = -1);
  // research toggles of orders that never change a bit: -1 reads one, 0 / 1 sets it; each returns the previous value
  const auto toggle = [&m](const char* name, int64_t& (*ref)(), const char* doc) {
    m.def(name, [ref](int64_t on) {
      const int64_t was = ref();
      if (on >= 0) ref() = on ? 1 : 0;
      return was;
    }, doc, pybind11::arg("on") = -1);
  };
  toggle("order_by_data", &order_by_data,
         "whether a step's attention (not a paged step's recall) runs its tasks by the data they read (1, the default: "
         "a chunk's keys and values read once for every row of the step) or row by row (0); the same bits either way");
  toggle("score_eight", &score_eight,
         "whether the compact keys' scoring sums eight keys at once (1, the default) or one or two at a time (0); the "
         "same bits either way");
  toggle("paged_tasks_apart", &tasks_apart,
         "whether a paged step of many (row, KV head) tasks (a prefill chunk) plans, chooses and merges them on the "
         "threads (1, the default) or on the calling thread (0: before); the same bits either way");
  toggle("made_bounds", &made_bounds,
         "whether a paged step makes the bounds of the whole pages past the bounds table (a prefill chunk's own) once a "
         "layer for all its rows (1, the default) or each row its own (0: before); the same bits either way");
  toggle("score_q8", &score_q8,
         "whether compact keys are scored against the query quantized to int8 (1, the default: exact integer dots, "
         "the same bits on every path) or the fp32 query (0: before; kv/paged_store.query_int8 sets both sides)");
  toggle("rows_apart", &rows_apart_on,
         "whether a step of several rows shares its per-row loops and its attention's tasks (over short histories too) "
         "out to the threads (1, the default) or runs them on one thread as before (0); the same bits either way");
  toggle("silu_vectors", &silu_vectors,
         "whether the MLP's SiLU runs in AVX2 vectors (1, the default where the CPU has AVX2) or in plain floats (0); "
         "the two round differently (each is row-exact)");
  toggle("q4_prefetch_next", &q4::prefetch_next,
         "whether the AVX2 int4 kernel's second pass over a block of 16 columns prefetches the next block's weights (1, "
         "the default) or nothing (0: before); the same bits either way");
  toggle("q4_one_pass_row", &q4::one_pass_row,
         "whether the AVX2 int4 kernel runs a one-row call's two halves of each group in one pass over the weights (1, "
         "the default) or half by half in two passes (0: before); the same bits either way");
  toggle("q4_row_registers", &q4::row_registers,
         "whether the int4 kernel's AVX2 path runs a tile of one row with its sums in registers (1, the default) or "
         "as a tile of up to 8 rows, sums in memory (0); the same bits either way");
  toggle("q4_vnni_tiles", &q4::vnni_tiles,
         "whether the AVX-512 int4 kernel runs its rows in tiles of a fixed count, their sums in registers and their "
         "dot chains interleaved (1, the default) or in the runtime loop over up to 8 rows (0: before); the same bits "
         "either way");
  toggle("score_keys_avx512", &score_keys_avx512,
         "whether the compact keys' scoring takes 4-bit codes of 64 dimensions two keys a vector with AVX-512 VNNI where "
         "the build has it (1, the default) or the AVX2 code (0: before); the same bits either way");
  toggle("trim_columns", &trim_columns,
         "whether a whole step's rows attend only up to their last visible column (1, the default) or scan every "
         "column of the step's mask, masked ones skipped one by one (0); the same bits either way");
  m.def("row_attention", [](int64_t kernel) {
    const int64_t was = attention_kernel();
    if (kernel >= 0) {
      TORCH_CHECK(kernel == 0 || (kernel == 1 && q4::best_isa() != q4::kNone),
                  "row_attention: 0 (16-lane code) or 1 (AVX2, on a CPU that has it)");
      attention_kernel() = kernel;
    }
    return was;
  }, "the attention chunk code the row step runs: 0 the 16-lane vector code, 1 AVX2; returns the previous one "
     "(-1: only read it)", pybind11::arg("kernel") = -1);
  m.def("fp16_in_registers", [] {
#if defined(KAKEYA_HALF16)
    return true;
#else
    return attention_kernel() == 1;
#endif
  }, "whether the attention code in use reads fp16 slabs converting them in its registers (the AVX2 code; the "
     "16-lane code of an AVX-512 build), not through a converted copy of each chunk");
  m.def("group_max_scores", &group_max_scores,
        "compact keys' scores: q (B, G, M, D) fp32, codes (B, C, D/2) uint8 (4-bit) or (B, C, D) int8, scale (B, C, 1) "
        "fp16 -> (B, M, C) fp32, max over g (kv/paged_store.RowQuant.group_max_scores)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("row_quant8_into", &row_quant8_into,
        "kv/paged_store.RowQuant(8).encode in place: x (A, B, C, N, D) fp32/fp16 -> codes (A, B, C, N, D) int8, scale "
        "(A, B, C, N, 1) fp16 (views; the last dimension contiguous), the same bits",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("refined_head", &refined_head,
        "linear.RefinedHead's logits: x (M, K) fp32, q4 blocks of the head (N columns) or of it and its 4-bit residual "
        "(2N, summed), its fp32 rows (N, K), refine, activation planes -> (M, N) fp32: the kernel's scores, each row's "
        "`refine` best recomputed exactly from the fp32 rows",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("w"), pybind11::arg("refine"),
        pybind11::arg("planes") = 1, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("q4_isa", [] { return static_cast<int64_t>(q4::best_isa()); }, "0 none (no q4 kernel here), 1 AVX2, 2 AVX-512 VNNI");
  pybind11::class_<PagedView>(m, "PagedView")
      .def(pybind11::init<std::vector<at::Tensor>, std::vector<int64_t>, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&>());
  pybind11::class_<RowStep>(m, "RowStep")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, std::vector<int64_t>,
                          std::vector<at::Tensor>>())
      .def("run", &RowStep::run, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("layer_qkv", &RowStep::layer_qkv, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("layer_finish", &RowStep::layer_finish, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("final_hidden", &RowStep::final_hidden, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("attend_rows", &RowStep::attend_rows, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("attend_recalled", &RowStep::attend_recalled, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("paged_rows", &RowStep::paged_rows, pybind11::call_guard<pybind11::gil_scoped_release>());
}
