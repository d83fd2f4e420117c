"""Tensor parallelism of the built-in GPT with DTensor ``parallelize_module``; applied by ``parallelize``.

Per block (Megatron style): attention ``q``/``k``/``v`` column-wise and ``o`` row-wise, MLP ``fc1`` column-wise
and ``fc2`` row-wise, so each block costs one all-reduce in forward and one in backward per sublayer.
With sequence parallelism the activations between the sublayers stay split along the sequence: LayerNorms run
on the local sequence shard (``SequenceParallel``), and each sublayer all-gathers its input and
reduce-scatters its output instead of all-reducing; the embedding output is split along the sequence and the
head gathers it back (head column-wise over the vocabulary, logits all-gathered).

Works on a whole model or on a pipeline stage (any of ``embed``/``norm``/``head`` may be None). Every TP rank
must see the same batch: non-DTensor parameters (embeddings, LayerNorms without SP) silently diverge otherwise.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def apply_tp(model: nn.Module, tp_mesh: Any, *, sequence_parallel: bool) -> None:
    """Shard ``model``'s blocks (and, with sequence parallel, its embedding output, norm and head) over
    ``tp_mesh`` in place."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)

    if sequence_parallel:
        plan: dict[str, Any] = {}
        if model.embed is not None:
            plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                                use_local_output=True)
        if model.norm is not None:
            plan["norm"] = SequenceParallel()
        if model.head is not None:
            plan["head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
        if plan:
            parallelize_module(model, tp_mesh, plan)
        block_plan = {
            "ln1": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(output_layouts=Shard(1)),
            "ln2": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.fc1": ColwiseParallel(),
            "mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
        }
    else:
        block_plan = {
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(),
            "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel(),
        }
    for block in model.blocks.values():
        parallelize_module(_unwrapped(block), tp_mesh, block_plan)


def _unwrapped(block: nn.Module) -> nn.Module:
    return getattr(block, "_checkpoint_wrapped_module", block)
