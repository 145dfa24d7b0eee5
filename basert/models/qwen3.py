"""Qwen2 / Qwen3 dense and Qwen3-MoE: the llama block with per-head q/k RMSNorm (Qwen3) and split-half RoPE."""

from __future__ import annotations

from basert.models.layers import MLP, Attention, Weights
from basert.models.llama import DecoderLayer, rope_for
from basert.models.moe import SparseMoE
from basert.models.transformer import DecoderModel


def build(weights: Weights, config: dict, max_pos: int) -> DecoderModel:
    rope = rope_for(config, max_pos)
    sparse_step = config.get("decoder_sparse_step", 1) or 1
    dense_layers = set(config.get("mlp_only_layers", []))
    layers = []
    for i in range(config["num_hidden_layers"]):
        attention = Attention(weights, f"layers.{i}.self_attn", config, i, rope,
                              qk_norm=config.get("qk_norm", True), output_gate=False)
        moe = (config.get("num_experts", 0) > 0 and i not in dense_layers and (i + 1) % sparse_step == 0
               and weights.has(f"layers.{i}.ffn_gate_exps.weight"))
        feed_forward = SparseMoE(weights, i, config) if moe else MLP(weights, f"layers.{i}.mlp")
        layers.append(DecoderLayer(weights, i, config, attention, feed_forward))
    return DecoderModel(weights, config, layers)
