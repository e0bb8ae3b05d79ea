// What the CPU and CUDA bindings share: how error messages name a tensor's shape and dtype, and
// the element type a tensor's dtype maps to.
#pragma once

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "capabilities.h"
#include "elem_type.h"
#include "key_rotation.h"
#include "paged_blocks.h"

namespace kvcache_ext {

inline std::string shape_of(const torch::stable::Tensor& t) {
  std::string s = "(";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + ")";
}

inline std::string dtype_name(torch::headeronly::ScalarType t) { return torch::headeronly::toString(t); }

inline ElemType elem_type_of(const torch::stable::Tensor& t, const char* what) {
  using torch::headeronly::ScalarType;
  switch (t.scalar_type()) {
    case ScalarType::Float: return ElemType::kFloat32;
    case ScalarType::BFloat16: return ElemType::kBFloat16;
    case ScalarType::Half: return ElemType::kFloat16;
    default: STD_TORCH_CHECK(false, what, " must be float32, bfloat16 or float16, got ", dtype_name(t.scalar_type()));
  }
  return ElemType::kFloat32;
}

// Bytes a tensor's elements span, from its first to one past its last (0 when empty).
inline int64_t span_bytes(const torch::stable::Tensor& t) {
  if (t.numel() == 0) return 0;
  int64_t last = 0;
  for (int64_t i = 0; i < t.dim(); ++i) last += (t.size(i) - 1) * t.stride(i);
  return (last + 1) * static_cast<int64_t>(t.element_size());
}

// Whether no two elements of t share memory: with the dimensions of more than one element sorted
// by stride, each stride must step over everything the smaller ones span (a sufficient test, and
// exact for every layout made by slicing, transposing and permuting; expanded views fail it).
inline bool elements_distinct(const torch::stable::Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size)
  for (int64_t i = 0; i < t.dim(); ++i)
    if (t.size(i) > 1) dims.emplace_back(t.stride(i), t.size(i));
  std::sort(dims.begin(), dims.end());
  int64_t spanned = 1;  // elements covered by the dimensions so far
  for (const auto& [stride, size] : dims) {
    if (stride < spanned) return false;
    spanned = stride * (size - 1) + spanned;
  }
  return true;
}

// append_kv's optional new_counts: int64 of shape (batch,), one count of stored tokens per row.
// (Values and device are each binding's to check.)
inline void check_new_counts_layout(const torch::stable::Tensor& new_counts, int64_t batch) {
  STD_TORCH_CHECK(new_counts.dim() == 1 && new_counts.size(0) == batch &&
                      new_counts.scalar_type() == torch::headeronly::ScalarType::Long,
                  "new_counts must be int64 of shape (", batch, ",), got ", dtype_name(new_counts.scalar_type()),
                  " of shape ", shape_of(new_counts));
}

// The device-independent checks of a cache pair and its lengths: shapes, dtypes, layout.
// Values of their own width (v's head_dim not k's, as MLA's expanded 192/128): where the
// kernels allow it (value_dim_may_differ: the CPU's), v's last dimension is checked on its own.
inline void check_value_shape(const torch::stable::Tensor& k, const torch::stable::Tensor& v, const char* k_name,
                              const char* v_name, bool value_dim_may_differ) {
  if (!value_dim_may_differ) {
    STD_TORCH_CHECK(v.dim() == 4 && v.sizes().equals(k.sizes()), v_name, " must have ", k_name, "'s shape ",
                    shape_of(k), ", got ", shape_of(v));
    return;
  }
  STD_TORCH_CHECK(v.dim() == 4 && v.size(0) == k.size(0) && v.size(1) == k.size(1) && v.size(2) == k.size(2), v_name,
                  " must have ", k_name, "'s first three dimensions ", shape_of(k), " (its head_dim may differ), got ",
                  shape_of(v));
  STD_TORCH_CHECK(head_dim_supported(v.size(3)), "the values' head_dim must be a multiple of ", kHeadDimMultiple,
                  " between ", kHeadDimMultiple, " and ", kMaxHeadDim, ", got ", v.size(3));
}

inline void check_cache_layout(const torch::stable::Tensor& k_cache, const torch::stable::Tensor& v_cache,
                               const torch::stable::Tensor& lengths, bool value_dim_may_differ = false) {
  using torch::headeronly::ScalarType;
  STD_TORCH_CHECK(k_cache.dim() == 4, "k_cache must be (batch, kv_heads, slots, head_dim), got shape ",
                  shape_of(k_cache));
  check_value_shape(k_cache, v_cache, "k_cache", "v_cache", value_dim_may_differ);
  STD_TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "v_cache must be ", dtype_name(k_cache.scalar_type()),
                  " like k_cache, got ", dtype_name(v_cache.scalar_type()));
  elem_type_of(k_cache, "k_cache");
  STD_TORCH_CHECK(head_dim_supported(k_cache.size(3)), "head_dim must be a multiple of ", kHeadDimMultiple, " between ",
                  kHeadDimMultiple, " and ", kMaxHeadDim, ", got ", k_cache.size(3));
  // The ops write the caches in place: an element must not be two places at once.
  STD_TORCH_CHECK(elements_distinct(k_cache) && elements_distinct(v_cache),
                  "k_cache and v_cache must not be expanded or self-overlapping views (writes would collide)");
  const auto* k_begin = static_cast<const char*>(k_cache.const_data_ptr());
  const auto* v_begin = static_cast<const char*>(v_cache.const_data_ptr());
  STD_TORCH_CHECK(
      k_cache.numel() == 0 || k_begin + span_bytes(k_cache) <= v_begin || v_begin + span_bytes(v_cache) <= k_begin,
      "k_cache and v_cache must not share memory");
  STD_TORCH_CHECK(k_cache.size(2) >= 1, "k_cache must have at least one slot, got shape ", shape_of(k_cache));
  STD_TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
                  "k_cache and v_cache need a contiguous last (head_dim) dimension, got strides ", k_cache.stride(3),
                  " and ", v_cache.stride(3));
  STD_TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == k_cache.size(0), "lengths must have shape (",
                  k_cache.size(0), ",), got ", shape_of(lengths));
  STD_TORCH_CHECK(lengths.scalar_type() == ScalarType::Long, "lengths must be int64, got ",
                  dtype_name(lengths.scalar_type()));
}

// The device-independent checks of a paged pool pair (num_blocks, kv_heads, block_size, head_dim):
// shapes, dtypes, block size, layout. Returns log2(block_size).
inline int64_t check_pool_layout(const torch::stable::Tensor& k_pool, const torch::stable::Tensor& v_pool,
                                 bool value_dim_may_differ = false) {
  STD_TORCH_CHECK(k_pool.dim() == 4, "k_pool must be (num_blocks, kv_heads, block_size, head_dim), got shape ",
                  shape_of(k_pool));
  check_value_shape(k_pool, v_pool, "k_pool", "v_pool", value_dim_may_differ);
  STD_TORCH_CHECK(v_pool.scalar_type() == k_pool.scalar_type(), "v_pool must be ", dtype_name(k_pool.scalar_type()),
                  " like k_pool, got ", dtype_name(v_pool.scalar_type()));
  elem_type_of(k_pool, "k_pool");
  STD_TORCH_CHECK(head_dim_supported(k_pool.size(3)), "head_dim must be a multiple of ", kHeadDimMultiple, " between ",
                  kHeadDimMultiple, " and ", kMaxHeadDim, ", got ", k_pool.size(3));
  const int64_t block_size = k_pool.size(2);
  STD_TORCH_CHECK(block_size_supported(block_size),
                  "block_size (k_pool's dimension 2) must be a power of two from 1 to ", kMaxBlockSize, ", got ",
                  block_size);
  STD_TORCH_CHECK(elements_distinct(k_pool) && elements_distinct(v_pool),
                  "k_pool and v_pool must not be expanded or self-overlapping views (writes would collide)");
  const auto* k_begin = static_cast<const char*>(k_pool.const_data_ptr());
  const auto* v_begin = static_cast<const char*>(v_pool.const_data_ptr());
  STD_TORCH_CHECK(
      k_pool.numel() == 0 || k_begin + span_bytes(k_pool) <= v_begin || v_begin + span_bytes(v_pool) <= k_begin,
      "k_pool and v_pool must not share memory");
  STD_TORCH_CHECK(k_pool.stride(3) == 1 && v_pool.stride(3) == 1,
                  "k_pool and v_pool need a contiguous last (head_dim) dimension, got strides ", k_pool.stride(3),
                  " and ", v_pool.stride(3));
  int64_t shift = 0;
  while ((int64_t{1} << shift) < block_size) ++shift;
  return shift;
}

// block_tables (batch, max_blocks_per_row) int32 or int64, and every position of a table within
// kMaxLength (so position arithmetic stays in int64).
inline void check_block_tables(const torch::stable::Tensor& block_tables, int64_t batch, int64_t block_shift) {
  using torch::headeronly::ScalarType;
  STD_TORCH_CHECK(block_tables.scalar_type() == ScalarType::Int || block_tables.scalar_type() == ScalarType::Long,
                  "block_tables must be int32 or int64, got ", dtype_name(block_tables.scalar_type()));
  STD_TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch, "block_tables must be (batch=", batch,
                  ", max_blocks_per_row), got shape ", shape_of(block_tables));
  STD_TORCH_CHECK(block_tables.size(1) <= (kMaxLength >> block_shift), "block_tables has ", block_tables.size(1),
                  " blocks per row: more positions than 2^62");
}

// A paged attention's block_tables (check_block_tables), and room in them for the num_new new
// tokens (every row's length is at least num_new and at most the table's positions): a shape check,
// so that it refuses an empty batch too, as the Python wrappers do.
inline void check_attention_block_tables(const torch::stable::Tensor& block_tables, int64_t batch, int64_t block_shift,
                                         int64_t num_new) {
  check_block_tables(block_tables, batch, block_shift);
  const int64_t capacity = block_tables.size(1) << block_shift;
  STD_TORCH_CHECK(num_new <= capacity, "q holds ", num_new, " new tokens but block_tables holds ", capacity,
                  " positions per row (", block_tables.size(1), " blocks of ", int64_t{1} << block_shift,
                  "): at most as many new tokens as positions");
}

// The int64 (batch,) vectors of the paged ops (lengths, new_counts); devices are each binding's.
inline void check_row_counts(const torch::stable::Tensor& t, int64_t batch, const char* what) {
  STD_TORCH_CHECK(t.dim() == 1 && t.size(0) == batch && t.scalar_type() == torch::headeronly::ScalarType::Long, what,
                  " must be int64 of shape (", batch, ",), got ", dtype_name(t.scalar_type()), " of shape ",
                  shape_of(t));
}

// paged_append_kv's new keys/values against the pool: shapes and dtype. Returns num_new. value_dim:
// the values' head_dim (v_pool's), -1 for the keys'.
inline int64_t check_paged_new_tokens(const torch::stable::Tensor& k_pool, const torch::stable::Tensor& k_new,
                                      const torch::stable::Tensor& v_new, int64_t value_dim = -1) {
  const int64_t H = k_pool.size(1), D = k_pool.size(3), Dv = value_dim < 0 ? D : value_dim;
  for (const auto& [t, name, width] : {std::tuple{&k_new, "k_new", D}, std::tuple{&v_new, "v_new", Dv}}) {
    STD_TORCH_CHECK(t->dim() == 4 && t->size(1) == H && t->size(3) == width && k_new.dim() == 4 &&
                        t->size(0) == k_new.size(0) && t->size(2) == k_new.size(2),
                    "k_new and v_new must be (batch, kv_heads=", H, ", num_new, head_dim=", D,
                    ") and (batch, kv_heads=", H, ", num_new, ", Dv, "), got ", shape_of(k_new), " and ",
                    shape_of(v_new));
    STD_TORCH_CHECK(t->scalar_type() == k_pool.scalar_type(), name, " must be ", dtype_name(k_pool.scalar_type()),
                    " like the pool, got ", dtype_name(t->scalar_type()));
  }
  return k_new.size(2);
}

// The GQA grouping of every attention op: at least one query head and one KV head, q_heads a
// multiple of kv_heads (a query of zero heads would make a group of zero heads per KV head).
inline void check_query_heads(int64_t q_heads, int64_t kv_heads) {
  STD_TORCH_CHECK(kv_heads >= 1 && q_heads >= 1 && q_heads % kv_heads == 0, "q_heads (", q_heads,
                  ") must be a positive multiple of kv_heads (", kv_heads, ") and kv_heads at least 1");
}

// paged_decode_attention's q against the pool, and window: shapes, dtype, GQA grouping.
inline void check_paged_queries(const torch::stable::Tensor& q, const torch::stable::Tensor& k_pool,
                                std::optional<int64_t> window) {
  const int64_t H_kv = k_pool.size(1), D = k_pool.size(3);
  STD_TORCH_CHECK(q.dim() == 4 && q.size(3) == D, "q must be (batch, q_heads, num_new, head_dim=", D, "), got shape ",
                  shape_of(q));
  STD_TORCH_CHECK(q.scalar_type() == k_pool.scalar_type(), "q must have the pool's dtype ",
                  dtype_name(k_pool.scalar_type()), ", got ", dtype_name(q.scalar_type()));
  STD_TORCH_CHECK(q.size(2) >= 1, "q must hold at least one new token");
  check_query_heads(q.size(1), H_kv);
  STD_TORCH_CHECK(!window.has_value() || *window >= 1, "window must be >= 1 or None, got ", window.value_or(0));
}

// block_tables (host memory) as the paged ops' value checks (paged_blocks.h) read it.
inline HostBlockTable host_block_table(const torch::stable::Tensor& block_tables) {
  return {block_tables.const_data_ptr(),
          block_tables.scalar_type() == torch::headeronly::ScalarType::Long,
          block_tables.size(0),
          block_tables.size(1),
          {block_tables.stride(0), block_tables.stride(1)}};
}

// Each row's length, read through lengths' stride (it may be a view), checked to lie in
// [lowest, kMaxLength]: `what` says what a length counts, for the error. Reads lengths on the
// host: for the CPU bindings only (the CUDA ones never read device memory).
inline std::vector<int64_t> row_lengths(const torch::stable::Tensor& lengths, int64_t lowest, const char* what) {
  const int64_t B = lengths.size(0), stride = lengths.stride(0);
  const int64_t* data = lengths.const_data_ptr<int64_t>();
  std::vector<int64_t> len(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    len[b] = data[b * stride];
    STD_TORCH_CHECK(len[b] >= lowest && len[b] <= kMaxLength, "lengths must count ", what, ": between ", lowest,
                    " and 2^62, got ", len[b], " for row ", b);
  }
  return len;
}

// Each row's count of stored tokens for an append of num_new tokens per row: new_counts (int64
// (batch,), read through its stride) checked to lie in [0, num_new], or num_new for every row
// without it. Reads new_counts on the host: for the CPU bindings only.
inline std::vector<int64_t> row_new_counts(const std::optional<torch::stable::Tensor>& new_counts, int64_t batch,
                                           int64_t num_new) {
  std::vector<int64_t> count(static_cast<size_t>(batch), num_new);
  if (!new_counts.has_value()) return count;
  check_new_counts_layout(*new_counts, batch);
  STD_TORCH_CHECK(new_counts->is_cpu(), "new_counts must be a CPU tensor for the CPU kernel");
  const int64_t* data = new_counts->const_data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    count[b] = data[b * new_counts->stride(0)];
    STD_TORCH_CHECK(count[b] >= 0 && count[b] <= num_new, "new_counts must be between 0 and num_new=", num_new,
                    ", got ", count[b], " for row ", b);
  }
  return count;
}

// append_kv's new keys/values against the cache: shapes, dtype, equal token counts, at most as
// many tokens as slots. Returns the number of new tokens. (Devices are each binding's to check.)
// append_kv's new keys/values against the cache: shapes and dtype. Returns num_new. value_dim: the
// values' head_dim (v_cache's), -1 for the keys'.
inline int64_t check_new_tokens(const torch::stable::Tensor& k_cache, const torch::stable::Tensor& k_new,
                                const torch::stable::Tensor& v_new, int64_t value_dim = -1) {
  const int64_t B = k_cache.size(0), H = k_cache.size(1), S = k_cache.size(2), D = k_cache.size(3);
  for (const auto& [t, name, width] :
       {std::tuple{&k_new, "k_new", D}, std::tuple{&v_new, "v_new", value_dim < 0 ? D : value_dim}}) {
    STD_TORCH_CHECK(t->dim() == 4 && t->size(0) == B && t->size(1) == H && t->size(3) == width, name,
                    " must be (batch=", B, ", kv_heads=", H, ", num_new, head_dim=", width, ") like the cache, got ",
                    shape_of(*t));
    STD_TORCH_CHECK(t->scalar_type() == k_cache.scalar_type(), name, " must be ", dtype_name(k_cache.scalar_type()),
                    " like the cache, got ", dtype_name(t->scalar_type()));
  }
  const int64_t T = k_new.size(2);
  STD_TORCH_CHECK(v_new.size(2) == T, "k_new and v_new must hold the same number of tokens, got ", T, " and ",
                  v_new.size(2));
  STD_TORCH_CHECK(T <= S, "cannot append ", T, " tokens at once to a cache of ", S, " slots");
  return T;
}

// decode_attention's scale as the kernels use it (default 1/sqrt(head_dim)): finite, and at most
// FLT_MAX / 2 in magnitude so that float32 products with it (the CUDA kernel folds in log2(e))
// stay finite.
inline float checked_scale(std::optional<double> scale, int64_t head_dim) {
  const double value = scale.value_or(1.0 / std::sqrt(static_cast<double>(head_dim)));
  STD_TORCH_CHECK(std::isfinite(value) && std::abs(value) <= std::numeric_limits<float>::max() / 2,
                  "scale must be finite and at most 1.7e38 in magnitude (float32 arithmetic), got ", value);
  return static_cast<float>(value);
}

// decode_attention's new tokens must fit the cache's slots: with more, the earliest queries' own
// positions are already overwritten and they would attend to nothing.
inline void check_new_tokens_fit(int64_t num_new, int64_t slots) {
  STD_TORCH_CHECK(num_new <= slots, "q holds ", num_new, " new tokens but the cache has ", slots,
                  " slots: at most as many new tokens as slots");
}

// The optional arguments of decode_attention that both devices check alike: softcap must be a
// positive finite number, sinks a float32 [q_heads] tensor on q's device.
inline void check_softcap_and_sinks(std::optional<double> softcap, const std::optional<torch::stable::Tensor>& sinks,
                                    const torch::stable::Tensor& q) {
  STD_TORCH_CHECK(!softcap.has_value() || (std::isfinite(*softcap) && *softcap > 0),
                  "softcap must be a positive finite number or None, got ", softcap.value_or(0));
  if (!sinks.has_value()) return;
  STD_TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == q.size(1), "sinks must have one logit per query head, shape (",
                  q.size(1), ",), got ", shape_of(*sinks));
  STD_TORCH_CHECK(sinks->scalar_type() == torch::headeronly::ScalarType::Float, "sinks must be float32, got ",
                  dtype_name(sinks->scalar_type()));
  STD_TORCH_CHECK(sinks->get_device_index() == q.get_device_index() && sinks->is_cpu() == q.is_cpu(),
                  "sinks must be on q's device");
}

// The format a quantized cache's data dtype stores.
inline KvFormat format_of(const torch::stable::Tensor& data) {
  using torch::headeronly::ScalarType;
  switch (data.scalar_type()) {
    case ScalarType::Char: return KvFormat::kInt8;
    case ScalarType::Float8_e4m3fn: return KvFormat::kFp8E4M3;
    case ScalarType::Byte: return KvFormat::kInt4;
    default:
      STD_TORCH_CHECK(false,
                      "k_data must be int8 (int8 format), float8_e4m3fn (fp8_e4m3) or uint8 (int4, two "
                      "values per byte), got ",
                      dtype_name(data.scalar_type()));
  }
  return KvFormat::kInt8;
}

// Whether two tensors' spans of memory are apart.
inline bool disjoint(const torch::stable::Tensor& a, const torch::stable::Tensor& b) {
  const auto* a_begin = static_cast<const char*>(a.const_data_ptr());
  const auto* b_begin = static_cast<const char*>(b.const_data_ptr());
  return a.numel() == 0 || b.numel() == 0 || a_begin + span_bytes(a) <= b_begin || b_begin + span_bytes(b) <= a_begin;
}

// The device-independent checks of quantized storage (python_ref/quantize.py): data and scales
// of keys and values, laid out (`dims`, head_dim) = (batch, kv_heads, slots, ...) for a cache or
// (num_blocks, kv_heads, block_size, ...) for a paged pool; shapes, dtypes, layout, no shared
// memory. Returns the format and head_dim (values per cached vector).
inline std::pair<KvFormat, int64_t> check_quantized_storage(const torch::stable::Tensor& k_data,
                                                            const torch::stable::Tensor& k_scales,
                                                            const torch::stable::Tensor& v_data,
                                                            const torch::stable::Tensor& v_scales, const char* dims) {
  using torch::headeronly::ScalarType;
  using torch::stable::Tensor;
  STD_TORCH_CHECK(k_data.dim() == 4, "k_data must be (", dims, ", head_dim bytes), got shape ", shape_of(k_data));
  STD_TORCH_CHECK(v_data.dim() == 4 && v_data.sizes().equals(k_data.sizes()), "v_data must have k_data's shape ",
                  shape_of(k_data), ", got ", shape_of(v_data));
  STD_TORCH_CHECK(v_data.scalar_type() == k_data.scalar_type(), "v_data must be ", dtype_name(k_data.scalar_type()),
                  " like k_data, got ", dtype_name(v_data.scalar_type()));
  const KvFormat format = format_of(k_data);
  const int64_t B = k_data.size(0), H = k_data.size(1), S = k_data.size(2);
  const int64_t D = format == KvFormat::kInt4 ? 2 * k_data.size(3) : k_data.size(3);
  STD_TORCH_CHECK(head_dim_supported(D), "head_dim must be a multiple of ", kHeadDimMultiple, " between ",
                  kHeadDimMultiple, " and ", kMaxHeadDim, ", got ", D);
  STD_TORCH_CHECK(format != KvFormat::kInt4 || D % kInt4Group == 0, "int4 needs head_dim a multiple of ", kInt4Group,
                  ", got ", D);
  STD_TORCH_CHECK(S >= 1, "k_data must have at least one slot, got shape ", shape_of(k_data));
  const bool int4 = format == KvFormat::kInt4;
  const ScalarType scale_type = int4 ? ScalarType::Half : ScalarType::Float;
  for (const auto& [t, name] : {std::pair{&k_scales, "k_scales"}, std::pair{&v_scales, "v_scales"}}) {
    const bool shape_ok = int4 ? t->dim() == 4 && t->size(0) == B && t->size(1) == H && t->size(2) == S &&
                                     t->size(3) == D / kInt4Group && (t->size(3) == 1 || t->stride(3) == 1)
                               : t->dim() == 3 && t->size(0) == B && t->size(1) == H && t->size(2) == S;
    STD_TORCH_CHECK(shape_ok, name, " must be (", dims, int4 ? ", head_dim / 32) with contiguous groups" : ")", " for ",
                    shape_of(k_data), " data, got ", shape_of(*t));
    STD_TORCH_CHECK(t->scalar_type() == scale_type, name, " must be ", dtype_name(scale_type), ", got ",
                    dtype_name(t->scalar_type()));
  }
  STD_TORCH_CHECK(k_data.stride(3) == 1 && v_data.stride(3) == 1, "k_data and v_data need a contiguous last dimension");
  // The ops write all four in place: no element may be two places at once, no two may overlap.
  const Tensor* written[4] = {&k_data, &k_scales, &v_data, &v_scales};
  for (int i = 0; i < 4; ++i) {
    STD_TORCH_CHECK(elements_distinct(*written[i]),
                    "the cache's data and scales must not be expanded or self-overlapping views");
    for (int j = i + 1; j < 4; ++j)
      STD_TORCH_CHECK(disjoint(*written[i], *written[j]),
                      "k_data, k_scales, v_data and v_scales must not share memory");
  }
  return {format, D};
}

// check_quantized_storage of a quantized cache (batch, kv_heads, slots, ...), and its lengths.
// Devices and the slot limit are each binding's to check.
inline std::pair<KvFormat, int64_t> check_quantized_cache_layout(const torch::stable::Tensor& k_data,
                                                                 const torch::stable::Tensor& k_scales,
                                                                 const torch::stable::Tensor& v_data,
                                                                 const torch::stable::Tensor& v_scales,
                                                                 const torch::stable::Tensor& lengths) {
  const auto format_and_head_dim =
      check_quantized_storage(k_data, k_scales, v_data, v_scales, "batch, kv_heads, slots");
  STD_TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == k_data.size(0), "lengths must have shape (", k_data.size(0),
                  ",), got ", shape_of(lengths));
  STD_TORCH_CHECK(lengths.scalar_type() == torch::headeronly::ScalarType::Long, "lengths must be int64, got ",
                  dtype_name(lengths.scalar_type()));
  return format_and_head_dim;
}

// check_quantized_storage of a quantized paged pool (num_blocks, kv_heads, block_size, ...) and
// its block size. Returns the format, head_dim and log2(block_size).
inline std::tuple<KvFormat, int64_t, int64_t> check_quantized_pool_layout(const torch::stable::Tensor& k_data,
                                                                          const torch::stable::Tensor& k_scales,
                                                                          const torch::stable::Tensor& v_data,
                                                                          const torch::stable::Tensor& v_scales) {
  const auto [format, D] =
      check_quantized_storage(k_data, k_scales, v_data, v_scales, "num_blocks, kv_heads, block_size");
  const int64_t block_size = k_data.size(2);
  STD_TORCH_CHECK(block_size_supported(block_size),
                  "block_size (k_data's dimension 2) must be a power of two from 1 to ", kMaxBlockSize, ", got ",
                  block_size);
  int64_t shift = 0;
  while ((int64_t{1} << shift) < block_size) ++shift;
  return {format, D, shift};
}

// append_kv_quantized's new keys/values against a quantized cache of head_dim D: shapes, a float
// dtype shared by both, equal token counts, at most as many tokens as slots. Returns the number
// of new tokens. (Devices are each binding's to check.)
inline int64_t check_quantized_new_tokens(const torch::stable::Tensor& k_data, int64_t D,
                                          const torch::stable::Tensor& k_new, const torch::stable::Tensor& v_new) {
  const int64_t B = k_data.size(0), H = k_data.size(1), S = k_data.size(2);
  for (const auto& [t, name] : {std::pair{&k_new, "k_new"}, std::pair{&v_new, "v_new"}}) {
    STD_TORCH_CHECK(t->dim() == 4 && t->size(0) == B && t->size(1) == H && t->size(3) == D, name, " must be (batch=", B,
                    ", kv_heads=", H, ", num_new, head_dim=", D, ") like the cache, got ", shape_of(*t));
    elem_type_of(*t, name);
  }
  STD_TORCH_CHECK(v_new.scalar_type() == k_new.scalar_type(), "v_new must be ", dtype_name(k_new.scalar_type()),
                  " like k_new, got ", dtype_name(v_new.scalar_type()));
  const int64_t T = k_new.size(2);
  STD_TORCH_CHECK(v_new.size(2) == T, "k_new and v_new must hold the same number of tokens, got ", T, " and ",
                  v_new.size(2));
  STD_TORCH_CHECK(T <= S, "cannot append ", T, " tokens at once to a cache of ", S, " slots");
  return T;
}

// paged_append_kv_quantized's new keys/values against a quantized pool of head_dim D: shapes and a
// float dtype shared by both. Returns num_new. (Devices are each binding's to check.)
inline int64_t check_paged_quantized_new_tokens(const torch::stable::Tensor& k_data, int64_t D,
                                                const torch::stable::Tensor& k_new,
                                                const torch::stable::Tensor& v_new) {
  const int64_t H = k_data.size(1);
  for (const auto& [t, name] : {std::pair{&k_new, "k_new"}, std::pair{&v_new, "v_new"}}) {
    STD_TORCH_CHECK(t->dim() == 4 && t->size(1) == H && t->size(3) == D && t->sizes().equals(k_new.sizes()),
                    "k_new and v_new must both be (batch, kv_heads=", H, ", num_new, head_dim=", D, "), got ",
                    shape_of(k_new), " and ", shape_of(v_new));
    elem_type_of(*t, name);
  }
  STD_TORCH_CHECK(v_new.scalar_type() == k_new.scalar_type(), "v_new must be ", dtype_name(k_new.scalar_type()),
                  " like k_new, got ", dtype_name(v_new.scalar_type()));
  return k_new.size(2);
}

// A quantized attention's q against kv_heads KV heads, and the attention options: q's dtype, at
// least one new token, GQA grouping, window, softcap and sinks. (Shapes against the cache or pool,
// and devices, are each binding's to check.)
inline void check_quantized_queries(const torch::stable::Tensor& q, int64_t H_kv, std::optional<int64_t> window,
                                    std::optional<double> softcap, const std::optional<torch::stable::Tensor>& sinks) {
  elem_type_of(q, "q");
  STD_TORCH_CHECK(q.size(2) >= 1, "q must hold at least one new token");
  check_query_heads(q.size(1), H_kv);
  STD_TORCH_CHECK(!window.has_value() || *window >= 1, "window must be >= 1 or None, got ", window.value_or(0));
  check_softcap_and_sinks(softcap, sinks, q);
}

// The rotated-key formats' Walsh-Hadamard transform (key_rotation.h) needs a power-of-two head_dim.
inline void check_rotated_head_dim(bool rotate_keys, int64_t head_dim) {
  STD_TORCH_CHECK(!rotate_keys || rotation_head_dim_supported(head_dim),
                  "rotated keys (rotate_keys, the *_rot formats) need head_dim a power of two (a Walsh-Hadamard "
                  "transform), got ",
                  head_dim);
}

// ---- the attention ops' queries, as both bindings check them ----------------------------------
// Each takes the binding's check of a tensor's device, check_device(t, name) (the CPU binding's: a
// CPU tensor; the CUDA one's: on the cache's GPU), and makes it where the binding made it before, so
// that a call with one bad argument is refused with the same message on either device.

// The sizes of a contiguous cache's attention: the cache's, then q's heads and new tokens.
struct QueryProblem {
  int64_t batch, kv_heads, slots, head_dim, q_heads, num_new;
};

// decode_attention's q against the cache pair (batch, kv_heads, slots, head_dim), and the window:
// q's rank, device, shape and dtype, at least one new token and no more than the slots, the GQA
// grouping. (softcap and sinks: check_softcap_and_sinks, where each binding checks them.)
template <typename CheckDevice>
inline QueryProblem check_decode_queries(const torch::stable::Tensor& q, const torch::stable::Tensor& k_cache,
                                         std::optional<int64_t> window, CheckDevice check_device) {
  STD_TORCH_CHECK(q.dim() == 4, "q must be (batch, q_heads, num_new, head_dim), got shape ", shape_of(q));
  check_device(q, "q");
  const QueryProblem s{k_cache.size(0), k_cache.size(1), k_cache.size(2), k_cache.size(3), q.size(1), q.size(2)};
  STD_TORCH_CHECK(q.size(0) == s.batch && q.size(3) == s.head_dim, "q must be (batch=", s.batch,
                  ", q_heads, num_new, head_dim=", s.head_dim, ") to match the cache ", shape_of(k_cache), ", got ",
                  shape_of(q));
  STD_TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q must have the cache's dtype ",
                  dtype_name(k_cache.scalar_type()), ", got ", dtype_name(q.scalar_type()));
  STD_TORCH_CHECK(s.num_new >= 1, "q must hold at least one new token");
  check_new_tokens_fit(s.num_new, s.slots);
  check_query_heads(s.q_heads, s.kv_heads);
  STD_TORCH_CHECK(!window.has_value() || *window >= 1, "window must be >= 1 or None, got ", window.value_or(0));
  return s;
}

// decode_attention_quantized's q against a quantized cache of head_dim D (k_data: its codes), and the
// options: q's rank, device and shape, check_quantized_queries, the new tokens fitting the slots.
template <typename CheckDevice>
inline void check_quantized_cache_queries(const torch::stable::Tensor& q, const torch::stable::Tensor& k_data,
                                          int64_t D, std::optional<int64_t> window, std::optional<double> softcap,
                                          const std::optional<torch::stable::Tensor>& sinks, CheckDevice check_device) {
  STD_TORCH_CHECK(q.dim() == 4, "q must be (batch, q_heads, num_new, head_dim), got shape ", shape_of(q));
  check_device(q, "q");
  const int64_t B = k_data.size(0);
  STD_TORCH_CHECK(q.size(0) == B && q.size(3) == D, "q must be (batch=", B, ", q_heads, num_new, head_dim=", D,
                  ") to match the cache, got ", shape_of(q));
  check_quantized_queries(q, k_data.size(1), window, softcap, sinks);
  check_new_tokens_fit(q.size(2), k_data.size(2));
}

// paged_decode_attention_quantized's q against a quantized pool of head_dim D (k_data: its codes)
// in blocks of 2^shift positions, the options, the block tables and lengths: shapes, dtypes,
// devices (not the values: each binding reads them).
template <typename CheckDevice>
inline void check_paged_quantized_queries(const torch::stable::Tensor& q, const torch::stable::Tensor& k_data,
                                          int64_t D, int64_t shift, const torch::stable::Tensor& block_tables,
                                          const torch::stable::Tensor& lengths, std::optional<int64_t> window,
                                          std::optional<double> softcap,
                                          const std::optional<torch::stable::Tensor>& sinks, CheckDevice check_device) {
  STD_TORCH_CHECK(q.dim() == 4 && q.size(3) == D, "q must be (batch, q_heads, num_new, head_dim=", D, "), got shape ",
                  shape_of(q));
  check_device(q, "q");
  check_quantized_queries(q, k_data.size(1), window, softcap, sinks);
  check_attention_block_tables(block_tables, q.size(0), shift, q.size(2));
  check_device(block_tables, "block_tables");
  check_row_counts(lengths, q.size(0), "lengths");
  check_device(lengths, "lengths");
}

// paged_append_kv_quantized's new keys/values against a quantized pool of head_dim D in blocks of
// 2^shift positions, its block tables, lengths and new_counts: shapes, dtypes, devices (not the
// values: each binding reads them). Returns the number of new tokens.
template <typename CheckDevice>
inline int64_t check_paged_quantized_append(const torch::stable::Tensor& k_data, int64_t D, int64_t shift,
                                            const torch::stable::Tensor& k_new, const torch::stable::Tensor& v_new,
                                            const torch::stable::Tensor& block_tables,
                                            const torch::stable::Tensor& lengths,
                                            const std::optional<torch::stable::Tensor>& new_counts,
                                            CheckDevice check_device) {
  const int64_t T = check_paged_quantized_new_tokens(k_data, D, k_new, v_new);
  check_device(k_new, "k_new");
  check_device(v_new, "v_new");
  const int64_t B = k_new.size(0);
  check_block_tables(block_tables, B, shift);
  check_device(block_tables, "block_tables");
  check_row_counts(lengths, B, "lengths");
  check_device(lengths, "lengths");
  if (new_counts.has_value()) {
    check_row_counts(*new_counts, B, "new_counts");
    check_device(*new_counts, "new_counts");
  }
  return T;
}

}  // namespace kvcache_ext
