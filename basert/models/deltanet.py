"""Gated DeltaNet linear attention (Qwen3.5 / Qwen3-Next), per-token recurrence for prefill and decode.

    mixed = x W_qkv^T -> causal depthwise conv1d (carried state) -> silu -> q, k, v
    g = -exp(A_log) * softplus(a + dt_bias);  beta = sigmoid(b)
    S = exp(g) S;  S += k^ (beta (v - S^T k^))^T;  o = S^T q^      (q^, k^ L2-normalised)
    y = out_proj(gated_rmsnorm(o, z))
"""

from __future__ import annotations

import numpy as np

from basert._ext import deltanet as gdn
from basert._ext import ops
from basert.models.config import Qwen35Config
from basert.models.layers import Batch, Linear, Weights, Workspace


class GatedDeltaNet:
    def __init__(self, weights: Weights, prefix: str, config: Qwen35Config, state_layer: int):
        sizes = config.linear_attention
        self.n_k, self.n_v = sizes.num_key_heads, sizes.num_value_heads
        self.d_k, self.d_v = sizes.key_head_dim, sizes.value_head_dim
        self.key_dim, self.value_dim, self.conv_dim = sizes.key_dim, sizes.value_dim, sizes.conv_dim
        self.eps = config.rms_norm_eps
        hidden = config.hidden_size
        self.in_proj_qkv = Linear(weights, f"{prefix}.in_proj_qkv.weight", self.conv_dim, hidden)
        self.in_proj_z = Linear(weights, f"{prefix}.in_proj_z.weight", self.value_dim, hidden)
        self.in_proj_a = Linear(weights, f"{prefix}.in_proj_a.weight", self.n_v, hidden)
        self.in_proj_b = Linear(weights, f"{prefix}.in_proj_b.weight", self.n_v, hidden)
        self.out_proj = Linear(weights, f"{prefix}.out_proj.weight", hidden, self.value_dim)
        self.conv_weight = weights.vector(f"{prefix}.conv1d.weight", self.conv_dim, sizes.conv_kernel_dim)
        self.A_log = weights.vector(f"{prefix}.A_log", self.n_v)
        self.dt_bias = weights.vector(f"{prefix}.dt_bias", self.n_v)
        self.norm_weight = weights.vector(f"{prefix}.norm.weight", self.d_v)
        self.state_layer = state_layer

    def __call__(self, h: np.ndarray, batch: Batch, ws: Workspace, out: np.ndarray) -> np.ndarray:
        t = h.shape[0]
        mixed = self.in_proj_qkv(h, ws.get("gdn.mixed", t, self.conv_dim))
        z = self.in_proj_z(h, ws.get("gdn.z", t, self.value_dim))
        a = self.in_proj_a(h, ws.get("gdn.a", t, self.n_v))
        b = self.in_proj_b(h, ws.get("gdn.b", t, self.n_v))
        g = ws.get("gdn.g", t, self.n_v)
        beta = ws.get("gdn.beta", t, self.n_v)
        gdn.gdn_gates(a, b, self.A_log, self.dt_bias, g, beta)
        conv = ws.get("gdn.conv", t, self.conv_dim)
        q = ws.get("gdn.q", t, self.n_k, self.d_k)
        k = ws.get("gdn.k", t, self.n_k, self.d_k)
        v = ws.get("gdn.v", t, self.n_v, self.d_v)
        o = ws.get("gdn.o", t, self.n_v, self.d_v)
        for item in batch.items:
            rows = slice(item.row, item.row + item.length)
            gdn.gdn_conv(mixed[rows], item.conv_state[self.state_layer], self.conv_weight, conv[rows])
        np.copyto(q.reshape(t, self.key_dim), conv[:, : self.key_dim])
        np.copyto(k.reshape(t, self.key_dim), conv[:, self.key_dim: 2 * self.key_dim])
        np.copyto(v.reshape(t, self.value_dim), conv[:, 2 * self.key_dim:])
        for item in batch.items:
            rows = slice(item.row, item.row + item.length)
            gdn.gdn_recurrent(q[rows], k[rows], v[rows], g[rows], beta[rows],
                              item.ssm_state[self.state_layer], o[rows])
        normed = ws.get("gdn.normed", t, self.n_v, self.d_v)
        ops.gated_rmsnorm(o, z.reshape(t, self.n_v, self.d_v), self.norm_weight, self.eps, normed)
        return self.out_proj(normed.reshape(t, self.value_dim), out)
