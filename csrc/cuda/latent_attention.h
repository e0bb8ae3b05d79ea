// Framework-free interface of the CUDA latent (MLA) decode attention (latent_attention.cuh): the
// problem as raw pointers and sizes, its plan and its launch. Included by the kernel's translation
// unit (latent_attention.cu), the LibTorch binding (ops_cuda.cu) and the tests' CUDA emulation.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "../capabilities.h"
#include "../elem_type.h"

namespace kvcache_ext::cuda {

// One part of the cached rows: columns [column, column + width) of every row, stored in the
// problem's element type (scales null) or as codes of the problem's format with one float32 scale
// per token (python_ref/latent.py's quantized latent cache: c, and k_pe when it is quantized).
struct LatentPartParams {
  const void* data;         // [batch, kv_heads, slots, width], width contiguous
  int64_t stride[3];        // batch, head, slot: in elements (bytes for codes)
  int64_t column, width;    // width 0: no such part
  const float* scales;      // [batch, kv_heads, slots], or null
  int64_t scale_stride[3];  // batch, head, slot, in elements
};

// python_ref.latent.reference_latent_attention: keys the cached rows (key_dim wide), values their
// first value_dim columns, read from the same bytes. A row whose length is below num_new or above
// kMaxLength (only the device can see it) gets zeros and a log-sum-exp of -inf and reads nothing.
struct LatentAttentionParams {
  const void* q;           // [batch, q_heads, num_new, key_dim], strides q_stride (elements)
  const int64_t* lengths;  // [batch] tokens per row, the num_new new ones included (device)
  int64_t lengths_stride;  // elements
  void* out;               // [batch, q_heads, num_new, value_dim] contiguous, q's dtype
  float* lse;              // [batch, q_heads, num_new] contiguous
  float* partial_out;      // [batch * q_heads * num_new, splits, value_dim], used when splits > 1
  float* partial_lse;      // [batch * q_heads * num_new, splits], used when splits > 1
  int64_t batch, q_heads, kv_heads, num_new, key_dim, value_dim, slots;
  int64_t q_stride[4];
  // The cached rows: all of a row in parts[0] (a plain cache, q's type), or c in parts[0] and k_pe
  // in parts[1] (a quantized cache; k_pe in q's type or quantized like c).
  LatentPartParams parts[2];
  KvFormat format;  // of the parts with scales (int8 or fp8_e4m3)
  int64_t window;   // in [1, kMaxLength] (kernel_window): "no window" is kMaxLength
  float scale;      // applied to q . k (natural-log softmax domain)
  ElemType elem;    // of q and out, and of the parts without scales
  // Whether every part's rows are aligned to the kernel's loads of 8 values (16 bytes; 8 bytes of
  // codes): pointers and strides; otherwise the kernel reads them element by element.
  bool vector_loads;
  // Filled by plan_latent_attention:
  int64_t row_chunks;  // ceil(group * num_new / kLatentRows)
  int splits;          // chunks the visible positions are split into (Flash-Decoding)
  // Set by the launcher: the split kernel's block x serves work unit first_unit + x.
  int64_t first_unit;
};

// Query rows (group member x new token) one block serves, and the positions of one step.
constexpr int kLatentRows = 16;
constexpr int kLatentTile = 8;
constexpr int kLatentThreads = 512;

// Fills vector_loads from the parts' pointers and strides (elem and the parts must be set).
inline void choose_latent_loads(LatentAttentionParams& p) {
  bool aligned = true;
  for (const LatentPartParams& part : p.parts) {
    if (part.width == 0) continue;
    const int64_t elem_bytes = part.scales ? 1 : (p.elem == ElemType::kFloat32 ? 4 : 2);
    const int64_t load = part.scales ? 8 : 16;  // a float32 chunk is two 16-byte loads
    aligned = aligned && reinterpret_cast<uintptr_t>(part.data) % load == 0 && (part.column % 8) == 0 &&
              (part.width % 8) == 0;
    for (int i = 0; i < 3; ++i) aligned = aligned && (part.stride[i] * elem_bytes) % load == 0;
  }
  p.vector_loads = aligned;
}

// Chooses row_chunks and splits from shapes only (never from lengths, which live on the device),
// so the scratch size is known before launch and a decode step can be captured in a CUDA graph.
// `sm_count`: multiprocessors of the device.
void plan_latent_attention(LatentAttentionParams& p, int sm_count);

// Blocks of the split kernel for p's dtype that one SM keeps resident (0 if the query fails).
int latent_split_kernel_blocks_per_sm(const LatentAttentionParams& p);

// Launches the split kernel and, when splits > 1, the combine kernel. Expects a checked problem
// (key_dim a multiple of 8 up to kMaxLatentKeyDimCuda, value_dim one up to key_dim), window in [1,
// kMaxLength] and a plan.
cudaError_t launch_latent_attention(const LatentAttentionParams& p, cudaStream_t stream);

// ---- append_latent_quantized ------------------------------------------------------------------
// Quantizes the new latent rows (float32/bfloat16/float16) into a quantized latent cache, bit for
// bit python_ref.latent.quantize_latent: c (the first value_dim values) into codes with one scale
// per token, k_pe (the rest) quantized the same way when it has scales, else copied as it comes.
// Token t of row b goes to slot (lengths[b] + t) % slots for t < counts[b]. Strides in elements of
// each tensor (codes: bytes). A row whose length is outside [0, kMaxLength] or whose count is
// outside [0, num_new] is left untouched (only the device can see them).
struct LatentAppendParams {
  void* c_data;            // [batch, kv_heads, slots, value_dim] codes
  float* c_scales;         // [batch, kv_heads, slots]
  void* k_pe;              // [batch, kv_heads, slots, key_dim - value_dim]: codes or elem values
  float* k_pe_scales;      // [batch, kv_heads, slots], or null: k_pe copied
  const void* source;      // latent_new [batch, kv_heads, num_new, key_dim]
  const int64_t* lengths;  // [batch] tokens already in each row (device memory)
  int64_t lengths_stride;  // elements
  const int64_t* counts;   // [batch] tokens of each row to store (device memory); nullptr: all
  int64_t counts_stride;   // elements
  int64_t c_stride[3], c_scale_stride[3], pe_stride[3], pe_scale_stride[3];  // batch, head, slot
  int64_t source_stride[4];                                                  // batch, head, token, value
  int64_t batch, kv_heads, num_new, slots, key_dim, value_dim;
  KvFormat format;  // int8 or fp8_e4m3
  ElemType elem;    // of the source (and of an unquantized k_pe)
};

cudaError_t launch_append_latent_quantized(const LatentAppendParams& p, cudaStream_t stream);

}  // namespace kvcache_ext::cuda
