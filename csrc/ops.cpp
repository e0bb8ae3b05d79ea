// Every op of the kvcache_ext namespace, its schema and what it does. Implementations register
// per device in cpu/ops_cpu.cpp and cuda/ops_cuda.cu; fake (meta) implementations for
// torch.compile live in kvcache_ext/ops.py.
#include <torch/csrc/stable/library.h>

STABLE_TORCH_LIBRARY(kvcache_ext, m) {
  // Writes k_new/v_new [batch, kv_heads, num_new, head_dim] (any strides) into
  // k_cache/v_cache [batch, kv_heads, slots, head_dim] in place: token t of row b goes to slot
  // (lengths[b] + t) % slots. lengths [batch] int64 counts the tokens already in each row and
  // is not changed. The caller checks capacity (a non-ring cache must have room). new_counts
  // [batch] int64, each in [0, num_new] (default: num_new for every row): only tokens
  // t < new_counts[b] of row b are written (a step that adds fewer tokens to some rows, padded
  // on the right); the slots of the others keep what they held.
  m.def(
      "append_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k_new, Tensor v_new, "
      "Tensor lengths, Tensor? new_counts=None) -> ()");

  // Attention of q [batch, q_heads, num_new, head_dim] over the cache, lengths [batch] int64
  // counting each row's tokens with the new ones included; exactly python_ref's
  // reference_attention: GQA, bottom-right causal, ring-buffer slots, optional sliding window,
  // scale (default 1/sqrt(head_dim)), optional soft-capping of the scores (softcap > 0) and sink
  // logits (sinks [q_heads] float32). Returns out [batch, q_heads, num_new, head_dim] in q's
  // dtype and the log of the softmax denominator [batch, q_heads, num_new] float32.
  m.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor lengths, "
      "int? window=None, float? scale=None, float? softcap=None, Tensor? sinks=None) -> (Tensor, Tensor)");

  // Row i of k_cache/v_cache [batch, kv_heads, slots, head_dim] becomes a copy of old row
  // src_rows[i] (all slots), in place, for every i: src_rows [batch] int64, each in [0, batch),
  // may repeat (beam search reorders rows, a prefix is forked into several rows). Only rows
  // with src_rows[i] != i are written, and only the overwritten rows that are also sources
  // are staged in scratch memory, instead of copying the whole cache out and back.
  m.def("gather_rows(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor src_rows) -> ()");

  // Paged storage (python_ref/paged.py is the reference): per layer, block pools k_pool/v_pool
  // [num_blocks, kv_heads, block_size, head_dim] (block_size a power of two, capabilities.h) and
  // block_tables [batch, max_blocks_per_row] int32 or int64: position p of row b lives in block
  // block_tables[b, p / block_size] at offset p % block_size. Only the entries a call reads or
  // writes must be block ids in [0, num_blocks); the others are ignored. No ring: every position
  // of a row is in its table (lengths[b] <= max_blocks_per_row * block_size).
  //
  // paged_append_kv writes token t < new_counts[b] (default: all num_new) of k_new/v_new [batch,
  // kv_heads, num_new, head_dim] to position lengths[b] + t of row b (lengths [batch] int64: the
  // tokens held before; not changed). Refuses, writing nothing, two written positions that map to
  // one (block, offset): a block shared between rows is copied by the caller before a write.
  m.def(
      "paged_append_kv(Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor k_new, Tensor v_new, Tensor block_tables, "
      "Tensor lengths, Tensor? new_counts=None) -> ()");
  // decode_attention's semantics (lengths counting the new tokens, GQA, bottom-right causal,
  // window, scale, softcap, sinks) over the positions the block tables hold; the same kernel in
  // its block-table address mode. Blocks no query sees (before a window) are not read.
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor lengths, "
      "int? window=None, float? scale=None, float? softcap=None, Tensor? sinks=None) -> (Tensor out, Tensor lse)");

  // The capability table of csrc/capabilities.h for device_type "cpu" or "cuda", as JSON: dtypes,
  // head_dim rule, limits on lengths and slots. Read by kvcache_ext.capabilities().
  m.def("capabilities(str device_type) -> str");

  // CPU instruction set the kernels use: 0 baseline, 1 AVX2, 2 AVX-512.
  m.def("cpu_isa() -> int");
  // Asks for an instruction set (same numbering); returns the one used, at most the best the
  // CPU supports. For tests and benchmarks of every code path.
  m.def("select_cpu_isa(int isa) -> int");

  // Quantized caches (formats specified in python_ref/quantize.py; the format follows from the
  // data dtype: int8 -> "int8", float8_e4m3fn -> "fp8_e4m3", uint8 -> "int4", two values per
  // byte). data [batch, kv_heads, slots, head_dim] (head_dim / 2 bytes for int4), scales float32
  // [batch, kv_heads, slots] (int8, fp8) or float16 [batch, kv_heads, slots, head_dim / 32]
  // (int4). append_kv_quantized quantizes k_new/v_new [batch, kv_heads, num_new, head_dim]
  // (float32, bfloat16 or float16) into slot (lengths[b] + t) % slots, data and scales, exactly
  // as python_ref.quantize.quantize does; lengths and new_counts as for append_kv (only tokens
  // t < new_counts[b] of row b are quantized and written). rotate_keys (the "*_rot" formats):
  // keys are stored as R k, R python_ref.quantize's fixed randomised Hadamard transform (head_dim a
  // power of two), and the attention ops given rotate_keys attend with R q over them.
  m.def(
      "append_kv_quantized(Tensor(a!) k_data, Tensor(b!) k_scales, Tensor(c!) v_data, Tensor(d!) v_scales, "
      "Tensor k_new, Tensor v_new, Tensor lengths, Tensor? new_counts=None, bool rotate_keys=False) -> ()");
  // decode_attention over the values a quantized cache stands for, dequantized in registers:
  // python_ref.quantize.reference_quantized_attention. q (and out) float32, bfloat16 or float16.
  m.def(
      "decode_attention_quantized(Tensor q, Tensor k_data, Tensor k_scales, Tensor v_data, Tensor v_scales, "
      "Tensor lengths, int? window=None, float? scale=None, float? softcap=None, Tensor? sinks=None, "
      "bool rotate_keys=False) -> (Tensor, Tensor)");

  // The paged forms of the two quantized ops: pools of codes k_data/v_data [num_blocks, kv_heads,
  // block_size, head_dim] (head_dim / 2 bytes for int4) and scales k_scales/v_scales float32
  // [num_blocks, kv_heads, block_size] or float16 [num_blocks, kv_heads, block_size, head_dim /
  // 32], the quantized layout with blocks in place of rows; block_tables, lengths, new_counts and
  // the refusals as for paged_append_kv / paged_decode_attention. The append quantizes exactly as
  // append_kv_quantized; the attention is decode_attention_quantized's over the positions the
  // tables hold, the quantized kernel in its block-table address mode.
  m.def(
      "paged_append_kv_quantized(Tensor(a!) k_data, Tensor(b!) k_scales, Tensor(c!) v_data, Tensor(d!) v_scales, "
      "Tensor k_new, Tensor v_new, Tensor block_tables, Tensor lengths, Tensor? new_counts=None, "
      "bool rotate_keys=False) -> ()");
  m.def(
      "paged_decode_attention_quantized(Tensor q, Tensor k_data, Tensor k_scales, Tensor v_data, Tensor v_scales, "
      "Tensor block_tables, Tensor lengths, int? window=None, float? scale=None, float? softcap=None, "
      "Tensor? sinks=None, bool rotate_keys=False) -> (Tensor out, Tensor lse)");

  // KIVI caches (per-channel key scales; the "*_kivi" formats of python_ref/quantize.py, layout in its
  // kivi_shapes; the code format follows from v_data's dtype as above): k_codes [batch, kv_heads,
  // groups, head_dim, 32] (int4: 16 bytes of two) holds each complete group of 32 positions' keys
  // per channel, k_scales float32 [batch, kv_heads, groups, head_dim] (int4: float16 [..., head_dim,
  // 1]) their scales, k_recent float32 [batch, kv_heads, 32, head_dim] the keys of each row's newest
  // incomplete group (position p in row p % 32), v_data/v_scales the values per token as a quantized
  // cache's. No ring: a row holds at most slots (v_data's dimension 2) tokens, refused past it.
  // append_kv_kivi stores token t < new_counts[b] of k_new/v_new [batch, kv_heads, num_new, head_dim]
  // at position lengths[b] + t exactly as python_ref.quantize.append_kivi does (values quantized,
  // keys into k_recent, a group quantized per channel when its last position arrives).
  m.def(
      "append_kv_kivi(Tensor(a!) k_codes, Tensor(b!) k_scales, Tensor(c!) k_recent, Tensor(d!) v_data, "
      "Tensor(e!) v_scales, Tensor k_new, Tensor v_new, Tensor lengths, Tensor? new_counts=None) -> ()");
  // decode_attention over the keys and values a KIVI cache stands for:
  // python_ref.quantize.reference_kivi_attention (window, scale, softcap and sinks as decode_attention's).
  m.def(
      "decode_attention_kivi(Tensor q, Tensor k_codes, Tensor k_scales, Tensor k_recent, Tensor v_data, "
      "Tensor v_scales, Tensor lengths, int? window=None, float? scale=None, float? softcap=None, "
      "Tensor? sinks=None) -> (Tensor out, Tensor lse)");

  // Latent (MLA) attention, python_ref.latent.reference_latent_attention: the cache [batch, kv_heads,
  // slots, key_dim] holds each token's latent once for every query head of its group (DeepSeek:
  // kv_heads 1, key_dim kv_lora_rank + qk_rope_head_dim = 576); q [batch, q_heads, num_new, key_dim]
  // are the absorbed queries; scores are taken over all key_dim columns and the values are the first
  // value_dim of them (512: the latent c), read from the same bytes. lengths, window, the causal
  // alignment of the num_new queries and the ring of slots are decode_attention's; scale defaults
  // to 1/sqrt(key_dim) (MLA passes its own). Returns out [batch, q_heads, num_new, value_dim] in q's
  // dtype and the log of the softmax denominator [batch, q_heads, num_new] float32.
  m.def(
      "latent_decode_attention(Tensor q, Tensor cache, Tensor lengths, int value_dim, int? window=None, "
      "float? scale=None) -> (Tensor out, Tensor lse)");

  // Quantized latent caches (python_ref/latent.py, the layout specified in python_ref/quantize.py):
  // c_data [batch, kv_heads, slots, value_dim] int8 or float8_e4m3fn codes of the latent c with
  // c_scales [batch, kv_heads, slots] float32 (one per token); k_pe [batch, kv_heads, slots, rope]
  // the rotary key, in q's dtype without k_pe_scales, or codes of c_data's dtype with k_pe_scales
  // float32 (one per token). key_dim = value_dim + rope. The attention is latent_decode_attention's
  // over the rows the codes stand for (python_ref.latent.reference_quantized_latent_attention),
  // dequantized as the kernel reads them; the append quantizes latent_new [batch, kv_heads, num_new,
  // key_dim] (float32, bfloat16 or float16; k_pe's dtype when it is unquantized) exactly as
  // python_ref.latent.quantize_latent does, to slot (lengths[b] + t) % slots for t < new_counts[b]
  // (append_kv's rules).
  m.def(
      "latent_decode_attention_quantized(Tensor q, Tensor c_data, Tensor c_scales, Tensor k_pe, "
      "Tensor? k_pe_scales, Tensor lengths, int? window=None, float? scale=None) -> (Tensor out, Tensor lse)");
  m.def(
      "append_latent_quantized(Tensor(a!) c_data, Tensor(b!) c_scales, Tensor(c!) k_pe, Tensor(d!)? k_pe_scales, "
      "Tensor latent_new, Tensor lengths, Tensor? new_counts=None) -> ()");

  // Paged latent pools (python_ref/paged.py's latent pools): per layer, one pool [num_blocks,
  // kv_heads, block_size, key_dim] of latent rows (the latent layout with blocks in place of rows);
  // block_tables, lengths, new_counts and the refusals as for paged_append_kv / paged_decode_attention.
  // paged_append_latent writes token t < new_counts[b] of latent_new [batch, kv_heads, num_new,
  // key_dim] (the pool's dtype) to position lengths[b] + t of row b, as it comes;
  // paged_latent_decode_attention is latent_decode_attention's over the positions the tables hold,
  // the latent kernel in its block-table address mode (each row read once for all query heads).
  m.def(
      "paged_append_latent(Tensor(a!) pool, Tensor latent_new, Tensor block_tables, Tensor lengths, "
      "Tensor? new_counts=None) -> ()");
  m.def(
      "paged_latent_decode_attention(Tensor q, Tensor pool, Tensor block_tables, Tensor lengths, int value_dim, "
      "int? window=None, float? scale=None) -> (Tensor out, Tensor lse)");
  // Their quantized forms: the quantized latent layout with blocks in place of rows, c_data [num_blocks,
  // kv_heads, block_size, value_dim] codes with c_scales [num_blocks, kv_heads, block_size] float32, k_pe
  // [num_blocks, kv_heads, block_size, rope] in q's dtype or codes with k_pe_scales; the append quantizes
  // exactly as append_latent_quantized, the attention is latent_decode_attention_quantized's over the
  // positions the tables hold; block_tables, lengths, new_counts and the refusals as above.
  m.def(
      "paged_append_latent_quantized(Tensor(a!) c_data, Tensor(b!) c_scales, Tensor(c!) k_pe, "
      "Tensor(d!)? k_pe_scales, Tensor latent_new, Tensor block_tables, Tensor lengths, Tensor? new_counts=None) -> "
      "()");
  m.def(
      "paged_latent_decode_attention_quantized(Tensor q, Tensor c_data, Tensor c_scales, Tensor k_pe, "
      "Tensor? k_pe_scales, Tensor block_tables, Tensor lengths, int? window=None, float? scale=None) "
      "-> (Tensor out, Tensor lse)");

  // A linear layer's product for a decode step's few rows: out [rows, out_features] = x [rows,
  // in_features] · weight [out_features, in_features]ᵀ, accumulated in float32 and returned in x's
  // dtype; x and weight of one dtype (float32, bfloat16, float16), 1 to 16 rows, the weight's last
  // dimension contiguous. Reads the weight once for all rows (csrc/cpu/small_batch_linear.h).
  m.def("small_batch_linear(Tensor x, Tensor weight) -> Tensor");
  // The same with an int8 weight and one scale per output feature (float32, bfloat16 or float16):
  // out = (x's rows rounded to int8 in blocks of 32 features) · weightᵀ · scales, any number of rows,
  // returned in x's dtype (csrc/cpu/small_batch_linear.h: Int8LinearProblem states the rounding).
  m.def("int8_weight_linear(Tensor x, Tensor weight, Tensor scales) -> Tensor");
  // The same with an int4 weight (uint8, two codes a byte, llama.cpp's q4_0 order) and one scale per
  // block of 32 input features (scales [out_features, in_features / 32]); in_features a multiple of
  // 32 (csrc/cpu/small_batch_linear.h: Int4LinearProblem states the format).
  m.def("int4_weight_linear(Tensor x, Tensor weight, Tensor scales) -> Tensor");
}
