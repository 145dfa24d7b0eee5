"""Qwen3.5 / 3.6 hybrid and Qwen3-Next: Gated DeltaNet layers and gated full-attention layers.

The layer pattern comes from the config's layer_types. Full attention: per-head q/k norm, partial
split-half RoPE, output multiplied by sigmoid(gate) from the second half of each q_proj head.
The feed-forward block is a dense SwiGLU MLP or, in the MoE variants, the sparse MoE.
"""

from __future__ import annotations

from basert.models.config import Qwen35Config
from basert.models.deltanet import GatedDeltaNet
from basert.models.layers import Attention, Weights
from basert.models.llama import DecoderLayer, dense_mlp, rope_for
from basert.models.moe import SparseMoE
from basert.models.transformer import DecoderModel


def build(weights: Weights, config: Qwen35Config, max_pos: int) -> DecoderModel:
    rope = rope_for(config, max_pos)
    layers = []
    kv_layer = state_layer = 0
    for i, kind in enumerate(config.layer_types):
        if kind == "full_attention":
            mixer = Attention(weights, f"layers.{i}.self_attn", config, kv_layer, rope,
                              qk_norm=True, output_gate=config.attn_output_gate)
            kv_layer += 1
        else:
            mixer = GatedDeltaNet(weights, f"layers.{i}.linear_attn", config, state_layer)
            state_layer += 1
        if config.moe is not None and config.moe.is_sparse(i):
            feed_forward = SparseMoE(weights, i, config.hidden_size, config.moe)
        else:
            feed_forward = dense_mlp(weights, i, config)
        layers.append(DecoderLayer(weights, i, config, mixer, feed_forward))
    return DecoderModel(weights, config, layers)
