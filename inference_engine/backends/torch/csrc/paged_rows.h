// Paged recall for every row of a paged step (decode rows, verify blocks, prefill chunks, each as the one-token step at
// its position) in one call per layer: kv/paged.py's page choice
// (compact keys scored, through the page bounds' shortlist past `shortlist_from` pages), its reads of the chosen pages
// from either tier of the page store, and the row's attention over them and the resident slab, one softmax. Past the
// trained context a row chooses through far_keys with its query rotated to far_distance, and attends in InfLLM's
// layout (its pages in position order right before its window, the sink right before them; the query counter-rotated
// once per page instead of the page's keys rotated), as kv/paged.py's `_far_row` does.
//
// Included by row_step.cpp inside its namespace, after the attention chunks (attend_chunk_any, merge_chunks) and the
// compact keys' scoring (score_keys_any) it reuses. Every row's arithmetic is its own and does not depend on the
// other rows of the call or on the threads: a verify block's rows equal the one-token steps at their positions bit
// for bit, and a row that recalls nothing (its candidates all in its window) attends exactly as the whole-step call
// (RowStep::run) does: the same chunks of the slab, merged in the same order.
//
// Written for this project (no code from elsewhere).

// One payload of a paged row table (kv/paged_store.SpillingRowTable) for every layer: its RAM ring (L, S, Hkv, cap,
// ...) and its spill file (pages, L, S, Hkv, P, ...); `at` finds row r of (layer, s, head) where the table keeps it.
// A page's P rows are contiguous in either tier.
struct PagedTier {
  const uint8_t* ring = nullptr;
  const uint8_t* file = nullptr;
  int64_t L = 0, S = 0, Hkv = 0, cap = 0, width = 0, P = 0, rows = 0, cold_pages = 0, wrap = 0;

  PagedTier() = default;
  // rows: the table's rows; cold: pages in the spill file; wrap: the ring's size once rows sit at slot r % wrap, else 0
  PagedTier(const at::Tensor& ring_t, const at::Tensor& file_t, int64_t page, int64_t rows_, int64_t cold, int64_t wrap_)
      : P(page), rows(rows_), cold_pages(cold), wrap(wrap_) {
    TORCH_CHECK(ring_t.dim() >= 4 && ring_t.is_contiguous() && ring_t.device().is_cpu(),
                "paged rows: a table's ring must be (L, S, Hkv, capacity, ...) contiguous on the CPU");
    L = ring_t.size(0), S = ring_t.size(1), Hkv = ring_t.size(2), cap = ring_t.size(3);
    width = ring_t.element_size();
    for (int64_t d = 4; d < ring_t.dim(); ++d) width *= ring_t.size(d);
    ring = static_cast<const uint8_t*>(ring_t.data_ptr());
    TORCH_CHECK(rows >= cold * P && cold >= 0 && wrap >= 0 && (wrap ? wrap == cap && wrap % P == 0 : rows <= cap),
                "paged rows: a table's rows do not fit its ring");
    if (cold) {
      TORCH_CHECK(file_t.defined() && file_t.is_contiguous() && file_t.dim() == ring_t.dim() + 1 && file_t.size(0) >= cold &&
                      file_t.size(1) == L && file_t.size(2) == S && file_t.size(3) == Hkv && file_t.size(4) == P &&
                      file_t.element_size() == ring_t.element_size(),
                  "paged rows: a spill file must be (pages, L, S, Hkv, P, ...) as its ring");
      file = static_cast<const uint8_t*>(file_t.data_ptr());
    }
  }

  const uint8_t* at(int64_t l, int64_t s, int64_t h, int64_t r) const {
    const int64_t j = r / P;
    if (j < cold_pages) return file + ((((j * L + l) * S + s) * Hkv + h) * P + r % P) * width;
    return ring + (((l * S + s) * Hkv + h) * cap + (wrap ? r % wrap : r)) * width;
  }
};

// Row r's payload of (layer, s, head): from the table below its rows, else the step's still-resident row r - rows
// (fresh: (S?, Hkv, nf, ...) contiguous, `fresh_row` bytes a row, `fresh_heads` rows apart per head).
struct PagedRows {
  PagedTier tier;
  const uint8_t* fresh = nullptr;
  int64_t fresh_n = 0;

  const uint8_t* at(int64_t l, int64_t s, int64_t h, int64_t r) const {
    if (r < tier.rows) return tier.at(l, s, h, r);
    const int64_t f = r - tier.rows;
    TORCH_CHECK(f < fresh_n, "paged rows: row ", r, " is neither in its table nor among the step's resident rows");
    return fresh + ((s * tier.Hkv + h) * fresh_n + f) * tier.width;
  }
  // a pointer to rows [r0, r0 + n) of (layer, s, head): in place when they are one run, else copied into buf
  const uint8_t* run(int64_t l, int64_t s, int64_t h, int64_t r0, int64_t n, std::vector<uint8_t>& buf) const {
    if (r0 + n <= tier.rows && r0 / tier.P == (r0 + n - 1) / tier.P) return tier.at(l, s, h, r0);
    if (r0 >= tier.rows) return at(l, s, h, r0);  // fresh rows are one run
    buf.resize(n * tier.width);
    for (int64_t i = 0; i < n; ++i) std::memcpy(&buf[i * tier.width], at(l, s, h, r0 + i), tier.width);
    return buf.data();
  }
};

// RoPE rotate-half of G vectors x (G, D) by `delta` positions: cos/sin of delta * inv_freq in float, as the
// model's rotary tables are made.
inline void rotate_by(const float* x, int64_t G, int64_t D, const float* inv_freq, int64_t delta, float* out) {
  const int64_t half = D / 2;
  float c[128], s[128];
  for (int64_t d = 0; d < half; ++d) {
    const float a = static_cast<float>(delta) * inv_freq[d];
    c[d] = std::cos(a);
    s[d] = std::sin(a);
  }
  for (int64_t g = 0; g < G; ++g) {
    const float* xg = x + g * D;
    float* og = out + g * D;
    for (int64_t d = 0; d < half; ++d) {
      og[d] = xg[d] * c[d] - xg[d + half] * s[d];
      og[d + half] = xg[d + half] * c[d] + xg[d] * s[d];
    }
  }
}

// Per page of compact keys, the elementwise max and min of the decoded keys rounded outward to float16, as
// kv/paged.py's `_page_bounds` makes the page bounds table (the same float operations, so a page's bound is the same
// bits whether a row reads it from the table or makes it here from the page's codes).
inline void page_bound(const uint8_t* codes, const c10::Half* sc, int64_t n, int64_t D, bool four, c10::Half* hi,
                       c10::Half* lo) {
  float mx[256], mn[256];
  for (int64_t d = 0; d < D; ++d) mx[d] = -INFINITY, mn[d] = INFINITY;
  const int64_t row_bytes = four ? D / 2 : D;
  for (int64_t r = 0; r < n; ++r) {
    const uint8_t* row = codes + r * row_bytes;
    const float s = static_cast<float>(sc[r]);
    for (int64_t d = 0; d < D; ++d) {
      int v;
      if (four) v = d % 2 ? static_cast<int>(row[d / 2] >> 4) - 8 : static_cast<int>(row[d / 2] & 15) - 8;
      else v = reinterpret_cast<const int8_t*>(row)[d];
      const float x = static_cast<float>(v) * s;
      mx[d] = x > mx[d] ? x : mx[d];
      mn[d] = x < mn[d] ? x : mn[d];
    }
  }
  for (int64_t d = 0; d < D; ++d) {  // |x| * 2^-10 is exact: one rounding per add, as torch's elementwise ops
    hi[d] = c10::Half((mx[d] + std::fabs(mx[d]) * 0x1p-10f) + 0x1p-24f);
    lo[d] = c10::Half((mn[d] - std::fabs(mn[d]) * 0x1p-10f) - 0x1p-24f);
  }
}

// A page's bound score for G query rows qf (G, D): max over g of sum over d of max(q * hi, q * lo) (hi >= lo, so
// the larger product is q * hi where q > 0, q * lo where q < 0: kv/paged.py's two matmuls over the clamped query).
// With AVX2 and F16C: 8 dimensions at a time, the float16 bounds converted in registers, NP pages at a time (each
// page's sums the same operations in the same order as alone, so the same bits; their add chains side by side).
#if defined(__AVX2__) && defined(__F16C__)
template <int NP>
inline void bound_scores(const float* qf, int64_t G, int64_t D, const c10::Half* const* hi, const c10::Half* const* lo,
                         float* out) {
  for (int p = 0; p < NP; ++p) out[p] = -INFINITY;
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int64_t gn = std::min<int64_t>(4, G - g0);
    __m256 acc[NP][4];
    for (int p = 0; p < NP; ++p)
      for (int g = 0; g < 4; ++g) acc[p][g] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      __m256 h[NP], l[NP];
      for (int p = 0; p < NP; ++p) {
        h[p] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi[p] + d)));
        l[p] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo[p] + d)));
      }
      for (int64_t g = 0; g < gn; ++g) {
        const __m256 x = _mm256_loadu_ps(qf + (g0 + g) * D + d);
        for (int p = 0; p < NP; ++p)
          acc[p][g] = _mm256_add_ps(acc[p][g], _mm256_max_ps(_mm256_mul_ps(x, h[p]), _mm256_mul_ps(x, l[p])));
      }
    }
    for (int p = 0; p < NP; ++p)
      for (int64_t g = 0; g < gn; ++g) {
        __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc[p][g]), _mm256_extractf128_ps(acc[p][g], 1));
        v = _mm_add_ps(v, _mm_movehl_ps(v, v));
        const float s = _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
        out[p] = s > out[p] ? s : out[p];
      }
  }
}
#endif

inline float bound_score(const float* qf, int64_t G, int64_t D, const c10::Half* hi, const c10::Half* lo) {
#if defined(__AVX2__) && defined(__F16C__)
  float best;
  bound_scores<1>(qf, G, D, &hi, &lo, &best);
  return best;
#else
  float best = -INFINITY;
  for (int64_t g = 0; g < G; ++g) {
    float s = 0.f;
    for (int64_t d = 0; d < D; ++d) {
      const float x = qf[g * D + d], a = x * static_cast<float>(hi[d]), b = x * static_cast<float>(lo[d]);
      s += a > b ? a : b;
    }
    best = s > best ? s : best;
  }
  return best;
#endif
}

// The configuration of one paged session's step (kv/paged.py builds it once a step).
struct PagedConfig {
  int64_t sink, window, P, M, S, shortlist_from, far_distance, far_from, bounds_rows;
  bool bounds_far;  // the bounds table holds far_keys' bounds (page choice past the context has started)
  bool far_spread;  // rows at or past far_from see their pages "spread" (gaps scaled), else "packed" (kv/paged.py)
  // choice_every > 1: a row at p >= choice_from takes the pages its source position chose (kv/paged.py
  // `_choice_source`: p - (p - choice_from) % choice_every), a row of the step or the kept choice (made at kept_pos)
  int64_t choice_every, choice_from, kept_pos;

  int64_t choice_source(int64_t p) const {
    return choice_every <= 1 || p < choice_from ? p : p - (p - choice_from) % choice_every;
  }
};

// One paged session's step as kv/paged.py hands it over (`_native_view`, once a step): its tables, their bookkeeping,
// and per row its position, candidate count and slab keys (rows (T, 3) int64), visible slab columns (mask (T, N)
// bool), the sink's slab columns, and the rotary's frequencies (D/2 fp32).
//   tables: compact keys at true positions (ring codes, ring scales, file codes, file scales), the same of far_keys,
//     the page store (ring, file; K/V in the slab's dtype, fp32 or fp16, stack 2), the page bounds
//     (L, 2, Hkv, pages, D) fp16;
//   meta: per table (rows, cold pages, ring size once wrapped else 0) for keys, far_keys, pages; then sink, window,
//     page size, recall pages, shortlist pages, shortlist_from, far_distance, far_from (rows at or past it: InfLLM's
//     layout), bounds rows, bounds of far_keys (0 / 1), the far layout (0 packed, 1 spread).
struct PagedView {
  std::vector<at::Tensor> tables;
  std::vector<int64_t> meta, sinks;
  at::Tensor rows, mask, inv_freq;
  PagedConfig cf{};

  PagedView(std::vector<at::Tensor> tables_, std::vector<int64_t> meta_, const at::Tensor& rows_, const at::Tensor& mask_,
            const at::Tensor& sink_cols, const at::Tensor& inv_freq_)
      : tables(std::move(tables_)), meta(std::move(meta_)), rows(rows_.contiguous()), mask(mask_.contiguous()),
        inv_freq(inv_freq_.contiguous()) {
    TORCH_CHECK(tables.size() == 13 && meta.size() == 23, "paged view: 13 tables and 23 numbers");
    TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 2 && rows.size(1) == 3, "paged view: rows must be (T, 3) int64");
    TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 2 && mask.size(0) == rows.size(0),
                "paged view: mask must be (T, N) bool");
    TORCH_CHECK(inv_freq.scalar_type() == at::kFloat, "paged view: inv_freq must be fp32");
    cf = PagedConfig{meta[9], meta[10], meta[11], meta[12], meta[13], meta[14], meta[15], meta[16], meta[17], meta[18] != 0,
                    meta[19] != 0, meta[20], meta[21], meta[22]};
    TORCH_CHECK(cf.choice_every >= 1, "paged view: choice_every must be >= 1");
    for (int t : {11, 12})
      TORCH_CHECK(tables[t].numel() == 0 || (tables[t].scalar_type() == at::kLong && tables[t].is_contiguous()),
                  "paged view: the kept choice and the rows' choices must be int64, contiguous (or empty)");
    TORCH_CHECK(cf.P >= 1 && cf.P <= kChunk && cf.M >= 0 && cf.sink >= 0 && cf.window >= 0,
                "paged view: the page size must be 1 .. 256");
    const bool four = tables[0].scalar_type() == at::kByte;
    TORCH_CHECK(four || tables[0].scalar_type() == at::kChar, "paged view: compact keys must be 4-bit (uint8) or int8 codes");
    TORCH_CHECK(tables[4].scalar_type() == tables[0].scalar_type(), "paged view: far_keys must be coded as the keys");
    TORCH_CHECK(tables[1].scalar_type() == at::kHalf && tables[5].scalar_type() == at::kHalf, "paged view: scales must be fp16");
    TORCH_CHECK((tables[8].scalar_type() == at::kFloat || tables[8].scalar_type() == at::kHalf) && tables[8].dim() == 5 &&
                    tables[8].size(1) == 2,
                "paged view: the page store must hold fp32 or fp16 K/V rows (as the session's slab)");
    const at::Tensor& b = tables[10];
    TORCH_CHECK(b.scalar_type() == at::kHalf && b.is_contiguous() && b.dim() == 5 && b.size(1) == 2 && b.size(3) >= cf.bounds_rows,
                "paged view: bounds must be (L, 2, Hkv, pages, D) fp16, contiguous");
    auto sc = sink_cols.to(at::kLong).contiguous();
    sinks.assign(sc.data_ptr<int64_t>(), sc.data_ptr<int64_t>() + sc.numel());
    TORCH_CHECK(static_cast<int64_t>(sinks.size()) <= kChunk, "paged view: at most 256 sink columns");
  }

  // against the model and the session's slab (capacity columns)
  void check(int64_t T, int64_t Hkv, int64_t D, int64_t layers, int64_t capacity) const {
    TORCH_CHECK(rows.size(0) == T, "paged view: ", rows.size(0), " rows for a step of ", T);
    TORCH_CHECK(inv_freq.numel() == D / 2, "paged view: inv_freq must hold D/2 frequencies");
    for (int t : {0, 4})
      TORCH_CHECK(tables[t].dim() == 5 && tables[t].size(0) == layers && tables[t].size(2) == Hkv &&
                      (tables[t].size(4) == D / 2 || tables[t].size(4) == D) && tables[t].size(4) * (tables[t].scalar_type() == at::kByte ? 2 : 1) == D,
                  "paged view: compact keys must be (L, 1, Hkv, rows, D/2 or D) for this model");
    TORCH_CHECK(tables[8].size(0) == layers && tables[8].size(2) == Hkv && tables[8].size(4) == D,
                "paged view: the page store must be (L, 2, Hkv, rows, D) for this model");
    TORCH_CHECK(tables[10].size(0) == layers && tables[10].size(2) == Hkv && tables[10].size(4) == D,
                "paged view: bounds must be (L, 2, Hkv, pages, D) for this model");
    if (cf.choice_every > 1) {
      TORCH_CHECK(tables[12].dim() == 4 && tables[12].size(0) == layers && tables[12].size(1) == T &&
                      tables[12].size(2) == Hkv && tables[12].size(3) == cf.M,
                  "paged view: the rows' choices must be (L, T, Hkv, M)");
      TORCH_CHECK(tables[11].numel() == 0 || (tables[11].dim() == 3 && tables[11].size(0) == layers &&
                                              tables[11].size(1) == Hkv && tables[11].size(2) == cf.M),
                  "paged view: the kept choice must be (L, Hkv, M)");
    }
    const int64_t N = mask.size(1);
    const int64_t* rp = rows.data_ptr<int64_t>();
    for (int64_t j = 0; j < T; ++j)
      TORCH_CHECK(rp[j * 3 + 1] >= 0 && rp[j * 3 + 2] >= 0 && rp[j * 3 + 2] <= std::min(N, capacity), "paged view: bad row");
    for (const int64_t s : sinks) TORCH_CHECK(s >= 0 && s < capacity, "paged view: a sink column is out of the slab");
  }
};

// The G query rows of one KV head, in score_keys' layout: 4-bit codes hold even dimensions in low nibbles, odd ones
// in high ones, so the even dimensions first, then the odd ones, per row.
inline void score_layout(const float* q, int64_t G, int64_t D, bool four, float* out) {
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) {
      if (!four) out[g * D + d] = q[g * D + d];
      else out[g * D + (d % 2 ? D / 2 + d / 2 : d / 2)] = q[g * D + d];
    }
}

// One (row, KV head) of a step: its page choice and its attention's parts, in phases that share the threads out
// evenly (a decode row has only Hkv of them: 3 for SmolLM2 on 2 threads), each piece computed alone and combined in a
// fixed order, so a row's bits depend on nothing but its own inputs.
struct PagedTask {
  int64_t row = 0, h = 0, pos = 0, c = 0, nk = 0;
  bool far = false;
  const float* q = nullptr;          // its G query rows (G, D) at its position
  std::vector<float> qs;             // those rows as the scoring reads them (rotated to far_distance past the context)
  std::vector<int8_t> qa;            // qs quantized to int8 (quantize_query; score_q8), its rows' sums and scale
  std::vector<int32_t> qsum;
  float qscale = 0.f;
  std::vector<int64_t> cand;         // the pages whose keys are scored
  std::vector<float> cand_best;      // each one's best key score
  std::vector<int64_t> pages;        // the chosen pages, position order
  std::vector<int64_t> slot;         // past far_from: where each page starts as the row sees it (far_slots)
  int64_t sink_start = 0;            // and where the sink starts
  std::vector<float> parts;          // the attention's parts: pages, the moved sink (past the context), slab chunks
  int64_t nw = 0;                    // slab chunks
  bool sink = false;
};

// Phase 1, in three parts so that a step's few tasks (a decode row has Hkv of them: 3 for SmolLM2, on 2 threads) share
// the threads evenly: plan_begin (per task: every page chosen whole when it has at most M; else its query turned for
// scoring, and every page a candidate, or past `shortlist_from` pages a bound to rank per whole page), rank_pages
// (the bounds of pages [j0, j1) of a task: items of kRankPages pages, every task's shared out together), plan_end
// (per task: the S pages the bounds rank highest plus the page it sees in part).
struct PagedRank {
  std::vector<float> qf;                        // the task's query rows (G, D), rotated as its choice reads them
  std::vector<std::pair<float, int64_t>> ranked;  // (bound score, page) per whole page
  bool shortlist = false;                        // its candidates are the bounds' shortlist (plan_end makes them)
};

constexpr int64_t kRankPages = 64;
// a step with at least this many (row, KV head) tasks runs its per-task planning, choice and merges on the threads
// (tasks_apart 1, the default) or on the calling thread as before (0: research scripts time it; the same bits)
constexpr int64_t kTasksApart = 16;
inline int64_t& tasks_apart() {
  static int64_t on = 1;
  return on;
}

inline void plan_begin(const PagedConfig& cf, PagedTask& t, PagedRank& rk, int64_t G, int64_t D, const PagedRows& codes,
                       const float* inv_freq) {
  const int64_t P = cf.P, n_pages = (t.c + P - 1) / P;
  if (n_pages <= cf.M) {
    for (int64_t j = 0; j < n_pages; ++j) t.pages.push_back(j);
    return;
  }
  const bool four = codes.tier.width * 2 == D;
  rk.qf.resize(G * D);
  if (t.far) rotate_by(t.q, G, D, inv_freq, cf.far_distance - t.pos, rk.qf.data());
  else std::memcpy(rk.qf.data(), t.q, G * D * sizeof(float));
  t.qs.resize(G * D);
  score_layout(rk.qf.data(), G, D, four, t.qs.data());
  if (score_q8()) {
    t.qa.resize(G * D);
    t.qsum.resize(G);
    t.qscale = quantize_query(t.qs.data(), G, D, t.qa.data(), t.qsum.data());
  }
  if (cf.S > 0 && n_pages > cf.shortlist_from) {
    rk.shortlist = true;
    rk.ranked.resize(t.c / P);
  } else {
    for (int64_t j = 0; j < n_pages; ++j) t.cand.push_back(j);
    t.cand_best.assign(t.cand.size(), -INFINITY);
  }
}

// Whether a step makes the bounds below once a layer (1, the default) or each ranking row makes its own (0: before;
// research scripts time the difference); the same bits either way.
inline int64_t& made_bounds() {
  static int64_t on = 1;
  return on;
}

// The bounds of whole pages [lo, hi) past the bounds table (the pages a prefill chunk completes: every later row of the
// chunk ranks them), made once a layer for every KV head from the codes of the table's kind (far_keys' once choice past
// the context began), as rank_pages would make them row by row: page_bound is a function of the page's codes, so the
// same bits. (Hkv, hi - lo, 2, D) fp16.
struct MadeBounds {
  int64_t lo = 0, hi = 0;
  std::vector<c10::Half> b;
  const c10::Half* at(int64_t h, int64_t j, int64_t D) const { return b.data() + ((h * (hi - lo) + (j - lo)) * 2) * D; }
};

inline void rank_pages(const PagedConfig& cf, int64_t l, const PagedTask& t, PagedRank& rk, int64_t j0, int64_t j1,
                       int64_t G, int64_t D, const PagedRows& codes, const PagedRows& scales, const c10::Half* bounds,
                       int64_t bounds_cap, int64_t Hkv, const MadeBounds& made_b) {
  const int64_t P = cf.P;
  const bool four = codes.tier.width * 2 == D;
  std::vector<c10::Half> made(2 * D);
  std::vector<uint8_t> cbuf, sbuf;
  const bool table = cf.bounds_far == t.far;  // else (a row below the context once choice past it began) made here
  const c10::Half* hi_t = bounds + ((l * 2 + 0) * Hkv + t.h) * bounds_cap * D;
  const c10::Half* lo_t = bounds + ((l * 2 + 1) * Hkv + t.h) * bounds_cap * D;
  int64_t j = j0;
#if defined(__AVX2__) && defined(__F16C__)
  if (table)  // pages in the table, two at a time
    for (; j + 2 <= std::min(j1, cf.bounds_rows); j += 2) {
      const c10::Half* hi[2] = {hi_t + j * D, hi_t + (j + 1) * D};
      const c10::Half* lo[2] = {lo_t + j * D, lo_t + (j + 1) * D};
      float sc[2];
      bound_scores<2>(rk.qf.data(), G, D, hi, lo, sc);
      rk.ranked[j] = {sc[0], j};
      rk.ranked[j + 1] = {sc[1], j + 1};
    }
#endif
  for (; j < j1; ++j) {
    const c10::Half *hi, *lo;
    if (table && j < cf.bounds_rows) {  // else made once a layer (made_b), or here from its codes at true positions
      hi = hi_t + j * D;
      lo = lo_t + j * D;
    } else if (table && j >= made_b.lo && j < made_b.hi) {
      hi = made_b.at(t.h, j, D);
      lo = hi + D;
    } else {
      const uint8_t* cp = codes.run(l, 0, t.h, j * P, P, cbuf);
      const auto* sp = reinterpret_cast<const c10::Half*>(scales.run(l, 0, t.h, j * P, P, sbuf));
      page_bound(cp, sp, P, D, four, made.data(), made.data() + D);
      hi = made.data(), lo = made.data() + D;
    }
    rk.ranked[j] = {bound_score(rk.qf.data(), G, D, hi, lo), j};
  }
}

inline void plan_end(const PagedConfig& cf, PagedTask& t, PagedRank& rk) {
  if (!rk.shortlist) return;  // chosen whole, or every page a candidate (plan_begin)
  const int64_t whole = static_cast<int64_t>(rk.ranked.size()), keep = std::min<int64_t>(cf.S, whole);
  // the top `keep` in order (score down, ties to the lower page: a strict total order, so the same pages in the same
  // order as a partial sort of the whole list)
  auto before = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
  if (keep < whole) std::nth_element(rk.ranked.begin(), rk.ranked.begin() + keep, rk.ranked.end(), before);
  std::sort(rk.ranked.begin(), rk.ranked.begin() + keep, before);
  for (int64_t i = 0; i < keep; ++i)
    if (rk.ranked[i].first > -INFINITY) t.cand.push_back(rk.ranked[i].second);
  if (whole < (t.c + cf.P - 1) / cf.P) t.cand.push_back(whole);  // the page it sees in part: always scored
  t.cand_best.assign(t.cand.size(), -INFINITY);
}

// Phase 2: candidates [k0, k1) of a task: each page's best key score (its visible keys' compact codes).
inline void score_candidates(const PagedConfig& cf, int64_t l, PagedTask& t, int64_t k0, int64_t k1, int64_t G, int64_t D,
                             const PagedRows& codes, const PagedRows& scales) {
  const bool four = codes.tier.width * 2 == D;
  const int64_t P = cf.P;
  std::vector<float> scores(P);
  std::vector<uint8_t> cbuf, sbuf;
  for (int64_t k = k0; k < k1; ++k) {
    const int64_t j = t.cand[k], n = std::min(P, t.c - j * P);
    const uint8_t* cp = codes.run(l, 0, t.h, j * P, n, cbuf);
    const auto* sp = reinterpret_cast<const c10::Half*>(scales.run(l, 0, t.h, j * P, n, sbuf));
    if (!t.qa.empty()) {
      if (four) score_keys_q8_any<true>(t.qa.data(), t.qsum.data(), t.qscale, G, D, cp, sp, 0, n, scores.data());
      else score_keys_q8_any<false>(t.qa.data(), t.qsum.data(), t.qscale, G, D, cp, sp, 0, n, scores.data());
    } else if (four) {
      score_keys_any<true>(t.qs.data(), G, D, cp, sp, 0, n, scores.data());
    } else {
      score_keys_any<false>(t.qs.data(), G, D, cp, sp, 0, n, scores.data());
    }
    float best = -INFINITY;
    for (int64_t i = 0; i < n; ++i) best = scores[i] > best ? scores[i] : best;
    t.cand_best[k] = best;
  }
}

// Past far_from: where a row sees its chosen pages (t.slot) and the sink (t.sink_start), as kv/paged.py's
// `_far_slots` computes them, integer for integer: "packed", the pages in the n page slots ending right before the
// window, the sink right before them; "spread", the same order with the gaps before each page and after the last
// scaled by free / total (floor), free = far_from - window - sink - n * P, when the gaps exceed it.
inline void far_slots(const PagedConfig& cf, PagedTask& t) {
  const int64_t n = static_cast<int64_t>(t.pages.size()), P = cf.P, w0 = t.pos - cf.window + 1;
  t.slot.resize(n);
  if (!cf.far_spread || n == 0) {
    for (int64_t i = 0; i < n; ++i) t.slot[i] = w0 - (n - i) * P;
    t.sink_start = w0 - n * P - cf.sink;
    return;
  }
  std::vector<int64_t> gaps(n + 1);
  int64_t prev_end = cf.sink, total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t start = cf.sink + t.pages[i] * P;
    gaps[i] = start - prev_end;
    prev_end = start + P;
  }
  gaps[n] = std::max<int64_t>(w0 - prev_end, 0);
  for (const int64_t gp : gaps) total += gp;
  const int64_t free = cf.far_from - cf.window - cf.sink - n * P;
  if (total > free)
    for (int64_t& gp : gaps) gp = gp * free / total;
  int64_t after = gaps[n];
  for (int64_t i = n - 1; i >= 0; --i) {
    t.slot[i] = w0 - after - (n - i) * P;
    after += gaps[i];
  }
  t.sink_start = w0 - after - n * P - cf.sink;
}

// Phase 3: the M best-scoring candidates (ties to the lower page), in position order (past far_from: where the row sees
// them); then the attention's part count.
inline void finish_choice(const PagedConfig& cf, PagedTask& t, int64_t G, int64_t D, const std::vector<int64_t>& sink_cols) {
  if (!t.cand.empty()) {
    std::vector<std::pair<float, int64_t>> scored;
    for (size_t k = 0; k < t.cand.size(); ++k)
      if (t.cand_best[k] > -INFINITY) scored.push_back({t.cand_best[k], t.cand[k]});
    const int64_t keep = std::min<int64_t>(cf.M, static_cast<int64_t>(scored.size()));
    std::partial_sort(scored.begin(), scored.begin() + keep, scored.end(), [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    for (int64_t i = 0; i < keep; ++i) t.pages.push_back(scored[i].second);
    std::sort(t.pages.begin(), t.pages.end());
  }
  t.nw = (t.nk + kChunk - 1) / kChunk;
  t.sink = t.far && !sink_cols.empty();
  if (t.far) far_slots(cf, t);
  t.parts.resize((t.pages.size() + (t.sink ? 1 : 0) + t.nw) * G * (D + 2));
}

inline int64_t part_count(const PagedTask& t) { return static_cast<int64_t>(t.pages.size()) + (t.sink ? 1 : 0) + t.nw; }

// Phase 4: part ci of a task's attention, alone: one chosen page (its visible rows; past far_from the query
// counter-rotated by the page's move to its slot, far_slots: packed before the window or spread), the moved sink, or
// a chunk of kChunk slab columns (those the row sees, without the sink past the context) as the whole-step call reads
// them. A row that recalls nothing has only slab chunks: the whole-step call's own parts. T: the slab's and the page
// store's element type (float, or c10::Half with `--kv-dtype fp16`: converted to floats as attend_chunk_pick reads them).
template <class T>
inline void attend_part(const PagedConfig& cf, int64_t l, const PagedTask& t, int64_t ci, int64_t G, int64_t D, float scale,
                        const PagedRows& kv, const T* k_slab, const T* v_slab, int64_t cap, const bool* mask_w,
                        const std::vector<int64_t>& sink_cols, const float* inv_freq, std::vector<float>& scores,
                        float* part) {
  static bool all_rows[kChunk];
  static const bool init = [] {
    for (int64_t i = 0; i < kChunk; ++i) all_rows[i] = true;
    return true;
  }();
  (void)init;
  const int64_t P = cf.P, n = static_cast<int64_t>(t.pages.size()), h = t.h;
  std::vector<float> moved;
  if (ci < n) {
    const int64_t r0 = t.pages[ci] * P, rn = std::min(P, t.c - r0);
    std::vector<uint8_t> kbuf, vbuf;
    const auto* kb = reinterpret_cast<const T*>(kv.run(l, 0, h, r0, rn, kbuf));
    const auto* vb = reinterpret_cast<const T*>(kv.run(l, 1, h, r0, rn, vbuf));
    const float* qq = t.q;
    if (t.far) {
      moved.resize(G * D);
      rotate_by(t.q, G, D, inv_freq, -(t.slot[ci] - (cf.sink + r0)), moved.data());
      qq = moved.data();
    }
    attend_chunk_any(D, G, qq, kb, vb, all_rows, 0, rn, scale, scores.data(), part);
    return;
  }
  if (t.sink && ci == n) {  // the sink, moved right before the pages
    const int64_t ns = static_cast<int64_t>(sink_cols.size());
    std::vector<T> ks(ns * D), vs(ns * D);
    for (int64_t s = 0; s < ns; ++s) {
      std::memcpy(&ks[s * D], k_slab + (h * cap + sink_cols[s]) * D, D * sizeof(T));
      std::memcpy(&vs[s * D], v_slab + (h * cap + sink_cols[s]) * D, D * sizeof(T));
    }
    moved.resize(G * D);
    rotate_by(t.q, G, D, inv_freq, -t.sink_start, moved.data());
    attend_chunk_any(D, G, moved.data(), ks.data(), vs.data(), all_rows, 0, ns, scale, scores.data(), part);
    return;
  }
  const int64_t w = ci - n - (t.sink ? 1 : 0), j0 = w * kChunk, j1 = std::min(t.nk, j0 + kChunk);
  std::vector<uint8_t> window_mask;
  if (t.sink) {  // the window without the sink (attended above, moved)
    window_mask.assign(mask_w, mask_w + j1);
    for (const int64_t s : sink_cols)
      if (s < j1) window_mask[s] = 0;
    mask_w = reinterpret_cast<const bool*>(window_mask.data());
  }
  attend_chunk_any(D, G, t.q, k_slab + h * cap * D, v_slab + h * cap * D, mask_w, j0, j1, scale, scores.data(), part);
}
