"""Activation checkpointing of the GPT blocks (``none``/``selective``/``full``); applied by ``parallelize``.

``full`` recomputes each whole block in backward (keeps only block inputs). ``selective`` is op-level
selective checkpointing as in torchtitan: matmul and attention outputs are saved, the cheap element-wise ops
(LayerNorm, GELU, adds) are recomputed, trading little compute for most of the activation memory of those ops.
Blocks are wrapped in place in their ``ModuleDict`` (the wrapper keeps state-dict keys unchanged).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.linear.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
}
"""Ops whose outputs ``selective`` keeps (recomputing them would cost real FLOPs)."""


def _policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, mode: str) -> None:
    """Wrap every block of ``model`` for activation checkpointing ``mode`` (no-op for ``none``)."""
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    for name, block in list(model.blocks.items()):
        if mode == "full":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False,
                                         context_fn=partial(create_selective_checkpoint_contexts, _policy))
        model.blocks[name] = wrapped
