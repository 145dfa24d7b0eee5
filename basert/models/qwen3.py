"""Qwen2 / Qwen3 dense and Qwen3-MoE: the llama block with per-head q/k RMSNorm (Qwen3) and split-half RoPE."""

from __future__ import annotations

from basert.models.config import Qwen3Config
from basert.models.layers import Attention, Weights
from basert.models.llama import DecoderLayer, dense_mlp, rope_for
from basert.models.moe import SparseMoE
from basert.models.transformer import DecoderModel


def build(weights: Weights, config: Qwen3Config, max_pos: int) -> DecoderModel:
    rope = rope_for(config, max_pos)
    layers = []
    for i in range(config.num_hidden_layers):
        attention = Attention(weights, f"layers.{i}.self_attn", config, i, rope, qk_norm=config.qk_norm,
                              output_gate=False)
        if config.moe is not None and config.moe.is_sparse(i):
            feed_forward = SparseMoE(weights, i, config.hidden_size, config.moe)
        else:
            feed_forward = dense_mlp(weights, i, config)
        layers.append(DecoderLayer(weights, i, config, attention, feed_forward))
    return DecoderModel(weights, config, layers)
