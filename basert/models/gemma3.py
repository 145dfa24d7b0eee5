"""Gemma 3: the embeddings scaled by sqrt(hidden), and a sandwich of four RMSNorms per layer

    h = x + norm_a(attn(norm_in(x)));  x' = h + norm_m(mlp(norm_pre(h)))

where attention has per-head q/k norms and is either a sliding-window layer (the local RoPE base, each token
sees the last `sliding_window` positions, itself included) or a global one (the global RoPE base), and the
MLP is GeGLU with GeLU's tanh form. The norm weights are stored as 1 + w (the converter folds the offset).
"""

from __future__ import annotations

import math

import numpy as np

from basert.models.config import Gemma3Config
from basert.models.layers import MLP, Attention, Batch, KVTensors, RMSNorm, RopeTables, Weights, Workspace
from basert.models.transformer import DecoderModel


class Gemma3Layer:
    """Attention and a GeGLU MLP, each with a norm before and a norm after, then the residual add."""

    output_norms = True   # the block outputs are normed before the residual add (the decode graph: *_NORM phases)

    def __init__(self, weights: Weights, layer: int, config: Gemma3Config, mixer: Attention, feed_forward: MLP):
        eps, hidden = config.rms_norm_eps, config.hidden_size
        prefix = f"layers.{layer}"
        self.hidden = hidden
        self.input_norm = RMSNorm(weights, f"{prefix}.input_norm.weight", hidden, eps)
        self.attn_out_norm = RMSNorm(weights, f"{prefix}.attn_out_norm.weight", hidden, eps)
        self.post_attn_norm = RMSNorm(weights, f"{prefix}.post_attn_norm.weight", hidden, eps)   # before the MLP
        self.mlp_out_norm = RMSNorm(weights, f"{prefix}.mlp_out_norm.weight", hidden, eps)
        self.mixer = mixer
        self.feed_forward = feed_forward

    def __call__(self, x: np.ndarray, batch: Batch, kv: KVTensors, ws: Workspace) -> None:
        t = x.shape[0]
        h = self.input_norm(x, ws.get("layer.h", t, self.hidden))
        delta = ws.get("layer.delta", t, self.hidden)
        self.mixer(h, batch, kv, ws, delta)
        np.add(x, self.attn_out_norm(delta, h), out=x)
        h = self.post_attn_norm(x, h)
        self.feed_forward(h, ws, delta)
        np.add(x, self.mlp_out_norm(delta, h), out=x)


def build(weights: Weights, config: Gemma3Config, max_pos: int) -> DecoderModel:
    if config.intermediate_size is None:
        raise weights.error("config lacks intermediate_size")
    global_rope = RopeTables(config.rope_theta, config.rotary_dim, max_pos, interleaved=config.rope_interleaved)
    local_rope = RopeTables(config.rope_local_theta, config.rotary_dim, max_pos,
                            interleaved=config.rope_interleaved)
    scale = config.query_pre_attn_scalar ** -0.5
    layers = []
    for i, kind in enumerate(config.layer_types):
        sliding = kind == "sliding_attention"
        attention = Attention(weights, f"layers.{i}.self_attn", config, i, local_rope if sliding else global_rope,
                              qk_norm=True, output_gate=False, window=config.sliding_window if sliding else 0,
                              scale=scale)
        mlp = MLP(weights, f"layers.{i}.mlp", config.hidden_size, config.intermediate_size, activation="gelu_tanh")
        layers.append(Gemma3Layer(weights, i, config, attention, mlp))
    return DecoderModel(weights, config, layers, embed_scale=math.sqrt(config.hidden_size))
