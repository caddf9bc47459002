"""The reference GPT and the hashed bigram embedding."""

from lowband.model.bigram import HashedBigramEmbedding, bigram_hash, bigram_hash_np
from lowband.model.gpt import (
    GPT,
    MLP,
    Block,
    CausalSelfAttention,
    GPTConfig,
    RMSNorm,
    apply_rope,
    rope_cos_sin,
)

__all__ = ["GPT", "MLP", "Block", "CausalSelfAttention", "GPTConfig", "HashedBigramEmbedding", "RMSNorm",
           "apply_rope", "bigram_hash", "bigram_hash_np", "rope_cos_sin"]
