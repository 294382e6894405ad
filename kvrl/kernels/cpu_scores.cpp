// kvrl's native CPU ops for the key redundancy of R-KV and G-KV (specification: the torch
// code of kvrl/kernels/scores.py, which they are tested against). One (sample, head) at a
// time, so each head's keys [D, N] stay in the core's cache across what torch does in
// several passes over the whole batch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

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
    std::vector<float> row_(n), cos_(n), found_(n);
    std::vector<int32_t> at_(n);
    for (int64_t i = begin; i < end; ++i) {
      const float* __restrict__ ki = kp + i * d * n;
      const bool* vi = vp + i * n;
      const int64_t* pi = pp + i * n;
      float* __restrict__ oi = op + i * n;
      float* __restrict__ row = row_.data();
      float* __restrict__ cos = cos_.data();
      float* __restrict__ found = found_.data();
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
        for (int64_t j = 0; j < n; ++j) cos[j] += kc[at[j]] * kc[j];
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
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j)
        if (vi[j]) top = std::max(top, row[j] / count);
      float total = 0.f;
      for (int64_t j = 0; j < n; ++j) {
        oi[j] = vi[j] ? std::exp(row[j] / count - top) : 0.f;
        total += oi[j];
      }
      for (int64_t j = 0; j < n; ++j) oi[j] /= total;
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

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvrl_cpu, m) {
  m.def("unit_keys(Tensor kt, Tensor valid, float eps) -> (Tensor, Tensor)");
  m.def("redundancy(Tensor k, Tensor norm, Tensor valid, Tensor pick, float eps) -> Tensor");
  m.def("block_extremes(Tensor(a!) blk, Tensor cols, Tensor new_code, Tensor valid, float threshold, bool last, "
        "Tensor(b!) newest) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvrl_cpu, CPU, m) {
  m.impl("unit_keys", &unit_keys);
  m.impl("redundancy", &redundancy);
  m.impl("block_extremes", &block_extremes);
}
