"""The decode fast path: the layers the model files built, handed to the C decode graph (basert._ext.graph).

The Python blocks stay the description of the model: this module only reads their weights and settings. A
model qualifies when every layer is a pre-norm attention block (no output gate, no sliding window) with a dense
SwiGLU MLP and the embeddings are used as they are — Llama/SmolLM2 and dense Qwen3; others (hybrids, MoE, Gemma 3)
keep the per-kernel path. The graph computes the same bits as that path, so which one runs a step never shows in
the results.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from basert._ext.graph import DecodeGraph
from basert.models.layers import MLP, Attention, RMSNorm

if TYPE_CHECKING:
    from basert.models.transformer import DecoderModel

# New tokens per step the graph takes (decode of up to this many sequences, or short prefill chunks); larger
# batches run the per-kernel path, whose tiled matmuls are faster there.
MAX_GRAPH_TOKENS = 16


def decode_graph(model: DecoderModel) -> DecodeGraph | None:
    """The C decode graph of the model's layers, or None when a layer is of a kind the graph does not run."""
    if model.embed_scale is not None:
        return None
    specs = []
    rope = None
    for index, layer in enumerate(model.layers):
        attention, mlp = layer.mixer, getattr(layer, "feed_forward", None)
        if not isinstance(attention, Attention) or attention.output_gate or attention.window:
            return None
        if not isinstance(mlp, MLP) or mlp.activation != "silu" or getattr(layer, "output_norms", False):
            return None
        if attention.kv_layer != index:
            return None
        if rope is not None and attention.rope is not rope:
            return None
        rope = attention.rope
        input_norm, post_norm = getattr(layer, "input_norm", None), getattr(layer, "post_attn_norm", None)
        if not isinstance(input_norm, RMSNorm) or not isinstance(post_norm, RMSNorm):
            return None
        if {input_norm.eps, post_norm.eps} != {attention.eps}:
            return None
        specs.append({
            "input_norm": input_norm.weight, "post_norm": post_norm.weight,
            "q_norm": attention.q_norm, "k_norm": attention.k_norm,
            "wq": attention.q_proj.weight, "wk": attention.k_proj.weight, "wv": attention.v_proj.weight,
            "wo": attention.o_proj.weight, "wgate": mlp.gate_proj.weight, "wup": mlp.up_proj.weight,
            "wdown": mlp.down_proj.weight,
        })
    if rope is None or model.final_norm.eps != model.layers[0].mixer.eps:
        return None
    first = model.layers[0].mixer
    return DecodeGraph(specs, model.final_norm.weight, model.head, rope.cos, rope.sin, rope.interleaved,
                       first.n_heads, first.n_kv, first.head_dim, first.eps, first.scale, MAX_GRAPH_TOKENS)
