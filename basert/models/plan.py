"""The decode fast path: the layers the model files built, handed to the C decode graph (basert._ext.graph).

The Python blocks stay the description of the model: this module only reads their weights and settings. A
model qualifies when every layer is a pre-norm attention block (no output gate; a sliding window and per-layer
RoPE tables allowed), optionally with its block outputs normed before the residual add (Gemma 3), with a
dense SwiGLU or GeGLU MLP — Llama/SmolLM2, dense Qwen3 and Gemma 3; others (hybrids, MoE) keep the per-kernel
path. The graph computes the same bits as that path, so which one runs a step never shows in the results.
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
    specs = []
    first = model.layers[0].mixer
    activation = getattr(getattr(model.layers[0], "feed_forward", None), "activation", None)
    for index, layer in enumerate(model.layers):
        attention, mlp = layer.mixer, getattr(layer, "feed_forward", None)
        if not isinstance(attention, Attention) or attention.output_gate or attention.kv_layer != index:
            return None
        if not isinstance(mlp, MLP) or mlp.activation != activation:
            return None
        if attention.rope.interleaved != first.rope.interleaved or attention.scale != first.scale:
            return None
        norms = {name: getattr(layer, name, None)
                 for name in ("input_norm", "post_attn_norm", "attn_out_norm", "mlp_out_norm")}
        output_norms = getattr(layer, "output_norms", False)
        wanted = norms if output_norms else {name: norms[name] for name in ("input_norm", "post_attn_norm")}
        if not all(isinstance(norm, RMSNorm) and norm.eps == first.eps for norm in wanted.values()):
            return None
        for shared in ((attention.q_proj, attention.k_proj, attention.v_proj), (mlp.gate_proj, mlp.up_proj)):
            if len({linear.weight.act_bits for linear in shared if linear.weight.integer}) > 1:
                raise ValueError(f"layer {index}: weights that read one input quantize it to different bits")
        specs.append({
            "input_norm": norms["input_norm"].weight, "post_norm": norms["post_attn_norm"].weight,
            "attn_out_norm": norms["attn_out_norm"].weight if output_norms else None,
            "mlp_out_norm": norms["mlp_out_norm"].weight if output_norms else None,
            "q_norm": attention.q_norm, "k_norm": attention.k_norm,
            **dict(zip(("bq", "bk", "bv"), attention.qkv_biases or (None, None, None))),
            "wq": attention.q_proj.weight, "wk": attention.k_proj.weight, "wv": attention.v_proj.weight,
            "wo": attention.o_proj.weight, "wgate": mlp.gate_proj.weight, "wup": mlp.up_proj.weight,
            "wdown": mlp.down_proj.weight, "cos": attention.rope.cos, "sin": attention.rope.sin,
            "window": attention.window,
        })
    if activation not in ("silu", "gelu_tanh") or model.final_norm.eps != first.eps:
        return None
    return DecodeGraph(specs, model.final_norm.weight, model.head, first.rope.interleaved, first.n_heads, first.n_kv,
                       first.head_dim, first.eps, first.scale, activation, MAX_GRAPH_TOKENS)
