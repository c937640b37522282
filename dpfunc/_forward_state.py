"""What a private forward may not move: the model's own state, watched around every step.

A forward that writes into the model (running statistics, a cache of the last
input, weights renormalised in place) carries the data out with no noise: in
``state_dict`` and in every later output. :class:`StateWatch` records the
model's buffers and parameters before a private forward and names what moved
after it, putting the buffers back.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class StateWatch:
    """The model's buffers and parameters, as a private forward must leave them.

    :meth:`start` before a forward records each parameter's version counter
    (a sharded model's are left out: FSDP2 moves them) and each buffer's
    tensor, version and value; :meth:`moved` after it names the parameters
    written in place and the buffers given other values (in place, through
    ``.data`` or by a new tensor), added or removed, and puts the buffers
    back as they were (a parameter cannot be: it is not copied). A write that
    leaves a buffer's values as they were (an idempotent ``fill_``) is not a
    change. The buffers' copies are kept from one forward to the next and
    taken again only for a buffer that changed in between (the caller's own
    change, outside the private forward), so a step costs two comparisons of
    the buffers, not a copy.
    """

    def __init__(self, model: nn.Module, sharded: bool):
        self.model, self.sharded = model, sharded
        self._buffers: dict[str, tuple[Tensor, int, Tensor]] = {}
        self._versions: list[tuple[str, Tensor, int]] = []

    def start(self) -> None:
        model = self.model
        self._versions = [] if self.sharded else [(n, p, p._version)
                                                  for n, p in model.named_parameters()]  # fmt: skip
        kept = {}
        for name, b in model.named_buffers():
            old = self._buffers.get(name)
            unchanged = old is not None and old[0] is b and old[0]._version == old[1]
            if unchanged and _same_values(b.detach(), old[2]):
                kept[name] = old
            else:
                kept[name] = (b, b._version, b.detach().clone())
        self._buffers = kept

    def moved(self) -> list[str]:
        names = [f"parameter {n!r}" for n, p, version in self._versions if p._version != version]
        before, now = self._buffers, dict(self.model.named_buffers())
        changed = sorted(name for name in now.keys() | before.keys()
                         if _changed(now.get(name), before.get(name)))  # fmt: skip
        for name in changed:  # put back as they were
            owner, _, leaf = name.rpartition(".")
            module = self.model.get_submodule(owner)
            if name in before:
                tensor, _, copy = before[name]
                with torch.no_grad():
                    tensor.copy_(copy)
                module._buffers[leaf] = tensor
                before[name] = (tensor, tensor._version, copy)
            else:
                del module._buffers[leaf]
        return names + [f"buffer {name!r}" for name in changed]


def _changed(now: Tensor | None, before: tuple[Tensor, int, Tensor] | None) -> bool:
    """Whether a buffer was added, removed or given other values (a bare version bump with the
    same values, an idempotent ``fill_``, is not a change: nothing of the data stays)."""
    if now is None or before is None:
        return True
    _, _, copy = before
    try:  # values, not versions: a write through .data bypasses the version counter
        return not _same_values(now.detach(), copy)
    except Exception:  # a tensor that cannot be read here (one that escaped a vmap)
        return True


def _same_values(a: Tensor, b: Tensor) -> bool:
    """Equal shapes, dtypes and values, NaN equal to NaN (a buffer may hold one)."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())
    return torch.equal(a, b)
