"""Activation checkpointing (transformers' ``gradient_checkpointing_enable()``) in dpfunc's passes.

A checkpointed block keeps no activations in the forward and recomputes them in
the backward. dpfunc's batched ghost pass (plain autograd) runs such a model:
its hooks add the same probe to a recomputed call as to the original one and
record nothing more (:mod:`dpfunc.ghost.runtime`), so the per-example norms and
the clipped sum equal those without checkpointing. ``torch.func``'s transforms
(the vmap path, the vmap ghost pass) refuse checkpointing's saved-tensor hooks
and reentrant ``autograd.Function``; the enabling recipes' input-gradient hook
(``enable_input_require_grads``) must not run inside them. See
docs/huggingface.md, "Activation checkpointing".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def inside_transforms_without_input_grads(model: nn.Module | None) -> Iterator[None]:
    """Within the block, ``enable_input_require_grads``' hooks skip calls inside torch.func.

    transformers' ``gradient_checkpointing_enable()`` and PEFT's
    ``prepare_model_for_kbit_training`` register a forward hook on the input
    embeddings that calls ``output.requires_grad_(True)``, so that reentrant
    activation checkpointing sees an input that requires grad. Inside a
    ``torch.func`` transform (dpfunc's vmap and ghost passes) ``requires_grad_``
    raises, and is not needed: the transform differentiates what it was given.
    Outside the transforms (the batched ghost pass, plain autograd) the hook
    runs as registered. Restored on exit.
    """
    swapped = []
    for module in () if model is None else model.modules():
        for key, hook in list(module._forward_hooks.items()):
            if getattr(hook, "__name__", "").startswith("make_inputs_require_grad"):
                module._forward_hooks[key] = _outside_transforms(hook)
                swapped.append((module, key, hook))
    try:
        yield
    finally:
        for module, key, hook in swapped:
            if key in module._forward_hooks:
                module._forward_hooks[key] = hook


def _outside_transforms(hook):
    def hook_outside_transforms(module, args, output):
        if torch._C._functorch.peek_interpreter_stack() is not None:  # inside vmap or grad
            return None
        return hook(module, args, output)

    return hook_outside_transforms


def activation_checkpointing(model: nn.Module | None) -> bool:
    """Whether ``model`` recomputes blocks in its backward (transformers' checkpointing on).

    transformers marks each block that checkpoints with ``gradient_checkpointing =
    True`` (``model.gradient_checkpointing_enable()``, ``TrainingArguments(
    gradient_checkpointing=True)``); a ``torch.utils.checkpoint`` call of one's own
    is not seen here. Only the batched ghost pass (plain autograd) runs such a
    model: ``torch.func``'s transforms refuse checkpointing's saved-tensor hooks.
    """
    return model is not None and any(
        getattr(module, "gradient_checkpointing", False) is True for module in model.modules()
    )
