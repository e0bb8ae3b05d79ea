"""Your own model on kvcache_ext.KVCache: the attention module calls cache.attend(...)."""

import torch
from torch import nn

from kvcache_ext import KVCache
from python_ref import generate


class Attention(nn.Module):
    def __init__(self, dim, heads, layer):
        super().__init__()
        self.layer, self.heads = layer, heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, cache):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        y = cache.attend(self.layer, q, k, v)  # stores k, v (B, H, T, D); attends over all cached
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class TinyLM(nn.Module):
    def __init__(self, vocab=1000, dim=64, heads=4, layers=2, max_positions=256):
        super().__init__()
        self.kv_shape = dict(num_layers=layers, kv_heads=heads, head_dim=dim // heads)
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_positions, dim)
        self.blocks = nn.ModuleList(Attention(dim, heads, layer) for layer in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx, cache):
        positions = cache.start_step(idx.shape[1])  # positions of the new tokens, from the cache
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = x + block(x, cache)
        cache.finish_step()  # every layer has stored its keys/values
        return self.head(x)


if __name__ == "__main__":
    torch.manual_seed(0)
    model = TinyLM().eval()
    prompt = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    cache = KVCache(**model.kv_shape, batch_size=2, max_cache_len=prompt.shape[1] + 20)
    print(generate(model, prompt, max_new_tokens=20, cache=cache))
