// Flash-Decoding attention over the KV cache, templated on q's element type, the cache's format
// (the same type, or quantized codes with their scales: python_ref/quantize.py), head_dim capacity
// (the power of two at or above head_dim) and the number of query rows a block serves. Semantics:
// python_ref.reference_attention (GQA, bottom-right causal for num_new >= 1, ring-buffer slots,
// optional sliding window), over python_ref.quantize's dequantized values for a quantized cache.
// The same body serves paged pools (python_ref/paged.py), plain or quantized: wrapping a format in
// Paged switches the address mode at compile time, so the contiguous kernels' code is as before.
//
// Work split. A block serves one (batch row, KV head, chunk of query rows, split) at a time:
//  * query rows are the (new token, group member) pairs of all query heads sharing the KV head,
//    so each K/V byte the block loads serves up to `kRows` queries (GQA read once per group);
//  * the positions visible to those rows are cut into `splits` equal pieces so that short
//    batches still fill the GPU; each split writes a partial output and its log-sum-exp and a
//    second kernel combines them (skipped when splits == 1).
// Inside a block, a key row of head_dim elements is read by a group of kLanesPerKey lanes,
// 16 bytes per lane per load (one vector load when the cache rows are 16-byte aligned, element
// loads otherwise; 8 quantized values per lane, i.e. 8 or 4 bytes of codes, widened and scaled in
// registers); the dot products are summed over the group with shuffles. Each
// lane group runs its own online softmax over every kKeyGroups-th key, so the main loop has no
// block-wide synchronisation; the groups are merged once at the end through shared memory.
// Scores are kept in log2 units (q pre-scaled by scale * log2(e)) so exp2 is a single
// instruction; all accumulation is in float32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "kernels.h"

namespace kvcache_ext::cuda {

constexpr int kAttentionThreads = kDecodeAttentionThreads;
constexpr int kCombineThreads = 128;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
// How far (in log2 units) the running maximum may trail the true one before the accumulator
// is rescaled. Exact either way (the final division uses the same reference); it only bounds
// the weights by 2^8 and saves the rescale on almost every step.
constexpr float kRescaleThreshold = 8.0f;

// ---- element types ------------------------------------------------------------------------------
template <typename E>
struct Elem;

template <>
struct Elem<float> {
  static __device__ __forceinline__ float to_float(float x) { return x; }
  static __device__ __forceinline__ float from_float(float x) { return x; }
  // 16 bytes -> 4 floats
  static __device__ __forceinline__ void unpack(const uint4& raw, float* out) {
    out[0] = __uint_as_float(raw.x);
    out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z);
    out[3] = __uint_as_float(raw.w);
  }
};

template <>
struct Elem<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  // 16 bytes -> 8 floats; a bfloat16 is the top half of a float32, so two bit operations.
  static __device__ __forceinline__ void unpack(const uint4& raw, float* out) {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __uint_as_float(words[i] << 16);
      out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
  }
};

template <>
struct Elem<__half> {
  static __device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
  static __device__ __forceinline__ void unpack(const uint4& raw, float* out) {
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(words[i] & 0xffffu)));
      out[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(words[i] >> 16)));
    }
  }
};

__host__ __device__ constexpr int next_pow2(int x) {
  int p = 1;
  while (p < x) p *= 2;
  return p;
}

__device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Reads the 16 bytes at `address` (a chunk of a K/V row): one vector load when every row start
// is 16-byte aligned, else element by element (any cache view, e.g. cache[:, :, 1:] or a layer's
// slice of a larger buffer at an odd offset).
template <typename E, bool kVectorLoads>
__device__ __forceinline__ uint4 load_chunk(const E* address) {
  if constexpr (kVectorLoads) {
    return __ldg(reinterpret_cast<const uint4*>(address));
  } else {
    uint32_t words[4];
    if constexpr (sizeof(E) == 4) {
      const uint32_t* elems = reinterpret_cast<const uint32_t*>(address);
#pragma unroll
      for (int i = 0; i < 4; ++i) words[i] = __ldg(elems + i);
    } else {
      const unsigned short* elems = reinterpret_cast<const unsigned short*>(address);
#pragma unroll
      for (int i = 0; i < 4; ++i)
        words[i] = uint32_t{__ldg(elems + 2 * i)} | (uint32_t{__ldg(elems + 2 * i + 1)} << 16);
    }
    return make_uint4(words[0], words[1], words[2], words[3]);
  }
}

// ---- cache formats ------------------------------------------------------------------------------
// How the kernel reads a cache row. C::Storage is what the cache pointers and strides count; a
// lane's load (C::Raw: kStorageElemsPerVec storage elements) widens to kValuesPerVec floats
// (C::unpack, times the scale C::load_scale read for it: the quantized formats' values exactly as
// python_ref.quantize.dequantize computes them), and value e of the lane's vec v is element
// C::value_index(v, e) of the head_dim row. kLayoutBytes: the element size whose lane layout the
// format shares (decode_tile_keys' elem_bytes); kRowMultiple: head_dim must be a multiple of it.
// kPaged: the address mode, rows (and their scales) found through the block table
// (DecodeAttentionParams::block_ids) rather than at slot % slots of the batch row's own buffer;
// false for every format, true once wrapped in Paged.
template <typename E>
struct PlainCache {  // the cache holds q's type
  static constexpr bool kPaged = false;
  using Storage = E;
  using Raw = uint4;
  static constexpr int kValuesPerVec = 16 / static_cast<int>(sizeof(E));
  static constexpr int kStorageElemsPerVec = kValuesPerVec;
  static constexpr int kLayoutBytes = static_cast<int>(sizeof(E));
  static constexpr int kRowMultiple = 8;
  template <bool kVectorLoads>
  static __device__ __forceinline__ Raw load(const E* address) {
    return load_chunk<E, kVectorLoads>(address);
  }
  static __device__ __forceinline__ float load_scale(const void*, int64_t, int) { return 1.0f; }
  static __device__ __forceinline__ void unpack(const Raw& raw, float, float* out) { Elem<E>::unpack(raw, out); }
  static __host__ __device__ constexpr int value_index(int vec, int e) { return vec * kValuesPerVec + e; }
};

// Bytes of a quantized row as 32-bit words (little-endian, like the GPU): one aligned load when
// every row start allows it, else byte by byte.
template <int kWords, bool kVectorLoads>
__device__ __forceinline__ void load_code_words(const uint8_t* address, uint32_t (&words)[kWords]) {
  if constexpr (kVectorLoads && kWords == 2) {
    const uint2 pair = __ldg(reinterpret_cast<const uint2*>(address));
    words[0] = pair.x;
    words[1] = pair.y;
  } else if constexpr (kVectorLoads) {
    words[0] = __ldg(reinterpret_cast<const uint32_t*>(address));
  } else {
#pragma unroll
    for (int w = 0; w < kWords; ++w) {
      words[w] = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) words[w] |= uint32_t{__ldg(address + 4 * w + i)} << (8 * i);
    }
  }
}

// float8 e4m3fn code -> float, exactly: normals move their 4-bit exponent from bias 7 to 127,
// subnormals count units of 2^-9, 0x7f / 0xff are NaN.
__device__ __forceinline__ float e4m3_to_float(uint32_t code) {
  const uint32_t magnitude = code & 0x7fu;
  const float value = magnitude == 0x7fu ? __uint_as_float(0x7fc00000u)
                      : magnitude < 8u   ? static_cast<float>(magnitude) * 0x1p-9f
                                         : __uint_as_float((magnitude + (120u << 3)) << 20);
  return code & 0x80u ? -value : value;
}

// int8 and fp8 e4m3: one byte per value, one float32 scale per token; a lane reads 8 codes.
template <KvFormat F>
struct ByteCodesCache {
  static_assert(F == KvFormat::kInt8 || F == KvFormat::kFp8E4M3, "one byte per value");
  static constexpr bool kPaged = false;
  using Storage = uint8_t;
  struct Raw {
    uint32_t words[2];
  };
  static constexpr int kValuesPerVec = 8;
  static constexpr int kStorageElemsPerVec = 8;
  static constexpr int kLayoutBytes = 2;
  static constexpr int kRowMultiple = 8;
  template <bool kVectorLoads>
  static __device__ __forceinline__ Raw load(const uint8_t* address) {
    Raw raw;
    load_code_words<2, kVectorLoads>(address, raw.words);
    return raw;
  }
  static __device__ __forceinline__ float load_scale(const void* scales, int64_t token, int) {
    return __ldg(static_cast<const float*>(scales) + token);
  }
  static __device__ __forceinline__ void unpack(const Raw& raw, float scale, float* out) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t code = (raw.words[i / 4] >> (8 * (i % 4))) & 0xffu;
      const float value = F == KvFormat::kInt8 ? static_cast<float>(static_cast<int8_t>(code)) : e4m3_to_float(code);
      out[i] = value * scale;
    }
  }
  static __host__ __device__ constexpr int value_index(int vec, int e) { return vec * 8 + e; }
};

// int4: a lane reads 4 bytes (vec v: bytes 4v..4v+3 of the row), which hold values 4j..4j+3 of
// group v / 4 (j = v % 4) in their low nibbles and values 16 + 4j.. in their high ones; one
// float16 scale per group of 32.
struct Int4Cache {
  static constexpr bool kPaged = false;
  using Storage = uint8_t;
  struct Raw {
    uint32_t words[1];
  };
  static constexpr int kValuesPerVec = 8;
  static constexpr int kStorageElemsPerVec = 4;
  static constexpr int kLayoutBytes = 2;
  static constexpr int kRowMultiple = static_cast<int>(kInt4Group);
  template <bool kVectorLoads>
  static __device__ __forceinline__ Raw load(const uint8_t* address) {
    Raw raw;
    load_code_words<1, kVectorLoads>(address, raw.words);
    return raw;
  }
  static __device__ __forceinline__ float load_scale(const void* scales, int64_t token, int vec) {
    const unsigned short bits = __ldg(static_cast<const unsigned short*>(scales) + token + vec / 4);
    return __half2float(__ushort_as_half(bits));
  }
  static __device__ __forceinline__ void unpack(const Raw& raw, float scale, float* out) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t byte = (raw.words[0] >> (8 * j)) & 0xffu;
      out[j] = (static_cast<float>(byte & 15u) - 8.0f) * scale;
      out[4 + j] = (static_cast<float>(byte >> 4) - 8.0f) * scale;
    }
  }
  static __host__ __device__ constexpr int value_index(int vec, int e) {
    return 32 * (vec / 4) + 4 * (vec % 4) + (e < 4 ? e : 12 + e);
  }
};

// The paged address mode of format C (a pool of blocks, python_ref/paged.py): C's loads, values and
// scales, its rows found through the block table. PagedCache<E>: a paged pool of q's type.
template <typename C>
struct Paged : C {
  static constexpr bool kPaged = true;
};
template <typename E>
using PagedCache = Paged<PlainCache<E>>;

// The head_dim capacity a kernel is compiled for: the power of two in [8, 256] at or above
// head_dim. The lane layout below depends on head_dim only through it (lanes per key are a power
// of two), so a kernel for capacity C serves every supported head_dim in (C / 2, C] with the
// same layout an exact instantiation would have, masking the lanes past head_dim.
__host__ __device__ constexpr int head_dim_capacity(int64_t head_dim) {
  int capacity = 8;
  while (capacity < head_dim) capacity *= 2;
  return capacity;
}

// How one block maps threads onto keys for cache format C and head_dim capacity kCapacity.
template <typename C, int kCapacity, int kRows, bool kVectorLoads>
struct AttentionLayout {
  static constexpr int kElemsPerVec = C::kValuesPerVec;  // per lane load
  static constexpr int kMaxVecsPerRow = kCapacity / kElemsPerVec;
  static constexpr int kLanesPerKey = kMaxVecsPerRow >= 32 ? 32 : next_pow2(kMaxVecsPerRow);
  static constexpr int kVecsPerLane = (kMaxVecsPerRow + kLanesPerKey - 1) / kLanesPerKey;
  static constexpr int kLaneElems = kVecsPerLane * kElemsPerVec;  // head_dim slice of a lane
  static constexpr int kKeyGroups = kAttentionThreads / kLanesPerKey;
  // Keys each lane group loads before using any: enough bytes in flight to cover memory
  // latency, few enough registers for the query rows' slices and accumulators.
  // Element loads of 2-byte types hold twice the registers per key in flight: half the keys;
  // so do rows of two vectors per lane (float32, capacity 256), where the 1- and 4-row kernels
  // spilled under their register cap of 168 (the 8-row kernels have 255).
  static constexpr int kKeysPerStep = (kRows == 1 ? 8 : (kRows <= 4 ? 4 : 2)) /
                                      (!kVectorLoads && C::kLayoutBytes == 2 ? 2 : 1) /
                                      (kVecsPerLane > 1 && kRows < 8 ? 2 : 1);
  static constexpr int kTileKeys = kKeyGroups * kKeysPerStep;  // keys per block per step
  // Resident blocks per SM to ask the compiler for (caps registers at 65536 / (128 * this)):
  // more resident warps keep more loads in flight, but the 4-row kernels of 2-byte types spill
  // 116-284 bytes under the 128-register cap of 4 blocks (nvcc 13.0, sm_80 and sm_90), so they
  // and the rows of two vectors per lane take 3 blocks (168 registers).
  static constexpr int kMinBlocksPerSm =
      kRows == 8 ? 2 : (kVecsPerLane > 1 || (C::kLayoutBytes == 2 && kRows == 4) ? 3 : 4);
  static_assert(kCapacity % kElemsPerVec == 0, "head_dim must fill whole 16-byte vectors");
  static_assert(kAttentionThreads % kLanesPerKey == 0, "lane groups must tile the block");
  static_assert(kTileKeys == decode_tile_keys(C::kLayoutBytes, kCapacity, kRows, kVectorLoads),
                "the planner's tile (kernels.h) must match the kernel's");
};

// One work unit of the split kernel: (batch row, KV head, chunk of query rows, split), split
// varying fastest so that the blocks of one group run side by side. kFullRow: head_dim equals
// kCapacity, so the lane guards are compile-time (a run-time head_dim costs the 4-row kernels
// ~6 registers, which they then spill).
template <typename E, typename C, int kCapacity, int kRows, bool kVectorLoads, bool kFullRow>
__device__ __forceinline__ void attend_work_unit(const DecodeAttentionParams& p, int64_t work) {
  using L = AttentionLayout<C, kCapacity, kRows, kVectorLoads>;
  using Storage = typename C::Storage;
  constexpr int kLanes = L::kLanesPerKey, kVecs = L::kVecsPerLane, kVecElems = L::kElemsPerVec;
  constexpr int kLaneElems = L::kLaneElems, kKeyGroups = L::kKeyGroups, kSteps = L::kKeysPerStep;

  const int lane = threadIdx.x % kLanes;       // position within the key's lane group
  const int key_group = threadIdx.x / kLanes;  // which keys of a tile this group reads
  const int head_dim = kFullRow ? kCapacity : static_cast<int>(p.head_dim);
  const int vecs_per_row = head_dim / kVecElems;  // exact: head_dim is a multiple of 8
  const int64_t group = p.q_heads / p.kv_heads;
  const int64_t T = p.num_new, S = p.slots, total_rows = group * T;
  const float scale_log2 = p.scale * kLog2e;
  const float softcap_log2 = p.softcap * kLog2e, inv_softcap_log2 = p.softcap > 0.0f ? 1.0f / softcap_log2 : 0.0f;
  const E* q = static_cast<const E*>(p.q);

  __shared__ float group_acc[kKeyGroups][kRows][kCapacity];
  __shared__ float group_max[kKeyGroups][kRows];
  __shared__ float group_sum[kKeyGroups][kRows];
  __shared__ int64_t out_row[kRows];  // row of out / lse each of the block's query rows writes

  const int split = static_cast<int>(work % p.splits);
  const int64_t unit = work / p.splits;
  const int64_t row_chunk = unit % p.row_chunks;
  const int64_t pair = unit / p.row_chunks;
  const int64_t b = pair / p.kv_heads, kv_head = pair % p.kv_heads;
  // Query row r = new token (r / group) of query head kv_head * group + r % group.
  const int64_t first_row = row_chunk * kRows;
  const int rows = static_cast<int>(min64(kRows, total_rows - first_row));

  // Every quantity below stays within int64 for valid rows (num_new <= n <= kMaxLength,
  // 1 <= window <= kMaxLength); an invalid row sees no position at all.
  const int64_t n = p.lengths[b * p.lengths_stride];
  const bool valid_row = n >= T && n <= kMaxLength;
  const int64_t first_live = n > S ? n - S : 0;  // older positions were overwritten
  auto first_visible = [&](int64_t query_pos) { return max64(first_live, query_pos - p.window + 1); };
  // Union of the rows' visible positions (at most min(n, slots) <= 2^31 - 1 of them), then this
  // block's split of it. Splits are rounded to whole tiles.
  int64_t range_begin = 0, range_end = 0;
  if (valid_row) {
    range_begin = first_visible(n - T + first_row / group);
    range_end = max64(range_begin, n - T + (first_row + rows - 1) / group + 1);
  }
  const int64_t per_split = ceil_div(ceil_div(range_end - range_begin, p.splits), L::kTileKeys) * L::kTileKeys;
  const int64_t begin = min64(range_end, range_begin + split * per_split);
  // Unsigned: tile and key offsets run up to count + kTileKeys < 2^32 without wrapping.
  const uint32_t count = static_cast<uint32_t>(min64(range_end, begin + per_split) - begin);

  // Each row's query slice (pre-scaled) and visible offsets [lo, end) relative to `begin`.
  float q_slice[kRows][kLaneElems];
  uint32_t visible_lo[kRows], visible_end[kRows];
#pragma unroll
  for (int m = 0; m < kRows; ++m) {
    visible_lo[m] = 0;
    visible_end[m] = 0;
#pragma unroll
    for (int e = 0; e < kLaneElems; ++e) q_slice[m][e] = 0.0f;
    if (m < rows) {
      const int64_t r = first_row + m;
      const int64_t token = r / group, head = kv_head * group + r % group;
      if (valid_row) {
        const int64_t query_pos = n - T + token;
        visible_lo[m] = static_cast<uint32_t>(min64(max64(first_visible(query_pos) - begin, 0), count));
        visible_end[m] = static_cast<uint32_t>(min64(max64(query_pos + 1 - begin, 0), count));
      }
      if (threadIdx.x == 0) out_row[m] = (b * p.q_heads + head) * T + token;
      const E* q_row = q + b * p.q_stride[0] + head * p.q_stride[1] + token * p.q_stride[2];
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        const int vec = lane + v * kLanes;
        if (vec < vecs_per_row) {
#pragma unroll
          for (int e = 0; e < kVecElems; ++e)
            q_slice[m][v * kVecElems + e] =
                Elem<E>::to_float(q_row[C::value_index(vec, e) * p.q_stride[3]]) * scale_log2;
        }
      }
    }
  }

  // A row's keys (and, quantized, their scales): from k_head, at slot * k_stride[2] (a cache) or,
  // paged, at block * k_stride[0] + offset * k_stride[2] with the block from row b's table.
  const Storage* k_head =
      static_cast<const Storage*>(p.k_cache) + (C::kPaged ? 0 : b * p.k_stride[0]) + kv_head * p.k_stride[1];
  const Storage* v_head =
      static_cast<const Storage*>(p.v_cache) + (C::kPaged ? 0 : b * p.v_stride[0]) + kv_head * p.v_stride[1];
  const int64_t k_scale_head = (C::kPaged ? 0 : b * p.k_scale_stride[0]) + kv_head * p.k_scale_stride[1];
  const int64_t v_scale_head = (C::kPaged ? 0 : b * p.v_scale_stride[0]) + kv_head * p.v_scale_stride[1];
  const int64_t begin_slot = begin % S;

  float running_max[kRows], running_sum[kRows], acc[kRows][kLaneElems];
#pragma unroll
  for (int m = 0; m < kRows; ++m) {
    running_max[m] = -INFINITY;
    running_sum[m] = 0.0f;
#pragma unroll
    for (int e = 0; e < kLaneElems; ++e) acc[m][e] = 0.0f;
  }

  for (uint32_t tile = 0; tile < count; tile += L::kTileKeys) {
    // Issue every load of the step first. Key offset u * kKeyGroups + key_group: the lane
    // groups of a warp read consecutive slots, i.e. contiguous memory.
    uint32_t key_offset[kSteps];
    typename C::Raw k_raw[kSteps][kVecs], v_raw[kSteps][kVecs];
    float k_scale[kSteps][kVecs], v_scale[kSteps][kVecs];  // 1 for a plain cache
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      key_offset[u] = tile + u * kKeyGroups + key_group;
      const bool in_range = key_offset[u] < count;
      int64_t slot = begin_slot + key_offset[u];  // in range: count <= S, so one wrap at most
      if (slot >= S) slot -= S;
      int64_t k_row = slot * p.k_stride[2], v_row = slot * p.v_stride[2];
      // Where the row's scales are (PlainCache ignores them, and the compiler drops this for it).
      int64_t k_scale_row = slot * p.k_scale_stride[2], v_scale_row = slot * p.v_scale_stride[2];
      if constexpr (C::kPaged) {
        // A paged row never wraps (slot is the position); entries past the range are not ids.
        const int64_t block = in_range ? __ldg(p.block_ids + b * p.blocks_per_row + (slot >> p.block_shift)) : 0;
        const int64_t offset = slot & ((int64_t{1} << p.block_shift) - 1);
        k_row = block * p.k_stride[0] + offset * p.k_stride[2];
        v_row = block * p.v_stride[0] + offset * p.v_stride[2];
        k_scale_row = block * p.k_scale_stride[0] + offset * p.k_scale_stride[2];
        v_scale_row = block * p.v_scale_stride[0] + offset * p.v_scale_stride[2];
      }
#pragma unroll
      for (int v = 0; v < kVecs; ++v) {
        const int vec = lane + v * kLanes;
        k_raw[u][v] = typename C::Raw{};
        v_raw[u][v] = typename C::Raw{};
        k_scale[u][v] = 0.0f;
        v_scale[u][v] = 0.0f;
        if (in_range && vec < vecs_per_row) {
          const int storage_offset = vec * C::kStorageElemsPerVec;
          k_raw[u][v] = C::template load<kVectorLoads>(k_head + k_row + storage_offset);
          v_raw[u][v] = C::template load<kVectorLoads>(v_head + v_row + storage_offset);
          k_scale[u][v] = C::load_scale(p.k_scales, k_scale_head + k_scale_row, vec);
          v_scale[u][v] = C::load_scale(p.v_scales, v_scale_head + v_scale_row, vec);
        }
      }
    }

    // Scores (log2 units): partial dot products over the lane's slice, summed over the group.
    float score[kRows][kSteps];
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      float k_slice[kLaneElems];
#pragma unroll
      for (int v = 0; v < kVecs; ++v) C::unpack(k_raw[u][v], k_scale[u][v], k_slice + v * kVecElems);
#pragma unroll
      for (int m = 0; m < kRows; ++m) {
        float s = 0.0f;
#pragma unroll
        for (int e = 0; e < kLaneElems; ++e) s = fmaf(q_slice[m][e], k_slice[e], s);
        score[m][u] = s;
      }
    }
#pragma unroll
    for (int offset = kLanes / 2; offset > 0; offset /= 2) {
#pragma unroll
      for (int m = 0; m < kRows; ++m)
#pragma unroll
        for (int u = 0; u < kSteps; ++u) score[m][u] += __shfl_xor_sync(0xffffffffu, score[m][u], offset);
    }

    // Mask, then online softmax. Every lane of a group holds the same scores, so each keeps
    // identical running statistics for its slice of the accumulator.
    if (p.softcap > 0.0f) {  // scores are in log2 units: cap at softcap * log2(e), same tanh
#pragma unroll
      for (int m = 0; m < kRows; ++m)
#pragma unroll
        for (int u = 0; u < kSteps; ++u) score[m][u] = softcap_log2 * tanhf(score[m][u] * inv_softcap_log2);
    }
#pragma unroll
    for (int m = 0; m < kRows; ++m) {
      float step_max = -INFINITY;
#pragma unroll
      for (int u = 0; u < kSteps; ++u) {
        if (key_offset[u] < visible_lo[m] || key_offset[u] >= visible_end[m]) score[m][u] = -INFINITY;
        step_max = fmaxf(step_max, score[m][u]);
      }
      if (step_max > running_max[m] + kRescaleThreshold) {
        const float correction = exp2f(running_max[m] - step_max);  // 0 on the first visible key
        running_sum[m] *= correction;
#pragma unroll
        for (int e = 0; e < kLaneElems; ++e) acc[m][e] *= correction;
        running_max[m] = step_max;
      }
#pragma unroll
      for (int u = 0; u < kSteps; ++u) {
        // exp2(-inf) = 0 for masked keys; a row that has seen nothing yet gets weight 0 too.
        score[m][u] = running_max[m] == -INFINITY ? 0.0f : exp2f(score[m][u] - running_max[m]);
        running_sum[m] += score[m][u];
      }
    }
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      float v_slice[kLaneElems];
#pragma unroll
      for (int v = 0; v < kVecs; ++v) C::unpack(v_raw[u][v], v_scale[u][v], v_slice + v * kVecElems);
#pragma unroll
      for (int m = 0; m < kRows; ++m)
#pragma unroll
        for (int e = 0; e < kLaneElems; ++e) acc[m][e] = fmaf(score[m][u], v_slice[e], acc[m][e]);
    }
  }

  // Merge the lane groups: rescale each to the common maximum and add.
#pragma unroll
  for (int m = 0; m < kRows; ++m) {
    if (lane == 0) {
      group_max[key_group][m] = running_max[m];
      group_sum[key_group][m] = running_sum[m];
    }
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const int vec = lane + v * kLanes;
      if (vec < vecs_per_row) {
#pragma unroll
        for (int e = 0; e < kVecElems; ++e) group_acc[key_group][m][C::value_index(vec, e)] = acc[m][v * kVecElems + e];
      }
    }
  }
  __syncthreads();

  for (int index = threadIdx.x; index < rows * head_dim; index += kAttentionThreads) {
    const int m = index / head_dim, d = index % head_dim;
    float best = -INFINITY;
#pragma unroll 8
    for (int g = 0; g < kKeyGroups; ++g) best = fmaxf(best, group_max[g][m]);
    float total = 0.0f, value = 0.0f;
    if (best != -INFINITY) {
#pragma unroll 8
      for (int g = 0; g < kKeyGroups; ++g) {
        const float weight = exp2f(group_max[g][m] - best);  // 0 for groups that saw nothing
        total = fmaf(group_sum[g][m], weight, total);
        value = fmaf(group_acc[g][m][d], weight, value);
      }
    }
    if (p.splits == 1 && p.sinks) {  // the sink logit joins the denominator (splits: in the combine)
      const float sink = p.sinks[(out_row[m] / T) % p.q_heads * p.sinks_stride] * kLog2e;
      const float shared = fmaxf(best, sink), weight = best == -INFINITY ? 0.0f : exp2f(best - shared);
      total = total * weight + exp2f(sink - shared);
      value *= weight;
      best = shared;
    }
    const float normalised = total > 0.0f ? value / total : 0.0f;
    const float row_lse = total > 0.0f ? (best + log2f(total)) * kLn2 : -INFINITY;  // natural log
    if (p.splits == 1) {
      static_cast<E*>(p.out)[out_row[m] * head_dim + d] = Elem<E>::from_float(normalised);
      if (d == 0) p.lse[out_row[m]] = row_lse;
    } else {
      p.partial_out[(out_row[m] * p.splits + split) * head_dim + d] = normalised;
      if (d == 0) p.partial_lse[out_row[m] * p.splits + split] = row_lse;
    }
  }
}

// Block x serves work unit first_unit + x: the launcher covers more units than one grid holds
// with several launches (a loop over units here would cost the 4-row kernels registers too).
template <typename E, typename C, int kCapacity, int kRows, bool kVectorLoads, bool kFullRow>
__global__ void __launch_bounds__(kAttentionThreads,
                                  (AttentionLayout<C, kCapacity, kRows, kVectorLoads>::kMinBlocksPerSm))
    decode_attention_split_kernel(const DecodeAttentionParams p) {
  attend_work_unit<E, C, kCapacity, kRows, kVectorLoads, kFullRow>(p, p.first_unit + blockIdx.x);
}

// Combines the splits of every output row: out = sum_s w_s * out_s / sum_s w_s with
// w_s = exp(lse_s - max lse), lse = max lse + log(sum_s w_s). One block per row.
template <typename E>
__global__ void __launch_bounds__(kCombineThreads) combine_splits_kernel(const DecodeAttentionParams p) {
  static_assert(kMaxSplits <= 64, "one warp reads the splits, two per lane");
  __shared__ float weight[kMaxSplits];
  __shared__ float inverse_total;
  const int splits = p.splits;
  const int64_t head_dim = p.head_dim;
  const int64_t rows = p.batch * p.q_heads * p.num_new;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      const float* lse_parts = p.partial_lse + row * splits;
      const float lse0 = lane < splits ? lse_parts[lane] : -INFINITY;
      const float lse1 = lane + 32 < splits ? lse_parts[lane + 32] : -INFINITY;
      float best = fmaxf(lse0, lse1);
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) best = fmaxf(best, __shfl_xor_sync(0xffffffffu, best, offset));
      const float w0 = best == -INFINITY ? 0.0f : expf(lse0 - best);
      const float w1 = best == -INFINITY ? 0.0f : expf(lse1 - best);
      float total = w0 + w1;
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) total += __shfl_xor_sync(0xffffffffu, total, offset);
      if (lane < splits) weight[lane] = w0;
      if (lane + 32 < splits) weight[lane + 32] = w1;
      if (lane == 0) {
        float row_lse = total > 0.0f ? best + logf(total) : -INFINITY, factor = 1.0f;
        if (p.sinks) {  // the sink logit joins the denominator: lse' = logaddexp(lse, sink)
          const float sink = p.sinks[(row / p.num_new) % p.q_heads * p.sinks_stride];
          const float shared = fmaxf(row_lse, sink);
          const float with_sink = shared + logf(expf(row_lse - shared) + expf(sink - shared));
          factor = row_lse == -INFINITY ? 0.0f : expf(row_lse - with_sink);
          row_lse = with_sink;
        }
        inverse_total = total > 0.0f ? factor / total : 0.0f;
        p.lse[row] = row_lse;
      }
    }
    __syncthreads();
    const float* out_parts = p.partial_out + row * splits * head_dim;
    for (int64_t d = threadIdx.x; d < head_dim; d += kCombineThreads) {
      float value = 0.0f;
      for (int s = 0; s < splits; ++s) value = fmaf(weight[s], out_parts[s * head_dim + d], value);
      static_cast<E*>(p.out)[row * head_dim + d] = Elem<E>::from_float(value * inverse_total);
    }
    __syncthreads();  // weight is rewritten for the next row
  }
}

// Launch dispatch, shared by the CUDA build and the CPU emulation of the tests: `launch(kernel,
// blocks, threads, params)` starts `kernel(params)` on `blocks` blocks of `threads` threads and
// returns its launch status. Kernels are chosen by head_dim capacity (head_dim_capacity),
// rows_per_block and load path: 16-byte loads with a compile-time head_dim (head_dim equal to its
// capacity: 8, 16, 32, 64, 128, 256), 16-byte loads with a run-time head_dim (the other
// multiples of 8), or element loads (unaligned caches, any head_dim; the slow path, compiled for
// 4 rows per block only to bound compile time and binary size).
enum class LoadPath { kElements = 0, kVectorsRuntimeHeadDim = 1, kVectorsFullRow = 2 };

inline LoadPath load_path_of(const DecodeAttentionParams& p) {
  if (!p.vector_loads) return LoadPath::kElements;
  return p.head_dim == head_dim_capacity(p.head_dim) ? LoadPath::kVectorsFullRow : LoadPath::kVectorsRuntimeHeadDim;
}
using AttentionKernel = void (*)(DecodeAttentionParams);

// CUDA's limit on gridDim.x: the split kernel is launched once per this many work units, the
// combine kernel's blocks stride over the rows beyond it.
constexpr int64_t kMaxGridX = (int64_t{1} << 31) - 1;
constexpr int kNumCapacities = 6;  // 8, 16, ..., 256

template <typename E, typename C, int kCapacity, bool kVectorLoads, bool kFullRow>
AttentionKernel split_kernel_for_rows(int rows_per_block) {
  switch (rows_per_block) {
    case 1: return decode_attention_split_kernel<E, C, kCapacity, 1, kVectorLoads, kFullRow>;
    case 4: return decode_attention_split_kernel<E, C, kCapacity, 4, kVectorLoads, kFullRow>;
    case 8: return decode_attention_split_kernel<E, C, kCapacity, 8, kVectorLoads, kFullRow>;
  }
  return nullptr;
}

template <typename E, typename C, int kCapacity>
AttentionKernel split_kernel_for_loads(int rows_per_block, LoadPath path) {
  if constexpr (kCapacity < C::kRowMultiple) {  // no head_dim of the format has this capacity
    return nullptr;
  } else {
    switch (path) {
      case LoadPath::kElements:  // one kernel per capacity for the slow path (plan_decode_attention)
        return rows_per_block == 4 ? decode_attention_split_kernel<E, C, kCapacity, 4, false, false> : nullptr;
      case LoadPath::kVectorsFullRow: return split_kernel_for_rows<E, C, kCapacity, true, true>(rows_per_block);
      case LoadPath::kVectorsRuntimeHeadDim:
        // Only capacities above twice the row multiple hold a head_dim below them (8 and 16
        // hold a single multiple of 8 each, 32 and 64 a single multiple of 32).
        if constexpr (C::kRowMultiple < kCapacity / 2)
          return split_kernel_for_rows<E, C, kCapacity, true, false>(rows_per_block);
        return nullptr;
    }
    return nullptr;
  }
}

// C: the cache's format (PlainCache<E> for a cache of q's type).
template <typename E, typename C = PlainCache<E>>
AttentionKernel split_kernel_for(const DecodeAttentionParams& p) {
  if (!head_dim_supported(p.head_dim) || p.head_dim % C::kRowMultiple != 0) return nullptr;
  switch (head_dim_capacity(p.head_dim)) {
    case 8: return split_kernel_for_loads<E, C, 8>(p.rows_per_block, load_path_of(p));
    case 16: return split_kernel_for_loads<E, C, 16>(p.rows_per_block, load_path_of(p));
    case 32: return split_kernel_for_loads<E, C, 32>(p.rows_per_block, load_path_of(p));
    case 64: return split_kernel_for_loads<E, C, 64>(p.rows_per_block, load_path_of(p));
    case 128: return split_kernel_for_loads<E, C, 128>(p.rows_per_block, load_path_of(p));
    case 256: return split_kernel_for_loads<E, C, 256>(p.rows_per_block, load_path_of(p));
  }
  return nullptr;
}

// Resident blocks per SM of the split kernel p would launch (0 if none fits or on error).
// Cached per kernel after the first query (assumes one GPU model per process).
template <typename E, typename C = PlainCache<E>>
int split_kernel_occupancy(const DecodeAttentionParams& p) {
  static std::atomic<int> cached[kNumCapacities][3][3];
  const AttentionKernel kernel = split_kernel_for<E, C>(p);
  if (kernel == nullptr) return 0;
  int capacity_index = 0;
  while ((8 << capacity_index) < head_dim_capacity(p.head_dim)) ++capacity_index;
  const int rows_index = p.rows_per_block == 1 ? 0 : (p.rows_per_block == 4 ? 1 : 2);
  std::atomic<int>& slot = cached[capacity_index][rows_index][static_cast<int>(load_path_of(p))];
  int blocks = slot.load(std::memory_order_relaxed);
  if (blocks > 0) return blocks;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kAttentionThreads, 0) != cudaSuccess) {
    cudaGetLastError();  // leave no sticky error for the launch check
    return 0;
  }
  slot.store(blocks, std::memory_order_relaxed);
  return blocks;
}

// `max_blocks` caps either grid (the tests' emulation lowers it to exercise the repeated
// launches and the combine kernel's stride).
template <typename E, typename C = PlainCache<E>, typename Launch>
cudaError_t dispatch_decode_attention(const DecodeAttentionParams& p, Launch&& launch, int64_t max_blocks = kMaxGridX) {
  const AttentionKernel split_kernel = split_kernel_for<E, C>(p);
  if (split_kernel == nullptr || p.window < 1 || p.window > kMaxLength) return cudaErrorInvalidValue;
  const int64_t units = p.batch * p.kv_heads * p.row_chunks * p.splits;
  for (int64_t first_unit = 0; first_unit < units; first_unit += max_blocks) {
    DecodeAttentionParams part = p;
    part.first_unit = first_unit;
    const int64_t blocks = units - first_unit < max_blocks ? units - first_unit : max_blocks;
    const cudaError_t status = launch(split_kernel, blocks, kAttentionThreads, part);
    if (status != cudaSuccess) return status;
  }
  if (p.splits == 1) return cudaSuccess;
  const int64_t rows = p.batch * p.q_heads * p.num_new;
  return launch(static_cast<AttentionKernel>(combine_splits_kernel<E>), rows < max_blocks ? rows : max_blocks,
                kCombineThreads, p);
}

// Calls fn(TypeTag<E>{}) with E the type `elem` names (the quantized launchers' q dtype switch).
template <typename T>
struct TypeTag {
  using type = T;
};
template <typename Fn>
auto with_elem_type(ElemType elem, Fn&& fn) {
  switch (elem) {
    case ElemType::kBFloat16: return fn(TypeTag<__nv_bfloat16>{});
    case ElemType::kFloat16: return fn(TypeTag<__half>{});
    case ElemType::kFloat32: break;
  }
  return fn(TypeTag<float>{});
}

// Calls fn(TypeTag<E>{}) with E the q element type of a kernel family (decode_attention_instances.h):
// Q itself, or for Q void (any q dtype) the type `elem` names.
template <typename Q, typename Fn>
auto with_query_type(ElemType elem, Fn&& fn) {
  if constexpr (std::is_void_v<Q>) {
    return with_elem_type(elem, fn);
  } else {
    return fn(TypeTag<Q>{});
  }
}

}  // namespace kvcache_ext::cuda
