"""Pytree helpers over optree.

Parameters, gradients, noise and optimizer state are pytrees: nested dicts,
tuples, lists and NamedTuples whose leaves are tensors. A model's parameters
are a flat ``dict[str, Tensor]`` keyed by ``named_parameters()`` names.

Leaf order is optree's: dict keys sorted, sequences in order. Every function
that walks leaves (noise draws, flattening) uses this one order, so results
do not depend on dict insertion order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch
from torch import Tensor

PyTree = Any
Params = dict[str, Tensor]


def tree_map(fn: Callable[..., Any], tree: PyTree, *rest: PyTree) -> PyTree:
    """Applies ``fn`` leaf by leaf over ``tree`` and trees of the same structure."""
    return optree.tree_map(fn, tree, *rest)


def tree_leaves(tree: PyTree) -> list[Any]:
    """The leaves of ``tree`` in optree's order (dict keys sorted)."""
    return optree.tree_leaves(tree)


def leaves_in_any_order(tree: PyTree) -> list[Any]:
    """The leaves of ``tree`` in an order left unspecified, for checks that treat every leaf
    alike (devices, shapes, dtypes, sizes); :func:`tree_leaves` where the order matters.

    Eagerly this is :func:`tree_leaves`. While Dynamo traces, the leaves come from one
    ``optree.tree_map``, which Dynamo runs natively, where it traces every step of
    ``optree.tree_leaves`` in Python: a fifth of the tracing time for a 41-leaf dict
    (0.07 s against 0.37 s on a 2-core CPU), paid by every check in a compiled step. That
    tree_map visits a dict in insertion order, not optree's sorted one.
    """
    if not torch.compiler.is_compiling():
        return optree.tree_leaves(tree)
    leaves: list[Any] = []
    optree.tree_map(leaves.append, tree)
    return leaves


def tree_structure(tree: PyTree) -> optree.PyTreeSpec:
    return optree.tree_structure(tree)


def check_same_structure(tree: PyTree, reference: PyTree, name: str, reference_name: str) -> None:
    """Raises ``ValueError`` unless ``tree`` has the structure and leaf shapes of ``reference``.

    Shapes are static, so this check is free inside a compiled function.
    """
    leaves, spec = optree.tree_flatten(tree)  # one walk each: Dynamo traces every walk
    ref_leaves, ref_spec = optree.tree_flatten(reference)
    if spec != ref_spec:
        raise ValueError(
            f"{name} must have the same tree structure as {reference_name}; "
            f"got {name} structure {spec} and {reference_name} structure {ref_spec}"
        )
    for i, (leaf, ref) in enumerate(zip(leaves, ref_leaves)):
        if leaf.shape != ref.shape:
            path = optree.tree_paths(tree)[i]
            raise ValueError(
                f"{name} leaf {_path_str(path)} has shape {tuple(leaf.shape)}, but the "
                f"matching {reference_name} leaf has shape {tuple(ref.shape)}"
            )


def _path_str(path: tuple) -> str:
    return "".join(f"[{p!r}]" for p in path) or "<root>"


def tree_zeros_like(tree: PyTree) -> PyTree:
    return tree_map(torch.zeros_like, tree)


def tree_add(a: PyTree, b: PyTree) -> PyTree:
    return tree_map(torch.add, a, b)


def tree_scale(tree: PyTree, factor: float | Tensor) -> PyTree:
    return tree_map(lambda x: x * factor, tree)


def global_norm(tree: PyTree) -> Tensor:
    """The L2 norm of all leaves stacked into one vector."""
    leaves = tree_leaves(tree)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in leaves]))
