"""The tiny decoder shape the Hugging Face tests build models from (offline, random weights)."""

TINY_DECODER = dict(
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
)
