"""Qwen2 / Qwen3 dense and Qwen3-MoE: the llama block with per-head q/k RMSNorm (Qwen3) and split-half RoPE."""

from __future__ import annotations

from basert.models.config import ModelConfig
from basert.models.layers import Attention, Weights
from basert.models.llama import DecoderLayer, dense_mlp, rope_for
from basert.models.moe import SparseMoE
from basert.models.transformer import DecoderModel


def build(weights: Weights, config: ModelConfig, max_pos: int) -> DecoderModel:
    rope = rope_for(config, max_pos)
    sparse_step = config.count("decoder_sparse_step", 1)
    dense_layers = config.layer_set("mlp_only_layers")
    layers = []
    for i in range(config.count("num_hidden_layers")):
        attention = Attention(weights, f"layers.{i}.self_attn", config, i, rope,
                              qk_norm=config.flag("qk_norm", True), output_gate=False)
        moe = (weights.has(f"layers.{i}.ffn_gate_exps.weight") and i not in dense_layers
               and (i + 1) % sparse_step == 0)
        feed_forward = SparseMoE(weights, i, config) if moe else dense_mlp(weights, i, config)
        layers.append(DecoderLayer(weights, i, config, attention, feed_forward))
    return DecoderModel(weights, config, layers)
