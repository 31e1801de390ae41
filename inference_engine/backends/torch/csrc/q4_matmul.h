// Int4 weights (Q4_1 groups of 32) x int8-quantized activations, with integer dot products, as llama.cpp does on
// x86: AVX-512 VNNI (vpdpbusd) or AVX2 (vpmaddubsw + vpmaddwd). Included by row_step.cpp. Written for this project.
//
// Why: torch's _weight_int4pack_mm_for_cpu with bf16 activations costs ~2.6x one row's time for 5 rows (a verify
// block) and is far from the weight bytes' memory bound for one. Here a weight block is unpacked once and used for
// every row of the call, so extra rows cost little more than their integer dot products.
//
// Layout ("q4x16"): columns in blocks of 16; for block b and group g (32 inputs) 320 bytes:
//   256 bytes of codes: four 64-byte vectors P_p (p = 0..3); byte 4j + i of P_p holds column j's code for input
//       8p + i in its low nibble and for input 8p + 4 + i in its high nibble (i = 0..3): a 64-byte vector of low
//       (high) nibbles is exactly vpdpbusd's operand for four consecutive inputs of 16 columns;
//   32 bytes: d of the 16 columns (fp16), 32 bytes: m (fp16); the weight is w = q * d + m.
// Activations: per row and group, t = x * 127 / amax, qx1 = round(t) in -127..127 and (planes = 2, the default)
// qx2 = round((t - qx1) * 256) clamped to -127..127: x ~ s * (256 qx1 + qx2) with s = amax / 127 / 256, about 16 bits
// per activation (one plane, int8 as llama.cpp's Q8, measured 98.2 % top-1 agreement with fp32 on SmolLM2, under the
// 99 % gate; two planes pass it: results/research/native_step.json). The integer dot is dot(q, qx1) * 256 +
// dot(q, qx2) (exact in int32, and in float: |.| < 2^24), so a second plane costs its dot products only:
//   y[r, n] = sum_g fma-chain of (float(dot) * (d * s)) then (m * xsum), xsum = s * sum(256 qx1 + qx2).
//
// Outlier channels (optional, `channels`): a few input channels (a linear's largest activations, chosen by
// native.outlier_channels) are taken out of the quantized activations (set to 0 there) and added exactly: after
// each group's integer part, y[r, n] += x[r, c] * w[n, c] for the group's listed c in order, w = fma(q, d, m) decoded
// from the block's own codes (no second copy of any weight). One plane with 16 of them per linear takes half the two
// planes' integer dot products per row; it measured 98.83 % top-1 agreement with fp32 on SmolLM2 (one plane alone
// 98.40 %, two 99.34 %, llama.cpp's own Q8 activations on the same GGUF 97.70 %): under the 99 % gate, so the daemon
// takes it only with --activations int8 (native.PLANES = 2 is the default; scripts/research/native_step.py --outliers 16
// --llama-cpp -> results/research/native_step_llama_cpp_quality_avx2.json). Per extra row the channels add about a
// third to the layers' one-plane matmul time (results/research/verify_split_avx2.json: 1.56 vs 1.19 ms).
//
// Exactness: integer dot products are exact, and every output element goes through the same float operations in
// the same order whatever the number of rows, the row's place in the call, the thread or the ISA (AVX-512 and
// AVX2 give the same bits: tests/backends/test_native_step.py). So rows are independent: a verify block's rows
// equal one-row calls, a session batched with others gets what it gets alone.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KAKEYA_X86 1
#else
#define KAKEYA_X86 0
#endif

namespace q4 {

constexpr int64_t kCols = 16, kGroup = 32, kCodeBytes = 256, kBlockBytes = 320;
enum Isa : int64_t { kNone = 0, kAvx2 = 1, kVnni512 = 2 };

inline Isa best_isa() {
#if KAKEYA_X86
  static const Isa isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni"))
      return kVnni512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return kAvx2;
    return kNone;
  }();
  return isa;
#else
  return kNone;
#endif
}

// codes (N, K) uint8 0..15, d and m (N, K/32) fp32 -> (N/16, K/32, 320) uint8
inline at::Tensor pack(const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte, "q4 pack: codes must be (N, K) uint8");
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(n % kCols == 0 && k % kGroup == 0, "q4 pack: N must be a multiple of 16 and K of 32");
  auto c = codes.contiguous();
  auto df = d.to(at::kFloat).contiguous(), mf = m.to(at::kFloat).contiguous();
  const int64_t groups = k / kGroup;
  auto out = at::empty({n / kCols, groups, kBlockBytes}, codes.options().dtype(at::kByte));
  const uint8_t* cp = c.data_ptr<uint8_t>();
  const float* dp = df.data_ptr<float>();
  const float* mp = mf.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  for (int64_t b = 0; b < n / kCols; ++b)
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* blk = op + (b * groups + g) * kBlockBytes;
      for (int p = 0; p < 4; ++p)
        for (int j = 0; j < kCols; ++j)
          for (int i = 0; i < 4; ++i) {
            const uint8_t* col = cp + (b * kCols + j) * k + g * kGroup;
            blk[p * 64 + 4 * j + i] = static_cast<uint8_t>((col[8 * p + i] & 15) | ((col[8 * p + 4 + i] & 15) << 4));
          }
      auto* dh = reinterpret_cast<c10::Half*>(blk + kCodeBytes);
      auto* mh = reinterpret_cast<c10::Half*>(blk + kCodeBytes + 32);
      for (int j = 0; j < kCols; ++j) {
        dh[j] = c10::Half(dp[(b * kCols + j) * groups + g]);
        mh[j] = c10::Half(mp[(b * kCols + j) * groups + g]);
      }
    }
  return out;
}

#if KAKEYA_X86
// quantize()'s group in AVX2 vectors, the same operations lane by lane (max is exact in any order, vroundps with
// _MM_FROUND_TO_NEAREST_INT is rintf in the default rounding mode, the integer sum is exact), so the same bits: the
// scalar loop cost about a quarter of the kernel's time on an AVX2 CPU (it does not vectorize).
template <int P>
__attribute__((target("avx2,fma"))) inline void quantize_group_avx2(const float* src, int64_t k, int8_t* dst,
                                                                    float* xs, float* xsum) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4], top = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(src + 8 * i);
    top = _mm256_max_ps(top, _mm256_and_ps(v[i], abs_mask));
  }
  __m128 t4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  t4 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
  t4 = _mm_max_ss(t4, _mm_shuffle_ps(t4, t4, 1));
  const float amax = _mm_cvtss_f32(t4);
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m256 hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f), k256 = _mm256_set1_ps(256.f);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  __m256i q1[4], q2[4], sum = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    const __m256 t = _mm256_mul_ps(v[i], inv);
    const __m256 a = _mm256_min_ps(_mm256_max_ps(_mm256_round_ps(t, kRound), lo), hi);
    q1[i] = _mm256_cvtps_epi32(a);
    __m256i whole = q1[i];
    if (P == 2) {
      const __m256 b = _mm256_min_ps(_mm256_max_ps(_mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(t, a), k256), kRound), lo), hi);
      q2[i] = _mm256_cvtps_epi32(b);
      whole = _mm256_add_epi32(_mm256_slli_epi32(whole, 8), q2[i]);
    }
    sum = _mm256_add_epi32(sum, whole);
  }
  // 4 x 8 int32 in -127..127 -> 32 int8 in order (the packs interleave 128-bit lanes; the permute undoes it)
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  auto narrow = [&](const __m256i* q) {
    const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    return _mm256_permutevar8x32_epi32(b, order);
  };
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), narrow(q1));
  if (P == 2) _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + k), narrow(q2));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  *xs = P == 2 ? amax / 127.f / 256.f : amax / 127.f;
  *xsum = *xs * static_cast<float>(_mm_cvtsi128_si32(s4));
}
#endif

// x (M, K) fp32 -> qx (M, planes, K) int8, xs (M, G), xsum (M, G)
inline void quantize(const float* x, int64_t rows, int64_t k, int planes, int8_t* qx, float* xs, float* xsum) {
  const int64_t groups = k / kGroup;
#if KAKEYA_X86
  if (best_isa() != kNone) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const float* src = x + r * k + g * kGroup;
        int8_t* dst = qx + r * planes * k + g * kGroup;
        if (planes == 2) quantize_group_avx2<2>(src, k, dst, xs + r * groups + g, xsum + r * groups + g);
        else quantize_group_avx2<1>(src, k, dst, xs + r * groups + g, xsum + r * groups + g);
      }
    return;
  }
#endif
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float* src = x + r * k + g * kGroup;
      float amax = 0.f;
      for (int i = 0; i < kGroup; ++i) {
        const float a = src[i] < 0.f ? -src[i] : src[i];
        amax = a > amax ? a : amax;
      }
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* dst = qx + r * planes * k + g * kGroup;
      int sum = 0;
      for (int i = 0; i < kGroup; ++i) {  // round half to even (rint in the default rounding mode)
        const float t = src[i] * inv;
        float q1 = __builtin_rintf(t);
        q1 = q1 > 127.f ? 127.f : (q1 < -127.f ? -127.f : q1);
        dst[i] = static_cast<int8_t>(q1);
        int whole = static_cast<int>(q1);
        if (planes == 2) {
          float q2 = __builtin_rintf((t - q1) * 256.f);
          q2 = q2 > 127.f ? 127.f : (q2 < -127.f ? -127.f : q2);
          dst[k + i] = static_cast<int8_t>(q2);
          whole = whole * 256 + static_cast<int>(q2);
        }
        sum += whole;
      }
      xs[r * groups + g] = planes == 2 ? amax / 127.f / 256.f : amax / 127.f;
      xsum[r * groups + g] = xs[r * groups + g] * static_cast<float>(sum);
    }
}

// Bytes ahead of the block being computed that the kernels prefetch (0 = none): a step's weights are streamed from
// memory once (they do not fit the caches), and the prefetches keep that stream going while the rows' dot products
// run, so a call's time is nearer max(memory, compute) than their sum. 2 KB measured best on an AVX-512 EPYC (1
// thread, SmolLM2's 30 layers, weights streamed: 5 rows 14.4 -> 9.3 ms, 1 row unchanged; 1 and 3 KB less good;
// scripts/research/native_step.py --prefetch). Prefetches never change a result's bits.
inline int64_t& prefetch_ahead() {
  static int64_t bytes = 2048;
  return bytes;
}

#if KAKEYA_X86
constexpr int kRowTile = 8;

// input i (0..31) of a group: its code is in vector P_(i / 8), byte 4j + i % 4 of column j's lane, the high nibble for
// i % 8 >= 4 (the layout at the top): shifted down by this within each 32-bit lane
inline int code_shift(int i) { return (i & 3) * 8 + ((i >> 2) & 1) * 4; }

inline void prefetch_lines(const uint8_t* at) {  // one block's worth of lines from `at`
  for (int line = 0; line < kBlockBytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(at + line), _MM_HINT_T0);
}

inline void prefetch_block(const uint8_t* blk, int64_t ahead) {
  if (ahead) prefetch_lines(blk + ahead);
}

// Whether block_avx2's second pass over a block of 16 columns (its columns 8..15, over weights the first pass brought
// into L1) prefetches the next block's weights (1, the default) or nothing (0: before; research scripts time it). The
// first pass streams a block from memory and the second computes from cache: without it no load was in flight while
// the second pass ran, and a decode row's matmuls took 1.24-1.28x the longer of their arithmetic and their memory reads
// (scripts/research/avx2_roofline.py, `layers`; a one-row call now takes row_avx2's single pass). Prefetches never
// change a result's bits.
inline int64_t& prefetch_next() {
  static int64_t on = 1;
  return on;
}

// Group g of a block of 16 columns for the AVX-512 kernels: its codes as vpdpbusd's unsigned operands (wq[2p] the low
// nibbles of vector P_p: inputs 8p..8p+3; wq[2p + 1] the high ones: 8p+4..8p+7), its d and m, and its outlier channels
// [c0, c1) with their weights q * d + m (one fma) decoded from the block's own codes into wf.
__attribute__((target("avx512f,avx512bw,avx512vnni,fma,f16c"), always_inline)) inline void group_vnni(
    const uint8_t* blk, int64_t g, const int64_t* ch, const int64_t* gfirst, int64_t nc, __m512i* wq, __m512& d,
    __m512& m, float* wf, int64_t& c0, int64_t& c1) {
  const __m512i lo_mask = _mm512_set1_epi8(15);
  for (int p = 0; p < 4; ++p) {
    const __m512i v = _mm512_loadu_si512(blk + p * 64);
    wq[2 * p] = _mm512_and_si512(v, lo_mask);
    wq[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo_mask);
  }
  d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kCodeBytes)));
  m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kCodeBytes + 32)));
  c0 = nc ? gfirst[g] : 0, c1 = nc ? gfirst[g + 1] : 0;
  for (int64_t ci = c0; ci < c1; ++ci) {
    const int i = static_cast<int>(ch[ci] - g * kGroup);
    const __m512i v = _mm512_loadu_si512(blk + (i >> 3) * 64);
    const __m512i q = _mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(code_shift(i))), _mm512_set1_epi32(15));
    _mm512_store_ps(wf + (ci - c0) * kCols, _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d, m));
  }
}

// A row's group into its sums: acc + float(dot) * (d * s), then + m * (s * sum) (the same two fmas on every path).
__attribute__((target("avx512f,fma"), always_inline)) inline __m512 add_group(__m512 acc, __m512i dot, __m512 d, __m512 m,
                                                                           float s, float t) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(s)), acc);
  return _mm512_fmadd_ps(m, _mm512_set1_ps(t), acc);
}

// Then the group's outlier channels [c0, c1), exactly, in order, for rows r0 .. r0 + nr (rows inside: their sums are
// independent chains): acc[r] += x[r, c] * w[c] with the weights group_vnni decoded into wf.
__attribute__((target("avx512f,fma"), always_inline)) inline void add_outliers(__m512* acc, int64_t nr, int64_t r0,
                                                                            const float* wf, const float* xo, int64_t nc,
                                                                            int64_t c0, int64_t c1) {
  for (int64_t ci = c0; ci < c1; ++ci) {
    const __m512 wv = _mm512_load_ps(wf + (ci - c0) * kCols);
    for (int64_t r = 0; r < nr; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xo[(r0 + r) * nc + ci]), wv, acc[r]);
  }
}

template <int P>
__attribute__((target("avx512f,avx512bw,avx512vnni,fma,f16c"))) inline void block_vnni(
    const uint8_t* w, int64_t groups, const int8_t* qx, const float* xs, const float* xsum, int64_t rows, int64_t k,
    float* y, int64_t n, int64_t col0, int64_t ahead, const float* xo, const int64_t* ch, const int64_t* gfirst,
    int64_t nc) {
  for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
    const int64_t nr = rows - r0 < kRowTile ? rows - r0 : kRowTile;
    __m512 acc[kRowTile];
    for (int r = 0; r < kRowTile; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* blk = w + g * kBlockBytes;
      if (r0 == 0) prefetch_block(blk, ahead);
      __m512i wq[8];
      __m512 d, m;
      alignas(64) float wf[kGroup * kCols];
      int64_t c0, c1;
      group_vnni(blk, g, ch, gfirst, nc, wq, d, m, wf, c0, c1);
      for (int r = 0; r < nr; ++r) {
        const int8_t* xr = qx + (r0 + r) * P * k + g * kGroup;
        __m512i dot = _mm512_setzero_si512();
        for (int plane = 0; plane < P; ++plane) {
          if (plane) dot = _mm512_slli_epi32(dot, 8);  // the first plane's dot * 256, then the second's added
          for (int c = 0; c < 8; ++c) {  // chunk c: inputs 4c..4c+3 = wq[(c / 2) * 2 + c % 2] (p = c / 2, high = c % 2)
            int32_t four;
            std::memcpy(&four, xr + plane * k + 4 * c, 4);
            dot = _mm512_dpbusd_epi32(dot, wq[c], _mm512_set1_epi32(four));
          }
        }
        acc[r] = add_group(acc[r], dot, d, m, xs[(r0 + r) * groups + g], xsum[(r0 + r) * groups + g]);
      }
      add_outliers(acc, nr, r0, wf, xo, nc, c0, c1);
    }
    for (int r = 0; r < nr; ++r) _mm512_storeu_ps(y + (r0 + r) * n + col0, acc[r]);
  }
}

// Whether block_vnni runs its rows in tiles of exactly NR rows (1, the default) or in the loop above (0: before;
// research scripts time it). The loop's integer dot of a row is one chain of 8 (one plane) or 16 (two) vpdpbusd, each
// waiting on the one before, and its tile of rows a runtime count, so the rows' sums went through memory: a decode row
// waited on that chain's latency and a verify block's rows overlapped only as far as the CPU reordered them. A tile of
// NR rows (a template) keeps its sums in registers, interleaves its rows' chains (chunk by chunk, every row), and
// splits each chain of a tile under 4 rows in two by chunk parity, then adds the halves: integer sums, exact in any
// order (|.| < 2^24), so every output element gets the same value and then the same float operations in the same
// order. The same bits either way (tests/backends/test_native_step.py).
inline int64_t& vnni_tiles() {
  static int64_t on = 1;
  return on;
}

template <int P, int NR>
__attribute__((target("avx512f,avx512bw,avx512vnni,fma,f16c"))) inline void tile_vnni(
    const uint8_t* w, int64_t groups, const int8_t* qx, const float* xs, const float* xsum, int64_t r0, int64_t k,
    float* y, int64_t n, int64_t col0, int64_t ahead, const float* xo, const int64_t* ch, const int64_t* gfirst,
    int64_t nc) {
  constexpr int S = NR < 4 ? 2 : 1;  // chains per row and plane
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* blk = w + g * kBlockBytes;
    if (r0 == 0) prefetch_block(blk, ahead);
    __m512i wq[8];
    __m512 d, m;
    alignas(64) float wf[kGroup * kCols];
    int64_t c0, c1;
    group_vnni(blk, g, ch, gfirst, nc, wq, d, m, wf, c0, c1);
    __m512i dot[NR];
    for (int plane = 0; plane < P; ++plane) {
      __m512i part[NR][S];
      for (int r = 0; r < NR; ++r)
        for (int s = 0; s < S; ++s) part[r][s] = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c)
        for (int r = 0; r < NR; ++r) {
          int32_t four;
          std::memcpy(&four, qx + (r0 + r) * P * k + plane * k + g * kGroup + 4 * c, 4);
          part[r][c % S] = _mm512_dpbusd_epi32(part[r][c % S], wq[c], _mm512_set1_epi32(four));
        }
      for (int r = 0; r < NR; ++r) {
        const __m512i sum = S == 2 ? _mm512_add_epi32(part[r][0], part[r][S - 1]) : part[r][0];
        dot[r] = plane ? _mm512_add_epi32(_mm512_slli_epi32(dot[r], 8), sum) : sum;
      }
    }
    for (int r = 0; r < NR; ++r)
      acc[r] = add_group(acc[r], dot[r], d, m, xs[(r0 + r) * groups + g], xsum[(r0 + r) * groups + g]);
    add_outliers(acc, NR, r0, wf, xo, nc, c0, c1);
  }
  for (int r = 0; r < NR; ++r) _mm512_storeu_ps(y + (r0 + r) * n + col0, acc[r]);
}

template <int P>
__attribute__((target("avx512f,avx512bw,avx512vnni,fma,f16c"))) inline void tiles_vnni(
    const uint8_t* w, int64_t groups, const int8_t* qx, const float* xs, const float* xsum, int64_t rows, int64_t k,
    float* y, int64_t n, int64_t col0, int64_t ahead, const float* xo, const int64_t* ch, const int64_t* gfirst,
    int64_t nc) {
  for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
    const int64_t nr = rows - r0 < kRowTile ? rows - r0 : kRowTile;
#define KAKEYA_TILE(R) \
  case R: tile_vnni<P, R>(w, groups, qx, xs, xsum, r0, k, y, n, col0, ahead, xo, ch, gfirst, nc); break;
    switch (nr) {
      KAKEYA_TILE(1) KAKEYA_TILE(2) KAKEYA_TILE(3) KAKEYA_TILE(4) KAKEYA_TILE(5) KAKEYA_TILE(6) KAKEYA_TILE(7)
      default: tile_vnni<P, kRowTile>(w, groups, qx, xs, xsum, r0, k, y, n, col0, ahead, xo, ch, gfirst, nc);
    }
#undef KAKEYA_TILE
  }
}

// Half `half` (8 columns) of a group's codes as vpmaddubsw's unsigned operands: wq[2p] the low nibbles of vector P_p
// (inputs 8p..8p+3), wq[2p + 1] the high ones (inputs 8p+4..8p+7).
__attribute__((target("avx2"), always_inline)) inline void unpack_half(const uint8_t* blk, int half, __m256i* wq) {
  const __m256i lo_mask = _mm256_set1_epi8(15);
  for (int p = 0; p < 4; ++p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + p * 64 + half * 32));
    wq[2 * p] = _mm256_and_si256(v, lo_mask);
    wq[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo_mask);
  }
}

// One row's integer dot over a group with 8 columns' codes wq, its P planes at xr (plane p at xr + p * k): u8 x s8 pairs
// into int16 (vpmaddubsw), the 8 chunks' pairs added in int16 (exact: |sum| <= 8 * 2 * 15 * 127 = 30480 < 2^15), then
// pairs of those into int32 once (vpmaddwd): the integer sums vpdpbusd makes, with one widening per plane instead of
// one per chunk (AVX2 CPUs are bound by these vector ops); the first plane's dot * 256 plus the second's.
template <int P>
__attribute__((target("avx2"), always_inline)) inline __m256i row_dot(const __m256i* wq, const int8_t* xr, int64_t k) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i dot = _mm256_setzero_si256();
  for (int plane = 0; plane < P; ++plane) {
    __m256i sv[8];
    for (int c = 0; c < 8; ++c) {
      int32_t four;
      std::memcpy(&four, xr + plane * k + 4 * c, 4);
      sv[c] = _mm256_maddubs_epi16(wq[c], _mm256_set1_epi32(four));
    }
    const __m256i t = _mm256_add_epi16(_mm256_add_epi16(_mm256_add_epi16(sv[0], sv[1]), _mm256_add_epi16(sv[2], sv[3])),
                                       _mm256_add_epi16(_mm256_add_epi16(sv[4], sv[5]), _mm256_add_epi16(sv[6], sv[7])));
    const __m256i p32 = _mm256_madd_epi16(t, ones);
    dot = plane ? _mm256_add_epi32(_mm256_slli_epi32(dot, 8), p32) : p32;
  }
  return dot;
}

// Outlier input i (0..31) of a group: its weights q * d + m for the half's 8 columns (one fma, as the AVX-512 path),
// decoded from the block's own codes.
__attribute__((target("avx2,fma"), always_inline)) inline __m256 outlier_weights(const uint8_t* blk, int i, int half,
                                                                                 __m256 d, __m256 m) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (i >> 3) * 64 + half * 32));
  const __m256i q = _mm256_and_si256(_mm256_srl_epi32(v, _mm_cvtsi32_si128(code_shift(i))), _mm256_set1_epi32(15));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m);
}

// Whether block_avx2 runs a tile of exactly one row as tile_avx2<P, 1> (1, the default) or as the general tile (0):
// a research toggle (row_step.cpp q4_row_registers); the same bits either way.
inline int64_t& row_registers() {
  static int64_t on = 1;
  return on;
}

// One tile of rows (r0 .. r0 + nr) over one half (8 columns) of a block of 16 columns. NR > 0: exactly NR rows, so
// their sums live in registers (a decode step's one row: its chain of fmas over the groups no longer goes through
// memory); NR = 0: nr rows, up to kRowTile. Every element gets the same float operations in the same order either way.
template <int P, int NR>
__attribute__((target("avx2,fma,f16c"))) inline void tile_avx2(const uint8_t* w, int64_t groups, const int8_t* qx,
                                                                 const float* xs, const float* xsum, int64_t k, float* y,
                                                                 int64_t n, int64_t col0, int64_t ahead, const float* xo,
                                                                 const int64_t* ch, const int64_t* gfirst, int64_t nc,
                                                                 int half, int64_t r0, int64_t nr_runtime, int64_t next) {
  const int64_t nr = NR ? NR : nr_runtime;
  __m256 acc[NR ? NR : kRowTile];
  for (int r = 0; r < (NR ? NR : kRowTile); ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* blk = w + g * kBlockBytes;
    if (half == 0 && r0 == 0) prefetch_block(blk, ahead);
    else if (next && r0 == 0) prefetch_lines(blk + next);  // the second pass: the next block's same group
    __m256i wq[8];
    unpack_half(blk, half, wq);
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kCodeBytes + half * 16)));
    const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kCodeBytes + 32 + half * 16)));
    // this group's outlier channels: their weights q * d + m (one fma, as the AVX-512 path) from the block's codes
    const int64_t c0 = nc ? gfirst[g] : 0, c1 = nc ? gfirst[g + 1] : 0;
    alignas(32) float wf[kGroup * 8];
    for (int64_t ci = c0; ci < c1; ++ci)
      _mm256_store_ps(wf + (ci - c0) * 8, outlier_weights(blk, static_cast<int>(ch[ci] - g * kGroup), half, d, m));
    for (int r = 0; r < nr; ++r) {
      const __m256i dot = row_dot<P>(wq, qx + (r0 + r) * P * k + g * kGroup, k);
      const float s = xs[(r0 + r) * groups + g], t = xsum[(r0 + r) * groups + g];
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(s)), acc[r]);
      acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(t), acc[r]);
    }
    for (int64_t ci = c0; ci < c1; ++ci) {  // then the group's outlier channels, exactly, in order (rows inside:
      const __m256 wv = _mm256_load_ps(wf + (ci - c0) * 8);  // their sums are independent chains)
      for (int r = 0; r < nr; ++r) acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(xo[(r0 + r) * nc + ci]), wv, acc[r]);
    }
  }
  for (int r = 0; r < nr; ++r) _mm256_storeu_ps(y + (r0 + r) * n + col0 + half * 8, acc[r]);
}

// Whether a call of exactly one row (a decode step's matmuls) runs both halves of each group in one pass over the
// block (1, the default: each weight line is read from memory once and used at once) or half by half (0: two passes,
// tile_avx2<P, 1>; research scripts time it). Every element gets the same float operations in the same order.
inline int64_t& one_pass_row() {
  static int64_t on = 1;
  return on;
}

// One row, both halves (16 columns) of a block of 16 columns, group by group: tile_avx2<P, 1>'s arithmetic for each
// half, interleaved by group, so the block's weights stream from memory once, in order, while they are used.
template <int P>
__attribute__((target("avx2,fma,f16c"))) inline void row_avx2(const uint8_t* w, int64_t groups, const int8_t* qx,
                                                                const float* xs, const float* xsum, int64_t k, float* y,
                                                                int64_t col0, int64_t ahead, const float* xo,
                                                                const int64_t* ch, const int64_t* gfirst, int64_t nc) {
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* blk = w + g * kBlockBytes;
    prefetch_block(blk, ahead);
    const int8_t* xr = qx + g * kGroup;
    const float s = xs[g], t = xsum[g];
    const int64_t c0 = nc ? gfirst[g] : 0, c1 = nc ? gfirst[g + 1] : 0;
    for (int half = 0; half < 2; ++half) {
      __m256i wq[8];
      unpack_half(blk, half, wq);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kCodeBytes + half * 16)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kCodeBytes + 32 + half * 16)));
      const __m256i dot = row_dot<P>(wq, xr, k);
      acc[half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, _mm256_set1_ps(s)), acc[half]);
      acc[half] = _mm256_fmadd_ps(m, _mm256_set1_ps(t), acc[half]);
      for (int64_t ci = c0; ci < c1; ++ci)  // the group's outlier channels, exactly, in order (as tile_avx2)
        acc[half] = _mm256_fmadd_ps(_mm256_set1_ps(xo[ci]),
                                    outlier_weights(blk, static_cast<int>(ch[ci] - g * kGroup), half, d, m), acc[half]);
    }
  }
  _mm256_storeu_ps(y + col0, acc[0]);
  _mm256_storeu_ps(y + col0 + 8, acc[1]);
}

template <int P>
__attribute__((target("avx2,fma,f16c"))) inline void block_avx2(const uint8_t* w, int64_t groups, const int8_t* qx,
                                                                  const float* xs, const float* xsum, int64_t rows,
                                                                  int64_t k, float* y, int64_t n, int64_t col0,
                                                                  int64_t ahead, const float* xo, const int64_t* ch,
                                                                  const int64_t* gfirst, int64_t nc, int64_t next) {
  if (rows == 1 && one_pass_row() && row_registers()) {
    row_avx2<P>(w, groups, qx, xs, xsum, k, y, col0, ahead, xo, ch, gfirst, nc);
    return;
  }
  for (int half = 0; half < 2; ++half)  // columns 8 * half .. 8 * half + 7: the 32-byte halves of each vector
    for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
      const int64_t nr = rows - r0 < kRowTile ? rows - r0 : kRowTile;
      if (nr == 1 && row_registers())
        tile_avx2<P, 1>(w, groups, qx, xs, xsum, k, y, n, col0, ahead, xo, ch, gfirst, nc, half, r0, 1, next);
      else
        tile_avx2<P, 0>(w, groups, qx, xs, xsum, k, y, n, col0, ahead, xo, ch, gfirst, nc, half, r0, nr, next);
    }
}
#endif

// x (M, K) fp32 -> (planes (M, P, K) int8, scales (2, M, K/32) fp32: per group the scale s, then s * sum)
inline std::pair<at::Tensor, at::Tensor> quantize(const at::Tensor& x, int64_t planes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % kGroup == 0,
              "q4 quantize: x must be (M, K) fp32, K a multiple of 32");
  TORCH_CHECK(planes == 1 || planes == 2, "q4 quantize: planes must be 1 or 2");
  auto xc = x.contiguous();
  const int64_t rows = x.size(0), k = x.size(1), groups = k / kGroup;
  auto qx = at::empty({rows, planes, k}, x.options().dtype(at::kChar));
  auto scales = at::empty({2, rows, groups}, x.options());
  quantize(xc.data_ptr<float>(), rows, k, static_cast<int>(planes), qx.data_ptr<int8_t>(), scales.data_ptr<float>(),
           scales.data_ptr<float>() + rows * groups);
  return {qx, scales};
}

// x (M, K) fp32 contiguous, w from pack() for N columns -> y (M, N) fp32. isa: kNone picks the best this CPU has;
// planes: 2 (~16-bit activations) or 1 (int8: the layers with outlier channels, the head's approximate greedy
// scoring). channels (C,) int64, ascending: outlier channels (see the top), or undefined / empty for none.
inline at::Tensor matmul(const at::Tensor& x, const at::Tensor& w, int64_t isa = kNone, int64_t planes = 2,
                         const at::Tensor& channels = {}) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "q4 matmul: x must be (M, K) fp32");
  TORCH_CHECK(w.dim() == 3 && w.size(2) == kBlockBytes, "q4 matmul: w must come from q4 pack");
  const int64_t rows = x.size(0), k = x.size(1), groups = w.size(1), n = w.size(0) * kCols;
  TORCH_CHECK(groups * kGroup == k, "q4 matmul: x has ", k, " inputs, the weights ", groups * kGroup);
  const Isa use = isa == kNone ? best_isa() : static_cast<Isa>(isa);
  TORCH_CHECK(use != kNone && use <= best_isa(), "q4 matmul: this CPU lacks AVX2 (or the ISA asked for)");
  TORCH_CHECK(planes == 1 || planes == 2, "q4 matmul: planes must be 1 or 2");
  const int64_t nc = channels.defined() ? channels.numel() : 0;
  const auto xc = x.contiguous();
  const float* xin = xc.data_ptr<float>();
  std::vector<float> rest, xo;  // with outlier channels: x without them (zeros there), and them (M, C), exact
  std::vector<int64_t> gfirst;  // per group, the first of its channels (groups + 1)
  const int64_t* ch = nullptr;
  if (nc) {
    TORCH_CHECK(channels.dim() == 1 && channels.scalar_type() == at::kLong && channels.is_contiguous(),
                "q4 matmul: channels must be (C,) int64");
    ch = channels.data_ptr<int64_t>();
    for (int64_t c = 0; c < nc; ++c)
      TORCH_CHECK(ch[c] >= 0 && ch[c] < k && (c == 0 || ch[c] > ch[c - 1]),
                  "q4 matmul: channels must be ascending input indices, got ", ch[c], " at ", c);
    gfirst.assign(groups + 1, nc);
    for (int64_t c = nc - 1; c >= 0; --c)
      for (int64_t g = ch[c] / kGroup; g >= 0 && gfirst[g] > c; --g) gfirst[g] = c;
    rest.assign(xin, xin + rows * k);
    xo.resize(rows * nc);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < nc; ++c) {
        xo[r * nc + c] = rest[r * k + ch[c]];
        rest[r * k + ch[c]] = 0.f;
      }
    xin = rest.data();
  }
  auto qx = at::empty({rows, planes, k}, x.options().dtype(at::kChar));
  auto scales = at::empty({2, rows, groups}, x.options());
  quantize(xin, rows, k, static_cast<int>(planes), qx.data_ptr<int8_t>(), scales.data_ptr<float>(),
           scales.data_ptr<float>() + rows * groups);
  const float* xs = scales.data_ptr<float>();
  const float* xsum = xs + rows * groups;
  auto y = at::empty({rows, n}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int8_t* qp = qx.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = n / kCols;
  const float* xop = nc ? xo.data() : nullptr;
  const int64_t* gp = nc ? gfirst.data() : nullptr;
#if KAKEYA_X86
  // grain: a thread takes at least 16 column blocks (small matrices stay on one thread)
  const int64_t ahead = prefetch_ahead();
  at::parallel_for(0, blocks, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const uint8_t* wb = wp + b * groups * kBlockBytes;
      // the last blocks of the thread's range prefetch no further than the weights' end
      const int64_t pf = (hi - b) * groups * kBlockBytes > ahead + kBlockBytes ? ahead : 0;
      const int64_t next = b + 1 < hi && prefetch_next() ? groups * kBlockBytes : 0;  // the next block of this thread's
      if (use == kVnni512 && vnni_tiles()) {
        if (planes == 2) tiles_vnni<2>(wb, groups, qp, xs, xsum, rows, k, yp, n, b * kCols, pf, xop, ch, gp, nc);
        else tiles_vnni<1>(wb, groups, qp, xs, xsum, rows, k, yp, n, b * kCols, pf, xop, ch, gp, nc);
      } else if (use == kVnni512 && planes == 2) block_vnni<2>(wb, groups, qp, xs, xsum, rows, k, yp, n, b * kCols, pf, xop, ch, gp, nc);
      else if (use == kVnni512) block_vnni<1>(wb, groups, qp, xs, xsum, rows, k, yp, n, b * kCols, pf, xop, ch, gp, nc);
      else if (planes == 2) block_avx2<2>(wb, groups, qp, xs, xsum, rows, k, yp, n, b * kCols, pf, xop, ch, gp, nc, next);
      else block_avx2<1>(wb, groups, qp, xs, xsum, rows, k, yp, n, b * kCols, pf, xop, ch, gp, nc, next);
    }
  });
#endif
  return y;
}

}  // namespace q4
