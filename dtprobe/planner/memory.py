"""Per-GPU memory of a layout: weights, gradients, optimizer state (by precision and ZeRO stage) and activations.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(Table 2), per layer in bytes with ``s`` sequence, ``b`` micro-batch, ``h`` hidden, ``a`` heads, ``t`` TP:

    no parallelism                      s b h (34 + 5 a s / h)
    TP                                  s b h (10 + 24 / t + 5 a s / (h t))
    TP + sequence parallel              (s b h / t) (34 + 5 a s / h)
    TP + SP + selective recompute       34 s b h / t
    full recompute                      2 s b h          (the layer input only)

The 24 is the TP-sharded part (Q, K, V 6, attention-output input 2, MLP 16 = 2 x 8 for f = 4h); it is
generalised here to grouped-query attention (K and V scaled by kv/a) and SwiGLU (6 s b f instead of 4 s b f),
so a GPT shape gives the paper's numbers exactly. Functions take scalars or numpy arrays (the search is
vectorised). Read by ``dtprobe.planner.search``.
"""

from __future__ import annotations

import numpy as np

RECOMPUTE = ("none", "selective", "full")
"""Activation recomputation modes; arrays carry their index (0, 1, 2)."""


def activation_bytes_per_layer(*, s, b, h, a, t=1, f=None, kv_heads=None, gated_mlp=False, sp=False,
                               recompute="none", bytes_per_value=2):
    """Activation bytes one transformer layer keeps for backward (Korthikanti et al. 2022, Table 2).

    ``recompute`` is a name or an array of indices into ``RECOMPUTE``; ``sp`` is sequence parallelism
    (a bool or an array); ``f`` defaults to ``4h`` and ``kv_heads`` to ``a`` (the paper's GPT shape).
    ``bytes_per_value`` scales the paper's 16-bit figures (4 for fp32 activations).
    """
    s, b, h, a, t = (np.asarray(x, dtype=float) for x in (s, b, h, a, t))
    f = 4 * h if f is None else np.asarray(f, dtype=float)
    kv_ratio = 1.0 if kv_heads is None else np.asarray(kv_heads, dtype=float) / a
    sbh = s * b * h
    replicated = 10 * sbh                                   # norm inputs 4, attn/MLP inputs 4, dropout masks 2
    sharded = (4 + 4 * kv_ratio) * sbh + (6 if gated_mlp else 4) * s * b * f   # Q,K,V,proj-in + MLP inner
    scores = 5 * a * s * s * b                              # softmax 2, its dropout mask 1, dropout output 2
    sp = np.asarray(sp, dtype=bool)
    rep = np.where(sp, replicated / t, replicated)
    code = np.asarray(RECOMPUTE.index(recompute) if isinstance(recompute, str) else recompute)
    none = rep + (sharded + scores) / t
    selective = rep + sharded / t
    full = 2 * sbh
    per_layer = np.where(code == 0, none, np.where(code == 1, selective, full))
    return per_layer * (bytes_per_value / 2)


def logits_bytes(*, s, b, vocab, t=1, bytes_per_value=2):
    """The output layer's logits held for the loss: 16-bit logits + fp32 softmax, vocab-sharded by TP."""
    return np.asarray(s, dtype=float) * b * vocab / t * (bytes_per_value + 4)


def state_bytes(*, params, dp, zero, param_bytes, grad_bytes, optimizer_bytes):
    """(weights, gradients, optimizer) bytes on one GPU for ``params`` local (TP- and PP-sharded) parameters.

    ZeRO-1 shards the optimizer state over ``dp``, ZeRO-2 also the gradients, ZeRO-3 also the weights
    (Rajbhandari et al. 2020): mixed-precision Adam = 2 + 2 + 12 bytes per parameter before sharding.
    """
    params, dp, zero = (np.asarray(x, dtype=float) for x in (params, dp, zero))
    weights = params * param_bytes / np.where(zero >= 3, dp, 1)
    grads = params * grad_bytes / np.where(zero >= 2, dp, 1)
    optim = params * optimizer_bytes / np.where(zero >= 1, dp, 1)
    return weights, grads, optim
