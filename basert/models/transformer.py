"""The decoder skeleton every architecture shares: embed, a stack of residual layers, final norm, head."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from basert._ext import matmul as mm
from basert.models.config import DecoderConfig, LinearAttentionConfig, Qwen35Config
from basert.models.layers import Attention, Batch, KVTensors, RMSNorm, Weights, Workspace
from basert.models.plan import decode_graph

# On the integer path every weight's input is quantized to 8 bits per block of 32, as llama.cpp quantizes it, except
# the LM head's, which takes 16: measured teacher-forced against the exact path (tools/check_agreement.py, README),
# it buys most of the accuracy 16 bits everywhere would (SmolLM2: mean KL 3.8e-3 -> 2.4e-3, llama.cpp's 3.7e-3) for
# one matmul per generated token, and none in a prefill but its last row.
HEAD_ACT_BITS = 16
# The integer path's arithmetic, part of the fingerprint that prefix-cache files and saved slots carry.
INTEGER_ARITHMETIC = f"a8h{HEAD_ACT_BITS}"


class Layer(Protocol):
    mixer: object   # Attention, or a recurrent mixer such as GatedDeltaNet

    def __call__(self, x: np.ndarray, batch: Batch, kv: KVTensors, ws: Workspace) -> None: ...


def head_tensor(has: Callable[[str], bool]) -> str:
    """The LM head's matrix among a model's tensors (`has` tells which exist): its own, or the embedding table it is
    tied to."""
    return "lm_head.weight" if has("lm_head.weight") else "embed_tokens.weight"


class DecoderModel:
    """h = embed(tokens); h = layer_i(h) for each layer; logits = head(norm(h)) at the requested rows."""

    def __init__(self, weights: Weights, config: DecoderConfig, layers: list[Layer],
                 embed_scale: float | None = None):
        """embed_scale: a factor the embeddings are multiplied by (in float32) before the first layer."""
        self.config = config
        self.embed_scale = None if embed_scale is None else np.float32(embed_scale)
        self.hidden = config.hidden_size
        self.vocab = config.vocab_size
        self.embed = weights.matrix("embed_tokens.weight", self.vocab, self.hidden)
        self.head = weights.matrix(head_tensor(weights.has), self.vocab, self.hidden, act_bits=HEAD_ACT_BITS)
        self.final_norm = RMSNorm(weights, "final_norm.weight", self.hidden, config.rms_norm_eps)
        self.layers = layers
        # Attention layers keep KV blocks, the others a recurrent state.
        self.n_attention_layers = sum(isinstance(layer.mixer, Attention) for layer in layers)
        self.n_linear_layers = len(layers) - self.n_attention_layers
        # Steps of up to graph.max_tokens new tokens run as one C call when the layers allow it (models/plan.py).
        self.graph = decode_graph(self)

    @property
    def kv_windows(self) -> list[int]:
        """Each attention layer's sliding window in positions (0: it sees every position), in KV-layer order."""
        windows = {layer.mixer.kv_layer: layer.mixer.window for layer in self.layers
                   if isinstance(layer.mixer, Attention)}
        return [windows[i] for i in range(len(windows))]

    @property
    def linear_attention(self) -> LinearAttentionConfig | None:
        """The sizes of the Gated DeltaNet layers' recurrent state; None for attention-only models."""
        return self.config.linear_attention if isinstance(self.config, Qwen35Config) else None

    def forward(self, batch: Batch, kv: KVTensors, ws: Workspace, logit_rows: np.ndarray,
                head: bool = True) -> np.ndarray:
        """Run all layers over the batch; logits [len(logit_rows), vocab] for the given rows, or without the
        head the final norm's output there [len(logit_rows), hidden] (the last hidden states). A view of the
        workspace, valid until the next forward."""
        t = batch.n_tokens
        x = ws.get("hidden", t, self.hidden)
        mm.embed_rows(self.embed, batch.tokens, x)
        if self.embed_scale is not None:
            np.multiply(x, self.embed_scale, out=x)
        n = logit_rows.shape[0]
        if self.graph is not None and head and t <= self.graph.max_tokens:
            rows = ws.get("graph.logit_rows", n, dtype=np.int32)
            np.copyto(rows, logit_rows, casting="unsafe")
            logits = ws.get("logits", n, self.vocab)
            self.graph.run(x, kv.k, kv.v, batch.positions, batch.rows, batch.lengths, batch.starts, batch.tables,
                           batch.window_tables, rows, logits, mm.get_num_threads())
            return logits
        for layer in self.layers:
            layer(x, batch, kv, ws)
        if n == 0:
            return np.zeros((0, self.vocab if head else self.hidden), dtype=np.float32)
        picked = ws.get("head.in", n, self.hidden)
        np.take(x, logit_rows, axis=0, out=picked)
        normed = self.final_norm(picked, ws.get("head.normed", n, self.hidden))
        if not head:
            return normed
        logits = ws.get("logits", n, self.vocab)
        mm.matmul(normed, self.head, logits)
        return logits
