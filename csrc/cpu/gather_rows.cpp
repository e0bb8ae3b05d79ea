// gather_rows on the CPU (schema in csrc/ops.cpp): every argument, src_rows' values included, is
// checked before the first byte is written.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <cstring>
#include <memory>
#include <vector>

#include "../gather_rows.h"

namespace kvcache_ext::cpu {
namespace {

using torch::stable::Tensor;

// One of the two caches: where row b, head h, slot s starts, in bytes.
struct CacheSide {
  char* data;
  int64_t stride[3];     // batch, head, slot; in elements
  int64_t vector_bytes;  // one slot's head_dim elements (keys and values may differ)
  char* at(int64_t b, int64_t h, int64_t s, int64_t elem) const {
    return data + (b * stride[0] + h * stride[1] + s * stride[2]) * elem;
  }
};

void gather_rows(Tensor k_cache, Tensor v_cache, Tensor src_rows) {
  check_gather_rows(k_cache, v_cache, src_rows, kCpuValueDimMayDiffer);
  STD_TORCH_CHECK(k_cache.is_cpu() && v_cache.is_cpu() && src_rows.is_cpu(),
                  "k_cache, v_cache and src_rows must be CPU tensors for the CPU kernel");
  const int64_t B = k_cache.size(0), H = k_cache.size(1), S = k_cache.size(2);
  const int64_t elem = static_cast<int64_t>(k_cache.element_size());
  std::vector<int64_t> src(static_cast<size_t>(B));
  const int64_t* src_data = src_rows.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    src[b] = src_data[b * src_rows.stride(0)];
    STD_TORCH_CHECK(src[b] >= 0 && src[b] < B, "src_rows must be row indices in [0, ", B, "), got ", src[b],
                    " for row ", b);
  }

  // Rows that change, and among the rows they read those that are overwritten too: only these
  // are staged, so that every read sees the old contents.
  std::vector<int64_t> changed, staged_slot(static_cast<size_t>(B), -1), staged;
  for (int64_t b = 0; b < B; ++b)
    if (src[b] != b) changed.push_back(b);
  for (int64_t b : changed)
    if (src[src[b]] != src[b] && staged_slot[src[b]] < 0) {
      staged_slot[src[b]] = static_cast<int64_t>(staged.size());
      staged.push_back(src[b]);
    }
  if (changed.empty()) return;

  const CacheSide sides[2] = {
      {static_cast<char*>(k_cache.mutable_data_ptr()),
       {k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)},
       k_cache.size(3) * elem},
      {static_cast<char*>(v_cache.mutable_data_ptr()),
       {v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)},
       v_cache.size(3) * elem},
  };
  // Staged rows, contiguous (row, head, slot, head_dim), the keys' block then the values'.
  // Uninitialised (new char[], not std::vector): every byte is written before it is read.
  const int64_t num_staged = static_cast<int64_t>(staged.size());
  const int64_t side_bytes[2] = {num_staged * H * S * sides[0].vector_bytes,
                                 num_staged * H * S * sides[1].vector_bytes};
  const std::unique_ptr<char[]> scratch(new char[static_cast<size_t>(side_bytes[0] + side_bytes[1])]);
  auto scratch_at = [&](int64_t side, int64_t slot, int64_t h, int64_t s) {
    return scratch.get() + side * side_bytes[0] + ((slot * H + h) * S + s) * sides[side].vector_bytes;
  };
  const int64_t vector_bytes = std::max(sides[0].vector_bytes, sides[1].vector_bytes);
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(S * vector_bytes, 1));

  // 1. Stage: one work item per (side, staged row, head).
  torch::stable::parallel_for(0, 2 * num_staged * H, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t side = item / (num_staged * H), slot = (item / H) % num_staged, h = item % H;
      for (int64_t s = 0; s < S; ++s)
        std::memcpy(scratch_at(side, slot, h, s), sides[side].at(staged[slot], h, s, elem), sides[side].vector_bytes);
    }
  });
  // 2. Write the changed rows: one work item per (side, changed row, head).
  const int64_t num_changed = static_cast<int64_t>(changed.size());
  torch::stable::parallel_for(0, 2 * num_changed * H, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t side = item / (num_changed * H), b = changed[(item / H) % num_changed], h = item % H;
      const int64_t from = src[b], slot = staged_slot[from];
      for (int64_t s = 0; s < S; ++s) {
        const char* source = slot >= 0 ? scratch_at(side, slot, h, s) : sides[side].at(from, h, s, elem);
        std::memcpy(sides[side].at(b, h, s, elem), source, sides[side].vector_bytes);
      }
    }
  });
}

}  // namespace
}  // namespace kvcache_ext::cpu

STABLE_TORCH_LIBRARY_IMPL(kvcache_ext, CPU, m) { m.impl("gather_rows", TORCH_BOX(&kvcache_ext::cpu::gather_rows)); }
