// CPU implementation of paged_append_latent (csrc/ops.cpp): new latent rows written as they come
// through the block tables into a paged latent pool (python_ref.paged.paged_latent_append_reference).
// Every argument, the values of lengths, new_counts and of each written block table entry included,
// is checked before the first byte is written.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/util/Exception.h>

#include <optional>

#include "../binding_common.h"
#include "latent_cache_checks.h"
#include "paged_rows.h"

namespace kvcache_ext::cpu {
namespace {

void paged_append_latent(Tensor pool, Tensor latent_new, Tensor block_tables, Tensor lengths,
                         std::optional<Tensor> new_counts) {
  const int64_t shift = check_latent_pool(pool);
  const int64_t num_blocks = pool.size(0), H = pool.size(1), Dk = pool.size(3);
  check_latent_dims(Dk, Dk);  // an append stores every column: no value_dim to check
  STD_TORCH_CHECK(elements_distinct(pool),
                  "pool must not be an expanded or self-overlapping view (writes would collide)");
  STD_TORCH_CHECK(latent_new.dim() == 4 && latent_new.size(1) == H && latent_new.size(3) == Dk,
                  "latent_new must be (batch, kv_heads=", H, ", num_new, key_dim=", Dk, ") like the pool, got ",
                  shape_of(latent_new));
  STD_TORCH_CHECK(latent_new.scalar_type() == pool.scalar_type(), "latent_new must be ", dtype_name(pool.scalar_type()),
                  " like the pool, got ", dtype_name(latent_new.scalar_type()));
  check_cpu_tensor(latent_new, "latent_new");
  STD_TORCH_CHECK(disjoint(pool, latent_new), "latent_new must not share memory with the pool");
  const int64_t B = latent_new.size(0), T = latent_new.size(2);
  check_block_tables(block_tables, B, shift);
  check_cpu_tensor(block_tables, "block_tables");
  check_row_vector(lengths, B, "lengths");
  if (new_counts.has_value()) check_row_vector(*new_counts, B, "new_counts");

  const PagedRows rows = paged_write_rows(block_tables, lengths, new_counts, T, shift, num_blocks);

  const PoolCopy copy = pool_copy(pool, latent_new);
  copy_into_blocks(&copy, 1, rows, H, T, static_cast<int64_t>(pool.element_size()), shift);
}

}  // namespace
}  // namespace kvcache_ext::cpu

STABLE_TORCH_LIBRARY_IMPL(kvcache_ext, CPU, m) {
  m.impl("paged_append_latent", TORCH_BOX(&kvcache_ext::cpu::paged_append_latent));
}
