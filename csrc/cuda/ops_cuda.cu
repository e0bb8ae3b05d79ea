// CUDA implementations of the ops catalogued in csrc/ops.cpp: input checks (as in
// cpu/ops_cpu.cpp), output and scratch allocation, and the launch on the current stream. The
// kernels themselves (kernels.h) see only raw pointers and sizes.
//
// A decode step must be capturable in a CUDA graph: nothing here reads device memory on the
// host or synchronises, and every allocation is sized from shapes. The price is that checks
// on the values of `lengths` cannot be made here, so every refusal below depends on shapes,
// dtypes, strides, devices and the scalar arguments only; the kernels stay in bounds for any
// length (append_kv leaves a row whose length is outside [0, kMaxLength] untouched;
// decode_attention gives a row whose length is outside [num_new, kMaxLength] zeros and a
// log-sum-exp of -inf).
//
// The paged ops are the exception: whether a block id is in range decides where a byte is
// written, and a call with a bad id must change nothing and raise, as on the CPU. So they read
// lengths, new_counts and block_tables on the host (one synchronising copy), check them with the
// CPU binding's code (paged_blocks.h), and hand the kernels a device copy of what was checked
// (the lengths, counts and a dense table of the used block ids), never the caller's table. They
// synchronise and cannot be captured in a CUDA graph; the Python wrappers keep their checks of
// shapes only, so the values are read once per call.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>  // aoti_torch_get_current_cuda_stream (USE_CUDA)
#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/macros.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/Exception.h>
#include <torch/headeronly/util/shim_utils.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "../binding_common.h"
#include "../capabilities.h"
#include "../cpu/latent_cache_checks.h"
#include "kernels.h"
#include "latent_attention.h"

namespace kvcache_ext::cuda {
namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

// All tensors of one call on the cache's GPU (`cache_name`: what the message calls it).
void check_on_device(const Tensor& t, const char* what, const Tensor& k_cache, const char* cache_name = "k_cache") {
  STD_TORCH_CHECK(t.is_cuda(), what, " must be a CUDA tensor for the CUDA kernel");
  STD_TORCH_CHECK(t.get_device_index() == k_cache.get_device_index(), what,
                  " must be on cuda:", k_cache.get_device_index(), " like ", cache_name,
                  ", got cuda:", t.get_device_index());
}

// Checks shared by both ops: the cache pair, its layout and the lengths tensor.
void check_cache(const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths) {
  check_cache_layout(k_cache, v_cache, lengths);
  const int64_t D = k_cache.size(3);
  STD_TORCH_CHECK(head_dim_supported(D), "head_dim must be a multiple of ", kHeadDimMultiple, " between ",
                  kHeadDimMultiple, " and ", kMaxHeadDim, ", got ", D);
  STD_TORCH_CHECK(k_cache.size(2) >= 1 && k_cache.size(2) <= kMaxSlotsCuda, "k_cache must have between 1 and ",
                  kMaxSlotsCuda, " slots on CUDA, got ", k_cache.size(2));
  STD_TORCH_CHECK(k_cache.is_cuda(), "k_cache must be a CUDA tensor for the CUDA kernel");
  check_on_device(v_cache, "v_cache", k_cache);
  check_on_device(lengths, "lengths", k_cache);
}

cudaStream_t current_stream(int32_t device_index) {
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_current_cuda_stream(device_index, &stream));
  return static_cast<cudaStream_t>(stream);
}

// Multiprocessor count, queried once per device (a host attribute query: no sync, capturable).
int sm_count(int32_t device_index) {
  static std::atomic<int> cached[64];
  if (device_index >= 0 && device_index < 64) {
    const int known = cached[device_index].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int count = 0;
  STD_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device_index));
  if (device_index >= 0 && device_index < 64) cached[device_index].store(count, std::memory_order_relaxed);
  return count;
}

// An attention's out [batch, q_heads, num_new, width] in q's dtype, lse [batch, q_heads, num_new]
// float32 and, for splits > 1, the split scratch (partial outputs, then partial log-sum-exps), whose
// pointers P's partial_out / partial_lse receive. Sized from shapes and the plan only.
struct AttentionBuffers {
  Tensor out, lse;
  std::optional<Tensor> scratch;
};
template <typename P>
AttentionBuffers attention_buffers(P& p, const Tensor& q, int64_t width) {
  const int64_t B = p.batch, H_q = p.q_heads, T = p.num_new;
  AttentionBuffers buffers{torch::stable::empty({B, H_q, T, width}, q.scalar_type(), std::nullopt, q.device()),
                           torch::stable::empty({B, H_q, T}, ScalarType::Float, std::nullopt, q.device()),
                           std::nullopt};
  p.out = buffers.out.mutable_data_ptr();
  p.lse = buffers.lse.mutable_data_ptr<float>();
  if (p.splits > 1) {
    const int64_t rows = B * H_q * T;
    buffers.scratch =
        torch::stable::empty({rows * p.splits * (width + 1)}, ScalarType::Float, std::nullopt, q.device());
    p.partial_out = buffers.scratch->mutable_data_ptr<float>();
    p.partial_lse = p.partial_out + rows * p.splits * width;
  }
  return buffers;
}

// The part of decode_attention both caches share once p holds the checked problem: the plan, the
// buffers (attention_buffers, so graph capture sees fixed sizes), the launch on the current stream.
std::tuple<Tensor, Tensor> plan_and_launch_decode(DecodeAttentionParams& p, const Tensor& q, int32_t device) {
  torch::stable::accelerator::DeviceGuard guard(device);
  plan_decode_attention(p, sm_count(device));
  const AttentionBuffers buffers = attention_buffers(p, q, p.head_dim);
  STD_CUDA_CHECK(launch_decode_attention(p, current_stream(device)));
  return {buffers.out, buffers.lse};
}

void append_kv(Tensor k_cache, Tensor v_cache, Tensor k_new, Tensor v_new, Tensor lengths,
               std::optional<Tensor> new_counts) {
  check_cache(k_cache, v_cache, lengths);
  const int64_t B = k_cache.size(0), H = k_cache.size(1), S = k_cache.size(2), D = k_cache.size(3);
  const int64_t T = check_new_tokens(k_cache, k_new, v_new);
  check_on_device(k_new, "k_new", k_cache);
  check_on_device(v_new, "v_new", k_cache);
  if (new_counts.has_value()) {
    check_new_counts_layout(*new_counts, B);
    check_on_device(*new_counts, "new_counts", k_cache);
  }
  if (T == 0 || B == 0 || H == 0) return;

  AppendKvParams p{};
  p.cache[0] = k_cache.mutable_data_ptr();
  p.cache[1] = v_cache.mutable_data_ptr();
  p.source[0] = k_new.const_data_ptr();
  p.source[1] = v_new.const_data_ptr();
  p.lengths = lengths.const_data_ptr<int64_t>();
  p.lengths_stride = lengths.stride(0);
  p.counts = new_counts.has_value() ? new_counts->const_data_ptr<int64_t>() : nullptr;
  p.counts_stride = new_counts.has_value() ? new_counts->stride(0) : 0;
  p.batch = B, p.kv_heads = H, p.num_new = T, p.slots = S;
  const int64_t cache_stride[2][3] = {{k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)},
                                      {v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)}};
  const int64_t source_stride[2][4] = {{k_new.stride(0), k_new.stride(1), k_new.stride(2), k_new.stride(3)},
                                       {v_new.stride(0), v_new.stride(1), v_new.stride(2), v_new.stride(3)}};
  choose_append_words(p, static_cast<int64_t>(k_cache.element_size()), D, cache_stride, source_stride);

  torch::stable::accelerator::DeviceGuard guard(k_cache.get_device_index());
  STD_CUDA_CHECK(launch_append_kv(p, current_stream(k_cache.get_device_index())));
}

// An attention's problem as the kernels take it, for q and the key/value buffers k and v of head_dim D
// (a cache's or a pool's, plain or quantized: strides per row or block, head, slot), and the options;
// the caller sets the lengths and slots (and the paged and quantized modes' fields).
DecodeAttentionParams decode_params(const Tensor& q, const Tensor& k, const Tensor& v, int64_t D,
                                    std::optional<int64_t> window, float scale, std::optional<double> softcap,
                                    const std::optional<Tensor>& sinks) {
  DecodeAttentionParams p{};
  p.elem = elem_type_of(q, "q");
  p.q = q.const_data_ptr();
  p.k_cache = k.const_data_ptr();
  p.v_cache = v.const_data_ptr();
  p.batch = q.size(0), p.q_heads = q.size(1), p.kv_heads = k.size(1), p.num_new = q.size(2), p.head_dim = D;
  for (int i = 0; i < 4; ++i) p.q_stride[i] = q.stride(i);
  for (int i = 0; i < 3; ++i) p.k_stride[i] = k.stride(i), p.v_stride[i] = v.stride(i);
  p.window = kernel_window(window.value_or(0));
  p.scale = scale;
  p.softcap = static_cast<float>(softcap.value_or(0.0));
  p.sinks = sinks.has_value() ? sinks->const_data_ptr<float>() : nullptr;
  p.sinks_stride = sinks.has_value() ? sinks->stride(0) : 0;
  return p;
}

std::tuple<Tensor, Tensor> decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor lengths,
                                            std::optional<int64_t> window, std::optional<double> scale,
                                            std::optional<double> softcap, std::optional<Tensor> sinks) {
  check_cache(k_cache, v_cache, lengths);
  const auto on_cache_device = [&](const Tensor& t, const char* what) { check_on_device(t, what, k_cache); };
  const int64_t D = check_decode_queries(q, k_cache, window, on_cache_device).head_dim;
  const float scale_value = checked_scale(scale, D);
  check_softcap_and_sinks(softcap, sinks, q);

  DecodeAttentionParams p = decode_params(q, k_cache, v_cache, D, window, scale_value, softcap, sinks);
  p.lengths = lengths.const_data_ptr<int64_t>();
  p.lengths_stride = lengths.stride(0);
  p.slots = k_cache.size(2);
  choose_decode_loads(p, static_cast<int64_t>(k_cache.element_size()));
  return plan_and_launch_decode(p, q, k_cache.get_device_index());
}

// The quantized cache on the GPU: layout checks shared with the CPU binding, then devices and
// the CUDA slot limit. Returns the format and head_dim.
std::pair<KvFormat, int64_t> check_quantized_cache(const Tensor& k_data, const Tensor& k_scales, const Tensor& v_data,
                                                   const Tensor& v_scales, const Tensor& lengths) {
  const auto format_and_head_dim = check_quantized_cache_layout(k_data, k_scales, v_data, v_scales, lengths);
  STD_TORCH_CHECK(k_data.size(2) <= kMaxSlotsCuda, "k_data must have between 1 and ", kMaxSlotsCuda,
                  " slots on CUDA, got ", k_data.size(2));
  STD_TORCH_CHECK(k_data.is_cuda(), "k_data must be a CUDA tensor for the CUDA kernel");
  check_on_device(k_scales, "k_scales", k_data);
  check_on_device(v_data, "v_data", k_data);
  check_on_device(v_scales, "v_scales", k_data);
  check_on_device(lengths, "lengths", k_data);
  return format_and_head_dim;
}

// A quantized append's tensors (a cache's or a pool's: the same four, dimension 0 the rows or the
// blocks) as the kernel reads them; the caller sets where the tokens go (lengths, and slots or the
// paged mode's fields).
AppendKvQuantizedParams quantized_append_params(Tensor& k_data, Tensor& k_scales, Tensor& v_data, Tensor& v_scales,
                                                const Tensor& k_new, const Tensor& v_new, KvFormat format, int64_t D) {
  AppendKvQuantizedParams p{};
  p.data[0] = k_data.mutable_data_ptr();
  p.data[1] = v_data.mutable_data_ptr();
  p.scales[0] = k_scales.mutable_data_ptr();
  p.scales[1] = v_scales.mutable_data_ptr();
  p.source[0] = k_new.const_data_ptr();
  p.source[1] = v_new.const_data_ptr();
  const Tensor* data[2] = {&k_data, &v_data};
  const Tensor* scales[2] = {&k_scales, &v_scales};
  const Tensor* source[2] = {&k_new, &v_new};
  for (int side = 0; side < 2; ++side) {
    for (int i = 0; i < 3; ++i) {
      p.data_stride[side][i] = data[side]->stride(i);
      p.scale_stride[side][i] = scales[side]->stride(i);
    }
    for (int i = 0; i < 4; ++i) p.source_stride[side][i] = source[side]->stride(i);
  }
  p.batch = k_new.size(0), p.kv_heads = k_data.size(1), p.num_new = k_new.size(2), p.head_dim = D;
  p.format = format;
  p.elem = elem_type_of(k_new, "k_new");
  return p;
}

void append_kv_quantized(Tensor k_data, Tensor k_scales, Tensor v_data, Tensor v_scales, Tensor k_new, Tensor v_new,
                         Tensor lengths, std::optional<Tensor> new_counts, bool rotate_keys) {
  const auto [format, D] = check_quantized_cache(k_data, k_scales, v_data, v_scales, lengths);
  check_rotated_head_dim(rotate_keys, D);
  const int64_t T = check_quantized_new_tokens(k_data, D, k_new, v_new);
  check_on_device(k_new, "k_new", k_data);
  check_on_device(v_new, "v_new", k_data);
  const int64_t B = k_data.size(0), H = k_data.size(1);
  if (new_counts.has_value()) {
    check_new_counts_layout(*new_counts, B);
    check_on_device(*new_counts, "new_counts", k_data);
  }
  if (T == 0 || B == 0 || H == 0) return;

  AppendKvQuantizedParams p = quantized_append_params(k_data, k_scales, v_data, v_scales, k_new, v_new, format, D);
  p.rotate_keys = rotate_keys;
  p.lengths = lengths.const_data_ptr<int64_t>();
  p.lengths_stride = lengths.stride(0);
  // Values are the kernel's to check (a row with a count outside [0, num_new] is left alone).
  p.counts = new_counts.has_value() ? new_counts->const_data_ptr<int64_t>() : nullptr;
  p.counts_stride = new_counts.has_value() ? new_counts->stride(0) : 0;
  p.slots = k_data.size(2);
  torch::stable::accelerator::DeviceGuard guard(k_data.get_device_index());
  STD_CUDA_CHECK(launch_append_kv_quantized(p, current_stream(k_data.get_device_index())));
}

// The queries a quantized attention's kernel reads: q itself, or for a rotated-key cache R q in
// float32 (key_rotation.cuh), contiguous, on q's device and the current stream.
Tensor kernel_queries(const Tensor& q, bool rotate_keys) {
  if (!rotate_keys) return q;
  Tensor rotated =
      torch::stable::empty({q.size(0), q.size(1), q.size(2), q.size(3)}, ScalarType::Float, std::nullopt, q.device());
  RotateQueriesParams r{};
  r.q = q.const_data_ptr();
  for (int i = 0; i < 4; ++i) r.q_stride[i] = q.stride(i);
  r.out = rotated.mutable_data_ptr<float>();
  r.batch = q.size(0), r.heads = q.size(1), r.num_new = q.size(2), r.head_dim = q.size(3);
  r.elem = elem_type_of(q, "q");
  STD_CUDA_CHECK(launch_rotate_queries(r, current_stream(q.get_device_index())));
  return rotated;
}

// The attention's (out, lse) for the caller's q: the kernel ran on kernel_queries(q), whose float32
// output a rotated-key attention converts to q's dtype.
std::tuple<Tensor, Tensor> in_query_dtype(std::tuple<Tensor, Tensor> result, const Tensor& q) {
  Tensor& out = std::get<0>(result);
  if (out.scalar_type() == q.scalar_type()) return result;
  Tensor converted = torch::stable::empty({out.size(0), out.size(1), out.size(2), out.size(3)}, q.scalar_type(),
                                          std::nullopt, q.device());
  torch::stable::copy_(converted, out);
  return {converted, std::get<1>(result)};
}

// A quantized attention's tensors and options (a cache's or a pool's: dimension 0 of the data and
// scales the rows or the blocks) as the kernels read them; the caller sets the lengths and slots
// (and the paged mode's fields).
DecodeAttentionParams quantized_decode_params(const Tensor& q, KvFormat format, int64_t D, const Tensor& k_data,
                                              const Tensor& k_scales, const Tensor& v_data, const Tensor& v_scales,
                                              std::optional<int64_t> window, float scale, std::optional<double> softcap,
                                              const std::optional<Tensor>& sinks) {
  DecodeAttentionParams p = decode_params(q, k_data, v_data, D, window, scale, softcap, sinks);
  p.quantized = true;
  p.format = format;
  p.k_scales = k_scales.const_data_ptr();
  p.v_scales = v_scales.const_data_ptr();
  for (int i = 0; i < 3; ++i) p.k_scale_stride[i] = k_scales.stride(i), p.v_scale_stride[i] = v_scales.stride(i);
  return p;
}

std::tuple<Tensor, Tensor> decode_attention_quantized(Tensor q, Tensor k_data, Tensor k_scales, Tensor v_data,
                                                      Tensor v_scales, Tensor lengths, std::optional<int64_t> window,
                                                      std::optional<double> scale, std::optional<double> softcap,
                                                      std::optional<Tensor> sinks, bool rotate_keys) {
  const auto [format, D] = check_quantized_cache(k_data, k_scales, v_data, v_scales, lengths);
  check_rotated_head_dim(rotate_keys, D);
  const auto on_cache_device = [&](const Tensor& t, const char* what) { check_on_device(t, what, k_data); };
  check_quantized_cache_queries(q, k_data, D, window, softcap, sinks, on_cache_device);
  const float scale_value = checked_scale(scale, D);

  torch::stable::accelerator::DeviceGuard guard(k_data.get_device_index());
  const Tensor queries = kernel_queries(q, rotate_keys);
  DecodeAttentionParams p = quantized_decode_params(queries, format, D, k_data, k_scales, v_data, v_scales, window,
                                                    scale_value, softcap, sinks);
  p.lengths = lengths.const_data_ptr<int64_t>();
  p.lengths_stride = lengths.stride(0);
  p.slots = k_data.size(2);
  choose_decode_loads(p, 1);  // data strides count bytes
  return in_query_dtype(plan_and_launch_decode(p, queries, k_data.get_device_index()), q);
}

// ---- paged pools ----------------------------------------------------------------------------
// A host copy of a small tensor of the call (lengths, new_counts, block_tables). Reading it
// waits for the work queued on the current stream, so the values are the ones the kernels
// would have read.
Tensor host_copy(const Tensor& t) {
  return torch::stable::to(t, torch::stable::Device(torch::headeronly::DeviceType::CPU));
}

// The checked values the kernels read (packed_for_kernels), on the device. The caller keeps the
// tensor alive until the launch is queued (the caching allocator then orders any reuse of its
// memory after the kernels).
Tensor device_copy_of_checked(const PagedRows& rows, bool append, const Tensor& like) {
  const std::vector<int64_t> packed = packed_for_kernels(rows, append);
  Tensor host = torch::stable::empty({static_cast<int64_t>(packed.size())}, ScalarType::Long, std::nullopt,
                                     torch::stable::Device(torch::headeronly::DeviceType::CPU));
  std::copy(packed.begin(), packed.end(), host.mutable_data_ptr<int64_t>());
  return torch::stable::to(host, like.device());
}

// Points the kernels' parameters at the checked values device_copy_of_checked put on the device
// (packed_for_kernels' layout: the lengths, an append's counts, then every row's used block ids).
template <typename Params>
void address_checked_rows(Params& p, const Tensor& checked, const PagedRows& rows, int64_t shift, int64_t batch) {
  p.lengths = checked.const_data_ptr<int64_t>();
  p.lengths_stride = 1;
  if constexpr (std::is_same_v<Params, DecodeAttentionParams>) {
    p.block_ids = p.lengths + batch;
    // The table's used part holds every row: the plan's span and the kernel's positions stay in it.
    p.slots = rows.width << shift;
  } else {  // an append: the checked counts (every row has one: T where none was given), then the ids
    p.counts = p.lengths + batch;
    p.counts_stride = 1;
    p.block_ids = p.lengths + 2 * batch;
  }
  p.blocks_per_row = rows.width;
  p.block_shift = static_cast<int>(shift);
}

// The values of a paged append (lengths, new_counts, block ids) checked on host copies by
// paged_blocks.h, as the CPU binding checks them; the plain and quantized bindings share it.
PagedRows checked_append_rows(const Tensor& block_tables, const Tensor& lengths,
                              const std::optional<Tensor>& new_counts, int64_t T, int64_t shift, int64_t num_blocks) {
  const Tensor host_lengths = host_copy(lengths), host_table = host_copy(block_tables);
  std::optional<Tensor> host_counts;
  if (new_counts.has_value()) host_counts = host_copy(*new_counts);
  PagedRows rows;
  const std::string error = check_paged_append_values(
      host_block_table(host_table), host_lengths.const_data_ptr<int64_t>(), host_lengths.stride(0),
      host_counts.has_value() ? host_counts->const_data_ptr<int64_t>() : nullptr,
      host_counts.has_value() ? host_counts->stride(0) : 0, T, shift, num_blocks, rows);
  STD_TORCH_CHECK(error.empty(), error);
  return rows;
}

// The same for a paged attention (lengths and the block ids some query sees).
PagedRows checked_attention_rows(const Tensor& block_tables, const Tensor& lengths, int64_t T,
                                 std::optional<int64_t> window, int64_t shift, int64_t num_blocks) {
  const Tensor host_lengths = host_copy(lengths), host_table = host_copy(block_tables);
  PagedRows rows;
  const std::string error =
      check_paged_attention_values(host_block_table(host_table), host_lengths.const_data_ptr<int64_t>(),
                                   host_lengths.stride(0), T, window.value_or(0), shift, num_blocks, rows);
  STD_TORCH_CHECK(error.empty(), error);
  return rows;
}

// Devices of a paged call's pools, tables and lengths; the layout checks are check_pool_layout's.
void check_paged_devices(const Tensor& k_pool, const Tensor& v_pool, const Tensor& block_tables,
                         const Tensor& lengths) {
  STD_TORCH_CHECK(k_pool.is_cuda(), "k_pool must be a CUDA tensor for the CUDA kernel");
  check_on_device(v_pool, "v_pool", k_pool);
  check_on_device(block_tables, "block_tables", k_pool);
  check_on_device(lengths, "lengths", k_pool);
}

void paged_append_kv(Tensor k_pool, Tensor v_pool, Tensor k_new, Tensor v_new, Tensor block_tables, Tensor lengths,
                     std::optional<Tensor> new_counts) {
  const int64_t shift = check_pool_layout(k_pool, v_pool);
  const int64_t num_blocks = k_pool.size(0), H = k_pool.size(1), D = k_pool.size(3);
  const int64_t T = check_paged_new_tokens(k_pool, k_new, v_new);
  const int64_t B = k_new.size(0);
  check_block_tables(block_tables, B, shift);
  check_row_counts(lengths, B, "lengths");
  if (new_counts.has_value()) check_row_counts(*new_counts, B, "new_counts");
  check_paged_devices(k_pool, v_pool, block_tables, lengths);
  check_on_device(k_new, "k_new", k_pool);
  check_on_device(v_new, "v_new", k_pool);
  if (new_counts.has_value()) check_on_device(*new_counts, "new_counts", k_pool);

  torch::stable::accelerator::DeviceGuard guard(k_pool.get_device_index());
  const PagedRows rows = checked_append_rows(block_tables, lengths, new_counts, T, shift, num_blocks);
  if (rows.width == 0 || H == 0) return;  // no row stores a token
  const Tensor checked = device_copy_of_checked(rows, true, k_pool);

  AppendKvParams p{};
  p.cache[0] = k_pool.mutable_data_ptr();
  p.cache[1] = v_pool.mutable_data_ptr();
  p.source[0] = k_new.const_data_ptr();
  p.source[1] = v_new.const_data_ptr();
  address_checked_rows(p, checked, rows, shift, B);
  p.batch = B, p.kv_heads = H, p.num_new = T;
  const int64_t pool_stride[2][3] = {{k_pool.stride(0), k_pool.stride(1), k_pool.stride(2)},
                                     {v_pool.stride(0), v_pool.stride(1), v_pool.stride(2)}};
  const int64_t source_stride[2][4] = {{k_new.stride(0), k_new.stride(1), k_new.stride(2), k_new.stride(3)},
                                       {v_new.stride(0), v_new.stride(1), v_new.stride(2), v_new.stride(3)}};
  choose_append_words(p, static_cast<int64_t>(k_pool.element_size()), D, pool_stride, source_stride);
  STD_CUDA_CHECK(launch_append_kv(p, current_stream(k_pool.get_device_index())));
}

std::tuple<Tensor, Tensor> paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables,
                                                  Tensor lengths, std::optional<int64_t> window,
                                                  std::optional<double> scale, std::optional<double> softcap,
                                                  std::optional<Tensor> sinks) {
  const int64_t shift = check_pool_layout(k_pool, v_pool);
  const int64_t num_blocks = k_pool.size(0), D = k_pool.size(3);
  check_paged_queries(q, k_pool, window);
  const int64_t B = q.size(0), T = q.size(2);
  check_attention_block_tables(block_tables, B, shift, T);
  check_row_counts(lengths, B, "lengths");
  check_paged_devices(k_pool, v_pool, block_tables, lengths);
  check_on_device(q, "q", k_pool);
  const int64_t capacity = block_tables.size(1) << shift;
  STD_TORCH_CHECK(capacity <= kMaxSlotsCuda, "block_tables holds ", capacity, " positions per row (",
                  block_tables.size(1), " blocks of ", k_pool.size(2), "); the CUDA kernels take at most ",
                  kMaxSlotsCuda);
  check_softcap_and_sinks(softcap, sinks, q);
  const float scale_value = checked_scale(scale, D);

  torch::stable::accelerator::DeviceGuard guard(k_pool.get_device_index());
  const PagedRows rows = checked_attention_rows(block_tables, lengths, T, window, shift, num_blocks);
  const Tensor checked = device_copy_of_checked(rows, false, k_pool);

  DecodeAttentionParams p = decode_params(q, k_pool, v_pool, D, window, scale_value, softcap, sinks);
  address_checked_rows(p, checked, rows, shift, B);
  choose_decode_loads(p, static_cast<int64_t>(k_pool.element_size()));
  return plan_and_launch_decode(p, q, k_pool.get_device_index());
}

// The quantized pool pair on the GPU: layout checks shared with the CPU binding, then devices.
// Returns the format, head_dim and log2(block_size).
std::tuple<KvFormat, int64_t, int64_t> check_quantized_pool(const Tensor& k_data, const Tensor& k_scales,
                                                            const Tensor& v_data, const Tensor& v_scales) {
  const auto layout = check_quantized_pool_layout(k_data, k_scales, v_data, v_scales);
  STD_TORCH_CHECK(k_data.is_cuda(), "k_data must be a CUDA tensor for the CUDA kernel");
  check_on_device(k_scales, "k_scales", k_data);
  check_on_device(v_data, "v_data", k_data);
  check_on_device(v_scales, "v_scales", k_data);
  return layout;
}

void paged_append_kv_quantized(Tensor k_data, Tensor k_scales, Tensor v_data, Tensor v_scales, Tensor k_new,
                               Tensor v_new, Tensor block_tables, Tensor lengths, std::optional<Tensor> new_counts,
                               bool rotate_keys) {
  const auto [format, D, shift] = check_quantized_pool(k_data, k_scales, v_data, v_scales);
  check_rotated_head_dim(rotate_keys, D);
  const int64_t num_blocks = k_data.size(0), H = k_data.size(1);
  const auto on_pool_device = [&](const Tensor& t, const char* what) { check_on_device(t, what, k_data); };
  const int64_t T =
      check_paged_quantized_append(k_data, D, shift, k_new, v_new, block_tables, lengths, new_counts, on_pool_device);
  const int64_t B = k_new.size(0);

  torch::stable::accelerator::DeviceGuard guard(k_data.get_device_index());
  const PagedRows rows = checked_append_rows(block_tables, lengths, new_counts, T, shift, num_blocks);
  if (rows.width == 0 || H == 0) return;  // no row stores a token
  const Tensor checked = device_copy_of_checked(rows, true, k_data);

  AppendKvQuantizedParams p = quantized_append_params(k_data, k_scales, v_data, v_scales, k_new, v_new, format, D);
  p.rotate_keys = rotate_keys;
  address_checked_rows(p, checked, rows, shift, B);
  STD_CUDA_CHECK(launch_append_kv_quantized(p, current_stream(k_data.get_device_index())));
}

std::tuple<Tensor, Tensor> paged_decode_attention_quantized(Tensor q, Tensor k_data, Tensor k_scales, Tensor v_data,
                                                            Tensor v_scales, Tensor block_tables, Tensor lengths,
                                                            std::optional<int64_t> window, std::optional<double> scale,
                                                            std::optional<double> softcap, std::optional<Tensor> sinks,
                                                            bool rotate_keys) {
  const auto [format, D, shift] = check_quantized_pool(k_data, k_scales, v_data, v_scales);
  check_rotated_head_dim(rotate_keys, D);
  const auto on_pool_device = [&](const Tensor& t, const char* what) { check_on_device(t, what, k_data); };
  check_paged_quantized_queries(q, k_data, D, shift, block_tables, lengths, window, softcap, sinks, on_pool_device);
  const int64_t B = q.size(0), T = q.size(2);
  const int64_t capacity = block_tables.size(1) << shift;
  STD_TORCH_CHECK(capacity <= kMaxSlotsCuda, "block_tables holds ", capacity, " positions per row (",
                  block_tables.size(1), " blocks of ", k_data.size(2), "); the CUDA kernels take at most ",
                  kMaxSlotsCuda);
  const float scale_value = checked_scale(scale, D);

  torch::stable::accelerator::DeviceGuard guard(k_data.get_device_index());
  const PagedRows rows = checked_attention_rows(block_tables, lengths, T, window, shift, k_data.size(0));
  const Tensor checked = device_copy_of_checked(rows, false, k_data);

  const Tensor queries = kernel_queries(q, rotate_keys);
  DecodeAttentionParams p = quantized_decode_params(queries, format, D, k_data, k_scales, v_data, v_scales, window,
                                                    scale_value, softcap, sinks);
  address_checked_rows(p, checked, rows, shift, B);
  choose_decode_loads(p, 1);  // data strides count bytes
  return in_query_dtype(plan_and_launch_decode(p, queries, k_data.get_device_index()), q);
}

// ---- latent (MLA) caches --------------------------------------------------------------------
// The CPU binding's checks of shapes, dtypes, layouts and devices (cpu/latent_cache_checks.h), then
// one GPU for every tensor and the CUDA limits; as for decode_attention, the values of lengths (and
// new_counts) are the kernels' to check, so nothing here reads device memory.

// The kernel's view of a checked part (cpu/latent_cache_checks.h's LatentPart).
LatentPartParams latent_part_params(const cpu::LatentPart& part) {
  LatentPartParams params{};
  params.data = part.data;
  params.column = part.column, params.width = part.width;
  params.scales = part.scales;
  for (int i = 0; i < 3; ++i) params.stride[i] = part.stride[i], params.scale_stride[i] = part.scale_stride[i];
  return params;
}

// A latent attention's (out, lse) once p holds the checked problem but for the queries': the plan,
// the buffers (attention_buffers), the launch on the current stream.
std::tuple<Tensor, Tensor> launch_latent(LatentAttentionParams& p, const Tensor& q, const Tensor& lengths,
                                         std::optional<int64_t> window, float scale, int32_t device) {
  p.elem = elem_type_of(q, "q");
  p.q = q.const_data_ptr();
  for (int i = 0; i < 4; ++i) p.q_stride[i] = q.stride(i);
  p.lengths = lengths.const_data_ptr<int64_t>();
  p.lengths_stride = lengths.stride(0);
  p.q_heads = q.size(1), p.num_new = q.size(2);
  p.window = kernel_window(window.value_or(0));
  p.scale = scale;
  choose_latent_loads(p);
  torch::stable::accelerator::DeviceGuard guard(device);
  plan_latent_attention(p, sm_count(device));
  const AttentionBuffers buffers = attention_buffers(p, q, p.value_dim);
  STD_CUDA_CHECK(launch_latent_attention(p, current_stream(device)));
  return {buffers.out, buffers.lse};
}

std::tuple<Tensor, Tensor> latent_decode_attention(Tensor q, Tensor cache, Tensor lengths, int64_t value_dim,
                                                   std::optional<int64_t> window, std::optional<double> scale) {
  STD_TORCH_CHECK(cache.dim() == 4, "cache must be (batch, kv_heads, slots, key_dim), got shape ", shape_of(cache));
  STD_TORCH_CHECK(cache.is_cuda(), "cache must be a CUDA tensor for the CUDA kernel");
  const int64_t B = cache.size(0), H_kv = cache.size(1), S = cache.size(2), Dk = cache.size(3);
  elem_type_of(cache, "cache");
  cpu::check_latent_dims(Dk, value_dim, /*cuda=*/true);
  STD_TORCH_CHECK(cache.stride(3) == 1, "cache needs a contiguous last (key_dim) dimension, got stride ",
                  cache.stride(3));
  STD_TORCH_CHECK(S <= kMaxSlotsCuda, "cache must have between 1 and ", kMaxSlotsCuda, " slots on CUDA, got ", S);
  cpu::check_latent_query_shapes(q, cache.scalar_type(), lengths, B, H_kv, S, Dk, window, /*cuda=*/true);
  check_on_device(q, "q", cache, "cache");
  check_on_device(lengths, "lengths", cache, "cache");
  const float checked = checked_scale(scale, Dk);

  LatentAttentionParams p{};
  p.batch = B, p.kv_heads = H_kv, p.key_dim = Dk, p.value_dim = value_dim, p.slots = S;
  // The whole row is one part, in q's dtype.
  p.parts[0].data = cache.const_data_ptr();
  p.parts[0].width = Dk;
  for (int i = 0; i < 3; ++i) p.parts[0].stride[i] = cache.stride(i);
  return launch_latent(p, q, lengths, window, checked, cache.get_device_index());
}

std::tuple<Tensor, Tensor> latent_decode_attention_quantized(Tensor q, Tensor c_data, Tensor c_scales, Tensor k_pe,
                                                             std::optional<Tensor> k_pe_scales, Tensor lengths,
                                                             std::optional<int64_t> window,
                                                             std::optional<double> scale) {
  STD_TORCH_CHECK(c_data.dim() == 4, "c_data must be (batch, kv_heads, slots, value_dim), got shape ",
                  shape_of(c_data));
  const KvFormat format = cpu::latent_format_of(c_data);
  const int64_t B = c_data.size(0), H_kv = c_data.size(1), S = c_data.size(2);
  STD_TORCH_CHECK(q.dim() == 4, "q must be (batch, q_heads, num_new, key_dim), got shape ", shape_of(q));
  const ScalarType dtype = q.scalar_type();
  elem_type_of(q, "q");
  cpu::LatentPart c = cpu::check_latent_part(c_data, c_scales, c_data.scalar_type(), dtype, B, H_kv, S, "c_data",
                                             "c_scales", cpu::kCacheDims, true);
  cpu::LatentPart pe = cpu::check_latent_part(k_pe, k_pe_scales, c_data.scalar_type(), dtype, B, H_kv, S, "k_pe",
                                              "k_pe_scales", cpu::kCacheDims, true);
  const int64_t Dv = c.width, Dk = c.width + pe.width;
  cpu::check_latent_dims(Dk, Dv, /*cuda=*/true);
  STD_TORCH_CHECK(pe.width >= 1, "k_pe must hold the rotary part (at least one column), got shape ", shape_of(k_pe));
  STD_TORCH_CHECK(S <= kMaxSlotsCuda, "c_data must have between 1 and ", kMaxSlotsCuda, " slots on CUDA, got ", S);
  cpu::check_latent_query_shapes(q, dtype, lengths, B, H_kv, S, Dk, window, /*cuda=*/true);
  check_on_device(c_scales, "c_scales", c_data, "c_data");
  check_on_device(k_pe, "k_pe", c_data, "c_data");
  if (k_pe_scales.has_value()) check_on_device(*k_pe_scales, "k_pe_scales", c_data, "c_data");
  check_on_device(q, "q", c_data, "c_data");
  check_on_device(lengths, "lengths", c_data, "c_data");
  const float checked = checked_scale(scale, Dk);

  LatentAttentionParams p{};
  p.batch = B, p.kv_heads = H_kv, p.key_dim = Dk, p.value_dim = Dv, p.slots = S;
  p.format = format;
  pe.column = Dv;
  p.parts[0] = latent_part_params(c);
  p.parts[1] = latent_part_params(pe);
  return launch_latent(p, q, lengths, window, checked, c_data.get_device_index());
}

void append_latent_quantized(Tensor c_data, Tensor c_scales, Tensor k_pe, std::optional<Tensor> k_pe_scales,
                             Tensor latent_new, Tensor lengths, std::optional<Tensor> new_counts) {
  const cpu::LatentWrites w =
      cpu::check_latent_writes(c_data, c_scales, k_pe, k_pe_scales, latent_new, cpu::kCacheDims, true, /*cuda=*/true);
  const int64_t B = c_data.size(0), H = c_data.size(1), S = c_data.size(2), T = latent_new.size(2);
  STD_TORCH_CHECK(S >= 1 && S <= kMaxSlotsCuda, "c_data must have between 1 and ", kMaxSlotsCuda,
                  " slots on CUDA, got shape ", shape_of(c_data));
  STD_TORCH_CHECK(T <= S, "cannot append ", T, " tokens at once to a cache of ", S, " slots");
  STD_TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == B && lengths.scalar_type() == ScalarType::Long,
                  "lengths must be int64 of shape (", B, ",), got ", dtype_name(lengths.scalar_type()), " of shape ",
                  shape_of(lengths));
  if (new_counts.has_value()) check_new_counts_layout(*new_counts, B);
  check_on_device(c_scales, "c_scales", c_data, "c_data");
  check_on_device(k_pe, "k_pe", c_data, "c_data");
  if (k_pe_scales.has_value()) check_on_device(*k_pe_scales, "k_pe_scales", c_data, "c_data");
  check_on_device(latent_new, "latent_new", c_data, "c_data");
  check_on_device(lengths, "lengths", c_data, "c_data");
  if (new_counts.has_value()) check_on_device(*new_counts, "new_counts", c_data, "c_data");
  if (T == 0 || B == 0 || H == 0) return;

  LatentAppendParams p{};
  p.c_data = w.c_data;
  p.c_scales = w.c_scales;
  p.k_pe = w.pe_data;
  p.k_pe_scales = w.pe_scales;
  p.source = w.src;
  p.lengths = lengths.const_data_ptr<int64_t>();
  p.lengths_stride = lengths.stride(0);
  // Values are the kernel's to check (a row with a count outside [0, num_new] is left alone).
  p.counts = new_counts.has_value() ? new_counts->const_data_ptr<int64_t>() : nullptr;
  p.counts_stride = new_counts.has_value() ? new_counts->stride(0) : 0;
  for (int i = 0; i < 3; ++i) {
    p.c_stride[i] = w.c.stride[i], p.c_scale_stride[i] = w.c.scale_stride[i];
    p.pe_stride[i] = w.pe.stride[i], p.pe_scale_stride[i] = w.pe.scale_stride[i];
  }
  for (int i = 0; i < 4; ++i) p.source_stride[i] = w.src_stride[i];
  p.batch = B, p.kv_heads = H, p.num_new = T, p.slots = S;
  p.key_dim = w.c.width + w.pe.width, p.value_dim = w.c.width;
  p.format = w.format;
  p.elem = w.elem;
  torch::stable::accelerator::DeviceGuard guard(c_data.get_device_index());
  STD_CUDA_CHECK(launch_append_latent_quantized(p, current_stream(c_data.get_device_index())));
}

}  // namespace
}  // namespace kvcache_ext::cuda

STABLE_TORCH_LIBRARY_IMPL(kvcache_ext, CUDA, m) {
  m.impl("latent_decode_attention", TORCH_BOX(&kvcache_ext::cuda::latent_decode_attention));
  m.impl("latent_decode_attention_quantized", TORCH_BOX(&kvcache_ext::cuda::latent_decode_attention_quantized));
  m.impl("append_latent_quantized", TORCH_BOX(&kvcache_ext::cuda::append_latent_quantized));
  m.impl("append_kv", TORCH_BOX(&kvcache_ext::cuda::append_kv));
  m.impl("decode_attention", TORCH_BOX(&kvcache_ext::cuda::decode_attention));
  m.impl("append_kv_quantized", TORCH_BOX(&kvcache_ext::cuda::append_kv_quantized));
  m.impl("decode_attention_quantized", TORCH_BOX(&kvcache_ext::cuda::decode_attention_quantized));
  m.impl("paged_append_kv", TORCH_BOX(&kvcache_ext::cuda::paged_append_kv));
  m.impl("paged_decode_attention", TORCH_BOX(&kvcache_ext::cuda::paged_decode_attention));
  m.impl("paged_append_kv_quantized", TORCH_BOX(&kvcache_ext::cuda::paged_append_kv_quantized));
  m.impl("paged_decode_attention_quantized", TORCH_BOX(&kvcache_ext::cuda::paged_decode_attention_quantized));
}
