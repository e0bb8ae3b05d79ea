// The thread schedule of decode attention, shared by every CPU decode-attention binding (plain
// and quantized caches): split into work items, split-K over positions when there are too few
// items for the threads, log-sum-exp merge of the splits, normalised output and lse. A call with
// less work than one task is worth runs on the calling thread alone, unsplit.
#pragma once

#include <cstdint>

#include "attention_problem.h"

namespace kvcache_ext::cpu {

// Runs `partial` over every (row, KV head, block of query heads, chunk of new tokens, split) of p
// and writes out [batch, q_heads, num_new, head_dim] (contiguous, p.elem, element size
// out_elem_size) and lse [batch, q_heads, num_new] float32. p.lengths must already be checked.
void schedule_decode_attention(const AttentionProblem& p, PartialAttentionFn partial, void* out, int64_t out_elem_size,
                               float* lse);

}  // namespace kvcache_ext::cpu
