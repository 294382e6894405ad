// kvrl's native CPU ops for the policies' scores (specification: the torch
// code of kvrl/kernels/reference/scores.py, which they are tested against). One (sample, head) at a
// time, so each head's keys [D, N] stay in the core's cache across what torch does in
// several passes over the whole batch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

// The hand-vectorised paths below, where native.py builds with -mavx2 -mfma or with the AVX-512
// flags (which imply AVX2; -mfma is passed too); other builds run the scalar loops beside them.
#if defined(__AVX2__) && defined(__FMA__)
#define KVRL_AVX2 1
#include <immintrin.h>
#endif

namespace {

void check_keys(const at::Tensor& k, const at::Tensor& valid) {
  TORCH_CHECK(k.dim() == 4 && k.scalar_type() == at::kFloat && k.is_contiguous() && k.device().is_cpu(),
              "keys must be a contiguous float32 CPU tensor [B, H, D, N]");
  TORCH_CHECK(valid.scalar_type() == at::kBool && valid.is_contiguous() &&
                  valid.sizes() == at::IntArrayRef({k.size(0), k.size(1), k.size(3)}),
              "valid must be a contiguous bool tensor [B, H, N]");
}

// Sum of x[0..n) in 8 independent lanes (a vector register) instead of one serial chain.
float lane_sum(const float* __restrict__ x, int64_t n) {
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int t = 0; t < 8; ++t) acc[t] += x[j + t];
  float s = 0.f;
  for (; j < n; ++j) s += x[j];
  for (int t = 0; t < 8; ++t) s += acc[t];
  return s;
}

// exp(x) for x ≤ 0 (Cephes expf: 2ⁿ·e^r with |r| ≤ ln2/2, within 2 ulp), in plain float and
// integer operations so that the compiler vectorises the loops that call it; std::exp does not
// vectorise without -ffast-math. Below −87.3 it returns about 1e-38 instead of a denormal.
inline float exp_neg(float x) {
  x = std::max(x, -87.3f);
  const float shift = 12582912.f;  // 1.5·2²³: adding it rounds x·log2(e) to an integer in the low bits
  const float t = x * 1.44269504f + shift;
  const float n = t - shift;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  int32_t bits;
  std::memcpy(&bits, &t, 4);
  bits = (bits - 0x4B400000 + 127) << 23;  // the integer n, as the exponent field of 2ⁿ
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

#ifdef KVRL_AVX2
// exp_neg on 8 lanes (the same steps, with fused multiply-adds). GCC leaves the scalar loops
// below partly unvectorised (the masked max pass stays scalar, for std::max's NaN order), which
// made attention_received's pass over the logits slower than torch's softmax alone; by hand it
// is 1.6x faster (53 -> 33 us per row of a SnapKV eviction in the vLLM benchmark's shapes).
inline __m256 exp_neg8(__m256 x) {
  const __m256 shift = _mm256_set1_ps(12582912.f);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 t = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504f), shift);
  const __m256 n = _mm256_sub_ps(t, shift);
  const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f),
                                   _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_sub_epi32(_mm256_castps_si256(t), _mm256_set1_epi32(0x4B400000)), _mm256_set1_epi32(127)),
      23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline float register_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return std::max(_mm_cvtss_f32(m), _mm_cvtss_f32(_mm_shuffle_ps(m, m, 1)));
}

inline float register_sum(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(m) + _mm_cvtss_f32(_mm_shuffle_ps(m, m, 1));
}
#endif

// The softmax of the visible slots (seen[j] = 1) of src without its division: dst[j] ←
// exp(src[j] − max), 0 where not seen; returns 1 / Σ dst, or 0 when the row sees nothing. The
// callers fold the division into the pass that reads dst.
float softmax_terms(const float* __restrict__ src, float* __restrict__ dst, const float* __restrict__ seen,
                    int64_t n) {
  const float none = -std::numeric_limits<float>::infinity();
  float top = none, total = 0.f;
  int64_t j = 0;
#ifdef KVRL_AVX2
  const __m256 zero = _mm256_setzero_ps(), low = _mm256_set1_ps(none);
  __m256 most = low;
  for (; j + 8 <= n; j += 8) {
    const __m256 on = _mm256_cmp_ps(_mm256_loadu_ps(seen + j), zero, _CMP_GT_OQ);
    most = _mm256_max_ps(most, _mm256_blendv_ps(low, _mm256_loadu_ps(src + j), on));
  }
  top = register_max(most);
  for (int64_t i = j; i < n; ++i) top = std::max(top, seen[i] > 0.f ? src[i] : none);
  if (top == none) return 0.f;
  const __m256 vtop = _mm256_set1_ps(top);
  __m256 acc = zero;
  for (j = 0; j + 8 <= n; j += 8) {
    const __m256 on = _mm256_cmp_ps(_mm256_loadu_ps(seen + j), zero, _CMP_GT_OQ);
    const __m256 e = _mm256_and_ps(exp_neg8(_mm256_sub_ps(_mm256_loadu_ps(src + j), vtop)), on);
    _mm256_storeu_ps(dst + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  total = register_sum(acc);
#else
  float most[8] = {none, none, none, none, none, none, none, none};
  for (; j + 8 <= n; j += 8)
    for (int t = 0; t < 8; ++t) most[t] = std::max(most[t], seen[j + t] > 0.f ? src[j + t] : none);
  for (int64_t i = j; i < n; ++i) top = std::max(top, seen[i] > 0.f ? src[i] : none);
  for (int t = 0; t < 8; ++t) top = std::max(top, most[t]);
  if (top == none) return 0.f;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (j = 0; j + 8 <= n; j += 8)
    for (int t = 0; t < 8; ++t) {
      const float e = exp_neg(src[j + t] - top);
      dst[j + t] = seen[j + t] > 0.f ? e : 0.f;
      acc[t] += dst[j + t];
    }
  for (int t = 0; t < 8; ++t) total += acc[t];
#endif
  for (; j < n; ++j) {
    const float e = exp_neg(src[j] - top);
    dst[j] = seen[j] > 0.f ? e : 0.f;
    total += dst[j];
  }
  return 1.f / total;
}

// a[j] ← a[j] + b[j]·c (mean) or max(a[j], b[j]·c), the two pools over a GQA group. By hand on
// AVX2: GCC keeps std::max's loop scalar.
inline void pool_into(float* __restrict__ a, const float* __restrict__ b, float c, bool mean, int64_t n) {
  int64_t j = 0;
#ifdef KVRL_AVX2
  const __m256 vc = _mm256_set1_ps(c);
  for (; j + 8 <= n; j += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(b + j), vc), y = _mm256_loadu_ps(a + j);
    _mm256_storeu_ps(a + j, mean ? _mm256_add_ps(y, x) : _mm256_max_ps(y, x));
  }
#endif
  for (; j < n; ++j) a[j] = mean ? a[j] + b[j] * c : std::max(a[j], b[j] * c);
}

// Normalised keys (invalid slots 0) and the norms + eps: torch's (kt * kt).sum(-2).sqrt() + eps
// and kt / norm, in the same order of operations.
std::tuple<at::Tensor, at::Tensor> unit_keys(const at::Tensor& kt, const at::Tensor& valid, double eps) {
  check_keys(kt, valid);
  const int64_t bh = kt.size(0) * kt.size(1), d = kt.size(2), n = kt.size(3);
  auto k = at::empty_like(kt);
  auto norm = at::empty({kt.size(0), kt.size(1), n}, kt.options());
  const float e = static_cast<float>(eps);
  const float* x = kt.data_ptr<float>();
  const bool* v = valid.data_ptr<bool>();
  float* y = k.data_ptr<float>();
  float* nm = norm.data_ptr<float>();
  at::parallel_for(0, bh, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* __restrict__ xi = x + i * d * n;
      float* __restrict__ yi = y + i * d * n;
      float* __restrict__ ni = nm + i * n;
      const bool* vi = v + i * n;
      std::fill(ni, ni + n, 0.f);
      for (int64_t c = 0; c < d; ++c)
        for (int64_t j = 0; j < n; ++j) ni[j] += xi[c * n + j] * xi[c * n + j];
      for (int64_t j = 0; j < n; ++j) ni[j] = std::sqrt(ni[j]) + e;
      for (int64_t c = 0; c < d; ++c)
        for (int64_t j = 0; j < n; ++j) yi[c * n + j] = xi[c * n + j] / ni[j];
      if (!std::all_of(vi, vi + n, [](bool b) { return b; }))
        for (int64_t c = 0; c < d; ++c)
          for (int64_t j = 0; j < n; ++j)
            if (!vi[j]) yi[c * n + j] = 0.f;
    }
  });
  return {k, norm};
}

// Redundancy from the normalised keys and every column's exempt row (pick, -1 for none):
// row sums of the cosines k̂_m·Σk̂ − k̂_m·k̂_m, minus cos(pick[n], n) from row pick[n],
// ÷ the valid count, softmax over the valid slots (0 elsewhere; all 0 without any).
at::Tensor redundancy(const at::Tensor& k, const at::Tensor& norm, const at::Tensor& valid, const at::Tensor& pick,
                      double eps) {
  check_keys(k, valid);
  TORCH_CHECK(pick.scalar_type() == at::kLong && pick.is_contiguous() && pick.sizes() == valid.sizes(),
              "pick must be a contiguous int64 tensor [B, H, N]");
  TORCH_CHECK(norm.scalar_type() == at::kFloat && norm.is_contiguous() && norm.sizes() == valid.sizes(),
              "norm must be a contiguous float32 tensor [B, H, N]");
  const int64_t bh = k.size(0) * k.size(1), d = k.size(2), n = k.size(3);
  auto out = at::empty(valid.sizes(), k.options());
  const float e = static_cast<float>(eps);
  const float* kp = k.data_ptr<float>();
  const float* np_ = norm.data_ptr<float>();
  const bool* vp = valid.data_ptr<bool>();
  const int64_t* pp = pick.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, bh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row_(n), cos_(n), found_(n), seen_(n);
    std::vector<int32_t> at_(n);
    for (int64_t i = begin; i < end; ++i) {
      const float* __restrict__ ki = kp + i * d * n;
      const bool* vi = vp + i * n;
      const int64_t* pi = pp + i * n;
      float* __restrict__ oi = op + i * n;
      float* __restrict__ row = row_.data();
      float* __restrict__ cos = cos_.data();
      float* __restrict__ found = found_.data();
      float* __restrict__ seen = seen_.data();
      int32_t* __restrict__ at = at_.data();
      for (int64_t j = 0; j < n; ++j) {
        TORCH_CHECK(pi[j] >= -1 && pi[j] < n, "pick ", pi[j], " is no slot of the ", n, " (or -1)");
        at[j] = pi[j] >= 0 ? static_cast<int32_t>(pi[j]) : 0;
        found[j] = pi[j] >= 0 ? 1.f : 0.f;
      }
      std::fill(row, row + n, 0.f);
      std::fill(cos, cos + n, 0.f);
      for (int64_t c = 0; c < d; ++c) {
        const float* __restrict__ kc = ki + c * n;
        const float s = lane_sum(kc, n);
        for (int64_t j = 0; j < n; ++j) row[j] += kc[j] * s;
        int64_t j = 0;
#ifdef KVRL_AVX2
        for (; j + 8 <= n; j += 8) {  // the picks' entries by a vector gather (the loop is not vectorised)
          const __m256 picked = _mm256_i32gather_ps(kc, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + j)), 4);
          _mm256_storeu_ps(cos + j, _mm256_fmadd_ps(picked, _mm256_loadu_ps(kc + j), _mm256_loadu_ps(cos + j)));
        }
#endif
        for (; j < n; ++j) cos[j] += kc[at[j]] * kc[j];
      }
      int64_t count = 0;
      for (int64_t j = 0; j < n; ++j) {
        const float self = 1.f - e / np_[i * n + j];
        row[j] -= vi[j] ? self * self : 0.f;
        count += vi[j];
      }
      for (int64_t j = 0; j < n; ++j) row[at[j]] -= cos[j] * found[j];
      if (count == 0) {
        std::fill(oi, oi + n, 0.f);
        continue;
      }
      for (int64_t j = 0; j < n; ++j) {
        row[j] /= static_cast<float>(count);
        seen[j] = vi[j] ? 1.f : 0.f;
      }
      const float inv = softmax_terms(row, oi, seen, n);
      for (int64_t j = 0; j < n; ++j) oi[j] *= inv;
    }
  });
  return out;
}

// One block of _updated_picks: blk [B, H, C, N] = cos(need column cols[i], every row m),
// overwritten. A hit is cos > threshold with m ≠ cols[i] (and m valid when threshold < 0,
// where an invalid row's cos 0 would pass). Returns each column's extreme hit as its row
// code [B, H, C] (m + 1 for the latest hit when `last`, else N − m for the earliest; 0:
// none), found by scanning from that end; newest [B, H, N] takes, per row, the largest
// new_code of the columns that hit it (only new columns have one).
at::Tensor block_extremes(at::Tensor blk, const at::Tensor& cols, const at::Tensor& new_code, const at::Tensor& valid,
                          double threshold, bool last, at::Tensor newest) {
  TORCH_CHECK(blk.dim() == 4 && blk.scalar_type() == at::kFloat && blk.is_contiguous(),
              "blk must be a contiguous float32 tensor [B, H, C, N]");
  const int64_t bh = blk.size(0) * blk.size(1), c = blk.size(2), n = blk.size(3);
  TORCH_CHECK(cols.scalar_type() == at::kLong && cols.is_contiguous() && cols.numel() == bh * c,
              "cols must be contiguous int64 [B, H, C]");
  TORCH_CHECK(new_code.scalar_type() == at::kFloat && new_code.is_contiguous() && new_code.numel() == bh * c,
              "new_code must be contiguous float32 [B, H, C]");
  TORCH_CHECK(newest.scalar_type() == at::kFloat && newest.is_contiguous() && newest.numel() == bh * n,
              "newest must be contiguous float32 [B, H, N]");
  TORCH_CHECK(valid.scalar_type() == at::kBool && valid.is_contiguous() && valid.numel() == bh * n,
              "valid must be contiguous bool [B, H, N]");
  auto extreme = at::empty({blk.size(0), blk.size(1), c}, blk.options());
  const float t = static_cast<float>(threshold);
  float* bp = blk.data_ptr<float>();
  const int64_t* cp = cols.data_ptr<int64_t>();
  const float* ncp = new_code.data_ptr<float>();
  const bool* vp = valid.data_ptr<bool>();
  float* np_ = newest.data_ptr<float>();
  float* ep = extreme.data_ptr<float>();
  at::parallel_for(0, bh, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> floor_(n);
    for (int64_t i = begin; i < end; ++i) {
      // A hit needs cos > floor[m]: the threshold, or +inf at an invalid row when it is < 0.
      float* __restrict__ floor = floor_.data();
      for (int64_t m = 0; m < n; ++m)
        floor[m] = (t >= 0.f || vp[i * n + m]) ? t : std::numeric_limits<float>::infinity();
      float* __restrict__ nw = np_ + i * n;
      for (int64_t q = 0; q < c; ++q) {
        float* __restrict__ row = bp + (i * c + q) * n;
        TORCH_CHECK(cp[i * c + q] >= 0 && cp[i * c + q] < n, "column ", cp[i * c + q], " is no slot of the ", n);
        row[cp[i * c + q]] = -std::numeric_limits<float>::infinity();
        float ex = 0.f;
        if (last) {
          for (int64_t m = n - 1; m >= 0; --m)
            if (row[m] > floor[m]) { ex = static_cast<float>(m + 1); break; }
        } else {
          for (int64_t m = 0; m < n; ++m)
            if (row[m] > floor[m]) { ex = static_cast<float>(n - m); break; }
        }
        ep[i * c + q] = ex;
        const float nc = ncp[i * c + q];
        if (nc > 0.f)
          for (int64_t m = 0; m < n; ++m) nw[m] = (row[m] > floor[m] && nc > nw[m]) ? nc : nw[m];
      }
    }
  });
  return extreme;
}

// window_attention(...).sum(2) of kvrl/kernels/reference/scores.py from the observation queries' logits
// [B, H, G·W, N] (query head g of the group, query w at row g·W + w), one (sample, head) at a
// time: masks by true position, softmax per query head then the pool over the group (or the
// pool of the logits then one softmax), the sum over the queries; [B, H, N].
at::Tensor attention_received(const at::Tensor& logits, const at::Tensor& key_pos, const at::Tensor& query_pos,
                              int64_t groups, bool mean, bool pool_first, bool candidates_only) {
  TORCH_CHECK(logits.dim() == 4 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits must be a contiguous float32 tensor [B, H, G*W, N]");
  const int64_t b = logits.size(0), h = logits.size(1), n = logits.size(3), w = query_pos.size(-1);
  TORCH_CHECK(query_pos.scalar_type() == at::kLong && query_pos.is_contiguous() && query_pos.dim() == 2 &&
                  query_pos.size(0) == b && groups * w == logits.size(2),
              "query_pos must be a contiguous int64 tensor [B, W] with G*W = ", logits.size(2));
  TORCH_CHECK(query_pos.numel() == 0 || query_pos.max().item<int64_t>() < std::numeric_limits<int32_t>::max(),
              "query positions must be below 2^31 - 1 (the visibility masks compare 32-bit positions)");
  TORCH_CHECK(key_pos.scalar_type() == at::kLong && key_pos.is_contiguous() &&
                  key_pos.sizes() == at::IntArrayRef({b, h, n}),
              "key_pos must be a contiguous int64 tensor [B, H, N]");
  auto out = at::zeros({b, h, n}, logits.options());
  const float* lp = logits.data_ptr<float>();
  const int64_t* kp = key_pos.data_ptr<int64_t>();
  const int64_t* qp = query_pos.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, b * h, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> seen_(n), row_(n), pooled_(n);
    std::vector<int32_t> from_(n);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t* qi = qp + (i / h) * w;
      const int64_t* ki = kp + i * n;
      // R-KV's candidates_only: the queries' own keys (from the first valid query position on)
      // are left out of every softmax.
      int64_t first = std::numeric_limits<int64_t>::max();
      if (candidates_only)
        for (int64_t q = 0; q < w; ++q)
          if (qi[q] >= 0) first = std::min(first, qi[q]);
      float* __restrict__ seen = seen_.data();
      float* __restrict__ row = row_.data();
      float* __restrict__ pooled = pooled_.data();
      float* __restrict__ oi = op + i * n;
      // Per slot, the first query position that sees it (INT32_MAX: none), in 32 bits so that
      // each query's mask below is one vectorised compare.
      int32_t* __restrict__ from = from_.data();
      const int32_t never = std::numeric_limits<int32_t>::max();
      for (int64_t j = 0; j < n; ++j) from[j] = ki[j] >= 0 && ki[j] < first && ki[j] < never ? ki[j] : never;
      for (int64_t q = 0; q < w; ++q) {
        const int64_t pos = qi[q];
        if (pos < 0) continue;  // a padding query sees nothing
        const int32_t p32 = static_cast<int32_t>(pos);
        for (int64_t j = 0; j < n; ++j) seen[j] = from[j] <= p32 ? 1.f : 0.f;
        if (pool_first) {  // pool the group's logits, then one softmax
          const float* l0 = lp + (i * groups * w + q) * n;
          std::copy(l0, l0 + n, pooled);
          for (int64_t g = 1; g < groups; ++g) pool_into(pooled, l0 + g * w * n, 1.f, mean, n);
          if (mean)
            for (int64_t j = 0; j < n; ++j) pooled[j] /= static_cast<float>(groups);
          const float inv = softmax_terms(pooled, row, seen, n);
          if (inv > 0.f)
            for (int64_t j = 0; j < n; ++j) oi[j] += row[j] * inv;
          continue;
        }
        std::fill(pooled, pooled + n, 0.f);  // a softmax per query head, then the pool
        for (int64_t g = 0; g < groups; ++g) {
          const float inv = softmax_terms(lp + ((i * groups + g) * w + q) * n, row, seen, n);
          if (inv == 0.f) break;  // no visible slot, for any head of the group
          pool_into(pooled, row, inv, mean, n);
        }
        const float scale = mean ? 1.f / static_cast<float>(groups) : 1.f;
        for (int64_t j = 0; j < n; ++j) oi[j] += pooled[j] * scale;
      }
    }
  });
  return out;
}

// pool_slots of kvrl/kernels/reference/scores.py: x [B, H, N] pooled along each head's valid slots only
// (neighbours are the previous/next valid slots), stride 1, an odd `kernel`; "max" pads with
// -inf, "avg" with zeros that count (the window's sum / kernel, as avg_pool1d); 0 at invalid
// slots. Torch needs a sort, two gathers, the pool and a scatter for the same.
at::Tensor pool_valid(const at::Tensor& x, const at::Tensor& valid, int64_t kernel, bool is_max) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 tensor [B, H, N]");
  TORCH_CHECK(valid.scalar_type() == at::kBool && valid.is_contiguous() && valid.sizes() == x.sizes(),
              "valid must be a contiguous bool tensor [B, H, N]");
  TORCH_CHECK(kernel >= 1 && kernel % 2 == 1, "kernel must be odd and >= 1, got ", kernel);
  const int64_t bh = x.size(0) * x.size(1), n = x.size(2), pad = kernel / 2;
  auto out = at::zeros_like(x);
  const float* xp = x.data_ptr<float>();
  const bool* vp = valid.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, bh, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> slot(n);
    std::vector<float> packed(n);
    for (int64_t i = begin; i < end; ++i) {
      int64_t m = 0;
      for (int64_t j = 0; j < n; ++j)
        if (vp[i * n + j]) {
          slot[m] = j;
          packed[m++] = xp[i * n + j];
        }
      for (int64_t a = 0; a < m; ++a) {
        const int64_t lo = std::max<int64_t>(0, a - pad), hi = std::min(m - 1, a + pad);
        float r = is_max ? -std::numeric_limits<float>::infinity() : 0.f;
        for (int64_t c = lo; c <= hi; ++c) r = is_max ? std::max(r, packed[c]) : r + packed[c];
        op[i * n + slot[a]] = is_max ? r : r / static_cast<float>(kernel);
      }
    }
  });
  return out;
}

// The prelude of key_redundancy_update: per slot, the slot that holds its previous pick (a
// true position; pos ascending among the valid slots) if that position is still in the cache,
// else -1 (kept); whether its exempt row must be searched again (need: valid, and its pick is
// neither present nor -1, i.e. NaN = arrived since, or an evicted position); whether it arrived
// since (fresh: valid and NaN). A position -> slot table per head instead of torch's cummax,
// searchsorted and six elementwise passes.
std::tuple<at::Tensor, at::Tensor, at::Tensor> previous_picks(const at::Tensor& pos, const at::Tensor& prev) {
  TORCH_CHECK(pos.dim() == 3 && pos.scalar_type() == at::kLong && pos.is_contiguous(),
              "pos must be a contiguous int64 tensor [B, H, N]");
  TORCH_CHECK(prev.scalar_type() == at::kFloat && prev.is_contiguous() && prev.sizes() == pos.sizes(),
              "prev must be a contiguous float32 tensor [B, H, N]");
  const int64_t bh = pos.size(0) * pos.size(1), n = pos.size(2);
  auto kept = at::empty_like(pos);
  auto need = at::empty(pos.sizes(), pos.options().dtype(at::kBool));
  auto fresh = at::empty_like(need);
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* vp = prev.data_ptr<float>();
  int64_t* kp = kept.data_ptr<int64_t>();
  bool* np_ = need.data_ptr<bool>();
  bool* fp = fresh.data_ptr<bool>();
  at::parallel_for(0, bh, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> slot_of;  // position -> slot (-1: none); positions are below the sequence length
    for (int64_t i = begin; i < end; ++i) {
      const int64_t* pi = pp + i * n;
      int64_t top = -1;
      for (int64_t j = 0; j < n; ++j) top = std::max(top, pi[j]);
      slot_of.assign(top + 1, -1);
      for (int64_t j = 0; j < n; ++j)
        if (pi[j] >= 0) slot_of[pi[j]] = static_cast<int32_t>(j);
      for (int64_t j = 0; j < n; ++j) {
        const float p = vp[i * n + j];
        int64_t at_slot = -1;
        if (p >= 0.f && p <= static_cast<float>(top) && p == std::floor(p)) at_slot = slot_of[static_cast<int64_t>(p)];
        const bool valid = pi[j] >= 0;
        kp[i * n + j] = at_slot;
        np_[i * n + j] = valid && at_slot < 0 && p != -1.f;
        fp[i * n + j] = valid && std::isnan(p);
      }
    }
  });
  return {kept, need, fresh};
}

// The stale columns of _updated_picks (an old slot whose exempt row was evicted): its extreme
// *old* near-duplicate now. At the previous eviction no row on the far side of the evicted pick
// was a near-duplicate (it was the latest one for `last`, the earliest otherwise), so only the
// old rows on the near side are scanned, outwards from the pick, 8 rows at a time (k is
// [D, N]: a row block is one contiguous load per channel), up to the first hit: cos > threshold,
// another slot, valid and not arrived since (fresh). Returns [B, H, N]: that row's slot, -1 for
// none or a column that is not stale.
at::Tensor stale_picks(const at::Tensor& k, const at::Tensor& pos, const at::Tensor& prev, const at::Tensor& stale,
                       const at::Tensor& fresh, double threshold, bool last) {
  TORCH_CHECK(k.dim() == 4 && k.scalar_type() == at::kFloat && k.is_contiguous(),
              "k must be a contiguous float32 tensor [B, H, D, N]");
  const int64_t bh = k.size(0) * k.size(1), d = k.size(2), n = k.size(3);
  const std::vector<int64_t> shape = {k.size(0), k.size(1), n};
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.is_contiguous() && pos.sizes() == shape,
              "pos must be a contiguous int64 tensor [B, H, N]");
  TORCH_CHECK(prev.scalar_type() == at::kFloat && prev.is_contiguous() && prev.sizes() == shape,
              "prev must be a contiguous float32 tensor [B, H, N]");
  for (const at::Tensor* m : {&stale, &fresh})
    TORCH_CHECK(m->scalar_type() == at::kBool && m->is_contiguous() && m->sizes() == shape,
                "stale and fresh must be contiguous bool tensors [B, H, N]");
  auto out = at::full(shape, -1, pos.options());
  const float t = static_cast<float>(threshold);
  const float* kp = k.data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* vp = prev.data_ptr<float>();
  const bool* sp = stale.data_ptr<bool>();
  const bool* fp = fresh.data_ptr<bool>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, bh, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> carried(n);
    std::vector<float> col(d);
    for (int64_t i = begin; i < end; ++i) {
      const float* ki = kp + i * d * n;
      const int64_t* pi = pp + i * n;
      const bool* fi = fp + i * n;
      int64_t top = -1;
      for (int64_t j = 0; j < n; ++j) carried[j] = top = std::max(top, pi[j]);
      for (int64_t j = 0; j < n; ++j) {
        if (!sp[i * n + j]) continue;
        // the first slot past the evicted pick's position: rows [0, edge) lie before it
        const auto evicted = static_cast<int64_t>(vp[i * n + j]);
        const int64_t edge = std::upper_bound(carried.begin(), carried.end(), evicted) - carried.begin();
        for (int64_t c = 0; c < d; ++c) col[c] = ki[c * n + j];
        int64_t found = -1;
        for (int64_t step = 0; found < 0; ++step) {
          const int64_t lo = last ? edge - 8 * (step + 1) : edge + 8 * step;  // the block's rows [lo, lo + 8)
          if (last ? lo + 8 <= 0 : lo >= n) break;
          float dot[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
          if (lo >= 0 && lo + 8 <= n) {
            for (int64_t c = 0; c < d; ++c)
              for (int r = 0; r < 8; ++r) dot[r] += col[c] * ki[c * n + lo + r];
          } else {
            for (int64_t c = 0; c < d; ++c)
              for (int r = 0; r < 8; ++r)
                if (lo + r >= 0 && lo + r < n) dot[r] += col[c] * ki[c * n + lo + r];
          }
          for (int r = 0; r < 8; ++r) {
            const int64_t m = last ? lo + 7 - r : lo + r;  // outwards from the evicted pick
            if (m < 0 || m >= n || m == j || pi[m] < 0 || fi[m]) continue;
            if (dot[last ? 7 - r : r] > t) {
              found = m;
              break;
            }
          }
        }
        op[i * n + j] = found;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvrl_cpu, m) {
  m.def("unit_keys(Tensor kt, Tensor valid, float eps) -> (Tensor, Tensor)");
  m.def("redundancy(Tensor k, Tensor norm, Tensor valid, Tensor pick, float eps) -> Tensor");
  m.def("block_extremes(Tensor(a!) blk, Tensor cols, Tensor new_code, Tensor valid, float threshold, bool last, "
        "Tensor(b!) newest) -> Tensor");
  m.def("pool_valid(Tensor x, Tensor valid, int kernel, bool is_max) -> Tensor");
  m.def("previous_picks(Tensor pos, Tensor prev) -> (Tensor, Tensor, Tensor)");
  m.def("stale_picks(Tensor k, Tensor pos, Tensor prev, Tensor stale, Tensor fresh, float threshold, bool last) -> "
        "Tensor");
  m.def("attention_received(Tensor logits, Tensor key_pos, Tensor query_pos, int groups, bool mean, bool pool_first, "
        "bool candidates_only) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvrl_cpu, CPU, m) {
  m.impl("unit_keys", &unit_keys);
  m.impl("redundancy", &redundancy);
  m.impl("block_extremes", &block_extremes);
  m.impl("attention_received", &attention_received);
  m.impl("pool_valid", &pool_valid);
  m.impl("previous_picks", &previous_picks);
  m.impl("stale_picks", &stale_picks);
}
