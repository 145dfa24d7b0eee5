"""Llama (SmolLM2): pre-norm residual blocks of GQA attention with RoPE and a SwiGLU MLP.

    h = x + attn(rmsnorm(x));  x' = h + mlp(rmsnorm(h))
"""

from __future__ import annotations

import numpy as np

from basert.models.config import DecoderConfig, LlamaConfig
from basert.models.layers import MLP, Attention, Batch, KVTensors, RMSNorm, RopeTables, Weights, Workspace
from basert.models.transformer import DecoderModel


class DecoderLayer:
    """Attention then a feed-forward block (dense MLP or MoE), each with a pre-norm and a residual."""

    def __init__(self, weights: Weights, layer: int, config: DecoderConfig, mixer, feed_forward):
        eps = config.rms_norm_eps
        self.hidden = config.hidden_size
        self.input_norm = RMSNorm(weights, f"layers.{layer}.input_norm.weight", self.hidden, eps)
        self.post_attn_norm = RMSNorm(weights, f"layers.{layer}.post_attn_norm.weight", self.hidden, eps)
        self.mixer = mixer
        self.feed_forward = feed_forward

    def __call__(self, x: np.ndarray, batch: Batch, kv: KVTensors, ws: Workspace) -> None:
        t = x.shape[0]
        h = self.input_norm(x, ws.get("layer.h", t, self.hidden))
        # Both mixers read all of their input before they write their output, which therefore goes over it; so
        # does the MLP, a chunk of rows at a time. The MoE block zeroes its output first: it needs one of its own.
        if isinstance(self.mixer, Attention):
            self.mixer(h, batch, kv, ws, h)
        else:
            self.mixer(h, batch, ws, h)
        np.add(x, h, out=x)
        h = self.post_attn_norm(x, h)
        out = h if isinstance(self.feed_forward, MLP) else ws.get("layer.delta", t, self.hidden)
        self.feed_forward(h, ws, out)
        np.add(x, out, out=x)


def rope_for(config: DecoderConfig, max_pos: int) -> RopeTables:
    return RopeTables(config.rope_theta, config.rotary_dim, max_pos, interleaved=config.rope_interleaved)


def dense_mlp(weights: Weights, layer: int, config: DecoderConfig) -> MLP:
    if config.intermediate_size is None:
        raise weights.error("config lacks intermediate_size")
    return MLP(weights, f"layers.{layer}.mlp", config.hidden_size, config.intermediate_size)


def build(weights: Weights, config: LlamaConfig, max_pos: int) -> DecoderModel:
    rope = rope_for(config, max_pos)
    layers = []
    for i in range(config.num_hidden_layers):
        attention = Attention(weights, f"layers.{i}.self_attn", config, i, rope, qk_norm=config.qk_norm,
                              output_gate=False)
        layers.append(DecoderLayer(weights, i, config, attention, dense_mlp(weights, i, config)))
    return DecoderModel(weights, config, layers)
