// C entry points that run csrc/cuda's kernels and host planning under the CPU emulation of
// emu.h, for tests/test_cuda_emulation.py (loaded with ctypes; pointers are CPU tensors').
#include "../../csrc/cuda/append_kv.cuh"
#include "../../csrc/cuda/append_kv_quantized.cuh"
#include "../../csrc/cuda/decode_attention.cu"  // plan_decode_attention, launch_decode_attention
#include "../../csrc/cuda/decode_attention.cuh"
#include "../../csrc/cuda/key_rotation.cuh"
#include "../../csrc/cuda/latent_append_quantized.cuh"
#include "../../csrc/cuda/latent_attention.cu"  // plan_latent_attention
#include "../../csrc/cuda/latent_attention.cuh"
#include "../../csrc/paged_blocks.h"

namespace kvcache_ext::cuda {

// Caps the grids of the emulated launches (the real launcher uses CUDA's limit), so that tests
// can make the kernels' blocks stride over more work than the grid holds.
int64_t max_emulated_blocks = kMaxGridX;
// -1: the launcher's choice of load path; 0 / 1: forced element / 16-byte loads (tests force
// 16-byte loads on unaligned caches to see the emulation refuse them).
int forced_vector_loads = -1;
// The last decode's split scratch, log-sum-exps: [rows, splits].
std::vector<float> last_partial_lse;

template <typename E, typename C = PlainCache<E>>
cudaError_t emulate_decode_attention(const DecodeAttentionParams& p) {
  return dispatch_decode_attention<E, C>(
      p,
      [&](AttentionKernel kernel, int64_t blocks, int threads, const DecodeAttentionParams& params) {
        return emu::launch(kernel, dim3(static_cast<unsigned>(blocks)), dim3(threads), params);
      },
      max_emulated_blocks);
}

// Not split_kernel_occupancy: it caches the first answer per kernel, and the tests change the
// emulated occupancy (emu::blocks_per_sm) between calls.
template <typename E, typename C = PlainCache<E>>
int emulated_occupancy(const DecodeAttentionParams& p) {
  const AttentionKernel kernel = split_kernel_for<E, C>(p);
  int blocks = 0;
  if (kernel == nullptr ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kAttentionThreads, 0) != cudaSuccess)
    return 0;
  return blocks;
}
// Every kernel family of decode_attention_instances.h, launched and sized under the emulation.
#define KVCACHE_EXT_EMULATE_DECODE_ATTENTION_FAMILY(name, Q, C)                                                        \
  cudaError_t launch_decode_attention_##name(const DecodeAttentionParams& p, cudaStream_t) {                           \
    return with_query_type<Q>(p.elem,                                                                                  \
                              [&](auto tag) { return emulate_decode_attention<typename decltype(tag)::type, C>(p); }); \
  }                                                                                                                    \
  int split_kernel_blocks_per_sm_##name(const DecodeAttentionParams& p) {                                              \
    return with_query_type<Q>(p.elem,                                                                                  \
                              [&](auto tag) { return emulated_occupancy<typename decltype(tag)::type, C>(p); });       \
  }
KVCACHE_EXT_DECODE_ATTENTION_INSTANCES(KVCACHE_EXT_EMULATE_DECODE_ATTENTION_FAMILY)
#undef KVCACHE_EXT_EMULATE_DECODE_ATTENTION_FAMILY

// The latent kernels under the emulation (latent_attention_kernels.cu on a GPU); the occupancy
// uncached, as for the decode families.
cudaError_t launch_latent_attention(const LatentAttentionParams& p, cudaStream_t) {
  return dispatch_latent_attention(
      p,
      [&](auto kernel, int64_t blocks, int threads, const auto& params) {
        return emu::launch(kernel, dim3(static_cast<unsigned>(blocks)), dim3(threads), params);
      },
      max_emulated_blocks);
}
int latent_split_kernel_blocks_per_sm(const LatentAttentionParams& p) {
  int blocks = 0;
  const cudaError_t status = with_elem_type(p.elem, [&](auto tag) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &blocks, latent_attention_split_kernel<typename decltype(tag)::type>, kLatentThreads, 0);
  });
  return status == cudaSuccess ? blocks : 0;
}

// Self-test kernels: faults the emulation must catch.
__shared__ int race_value;
__global__ void race_kernel(int* out, int synchronise) {
  if (threadIdx.x == 0) race_value = static_cast<int>(blockIdx.x) + 1;
  if (synchronise) __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = race_value;
}
__global__ void vector_copy_kernel(const char* source, char* destination) {
  const uint4 value = __ldg(reinterpret_cast<const uint4*>(source) + threadIdx.x);
  reinterpret_cast<uint4*>(destination)[threadIdx.x] = value;
}
__global__ void out_of_bounds_kernel(const float* source, float* destination, int n) {
  destination[threadIdx.x] = source[threadIdx.x + n];
}

}  // namespace kvcache_ext::cuda

using namespace kvcache_ext::cuda;

namespace {
// The scratch's guards: NaN with a payload no arithmetic produces, compared bit for bit.
constexpr uint32_t kGuardBits = 0x7fe5a5a5u;
constexpr int64_t kGuardFloats = 64;

bool guards_intact(const std::vector<float>& buffer, int64_t inner) {
  for (int64_t i = 0; i < kGuardFloats; ++i) {
    uint32_t before, after;
    std::memcpy(&before, &buffer[i], 4);
    std::memcpy(&after, &buffer[kGuardFloats + inner + i], 4);
    if (before != kGuardBits || after != kGuardBits) return false;
  }
  return true;
}

// The split scratch of an attention (partial outputs and log-sum-exps), each array between guards
// and its inside NaN-filled: anything the combine reads that the split kernel did not write shows
// up. Empty for splits == 1.
struct GuardedScratch {
  int64_t out_floats, lse_floats;
  std::vector<float> out, lse;
  GuardedScratch(int splits, int64_t rows, int64_t width)
      : out_floats(rows * splits * width), lse_floats(rows * splits) {
    if (splits == 1) return;
    const float guard = __uint_as_float(kGuardBits);
    out.assign(kGuardFloats + out_floats + kGuardFloats, guard);
    lse.assign(kGuardFloats + lse_floats + kGuardFloats, guard);
    std::fill_n(out.begin() + kGuardFloats, out_floats, std::nanf(""));
    std::fill_n(lse.begin() + kGuardFloats, lse_floats, std::nanf(""));
  }
  float* partial_out() { return out.empty() ? nullptr : out.data() + kGuardFloats; }
  float* partial_lse() { return lse.empty() ? nullptr : lse.data() + kGuardFloats; }
  // -2 (and the emulation's first error set) when a kernel wrote outside the scratch, else 0.
  int check() const {
    if (out.empty() || (guards_intact(out, out_floats) && guards_intact(lse, lse_floats))) return 0;
    if (emu::first_error.empty()) emu::first_error = "a kernel wrote outside the split scratch (guards changed)";
    return -2;
  }
};
}  // namespace

// What the CUDA binding does between its checks and the launch, for params filled but for the
// plan and scratch. elem_bytes: of the cache's elements (the strides' unit).
static int plan_and_launch(DecodeAttentionParams& p, int64_t elem_bytes, int sm_count, int64_t max_blocks,
                           int64_t* plan_out) {
  choose_decode_loads(p, elem_bytes);
  if (forced_vector_loads >= 0) p.vector_loads = forced_vector_loads != 0;
  if (!kvcache_ext::head_dim_supported(p.head_dim)) return -1;
  plan_decode_attention(p, sm_count);
  plan_out[0] = p.rows_per_block, plan_out[1] = p.row_chunks, plan_out[2] = p.splits, plan_out[3] = p.vector_loads;
  GuardedScratch scratch(p.splits, p.batch * p.q_heads * p.num_new, p.head_dim);
  p.partial_out = scratch.partial_out();
  p.partial_lse = scratch.partial_lse();
  max_emulated_blocks = max_blocks;
  const cudaError_t status = launch_decode_attention(p, nullptr);
  last_partial_lse.assign(p.partial_lse, p.partial_lse ? p.partial_lse + scratch.lse_floats : p.partial_lse);
  if (status != cudaSuccess) return status;
  return scratch.check();
}

extern "C" {

void emu_set_seed(uint64_t seed) { emu::set_seed(seed); }
// The first error the emulation reported since the last call (empty: none); clears it.
const char* emu_take_error() {
  static std::string taken;
  taken = emu::first_error;
  emu::clear_error();
  return taken.c_str();
}
void emu_set_blocks_per_sm(int blocks) { emu::blocks_per_sm = blocks; }
void emu_force_vector_loads(int forced) { forced_vector_loads = forced; }
int emu_sanitized() { return EMU_ASAN; }

// Plan only (no launch): plan_out receives rows_per_block, row_chunks, splits, vector_loads,
// tile keys. sizes: batch, q_heads, kv_heads, num_new, head_dim, slots.
int emu_plan_decode(int elem, const int64_t* sizes, int64_t window, int vector_loads, int sm_count, int64_t* plan_out) {
  DecodeAttentionParams p{};
  p.elem = static_cast<kvcache_ext::ElemType>(elem);
  p.batch = sizes[0], p.q_heads = sizes[1], p.kv_heads = sizes[2], p.num_new = sizes[3];
  p.head_dim = sizes[4], p.slots = sizes[5];
  p.window = kernel_window(window);
  p.vector_loads = vector_loads != 0;
  if (!kvcache_ext::head_dim_supported(p.head_dim)) return -1;
  plan_decode_attention(p, sm_count);
  plan_out[0] = p.rows_per_block, plan_out[1] = p.row_chunks, plan_out[2] = p.splits, plan_out[3] = p.vector_loads;
  plan_out[4] =
      decode_tile_keys(p.elem == kvcache_ext::ElemType::kFloat32 ? 4 : 2, p.head_dim, p.rows_per_block, p.vector_loads);
  return 0;
}

// What the CUDA binding (ops_cuda.cu) does between its checks and the launch, on CPU memory.
// sizes: batch, q_heads, kv_heads, num_new, head_dim, slots. kv_stride: k's 3 then v's 3.
// window: 0 for none. max_blocks: grid cap. plan_out receives rows_per_block, row_chunks,
// splits, vector_loads. Returns the launch status (716: a misaligned access, see
// emu_take_error), or -1 (unsupported head_dim), -2 (the split scratch's guards were written).
int emu_decode_attention(int elem, const void* q, const int64_t* q_stride, const void* k_cache, const void* v_cache,
                         const int64_t* kv_stride, const int64_t* lengths, int64_t lengths_stride, void* out,
                         float* lse, const int64_t* sizes, int64_t window, double scale, double softcap,
                         const float* sinks, int sm_count, int64_t max_blocks, int64_t* plan_out) {
  DecodeAttentionParams p{};
  p.elem = static_cast<kvcache_ext::ElemType>(elem);
  p.q = q, p.k_cache = k_cache, p.v_cache = v_cache, p.lengths = lengths;
  p.lengths_stride = lengths_stride;
  p.out = out, p.lse = lse;
  p.batch = sizes[0], p.q_heads = sizes[1], p.kv_heads = sizes[2], p.num_new = sizes[3];
  p.head_dim = sizes[4], p.slots = sizes[5];
  for (int i = 0; i < 4; ++i) p.q_stride[i] = q_stride[i];
  for (int i = 0; i < 3; ++i) p.k_stride[i] = kv_stride[i], p.v_stride[i] = kv_stride[3 + i];
  p.window = kernel_window(window);
  p.scale = static_cast<float>(scale);
  p.softcap = static_cast<float>(softcap);
  p.sinks = sinks, p.sinks_stride = 1;
  return plan_and_launch(p, p.elem == kvcache_ext::ElemType::kFloat32 ? 4 : 2, sm_count, max_blocks, plan_out);
}

// emu_decode_attention over a quantized cache: format (KvFormat) and elem (ElemType of q);
// k_data/v_data strides in bytes (kv_stride), the scales' in their elements (scale_stride: k's 3
// then v's 3).
int emu_decode_attention_quantized(int format, int elem, const void* q, const int64_t* q_stride, const void* k_data,
                                   const void* k_scales, const void* v_data, const void* v_scales,
                                   const int64_t* kv_stride, const int64_t* scale_stride, const int64_t* lengths,
                                   int64_t lengths_stride, void* out, float* lse, const int64_t* sizes, int64_t window,
                                   double scale, double softcap, const float* sinks, int sm_count, int64_t max_blocks,
                                   int64_t* plan_out) {
  DecodeAttentionParams p{};
  p.elem = static_cast<kvcache_ext::ElemType>(elem);
  p.quantized = true;
  p.format = static_cast<kvcache_ext::KvFormat>(format);
  p.q = q, p.k_cache = k_data, p.v_cache = v_data, p.k_scales = k_scales, p.v_scales = v_scales;
  p.lengths = lengths, p.lengths_stride = lengths_stride;
  p.out = out, p.lse = lse;
  p.batch = sizes[0], p.q_heads = sizes[1], p.kv_heads = sizes[2], p.num_new = sizes[3];
  p.head_dim = sizes[4], p.slots = sizes[5];
  for (int i = 0; i < 4; ++i) p.q_stride[i] = q_stride[i];
  for (int i = 0; i < 3; ++i) {
    p.k_stride[i] = kv_stride[i], p.v_stride[i] = kv_stride[3 + i];
    p.k_scale_stride[i] = scale_stride[i], p.v_scale_stride[i] = scale_stride[3 + i];
  }
  p.window = kernel_window(window);
  p.scale = static_cast<float>(scale);
  p.softcap = static_cast<float>(softcap);
  p.sinks = sinks, p.sinks_stride = 1;
  return plan_and_launch(p, 1, sm_count, max_blocks, plan_out);
}

// What the CUDA binding does for latent_decode_attention(_quantized) between its checks and the
// launch, on CPU memory. sizes: batch, q_heads, kv_heads, num_new, key_dim, value_dim, slots.
// Part i (0: a plain cache's rows or c; 1: k_pe, width 0 for none): part_data[i] with strides
// part_stride[3 i ..] (elements, bytes for codes), columns part_columns[2 i] onwards, part_columns[2 i
// + 1] wide, scales part_scales[i] (null: values of elem) with strides scale_stride[3 i ..]. format:
// KvFormat of the codes. window: 0 for none. plan_out receives row_chunks, splits, vector_loads.
// Returns the launch status (716: a misaligned access), or -2 (the split scratch's guards were
// written).
int emu_latent_attention(int elem, int format, const void* q, const int64_t* q_stride, const void* const* part_data,
                         const int64_t* part_stride, const int64_t* part_columns, const float* const* part_scales,
                         const int64_t* scale_stride, const int64_t* lengths, int64_t lengths_stride, void* out,
                         float* lse, const int64_t* sizes, int64_t window, double scale, int sm_count,
                         int64_t max_blocks, int64_t* plan_out) {
  LatentAttentionParams p{};
  p.elem = static_cast<kvcache_ext::ElemType>(elem);
  p.format = static_cast<kvcache_ext::KvFormat>(format);
  p.q = q, p.lengths = lengths, p.lengths_stride = lengths_stride, p.out = out, p.lse = lse;
  p.batch = sizes[0], p.q_heads = sizes[1], p.kv_heads = sizes[2], p.num_new = sizes[3];
  p.key_dim = sizes[4], p.value_dim = sizes[5], p.slots = sizes[6];
  for (int i = 0; i < 4; ++i) p.q_stride[i] = q_stride[i];
  for (int part = 0; part < 2; ++part) {
    LatentPartParams& target = p.parts[part];
    target.data = part_data[part];
    target.column = part_columns[2 * part], target.width = part_columns[2 * part + 1];
    target.scales = part_scales[part];
    for (int i = 0; i < 3; ++i)
      target.stride[i] = part_stride[3 * part + i], target.scale_stride[i] = scale_stride[3 * part + i];
  }
  p.window = kernel_window(window);
  p.scale = static_cast<float>(scale);
  choose_latent_loads(p);
  if (forced_vector_loads >= 0) p.vector_loads = forced_vector_loads != 0;
  plan_latent_attention(p, sm_count);
  plan_out[0] = p.row_chunks, plan_out[1] = p.splits, plan_out[2] = p.vector_loads;
  GuardedScratch scratch(p.splits, p.batch * p.q_heads * p.num_new, p.value_dim);
  p.partial_out = scratch.partial_out();
  p.partial_lse = scratch.partial_lse();
  max_emulated_blocks = max_blocks;
  const cudaError_t status = launch_latent_attention(p, nullptr);
  if (status != cudaSuccess) return status;
  return scratch.check();
}

// What the CUDA binding does for append_latent_quantized after its checks. sizes: batch, kv_heads,
// num_new, slots, key_dim, value_dim. strides: c_data's 3, c_scales' 3, k_pe's 3, k_pe_scales' 3,
// then latent_new's 4 (elements; codes in bytes). k_pe_scales null: k_pe is copied. counts: null
// (every token) or the caller's, which the kernel checks. max_blocks: the grid cap.
int emu_append_latent_quantized(int format, int elem, void* c_data, float* c_scales, void* k_pe, float* k_pe_scales,
                                const void* latent_new, const int64_t* strides, const int64_t* lengths,
                                int64_t lengths_stride, const int64_t* counts, int64_t counts_stride,
                                const int64_t* sizes, int64_t max_blocks) {
  LatentAppendParams p{};
  p.c_data = c_data, p.c_scales = c_scales, p.k_pe = k_pe, p.k_pe_scales = k_pe_scales, p.source = latent_new;
  p.lengths = lengths, p.lengths_stride = lengths_stride, p.counts = counts, p.counts_stride = counts_stride;
  for (int i = 0; i < 3; ++i) {
    p.c_stride[i] = strides[i], p.c_scale_stride[i] = strides[3 + i];
    p.pe_stride[i] = strides[6 + i], p.pe_scale_stride[i] = strides[9 + i];
  }
  for (int i = 0; i < 4; ++i) p.source_stride[i] = strides[12 + i];
  p.batch = sizes[0], p.kv_heads = sizes[1], p.num_new = sizes[2], p.slots = sizes[3];
  p.key_dim = sizes[4], p.value_dim = sizes[5];
  p.format = static_cast<kvcache_ext::KvFormat>(format);
  p.elem = static_cast<kvcache_ext::ElemType>(elem);
  return dispatch_append_latent_quantized(
      p,
      [&](LatentAppendKernel kernel, int64_t blocks, int threads, const LatentAppendParams& params) {
        return emu::launch(kernel, dim3(static_cast<unsigned>(blocks)), dim3(threads), params);
      },
      max_blocks);
}

// Copies the last decode's split log-sum-exps ([rows, splits]) to `out`; returns how many.
int64_t emu_last_partial_lse(float* out, int64_t capacity) {
  const int64_t n = std::min<int64_t>(capacity, static_cast<int64_t>(last_partial_lse.size()));
  std::copy_n(last_partial_lse.begin(), n, out);
  return static_cast<int64_t>(last_partial_lse.size());
}

// What the CUDA binding does for append_kv (contiguous or paged) once p holds the call's buffers and sizes:
// cache_stride holds k's 3 then v's 3 strides (of the caches or pools), source_stride k_new's 4 then
// v_new's 4; the word size chosen goes to word_bytes_out, each launch counts in launches_out.
static int choose_words_and_launch(AppendKvParams& p, const int64_t* cache_stride, const int64_t* source_stride,
                                   int64_t elem_bytes, int64_t head_dim, int64_t max_words_per_launch,
                                   int* word_bytes_out, int* launches_out) {
  const int64_t cs[2][3] = {{cache_stride[0], cache_stride[1], cache_stride[2]},
                            {cache_stride[3], cache_stride[4], cache_stride[5]}};
  const int64_t ss[2][4] = {{source_stride[0], source_stride[1], source_stride[2], source_stride[3]},
                            {source_stride[4], source_stride[5], source_stride[6], source_stride[7]}};
  choose_append_words(p, elem_bytes, head_dim, cs, ss);
  *word_bytes_out = p.word_bytes;
  return dispatch_append_kv(
      p,
      [&](AppendKernel kernel, dim3 grid, int threads, const AppendKvParams& chunk) {
        ++*launches_out;
        return emu::launch(kernel, grid, dim3(threads), chunk);
      },
      max_words_per_launch);
}

// sizes: batch, kv_heads, num_new, slots, head_dim. cache_stride: k's 3 then v's 3;
// source_stride: k_new's 4 then v_new's 4 (elements). max_words_per_launch: the token chunks'
// size limit. word_bytes_out: the path taken; launches_out: the launches made.
int emu_append_kv(void* k_cache, void* v_cache, const int64_t* cache_stride, const void* k_new, const void* v_new,
                  const int64_t* source_stride, const int64_t* lengths, int64_t lengths_stride, const int64_t* counts,
                  int64_t counts_stride, const int64_t* sizes, int64_t elem_bytes, int64_t max_words_per_launch,
                  int* word_bytes_out, int* launches_out) {
  AppendKvParams p{};
  p.cache[0] = k_cache, p.cache[1] = v_cache, p.source[0] = k_new, p.source[1] = v_new;
  p.lengths = lengths;
  p.lengths_stride = lengths_stride;
  p.counts = counts;  // nullptr: every token of every row
  p.counts_stride = counts_stride;
  p.batch = sizes[0], p.kv_heads = sizes[1], p.num_new = sizes[2], p.slots = sizes[3];
  *launches_out = 0;
  return choose_words_and_launch(p, cache_stride, source_stride, elem_bytes, sizes[4], max_words_per_launch,
                                 word_bytes_out, launches_out);
}

// What the CUDA binding does for append_kv_quantized after its checks. format: KvFormat; elem:
// ElemType of the sources. data_stride, scale_stride: k's 3 then v's 3; source_stride: k_new's 4
// then v_new's 4 (elements). new_counts: null (every token) or the caller's counts, which the
// kernel checks as the binding leaves them. sizes: batch, kv_heads, num_new, slots, head_dim.
// max_blocks: the grid cap.
// Whether the emulated quantized appends rotate keys (the *_rot formats): emu_set_rotate_keys.
static bool emulated_rotate_keys = false;
void emu_set_rotate_keys(int rotate) { emulated_rotate_keys = rotate != 0; }

static AppendKvQuantizedParams quantized_append_params(int format, int elem, void* k_data, void* k_scales, void* v_data,
                                                       void* v_scales, const int64_t* data_stride,
                                                       const int64_t* scale_stride, const void* k_new,
                                                       const void* v_new, const int64_t* source_stride) {
  AppendKvQuantizedParams p{};
  p.data[0] = k_data, p.data[1] = v_data, p.scales[0] = k_scales, p.scales[1] = v_scales;
  p.source[0] = k_new, p.source[1] = v_new;
  for (int side = 0; side < 2; ++side) {
    for (int i = 0; i < 3; ++i) {
      p.data_stride[side][i] = data_stride[3 * side + i];
      p.scale_stride[side][i] = scale_stride[3 * side + i];
    }
    for (int i = 0; i < 4; ++i) p.source_stride[side][i] = source_stride[4 * side + i];
  }
  p.format = static_cast<kvcache_ext::KvFormat>(format);
  p.elem = static_cast<kvcache_ext::ElemType>(elem);
  p.rotate_keys = emulated_rotate_keys;
  return p;
}

// The CUDA binding's query rotation of a rotated-key attention: out [batch, heads, num_new,
// head_dim] float32 contiguous = R q. sizes: batch, heads, num_new, head_dim.
int emu_rotate_queries(int elem, const void* q, const int64_t* q_stride, float* out, const int64_t* sizes,
                       int64_t max_blocks) {
  RotateQueriesParams p{};
  p.q = q, p.out = out, p.elem = static_cast<kvcache_ext::ElemType>(elem);
  for (int i = 0; i < 4; ++i) p.q_stride[i] = q_stride[i];
  p.batch = sizes[0], p.heads = sizes[1], p.num_new = sizes[2], p.head_dim = sizes[3];
  return dispatch_rotate_queries(
      p,
      [&](RotateQueriesKernel kernel, int64_t blocks, int threads, const RotateQueriesParams& params) {
        return emu::launch(kernel, dim3(static_cast<unsigned>(blocks)), dim3(threads), params);
      },
      max_blocks);
}

static int emulate_append_kv_quantized(const AppendKvQuantizedParams& p, int64_t max_blocks) {
  return dispatch_append_kv_quantized(
      p,
      [&](AppendQuantizedKernel kernel, int64_t blocks, int threads, const AppendKvQuantizedParams& params) {
        return emu::launch(kernel, dim3(static_cast<unsigned>(blocks)), dim3(threads), params);
      },
      max_blocks);
}

int emu_append_kv_quantized(int format, int elem, void* k_data, void* k_scales, void* v_data, void* v_scales,
                            const int64_t* data_stride, const int64_t* scale_stride, const void* k_new,
                            const void* v_new, const int64_t* source_stride, const int64_t* lengths,
                            int64_t lengths_stride, const int64_t* new_counts, int64_t new_counts_stride,
                            const int64_t* sizes, int64_t max_blocks) {
  AppendKvQuantizedParams p = quantized_append_params(format, elem, k_data, k_scales, v_data, v_scales, data_stride,
                                                      scale_stride, k_new, v_new, source_stride);
  p.lengths = lengths, p.lengths_stride = lengths_stride;
  p.counts = new_counts, p.counts_stride = new_counts_stride;
  p.batch = sizes[0], p.kv_heads = sizes[1], p.num_new = sizes[2], p.slots = sizes[3], p.head_dim = sizes[4];
  return emulate_append_kv_quantized(p, max_blocks);
}

// ---- paged ops: what the CUDA binding (ops_cuda.cu) does after its shape checks -----------------
// The value checks of paged_blocks.h on the caller's lengths, counts and table (host memory
// here, a host copy there), then the kernels on packed_for_kernels' copy of what was checked.
// table: int64 (table_wide 1) or int32 entries; table_layout: batch, max_blocks_per_row and the
// two strides. A refusal returns -3, its message in emu_take_error, with nothing launched.
static kvcache_ext::HostBlockTable emulated_table(const void* table, int table_wide, const int64_t* table_layout) {
  return {table, table_wide != 0, table_layout[0], table_layout[1], {table_layout[2], table_layout[3]}};
}
static int block_shift_of(int64_t block_size) {
  int shift = 0;
  while ((int64_t{1} << shift) < block_size) ++shift;
  return shift;
}

// sizes: batch, q_heads, kv_heads, num_new, head_dim, num_blocks, block_size. pool_stride: k's 3
// then v's 3 (block, head, offset). Otherwise as emu_decode_attention; slots_out: the slots the
// binding plans with (the used table width times block_size).
int emu_paged_decode_attention(int elem, const void* q, const int64_t* q_stride, const void* k_pool, const void* v_pool,
                               const int64_t* pool_stride, const void* table, int table_wide,
                               const int64_t* table_layout, const int64_t* lengths, int64_t lengths_stride, void* out,
                               float* lse, const int64_t* sizes, int64_t window, double scale, double softcap,
                               const float* sinks, int sm_count, int64_t max_blocks, int64_t* plan_out,
                               int64_t* slots_out) {
  const int shift = block_shift_of(sizes[6]);
  kvcache_ext::PagedRows rows;
  const std::string error =
      kvcache_ext::check_paged_attention_values(emulated_table(table, table_wide, table_layout), lengths,
                                                lengths_stride, sizes[3], window, shift, sizes[5], rows);
  if (!error.empty()) {
    emu::first_error = error;
    return -3;
  }
  const std::vector<int64_t> checked = kvcache_ext::packed_for_kernels(rows, false);
  DecodeAttentionParams p{};
  p.elem = static_cast<kvcache_ext::ElemType>(elem);
  p.q = q, p.k_cache = k_pool, p.v_cache = v_pool;
  p.lengths = checked.data(), p.lengths_stride = 1;
  p.block_ids = checked.data() + sizes[0], p.blocks_per_row = rows.width, p.block_shift = shift;
  p.out = out, p.lse = lse;
  p.batch = sizes[0], p.q_heads = sizes[1], p.kv_heads = sizes[2], p.num_new = sizes[3];
  p.head_dim = sizes[4], p.slots = rows.width << shift;
  *slots_out = p.slots;
  for (int i = 0; i < 4; ++i) p.q_stride[i] = q_stride[i];
  for (int i = 0; i < 3; ++i) p.k_stride[i] = pool_stride[i], p.v_stride[i] = pool_stride[3 + i];
  p.window = kernel_window(window);
  p.scale = static_cast<float>(scale);
  p.softcap = static_cast<float>(softcap);
  p.sinks = sinks, p.sinks_stride = 1;
  return plan_and_launch(p, p.elem == kvcache_ext::ElemType::kFloat32 ? 4 : 2, sm_count, max_blocks, plan_out);
}

// sizes: batch, kv_heads, num_new, head_dim, num_blocks, block_size. new_counts: null for every
// token. Otherwise as emu_append_kv (pool_stride: k's 3 then v's 3).
int emu_paged_append_kv(void* k_pool, void* v_pool, const int64_t* pool_stride, const void* k_new, const void* v_new,
                        const int64_t* source_stride, const void* table, int table_wide, const int64_t* table_layout,
                        const int64_t* lengths, int64_t lengths_stride, const int64_t* new_counts,
                        int64_t new_counts_stride, const int64_t* sizes, int64_t elem_bytes,
                        int64_t max_words_per_launch, int* word_bytes_out, int* launches_out) {
  const int shift = block_shift_of(sizes[5]);
  *word_bytes_out = 0;
  *launches_out = 0;
  kvcache_ext::PagedRows rows;
  const std::string error =
      kvcache_ext::check_paged_append_values(emulated_table(table, table_wide, table_layout), lengths, lengths_stride,
                                             new_counts, new_counts_stride, sizes[2], shift, sizes[4], rows);
  if (!error.empty()) {
    emu::first_error = error;
    return -3;
  }
  if (rows.width == 0 || sizes[1] == 0) return 0;  // no row stores a token
  const std::vector<int64_t> checked = kvcache_ext::packed_for_kernels(rows, true);
  AppendKvParams p{};
  p.cache[0] = k_pool, p.cache[1] = v_pool, p.source[0] = k_new, p.source[1] = v_new;
  p.lengths = checked.data(), p.lengths_stride = 1;
  p.counts = checked.data() + sizes[0], p.counts_stride = 1;
  p.block_ids = checked.data() + 2 * sizes[0], p.blocks_per_row = rows.width, p.block_shift = shift;
  p.batch = sizes[0], p.kv_heads = sizes[1], p.num_new = sizes[2];
  return choose_words_and_launch(p, pool_stride, source_stride, elem_bytes, sizes[3], max_words_per_launch,
                                 word_bytes_out, launches_out);
}

// emu_paged_decode_attention over a quantized pool: format (KvFormat) and elem (ElemType of q);
// pool_stride: k_data's 3 then v_data's 3 (bytes), scale_stride: k_scales' 3 then v_scales' 3.
int emu_paged_decode_attention_quantized(int format, int elem, const void* q, const int64_t* q_stride,
                                         const void* k_data, const void* k_scales, const void* v_data,
                                         const void* v_scales, const int64_t* pool_stride, const int64_t* scale_stride,
                                         const void* table, int table_wide, const int64_t* table_layout,
                                         const int64_t* lengths, int64_t lengths_stride, void* out, float* lse,
                                         const int64_t* sizes, int64_t window, double scale, double softcap,
                                         const float* sinks, int sm_count, int64_t max_blocks, int64_t* plan_out,
                                         int64_t* slots_out) {
  const int shift = block_shift_of(sizes[6]);
  kvcache_ext::PagedRows rows;
  const std::string error =
      kvcache_ext::check_paged_attention_values(emulated_table(table, table_wide, table_layout), lengths,
                                                lengths_stride, sizes[3], window, shift, sizes[5], rows);
  if (!error.empty()) {
    emu::first_error = error;
    return -3;
  }
  const std::vector<int64_t> checked = kvcache_ext::packed_for_kernels(rows, false);
  DecodeAttentionParams p{};
  p.elem = static_cast<kvcache_ext::ElemType>(elem);
  p.quantized = true;
  p.format = static_cast<kvcache_ext::KvFormat>(format);
  p.q = q, p.k_cache = k_data, p.v_cache = v_data, p.k_scales = k_scales, p.v_scales = v_scales;
  p.lengths = checked.data(), p.lengths_stride = 1;
  p.block_ids = checked.data() + sizes[0], p.blocks_per_row = rows.width, p.block_shift = shift;
  p.out = out, p.lse = lse;
  p.batch = sizes[0], p.q_heads = sizes[1], p.kv_heads = sizes[2], p.num_new = sizes[3];
  p.head_dim = sizes[4], p.slots = rows.width << shift;
  *slots_out = p.slots;
  for (int i = 0; i < 4; ++i) p.q_stride[i] = q_stride[i];
  for (int i = 0; i < 3; ++i) {
    p.k_stride[i] = pool_stride[i], p.v_stride[i] = pool_stride[3 + i];
    p.k_scale_stride[i] = scale_stride[i], p.v_scale_stride[i] = scale_stride[3 + i];
  }
  p.window = kernel_window(window);
  p.scale = static_cast<float>(scale);
  p.softcap = static_cast<float>(softcap);
  p.sinks = sinks, p.sinks_stride = 1;
  return plan_and_launch(p, 1, sm_count, max_blocks, plan_out);
}

// emu_paged_append_kv into a quantized pool: as emu_append_kv_quantized for the tensors, as
// emu_paged_append_kv for the table, lengths and new_counts. sizes: batch, kv_heads, num_new,
// head_dim, num_blocks, block_size. A refusal returns -3, as there.
int emu_paged_append_kv_quantized(int format, int elem, void* k_data, void* k_scales, void* v_data, void* v_scales,
                                  const int64_t* data_stride, const int64_t* scale_stride, const void* k_new,
                                  const void* v_new, const int64_t* source_stride, const void* table, int table_wide,
                                  const int64_t* table_layout, const int64_t* lengths, int64_t lengths_stride,
                                  const int64_t* new_counts, int64_t new_counts_stride, const int64_t* sizes,
                                  int64_t max_blocks) {
  const int shift = block_shift_of(sizes[5]);
  kvcache_ext::PagedRows rows;
  const std::string error =
      kvcache_ext::check_paged_append_values(emulated_table(table, table_wide, table_layout), lengths, lengths_stride,
                                             new_counts, new_counts_stride, sizes[2], shift, sizes[4], rows);
  if (!error.empty()) {
    emu::first_error = error;
    return -3;
  }
  if (rows.width == 0 || sizes[1] == 0) return 0;  // no row stores a token
  const std::vector<int64_t> checked = kvcache_ext::packed_for_kernels(rows, true);
  AppendKvQuantizedParams p = quantized_append_params(format, elem, k_data, k_scales, v_data, v_scales, data_stride,
                                                      scale_stride, k_new, v_new, source_stride);
  p.lengths = checked.data(), p.lengths_stride = 1;
  p.counts = checked.data() + sizes[0], p.counts_stride = 1;
  p.block_ids = checked.data() + 2 * sizes[0], p.blocks_per_row = rows.width, p.block_shift = shift;
  p.batch = sizes[0], p.kv_heads = sizes[1], p.num_new = sizes[2], p.head_dim = sizes[3];
  return emulate_append_kv_quantized(p, max_blocks);
}

// Self-tests of the emulation. race: out[blocks * threads] gets what each thread read of a
// shared value thread 0 writes (with or without a __syncthreads between).
int emu_selftest_race(int* out, int blocks, int threads, int synchronise) {
  return emu::launch(race_kernel, dim3(blocks), dim3(threads), out, synchronise);
}
// Copies `threads` 16-byte vectors from source to destination (each may be misaligned).
int emu_selftest_vector_copy(const char* source, char* destination, int threads) {
  return emu::launch(vector_copy_kernel, dim3(1), dim3(threads), source, destination);
}
// Reads source[threadIdx.x + n]: out of bounds of a 32-float buffer when n > 0 (for ASan).
int emu_selftest_out_of_bounds(int n) {
  std::vector<float> source(32, 1.0f), destination(32);
  return emu::launch(out_of_bounds_kernel, dim3(1), dim3(32), static_cast<const float*>(source.data()),
                     destination.data(), n);
}

}  // extern "C"
