// C entry points that run csrc/cuda's kernels and host planning under the CPU emulation of
// emu.h, for tests/test_cuda_emulation.py (loaded with ctypes; pointers are CPU tensors').
#include "../../csrc/cuda/append_kv.cuh"
#include "../../csrc/cuda/decode_attention.cu"  // plan_decode_attention, launch_decode_attention
#include "../../csrc/cuda/decode_attention.cuh"

namespace kvcache_ext::cuda {

// Caps the grids of the emulated launches (the real launcher uses CUDA's limit), so that tests
// can make the kernels' blocks stride over more work than the grid holds.
int64_t max_emulated_blocks = kMaxGridX;

template <typename E>
cudaError_t emulate_decode_attention(const DecodeAttentionParams& p) {
  return dispatch_decode_attention<E>(
      p,
      [&](AttentionKernel kernel, int64_t blocks, int threads, const DecodeAttentionParams& params) {
        return emu::launch(kernel, dim3(static_cast<unsigned>(blocks)), dim3(threads), params);
      },
      max_emulated_blocks);
}

cudaError_t launch_decode_attention_f32(const DecodeAttentionParams& p, cudaStream_t) {
  return emulate_decode_attention<float>(p);
}
cudaError_t launch_decode_attention_bf16(const DecodeAttentionParams& p, cudaStream_t) {
  return emulate_decode_attention<__nv_bfloat16>(p);
}
cudaError_t launch_decode_attention_f16(const DecodeAttentionParams& p, cudaStream_t) {
  return emulate_decode_attention<__half>(p);
}
int split_kernel_blocks_per_sm_f32(const DecodeAttentionParams& p) { return split_kernel_occupancy<float>(p); }
int split_kernel_blocks_per_sm_bf16(const DecodeAttentionParams& p) { return split_kernel_occupancy<__nv_bfloat16>(p); }
int split_kernel_blocks_per_sm_f16(const DecodeAttentionParams& p) { return split_kernel_occupancy<__half>(p); }

}  // namespace kvcache_ext::cuda

using namespace kvcache_ext::cuda;

extern "C" {

// What the CUDA binding (ops_cuda.cu) does between its checks and the launch, on CPU memory.
// sizes: batch, q_heads, kv_heads, num_new, head_dim, slots. kv_stride: k's 3 then v's 3.
// window: 0 for none. max_blocks: grid cap. plan_out receives rows_per_block, row_chunks,
// splits, vector_loads.
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
  const int64_t elem_bytes = p.elem == kvcache_ext::ElemType::kFloat32 ? 4 : 2;
  choose_decode_loads(p, elem_bytes);
  if (!kvcache_ext::head_dim_supported(p.head_dim)) return -1;
  plan_decode_attention(p, sm_count);
  plan_out[0] = p.rows_per_block, plan_out[1] = p.row_chunks, plan_out[2] = p.splits, plan_out[3] = p.vector_loads;
  std::vector<float> scratch;
  if (p.splits > 1) {
    const int64_t rows = p.batch * p.q_heads * p.num_new;
    // NaN-filled: anything the combine reads that the split kernel did not write shows up.
    scratch.assign(rows * p.splits * (p.head_dim + 1), std::nanf(""));
    p.partial_out = scratch.data();
    p.partial_lse = scratch.data() + rows * p.splits * p.head_dim;
  }
  max_emulated_blocks = max_blocks;
  return launch_decode_attention(p, nullptr);
}

// sizes: batch, kv_heads, num_new, slots, head_dim. cache_stride: k's 3 then v's 3;
// source_stride: k_new's 4 then v_new's 4 (elements). max_words_per_launch: the token chunks'
// size limit. word_bytes_out: the path taken; launches_out: the launches made.
int emu_append_kv(void* k_cache, void* v_cache, const int64_t* cache_stride, const void* k_new, const void* v_new,
                  const int64_t* source_stride, const int64_t* lengths, int64_t lengths_stride, const int64_t* sizes,
                  int64_t elem_bytes, int64_t max_words_per_launch, int* word_bytes_out, int* launches_out) {
  AppendKvParams p{};
  p.cache[0] = k_cache, p.cache[1] = v_cache, p.source[0] = k_new, p.source[1] = v_new;
  p.lengths = lengths;
  p.lengths_stride = lengths_stride;
  p.batch = sizes[0], p.kv_heads = sizes[1], p.num_new = sizes[2], p.slots = sizes[3];
  const int64_t cs[2][3] = {{cache_stride[0], cache_stride[1], cache_stride[2]},
                            {cache_stride[3], cache_stride[4], cache_stride[5]}};
  const int64_t ss[2][4] = {{source_stride[0], source_stride[1], source_stride[2], source_stride[3]},
                            {source_stride[4], source_stride[5], source_stride[6], source_stride[7]}};
  choose_append_words(p, elem_bytes, sizes[4], cs, ss);
  *word_bytes_out = p.word_bytes;
  *launches_out = 0;
  return dispatch_append_kv(
      p,
      [&](AppendKernel kernel, dim3 grid, int threads, const AppendKvParams& chunk) {
        ++*launches_out;
        return emu::launch(kernel, grid, dim3(threads), chunk);
      },
      max_words_per_launch);
}

}  // extern "C"
