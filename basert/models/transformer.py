"""The decoder skeleton every architecture shares: embed, a stack of residual layers, final norm, head."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from basert._ext import matmul as mm
from basert.models.layers import Batch, KVTensors, RMSNorm, Weights, Workspace


class Layer(Protocol):
    def __call__(self, x: np.ndarray, batch: Batch, kv: KVTensors, ws: Workspace) -> None: ...


class DecoderModel:
    """h = embed(tokens); h = layer_i(h) for each layer; logits = head(norm(h)) at the requested rows."""

    def __init__(self, weights: Weights, config: dict, layers: list[Layer]):
        self.config = config
        self.hidden = config["hidden_size"]
        self.vocab = config["vocab_size"]
        self.embed = weights.matrix("embed_tokens.weight")
        head_name = "embed_tokens.weight" if not weights.has("lm_head.weight") else "lm_head.weight"
        self.head = weights.matrix(head_name)
        self.final_norm = RMSNorm(weights, "final_norm.weight", config["rms_norm_eps"])
        self.layers = layers

    def forward(self, batch: Batch, kv: KVTensors, ws: Workspace, logit_rows: np.ndarray) -> np.ndarray:
        """Run all layers over the batch; logits [len(logit_rows), vocab] for the given rows (a view of
        the workspace, valid until the next forward)."""
        t = batch.n_tokens
        x = ws.get("hidden", t, self.hidden)
        mm.embed_rows(self.embed, batch.tokens, x)
        for layer in self.layers:
            layer(x, batch, kv, ws)
        n = logit_rows.shape[0]
        if n == 0:
            return np.zeros((0, self.vocab), dtype=np.float32)
        picked = ws.get("head.in", n, self.hidden)
        np.take(x, logit_rows, axis=0, out=picked)
        normed = self.final_norm(picked, ws.get("head.normed", n, self.hidden))
        logits = ws.get("logits", n, self.vocab)
        mm.matmul(normed, self.head, logits)
        return logits
