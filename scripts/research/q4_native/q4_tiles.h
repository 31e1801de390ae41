// Included by q4_matmul.cpp (scripts/research/q4_native) inside a namespace that defines block_dot() and kRows (one copy per ISA).
// Weights: per column j, G blocks of 18 bytes [d fp16][16 bytes of codes]; mw (N, G) fp16.

inline __m256i unpack_codes(const uint8_t* wb) {  // 16 bytes -> 32 codes in order (lo nibbles, then hi)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb));
  const __m128i mask = _mm_set1_epi8(15);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), mask), _mm_and_si128(v, mask));
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m256 tail_chunk(const uint16_t* mw, const float* xsum, int64_t c, int64_t g_count, __m256 acc) {
  const int64_t left = g_count - c * 8;
  if (left >= 8)
    return _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mw + c * 8))),
                           _mm256_loadu_ps(xsum + c * 8), acc);
  alignas(16) uint16_t hm[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  alignas(32) float xm[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < left; ++i) {
    hm[i] = mw[c * 8 + i];
    xm[i] = xsum[c * 8 + i];
  }
  return _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(hm))), _mm256_load_ps(xm), acc);
}

// NC weight columns x NR activation rows over every block of K: a weight block is unpacked once per NR rows.
template <int NC, int NR>
inline void tile(const uint8_t* w, const uint16_t* mw, int64_t j0, const int8_t* qx, const float* xs, const float* xsum,
                 int64_t r0, int64_t k, float* y, int64_t n) {
  const int64_t g_count = k / kBlock;
  const int64_t row_bytes = g_count * kBlockBytes;
  __m256 acc[NC][NR];
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < NR; ++r) acc[c][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < g_count; ++g) {
    __m256i xq[NR];
    __m256 xsv[NR];
    for (int r = 0; r < NR; ++r) {
      xq[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + (r0 + r) * k + g * kBlock));
      xsv[r] = _mm256_set1_ps(xs[(r0 + r) * g_count + g]);
    }
    for (int c = 0; c < NC; ++c) {
      const uint8_t* blk = w + (j0 + c) * row_bytes + g * kBlockBytes;
      const __m256i wq = unpack_codes(blk + 2);
      const __m256 dv = _mm256_set1_ps(half_to_float(blk));
      for (int r = 0; r < NR; ++r)
        acc[c][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot(wq, xq[r])), _mm256_mul_ps(dv, xsv[r]), acc[c][r]);
    }
  }
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < NR; ++r) {
      __m256 tl = _mm256_setzero_ps();
      for (int64_t ch = 0; ch * 8 < g_count; ++ch)
        tl = tail_chunk(mw + (j0 + c) * g_count, xsum + (r0 + r) * g_count, ch, g_count, tl);
      alignas(32) float a[8], t[8];
      _mm256_store_ps(a, acc[c][r]);
      _mm256_store_ps(t, tl);
      y[(r0 + r) * n + j0 + c] = lanes_sum(a) + lanes_sum(t);
    }
}

// Columns [j_lo, j_hi) of every row: tiles of 4 columns x kRows rows, then the rest.
inline void columns(const uint8_t* w, const uint16_t* mw, int64_t j_lo, int64_t j_hi, const int8_t* qx, const float* xs,
                    const float* xsum, int64_t m_rows, int64_t k, float* y, int64_t n) {
  int64_t r0 = 0;
  for (; r0 + kRows <= m_rows; r0 += kRows) {
    int64_t j = j_lo;
    for (; j + 4 <= j_hi; j += 4) tile<4, kRows>(w, mw, j, qx, xs, xsum, r0, k, y, n);
    for (; j < j_hi; ++j) tile<1, kRows>(w, mw, j, qx, xs, xsum, r0, k, y, n);
  }
  for (; r0 < m_rows; ++r0) {
    int64_t j = j_lo;
    for (; j + 4 <= j_hi; j += 4) tile<4, 1>(w, mw, j, qx, xs, xsum, r0, k, y, n);
    for (; j < j_hi; ++j) tile<1, 1>(w, mw, j, qx, xs, xsum, r0, k, y, n);
  }
}
