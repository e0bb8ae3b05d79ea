// What the kernels support, per device: the one table kvcache_ext.capabilities() reads (through
// the capabilities op in csrc/ops.cpp), KVCache checks at construction and README states. The
// bindings check their inputs against these constants, so the table cannot drift from the code.
#pragma once

#include <cstdint>
#include <string>

namespace kvcache_ext {

// head_dim: every multiple of kHeadDimMultiple from kHeadDimMultiple to kMaxHeadDim.
constexpr int64_t kHeadDimMultiple = 8;
constexpr int64_t kMaxHeadDim = 256;
// Tokens held by one row (lengths[b]): at most 2^62, so that every position and slot computation
// (a length plus a window, a block or new tokens) stays far inside int64.
constexpr int64_t kMaxLength = int64_t{1} << 62;
// Slots of a cache (its size along the token dimension): CPU kernels index with int64; the CUDA
// kernels count a split's positions in 32-bit ints.
constexpr int64_t kMaxSlotsCpu = kMaxLength;
constexpr int64_t kMaxSlotsCuda = (int64_t{1} << 31) - 1;

// Paged pools (num_blocks, kv_heads, block_size, head_dim): block_size a power of two from 1 to
// kMaxBlockSize (a position's block and offset are a shift and a mask), on both devices, quantized
// pools (paged_kv_formats in the table) included.
constexpr int64_t kMaxBlockSize = 256;

// Latent (MLA) caches (latent_decode_attention): rows of key_dim values, a multiple of
// kHeadDimMultiple up to kMaxLatentKeyDim on the CPU (DeepSeek's 576 and room) and
// kMaxLatentKeyDimCuda on CUDA (DeepSeek's 576: the CUDA kernel holds a row's slice per thread in
// registers, csrc/cuda/latent_attention.cuh).
constexpr int64_t kMaxLatentKeyDim = 1024;
constexpr int64_t kMaxLatentKeyDimCuda = 576;

// Plain and paged caches whose values have a head_dim of their own (any supported head_dim,
// independent of the keys'; MLA's expanded 192/128): the CPU kernels take them, the CUDA ones not yet.
constexpr bool kCpuValueDimMayDiffer = true;
constexpr bool kCudaValueDimMayDiffer = false;

inline bool block_size_supported(int64_t block_size) {
  return block_size >= 1 && block_size <= kMaxBlockSize && (block_size & (block_size - 1)) == 0;
}

inline bool head_dim_supported(int64_t head_dim) {
  return head_dim >= kHeadDimMultiple && head_dim <= kMaxHeadDim && head_dim % kHeadDimMultiple == 0;
}

constexpr const char* kKvFormatsJson =
    "[\"int8\", \"fp8_e4m3\", \"int4\", \"int8_rot\", \"fp8_e4m3_rot\", \"int4_rot\"]";

// The per-channel-key (KIVI) formats the kernels store (ops_kivi_cpu.cpp): CPU only, contiguous caches only.
constexpr const char* kKiviFormatsJson = "[\"int8_kivi\", \"fp8_e4m3_kivi\", \"int4_kivi\"]";

// The table as JSON, for one device type ("cpu" or "cuda"). Query heads per KV head (the GQA
// group) and new tokens per call are unlimited on both devices.
inline std::string capabilities_json(bool cuda) {
  return std::string("{\"dtypes\": [\"float32\", \"bfloat16\", \"float16\"], ") +
         "\"head_dim_multiple\": " + std::to_string(kHeadDimMultiple) +
         ", \"max_head_dim\": " + std::to_string(kMaxHeadDim) + ", \"max_length\": " + std::to_string(kMaxLength) +
         ", \"max_slots\": " + std::to_string(cuda ? kMaxSlotsCuda : kMaxSlotsCpu) + ", \"max_group\": null" +
         // Quantized cache formats (python_ref/quantize.py) the kernels store and attend over,
         // the rotated-key ones (rotate_keys) included: the same on both devices.
         ", \"kv_formats\": " + kKvFormatsJson +
         // Block sizes of paged pools the kernels take: the same on both devices.
         ", \"paged_max_block_size\": " + std::to_string(kMaxBlockSize) +
         // Quantized formats the paged kernels store and attend over: the same on both devices.
         ", \"paged_kv_formats\": " + kKvFormatsJson +
         // KIVI formats the kernels store and attend over (contiguous caches, CPU only).
         ", \"kivi_kv_formats\": " + (cuda ? "[]" : kKiviFormatsJson) +
         // Values of a head_dim of their own in plain and paged caches.
         ", \"independent_value_head_dim\": " +
         ((cuda ? kCudaValueDimMayDiffer : kCpuValueDimMayDiffer) ? "true" : "false") +
         // Widest latent cache row the latent kernel takes (0: none on this device).
         ", \"latent_max_key_dim\": " + std::to_string(cuda ? kMaxLatentKeyDimCuda : kMaxLatentKeyDim) +
         // Widest row of a paged latent pool (paged_latent_decode_attention; 0: no kernel on this device).
         ", \"paged_latent_max_key_dim\": " + std::to_string(cuda ? 0 : kMaxLatentKeyDim) +
         // Quantized formats of paged latent pools (the latent ones, in blocks).
         ", \"paged_latent_kv_formats\": " + (cuda ? "[]" : "[\"int8\", \"fp8_e4m3\"]") +
         // Quantized latent formats (python_ref/latent.py: c, and optionally k_pe, one scale per token):
         // the same on both devices.
         ", \"latent_kv_formats\": [\"int8\", \"fp8_e4m3\"]}";
}

}  // namespace kvcache_ext
