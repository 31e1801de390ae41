// Int4 (Q4_1 blocks) x int8 (activations quantized per 32-block) matmul for the CPU, llama.cpp's
// way of doing a 4-bit GEMM on AVX2 / AVX-512: integer dot products per block, one float multiply-add
// per block. Written for this project (no code from elsewhere).
//
// y[m, n] = sum_g (d[n, g] * xs[m, g]) * dot(qw[n, g, :], qx[m, g, :]) + mw[n, g] * xsum[m, g]
//   qw in 0..15 (w = qw * d + mw, GGUF Q4_1), qx in -127..127 with x ~ qx * xs (per row, per block of 32),
//   xsum = xs * sum(qx) over the block.
//
// Exactness: the integer dot products are exact, and every output element is computed by the same
// sequence of float operations whatever the number of rows M, the thread count or the ISA (AVX-512
// VNNI, AVX2 or scalar): 8 lane accumulators, one fma per block, a fixed-order sum at the end. So a
// row's output does not depend on the other rows of the call (what keeps a batched session's tokens
// those of the session alone) and a verify block's rows equal one-row steps bit for bit.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kBlock = 32;
constexpr int kBlockBytes = 18;  // a weight block: d (fp16), then 16 bytes of codes

// Activations (M, K) fp32 -> qx (M, K) int8, xs (M, G) and xsum (M, G) fp32.
void quantize_rows(const float* x, int64_t m_rows, int64_t k, int8_t* qx, float* xs, float* xsum) {
  const int64_t g_count = k / kBlock;
  at::parallel_for(0, m_rows, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m) {
      for (int64_t g = 0; g < g_count; ++g) {
        const float* src = x + m * k + g * kBlock;
        float amax = 0.f;
        for (int i = 0; i < kBlock; ++i) amax = std::fmax(amax, std::fabs(src[i]));
        const float s = amax / 127.f;
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        int8_t* dst = qx + m * k + g * kBlock;
        int sum = 0;
        for (int i = 0; i < kBlock; ++i) {
          int q = static_cast<int>(std::nearbyint(src[i] * inv));
          q = q > 127 ? 127 : (q < -127 ? -127 : q);
          dst[i] = static_cast<int8_t>(q);
          sum += q;
        }
        xs[m * g_count + g] = s;
        xsum[m * g_count + g] = s * static_cast<float>(sum);
      }
    }
  });
}

// The canonical computation of one output element (row r, column j), which every path reproduces:
//   acc[lane] = fma(float(dot_lane(g)), d[j,g] * xs[r,g], acc[lane]) for g = 0..G-1 (lane i: products 4i..4i+3)
//   tl[lane]  = fma(mw[j, 8c + lane], xsum[r, 8c + lane], tl[lane]) for chunks c (past G: nothing)
//   y = (acc[0] + ... + acc[7]) + (tl[0] + ... + tl[7])
inline float lanes_sum(const float v[8]) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}

void element_scalar(const uint8_t* w, const uint16_t* mw, const int8_t* qx, const float* xs, const float* xsum,
                    int64_t g_count, float* out) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, tl[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t g = 0; g < g_count; ++g) {
    const uint8_t* blk = w + g * kBlockBytes;
    uint16_t dh;
    std::memcpy(&dh, blk, 2);
    const uint8_t* wb = blk + 2;
    const int8_t* xb = qx + g * kBlock;
    const float scale = _cvtsh_ss(dh) * xs[g];
    for (int lane = 0; lane < 8; ++lane) {
      int dot = 0;
      for (int j = 0; j < 4; ++j) {
        const int i = lane * 4 + j;
        const int q = i < 16 ? (wb[i] & 15) : (wb[i - 16] >> 4);
        dot += q * xb[i];
      }
      acc[lane] = std::fma(static_cast<float>(dot), scale, acc[lane]);
    }
  }
  for (int64_t c = 0; c * 8 < g_count; ++c)
    for (int lane = 0; lane < 8; ++lane) {
      const int64_t g = c * 8 + lane;
      if (g < g_count) tl[lane] = std::fma(_cvtsh_ss(mw[g]), xsum[g], tl[lane]);
    }
  *out = lanes_sum(acc) + lanes_sum(tl);
}

// The tiles, compiled twice: for AVX2 (the file's flags) and for AVX-512 VNNI (a target region), so each
// instantiation inlines its own dot product.
namespace avx2 {
inline __m256i block_dot(__m256i wq, __m256i xq) {  // pairs to int16 (|15 * 127 * 2| fits), quads to int32
  return _mm256_madd_epi16(_mm256_maddubs_epi16(wq, xq), _mm256_set1_epi16(1));
}
constexpr int kRows = 2;  // 16 vector registers: 4 columns x 2 rows of accumulators
#include "q4_tiles.h"
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
namespace vnni {
inline __m256i block_dot(__m256i wq, __m256i xq) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), wq, xq); }
constexpr int kRows = 4;  // 32 vector registers
#include "q4_tiles.h"
}  // namespace vnni
#pragma GCC pop_options

void columns_scalar(const uint8_t* w, const uint16_t* mw, int64_t j_lo, int64_t j_hi, const int8_t* qx, const float* xs,
                    const float* xsum, int64_t m_rows, int64_t k, float* y, int64_t n) {
  const int64_t g_count = k / kBlock;
  for (int64_t r = 0; r < m_rows; ++r)
    for (int64_t j = j_lo; j < j_hi; ++j)
      element_scalar(w + j * g_count * kBlockBytes, mw + j * g_count, qx + r * k, xs + r * g_count, xsum + r * g_count,
                     g_count, y + r * n + j);
}

enum Isa { kScalar = 0, kAvx2 = 1, kVnniIsa = 2 };

Isa best_isa() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw"))
      return kVnniIsa;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
    return kScalar;
  }();
  return isa;
}

}  // namespace

// x (M, K) fp32; w (N, G * 18) uint8: per column, G blocks [d fp16][16 bytes: byte j = q[j] | q[16 + j] << 4];
// mw (N, G) fp16 (w = q * d + mw per block of 32). isa: -1 = the best this CPU has, else 0 scalar / 1 AVX2 /
// 2 AVX-512 VNNI (tests compare them: every path gives the same bits).
torch::Tensor q4_matmul(torch::Tensor x, torch::Tensor w, torch::Tensor mw, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be (M, K) fp32 contiguous");
  const int64_t m_rows = x.size(0), k = x.size(1), g_count = k / kBlock;
  TORCH_CHECK(k % kBlock == 0, "K must be a multiple of 32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.size(1) == g_count * kBlockBytes,
              "w must be (N, K/32 * 18) uint8 contiguous");
  const int64_t n = w.size(0);
  TORCH_CHECK(mw.dim() == 2 && mw.scalar_type() == torch::kFloat16 && mw.is_contiguous() && mw.size(0) == n &&
              mw.size(1) == g_count, "mw must be (N, K/32) fp16 contiguous");
  auto qx = torch::empty({m_rows, k}, x.options().dtype(torch::kInt8));
  auto xs = torch::empty({m_rows, g_count}, x.options());
  auto xsum = torch::empty({m_rows, g_count}, x.options());
  quantize_rows(x.data_ptr<float>(), m_rows, k, qx.data_ptr<int8_t>(), xs.data_ptr<float>(), xsum.data_ptr<float>());
  auto y = torch::empty({m_rows, n}, x.options());
  const Isa use = isa < 0 ? best_isa() : static_cast<Isa>(isa);
  TORCH_CHECK(use <= best_isa(), "this CPU lacks the requested instruction set");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(mw.data_ptr<at::Half>());
  const int8_t* qp = qx.data_ptr<int8_t>();
  const float* sp = xs.data_ptr<float>();
  const float* up = xsum.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t lo, int64_t hi) {
    if (use == kVnniIsa) vnni::columns(wp, mp, lo, hi, qp, sp, up, m_rows, k, yp, n);
    else if (use == kAvx2) avx2::columns(wp, mp, lo, hi, qp, sp, up, m_rows, k, yp, n);
    else columns_scalar(wp, mp, lo, hi, qp, sp, up, m_rows, k, yp, n);
  });
  return y;
}

int64_t q4_best_isa() { return static_cast<int64_t>(best_isa()); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q4_matmul", &q4_matmul, "int4 (Q4_1) x int8-quantized activations -> fp32");
  m.def("best_isa", &q4_best_isa, "0 scalar, 1 AVX2, 2 AVX-512 VNNI");
}
