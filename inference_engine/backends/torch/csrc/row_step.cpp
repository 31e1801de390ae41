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

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int kLanes = 16;  // fixed accumulator lanes: the sums' order never depends on the machine's vector width

enum Kind : int64_t { kDense = 0, kInt8 = 1, kInt4 = 2 };

struct Linear {
  int64_t kind = kDense;
  at::Tensor a, b;  // dense: w (N, K); int8: q (N, K), scales (N,) bf16; int4: packed, scale_zero (K/32, N, 2) bf16

  bool bf16_input() const { return kind != kDense; }

  at::Tensor operator()(const at::Tensor& x) const {
    switch (kind) {
      case kInt4: return at::_weight_int4pack_mm_for_cpu(x, a, 32, b);
      case kInt8: return at::_weight_int8pack_mm(x, a, b);
      default: return at::linear(x, a);
    }
  }
};

inline float dot(const float* a, const float* b, int64_t n) {  // n % kLanes == 0
  float acc[kLanes] = {0};
  for (int64_t i = 0; i < n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  float s = 0.f;
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  return s;
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

class RowStep {
 public:
  RowStep(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter, double eps, double attn_scale,
          std::vector<int64_t> kinds, std::vector<at::Tensor> tensors)
      : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), inter_(inter),
        eps_(static_cast<float>(eps)), scale_(static_cast<float>(attn_scale)) {
    // per layer: ln_in, ln_post_attn, then (a, b) for wqkv, wo, w_gate_up, w_down (kinds: 4 per layer); last: final norm
    TORCH_CHECK(head_dim % kLanes == 0 && hidden % kLanes == 0, "row step: head_dim and hidden must be multiples of 16");
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
  at::Tensor run(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                 const std::vector<std::vector<at::Tensor>>& k_slabs, const std::vector<std::vector<at::Tensor>>& v_slabs,
                 const at::Tensor& row_session, const at::Tensor& row_slot, const at::Tensor& mask,
                 const at::Tensor& row_keys) {
    at::NoGradGuard no_grad;
    const int64_t R = x.size(0), H = heads_, Hkv = kv_heads_, D = head_dim_, G = H / Hkv;
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
    for (size_t s = 0; s < k_slabs.size(); ++s) {
      TORCH_CHECK(static_cast<int64_t>(k_slabs[s].size()) == layers_ && static_cast<int64_t>(v_slabs[s].size()) == layers_,
                  "row step: one slab per layer");
    }
    const auto opts = x.options();
    float* xp = x.data_ptr<float>();
    std::vector<float> inv(R), q(R * H * D), att(R * H * D);
    const float* cp = cs.data_ptr<float>();
    const float* sp = sn.data_ptr<float>();
    const int64_t half = D / 2, nq = H * D, nkv = Hkv * D;

    for (int64_t l = 0; l < layers_; ++l) {
      const Linear &wqkv = lin_[l * 4], &wo = lin_[l * 4 + 1], &wgu = lin_[l * 4 + 2], &wdown = lin_[l * 4 + 3];
      // input norm -> fused q, k, v
      norms(xp, R, inv.data());
      auto qkv = as_float(wqkv(linear_input(xp, inv.data(), ln_in_[l].data_ptr<float>(), R, hidden_, wqkv.bf16_input(), opts)));
      const float* qkv_p = qkv.data_ptr<float>();
      // RoPE (rotate-half) on q and k; k, v into each row's slab column
      for (int64_t r = 0; r < R; ++r) {
        const float* c = cp + r * D;
        const float* s = sp + r * D;
        const float* row = qkv_p + r * (nq + 2 * nkv);
        for (int64_t h = 0; h < H; ++h) rope(row + h * D, c, s, &q[(r * H + h) * D], half);
        auto& ks = k_slabs[sess_p[r]][l];
        auto& vs = v_slabs[sess_p[r]][l];
        const int64_t cap = ks.size(1);
        TORCH_CHECK(slot_p[r] >= 0 && slot_p[r] < cap, "row step: slot out of the slab");
        float* kd = ks.data_ptr<float>();
        float* vd = vs.data_ptr<float>();
        for (int64_t h = 0; h < Hkv; ++h) {
          rope(row + nq + h * D, c, s, kd + (h * cap + slot_p[r]) * D, half);
          const float* v = row + nq + nkv + h * D;
          float* vdst = vd + (h * cap + slot_p[r]) * D;
          for (int64_t d = 0; d < D; ++d) vdst[d] = v[d];
        }
      }
      // attention: each (row, kv head) alone over the row's visible columns, in column order
      const int64_t work = R * Hkv;
      int64_t cols = 0;
      for (int64_t r = 0; r < R; ++r) cols += nk_p[r];
      const int64_t grain = cols * H * D < (1 << 18) ? work : 1;  // small steps stay on this thread
      at::parallel_for(0, work, grain, [&](int64_t lo, int64_t hi) {
        std::vector<float> scores;
        for (int64_t w = lo; w < hi; ++w) {
          const int64_t r = w / Hkv, h = w % Hkv, n = nk_p[r];
          const auto& ks = k_slabs[sess_p[r]][l];
          const auto& vs = v_slabs[sess_p[r]][l];
          const int64_t cap = ks.size(1);
          const float* kb = ks.data_ptr<float>() + h * cap * D;
          const float* vb = vs.data_ptr<float>() + h * cap * D;
          const bool* m = mask_p + r * N;
          scores.assign(G * n, 0.f);
          for (int64_t g = 0; g < G; ++g) {
            const float* qh = &q[(r * H + h * G + g) * D];
            float* sc = &scores[g * n];
            float mx = -INFINITY;
            for (int64_t j = 0; j < n; ++j) {
              if (!m[j]) continue;
              sc[j] = dot(qh, kb + j * D, D) * scale_;
              mx = sc[j] > mx ? sc[j] : mx;
            }
            float* out = &att[(r * H + h * G + g) * D];
            for (int64_t d = 0; d < D; ++d) out[d] = 0.f;
            if (mx == -INFINITY) continue;  // sees nothing (never for a real row): zeros
            float sum = 0.f;
            for (int64_t j = 0; j < n; ++j) {
              if (!m[j]) continue;
              const float p = std::exp(sc[j] - mx);
              sum += p;
              const float* v = vb + j * D;
              for (int64_t d = 0; d < D; ++d) out[d] += p * v[d];
            }
            const float rs = 1.f / sum;
            for (int64_t d = 0; d < D; ++d) out[d] *= rs;
          }
        }
      });
      // output projection + residual
      add_into(xp, as_float(wo(linear_input(att.data(), nullptr, nullptr, R, nq, wo.bf16_input(), opts))), R * hidden_);
      // post-attention norm -> gate/up -> SiLU(gate) * up -> down + residual
      norms(xp, R, inv.data());
      auto gu = as_float(wgu(linear_input(xp, inv.data(), ln_post_[l].data_ptr<float>(), R, hidden_, wgu.bf16_input(), opts)));
      const float* gup = gu.data_ptr<float>();
      std::vector<float> act(R * inter_);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t i = 0; i < inter_; ++i) {
          const float g = gup[r * 2 * inter_ + i], u = gup[r * 2 * inter_ + inter_ + i];
          act[r * inter_ + i] = g / (1.f + std::exp(-g)) * u;
        }
      add_into(xp, as_float(wdown(linear_input(act.data(), nullptr, nullptr, R, inter_, wdown.bf16_input(), opts))),
               R * hidden_);
    }
    norms(xp, R, inv.data());
    auto out = at::empty({R, hidden_}, opts.dtype(at::kFloat));
    const float* fw = final_norm_.data_ptr<float>();
    float* op = out.data_ptr<float>();
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = 0; i < hidden_; ++i) op[r * hidden_ + i] = fw[i] * (xp[r * hidden_ + i] * inv[r]);
    return out;
  }

 private:
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
  pybind11::class_<RowStep>(m, "RowStep")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, std::vector<int64_t>,
                          std::vector<at::Tensor>>())
      .def("run", &RowStep::run, pybind11::call_guard<pybind11::gil_scoped_release>());
}
