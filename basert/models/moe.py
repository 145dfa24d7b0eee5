"""Sparse MoE feed-forward (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next): top-k routing and an optional shared expert.

    p = softmax(x W_router^T)            over all experts, float32
    (w, idx) = top-k(p); w /= sum(w)     when norm_topk_prob
    y = sum_j w_j * down_e(silu(gate_e(x)) * up_e(x))
    y += sigmoid(x W_sg^T) * shared(x)   when the model has a shared expert
"""

from __future__ import annotations

import numpy as np

from basert._ext import matmul as mm
from basert._ext import ops
from basert.models.config import MoEConfig
from basert.models.layers import MLP, Weights, Workspace


class SparseMoE:
    def __init__(self, weights: Weights, layer: int, d_model: int, config: MoEConfig):
        prefix = f"layers.{layer}"
        n_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.renormalise = config.norm_topk_prob
        router = f"{prefix}.mlp.gate.weight"
        if not weights.has(router):
            router = f"{prefix}.mlp.router.weight"
        self.router = weights.matrix(router, n_experts, d_model)      # kept float32
        self.expert_hidden = config.moe_intermediate_size
        self.gate = weights.experts(f"{prefix}.ffn_gate_exps.weight", n_experts, self.expert_hidden, d_model)
        self.up = weights.experts(f"{prefix}.ffn_up_exps.weight", n_experts, self.expert_hidden, d_model)
        self.down = weights.experts(f"{prefix}.ffn_down_exps.weight", n_experts, d_model, self.expert_hidden)
        shared = f"{prefix}.mlp.shared_expert"
        self.shared = None
        if weights.has(f"{shared}.gate_proj.weight"):
            if config.shared_expert_intermediate_size is None:
                raise weights.error("config lacks shared_expert_intermediate_size")
            self.shared = MLP(weights, shared, d_model, config.shared_expert_intermediate_size)
        gate_name = f"{prefix}.mlp.shared_expert_gate.weight"
        self.shared_gate = weights.matrix(gate_name, 1, d_model) if weights.has(gate_name) else None

    def route(self, h: np.ndarray, ws: Workspace) -> tuple[np.ndarray, np.ndarray]:
        """Expert ids [T, k] and their weights [T, k] for each token."""
        # The kernel matmul, not numpy's BLAS: its row results do not depend on the batch size.
        logits = ws.get("moe.router", h.shape[0], self.router.n)
        mm.matmul(h, self.router, logits)
        logits -= logits.max(axis=1, keepdims=True)
        probs = np.exp(logits)
        probs /= probs.sum(axis=1, keepdims=True)
        # Stable sort: equal probabilities resolve to the lower expert id, whatever the batch.
        order = np.argsort(-probs, axis=1, kind="stable")[:, : self.top_k]
        chosen = np.take_along_axis(probs, order, axis=1)
        if self.renormalise:
            chosen = chosen / chosen.sum(axis=1, keepdims=True)
        return order, chosen.astype(np.float32)

    def __call__(self, h: np.ndarray, ws: Workspace, out: np.ndarray) -> np.ndarray:
        t, d = h.shape
        experts, expert_weights = self.route(h, ws)
        out.fill(0.0)
        for e in np.unique(experts):
            tokens, ranks = np.nonzero(experts == e)
            xe = np.ascontiguousarray(h[tokens])
            n = xe.shape[0]
            gate = ws.get("moe.gate", n, self.expert_hidden)
            up = ws.get("moe.up", n, self.expert_hidden)
            mm.matmul(xe, self.gate[e], gate)
            mm.matmul(xe, self.up[e], up)
            ops.silu_mul(gate, up, gate)
            y = ws.get("moe.down", n, d)
            mm.matmul(gate, self.down[e], y)
            out[tokens] += expert_weights[tokens, ranks][:, None] * y
        if self.shared is not None:
            shared = self.shared(h, ws, ws.get("moe.shared", t, d), tag="shared")
            if self.shared_gate is not None:
                gate = ws.get("moe.shared_gate", t, 1)
                mm.matmul(h, self.shared_gate, gate)
                shared *= 1.0 / (1.0 + np.exp(-gate))
            out += shared
        return out
