"""Norms and clipped sums of per-example gradients in outer-product form, with rounding bounds.

The clipped sum is computed by other float operations than the norm (one
product over every row of the batch), so a norm computed naively could be
tiny for an example whose positions cancel (huge inputs and output
gradients, a small gradient) while its contribution to the sum is large.
Every norm here is therefore an upper bound that covers the rounding of both
the norm and the sum (Higham's ``gamma_n`` bounds for dot products and
sums), so the contribution that is summed never exceeds the clip bound.

Half precision (bf16, fp16) is accumulated in float32: :func:`widen_form`
upcasts a rule's forms (exactly: every half value is a float32 value) before
any product or sum, so the bounds use float32's unit roundoff, and the
clipped sum of half parameters is float32. Rounding the layer's input to the
half dtype belongs to the forward (the layer computed with that value), not
to the sum, and needs no bound. Half's own unit roundoff (2^-9 for bf16) in a
``gamma_n`` would make the bound meaningless: ``gamma_{257}`` is infinite.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..clipping import _contract, _squared_norms, accumulation_dtype
from .registry import Outer

__all__ = [
    "Sites",
    "combine",
    "form_norms",
    "form_sum",
    "formed_norms",
    "linear_weight_norms",
    "widen",
    "widen_form",
]

F64 = torch.float64


def widen(t: Tensor) -> Tensor:
    """``t`` in :func:`~dpfunc.clipping.accumulation_dtype`, the vmap path's: float32 for
    bf16 and fp16 (exact: a half value is a float32 value), else unchanged."""
    return t.to(accumulation_dtype(t.dtype))


def widen_form(form: Outer | Tensor) -> Outer | Tensor:
    """A rule's form with its floating-point tensors in :func:`accumulation_dtype`."""
    if isinstance(form, Outer):
        left, right = form
        return Outer(left if _is_index(left) else widen(left), widen(right))
    return widen(form)


def formed_norms(formed: list[Tensor]) -> list[Tensor]:
    """Each example's squared norm of each formed gradient ``t [B, ...]`` in ``formed``,
    float64 ``[B]``: the vmap path's (:func:`dpfunc.clipping.per_sample_norms`, runs of
    float32 squares eagerly, whose rounding the clip margin covers), times ``(1 +
    gamma_2)^2``. One host synchronisation for the whole list (the check for runs
    that overflowed), as on the vmap path: a step passes all its formed gradients at once.

    Not a float64 copy of ``t``: eagerly on a CPU, that copy of a fresh
    ``[B, d_out, d_in]`` cost a transformer's ghost step a tenth of its time.
    :func:`weighted_sum` multiplies each entry by the clip factor cast to the
    accumulation dtype: two roundings, so the contribution is at most
    ``(1 + gamma_2)`` times the factor times the norm (the other examples'
    rows are exact zeros and add no rounding).
    """
    squares = _squared_norms(formed)
    return [sq * (1 + gamma(2, accumulation_dtype(t.dtype))) ** 2 for sq, t in zip(squares, formed)]


def _expand(w: Tensor, like: Tensor) -> Tensor:
    return w.reshape(-1, *([1] * (like.dim() - 1)))


def keep(t: Tensor, w: Tensor) -> Tensor:
    """``t`` with the rows of weight-0 examples set to exactly 0 (NaN-safe)."""
    return torch.where(_expand(w != 0, t), t, t.new_zeros(()))


def scaled(t: Tensor, w: Tensor) -> Tensor:
    """``w_i * t_i`` with rows of weight-0 examples exactly 0 (NaN-safe)."""
    w = _expand(w, t)
    return torch.where(w != 0, t * w.to(t.dtype), t.new_zeros(()))


def weighted_sum(g: Tensor, w: Tensor, finite: bool = False) -> Tensor:
    """``sum_i w_i g_i`` in :func:`accumulation_dtype` (float32 for half ``g``).

    ``finite``: the caller knows every row of ``g`` is finite, so a weight-0
    row adds exactly 0 without the ``where`` that keeps a NaN row out (see
    :func:`form_sum`), and the sum is the vmap path's matrix-vector product
    (:func:`dpfunc.clipping.clipped_sum`, whose rounding the clip margin covers)."""
    g = widen(g)
    return _contract(w.to(g.dtype), g) if finite else scaled(g, w).sum(0)


def gamma(n: int, dtype: torch.dtype) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: the relative error bound of ``n`` roundings."""
    nu = n * torch.finfo(dtype).eps / 2
    return nu / (1 - nu) if nu < 1 else math.inf


def position_norms(t: Tensor) -> Tensor:
    """Upper bounds on ``|t_..., :|``, the 2-norms over the last dimension, float64.

    Computed in ``t``'s dtype (converting the whole tensor to float64 first
    costs a copy of it, a third of the ghost norms' time on a transformer),
    then widened: the computed sum of ``d`` squares is at least ``(1 -
    gamma_d)`` times the exact one less ``d tiny`` for squares that underflow
    (``tiny``, the dtype's smallest normal number, also covers flushing
    subnormals to zero), and the square root rounds once more, so
    ``sqrt(n^2 + d tiny) / (1 - gamma_{d+1})`` bounds the norm from above. A
    position whose squares overflow (``|t| > 1.8e19`` in float32) gets an
    infinite bound, so its example's norm is infinite and it is treated as
    non-finite (weight 0), never under-counted.
    """
    d = t.shape[-1]
    tiny = torch.finfo(t.dtype).tiny
    n = torch.linalg.vector_norm(t, dim=-1).to(F64)
    return (n.square() + d * tiny).sqrt() * ((1 + 2**-50) / (1 - gamma(d + 1, t.dtype)))


def pair_sum(x: Tensor) -> Tensor:
    """``x [N, T, T'] -> [N]`` float64: the sum over the last dimension in ``x``'s dtype,
    then over the rest in float64 (so that only ``[N, T]``, not ``x``, is converted). The
    first stage's rounding is at most ``gamma_{T'}`` of ``x``'s dtype times ``sum |x|``,
    which the callers' error terms add. A first-stage sum that overflows (finite entries
    can sum past the dtype's range, to ``-inf`` as well) or is NaN becomes ``+inf``, so
    the example's norm is infinite and it is treated as non-finite, never clamped to a
    small norm."""
    rows = x.sum(-1)
    rows = torch.where(torch.isfinite(rows), rows, math.inf)
    return rows.to(F64).sum(-1)


def underflow(left_sum: Tensor, right_sum: Tensor, p: int, q: int, pairs: int, dtype) -> Tensor:
    """The absolute error that underflow can add to a Gram-form squared norm, float64 ``[N]``.

    Each entry of a Gram matrix of rows of width ``p`` may lose ``p tiny`` to
    products that underflow (``tiny``: the dtype's smallest normal number),
    which the other side's entries multiply: summed over the pairs, at most
    ``tiny (p R^2 + q L^2 + pairs (1 + p q tiny))`` with ``L`` and ``R`` the sums
    of the position norms of each side; doubled for the rounding of these
    terms. Negligible unless the magnitudes are extreme (inputs near 1e-19
    against output gradients near 1e19), where the products underflow while
    the gradient does not.
    """
    tiny = torch.finfo(dtype).tiny
    return 2 * tiny * (p * right_sum.square() + q * left_sum.square() + pairs * (1 + p * q * tiny))


def summed_underflow(p: int, q: int, terms: int, dtype) -> float:
    """What underflow can add to the norm of one example's contribution to a sum of
    ``terms`` products of ``[p] x [q]`` outer products: ``tiny`` per entry and term."""
    return math.sqrt(p * q) * (terms + 2) * torch.finfo(dtype).tiny


def gram_is_cheaper(t: int, d_in: int, d_out: int) -> bool:
    """Whether a Linear weight's per-example norm is cheaper from Gram matrices than formed.

    ``t == 1`` (the rank-one form), or ``T (d_in + d_out) < d_in d_out``: the
    Gram form's two ``T x T`` products cost ``T^2 (d_in + d_out)``
    multiply-adds an example, the direct form's gradient ``T d_in d_out``.
    Timed on a CPU (bench/gram_direct.md, float32, T = 64 and 512, widths
    128 to 11008), this picked the faster form at all 14 shapes; comparing
    sizes instead (``T^2 < d_in d_out``, the Gram matrix smaller than the
    gradient) picked the slower at two, both square layers with ``d / 2 <= T
    < d``: ``(64, 128, 128)``, direct 0.85x the Gram form's time, and ``(512,
    768, 768)``, BERT-base at T = 512, 0.76x. Memory where it says "formed":
    ``B d_in d_out <= B T (d_in + d_out)``, no more than the layer's inputs
    and output gradients that the ghost pass would hold for it. The ghost
    pass keeps the formed gradients for the clipped sum and lets the rows go
    (:func:`formed_where_cheaper`, which also forms some layers whose norm this
    rule takes from Gram matrices); where ``method="auto"`` leaves the layer
    to vmap instead, they are held with every other vmapped one (a
    ``memory_budget`` still caps the vmap path's whole).
    """
    return t == 1 or t * (d_in + d_out) < d_in * d_out


def linear_weight_norms(
    a: Tensor, g: Tensor, form: str | None = None, summed_over: int = 1
) -> Tensor:
    """An upper bound on ``||g_i^T a_i||_F^2`` for ``a [N, T, d_in]``, ``g [N, T, d_out]``.

    Returns float64 ``[N]``. ``form``: ``"outer"`` (``T == 1``: ``|a|^2
    |g|^2``), ``"gram"`` (``sum((a a^T) * (g g^T))``, ``T x T`` per example)
    or ``"direct"`` (forms the ``d_out x d_in`` gradient); ``None`` picks
    ``outer`` for ``T == 1``, else ``gram`` where :func:`gram_is_cheaper`
    (``T (d_in + d_out) < d_in d_out``), else ``direct``.

    Every rounding error is at most ``gamma * S_i`` with ``S_i = sum_t |a_it|
    |g_it|``, so the returned norm is the computed one plus those bounds:
    ``gram`` adds ``(3 gamma_{d+1} + gamma_T + 2 gamma_{T^2}(float64)) S^2``
    to the squared norm (the products, the sum of each Gram row in the
    forms' dtype, the rest in float64), ``direct`` adds ``gamma_T S`` to the
    norm, whose rows are bounded above as :func:`position_norms`, and every form
    adds ``gamma_{summed_over + 2} S`` for the sum over ``summed_over`` rows
    and the clip factor's two roundings (its cast to the gradients' dtype and
    the product by it). Half ``a`` and ``g`` are widened to float32 first, as
    :func:`form_sum` sums them, so the bounds are float32's.
    Measured in float32, the bound exceeds the exact norm by a relative
    1.5e-5 with one position and 256 rows, and by 1e-4 to 2e-4 with 32 to 64
    positions; it is loose only for examples whose positions cancel.
    """
    a, g = widen(a), widen(g)  # half forms are summed in float32 (see form_sum)
    t, d_in, d_out = a.shape[1], a.shape[2], g.shape[2]
    dtype = torch.promote_types(a.dtype, g.dtype)
    if form is None:
        form = "outer" if t == 1 else ("gram" if gram_is_cheaper(t, d_in, d_out) else "direct")
    a_norms, g_norms = position_norms(a), position_norms(g)
    s = (a_norms * g_norms).sum(1)  # S_i, bounded above: bounds every rounding error below
    if form == "outer":
        if t != 1:
            raise ValueError(f"form='outer' needs one position per example, got {t}")
        norm = s  # |a| |g|, bounded above: no cancellation
    elif form == "gram":
        gram = pair_sum(torch.bmm(a, a.mT) * torch.bmm(g, g.mT))
        error = 3 * gamma(max(d_in, d_out) + 1, dtype) + gamma(t, dtype) + 2 * gamma(t * t, F64)
        lost = underflow(a_norms.sum(1), g_norms.sum(1), d_in, d_out, t * t, dtype)
        norm = (gram.clamp(min=0) + error * s.square() + lost).sqrt()
    elif form == "direct":
        rows = position_norms(torch.bmm(g.mT, a))  # [N, d_out], each row bounded above
        norm = torch.linalg.vector_norm(rows, dim=1) * (1 + gamma(d_out + 1, F64))
        norm = norm + gamma(t, dtype) * s + summed_underflow(d_in, d_out, t, dtype)
    else:
        raise ValueError(f"form must be 'outer', 'gram', 'direct' or None, got form={form!r}")
    summed = gamma(summed_over + 2, dtype) * s + summed_underflow(d_in, d_out, summed_over, dtype)
    return (norm + summed).square()


def _index_norms(idx: Tensor, g: Tensor, summed_over: int) -> Tensor:
    """:func:`linear_weight_norms` for one-hot rows ``idx [N, T]`` (``|a_t| = 1``, exact)."""
    g = widen(g)
    t, dim = g.shape[1], g.shape[2]
    same = idx[:, :, None] == idx[:, None, :]
    gram = pair_sum(torch.where(same, torch.bmm(g, g.mT), g.new_zeros(())))
    s = position_norms(g).sum(1)
    error = 2 * gamma(dim + 1, g.dtype) + gamma(t, g.dtype) + 2 * gamma(t * t, F64)
    lost = underflow(s.new_full(s.shape, t), s, 0, dim, t * t, g.dtype)  # one-hot side exact
    norm = (gram.clamp(min=0) + error * s.square() + lost).sqrt()
    summed = gamma(summed_over + 2, g.dtype) * s + summed_underflow(1, dim, summed_over, g.dtype)
    return (norm + summed).square()  # the index_add, the factor


def _is_index(left: Tensor) -> bool:
    return not (left.is_floating_point() or left.is_complex())


class Sites(NamedTuple):
    """One parameter's :class:`Outer` forms at several sites, some with index rows and some
    dense (tied input and output embeddings): joined without forming the one-hot rows."""

    forms: tuple[Outer, ...]


def _left_gram(lj: Tensor, lk: Tensor) -> Tensor:
    """``[B, Tj, Tk]`` dot products of the left rows of two sites; one-hot rows are exact."""
    if _is_index(lj) and _is_index(lk):
        return (lj[:, :, None] == lk[:, None, :]).to(torch.float32)
    if _is_index(lj):  # onehot(v) . l_t = l_t[v], a gather
        return _left_gram(lk, lj).mT
    if _is_index(lk):
        index = lk.long()[:, None, :].expand(-1, lj.shape[1], -1)
        return torch.gather(lj, 2, index)
    return torch.bmm(lj, lk.mT)


def _sites_norms(sites: Sites, batch: int | None = None) -> Tensor:
    """The Gram form of :func:`linear_weight_norms` over every pair of sites, with its bounds."""
    forms = sites.forms
    dtype = forms[0].right.dtype
    b = forms[0].right.shape[0]  # the examples here (the real rows, when padding is left out)
    rows = b if batch is None else batch  # the rows the sum's rounding bound counts
    t = sum(f.right.shape[1] for f in forms)
    p = max(f.left.shape[-1] for f in forms if not _is_index(f.left))
    gram = torch.zeros(b, dtype=F64, device=forms[0].right.device)
    s, left_sum, right_sum = torch.zeros_like(gram), torch.zeros_like(gram), torch.zeros_like(gram)
    for j in forms:
        r_norms = position_norms(j.right)
        right_sum = right_sum + r_norms.sum(1)
        if _is_index(j.left):  # one-hot rows: norm 1, exact
            left_sum = left_sum + j.left.shape[1]
        else:
            l_norms = position_norms(j.left)
            left_sum = left_sum + l_norms.sum(1)
            r_norms = r_norms * l_norms
        s = s + r_norms.sum(1)
        for k in forms:
            left = _left_gram(j.left, k.left).to(dtype)
            gram = gram + pair_sum(left * torch.bmm(j.right, k.right.mT))
    q = forms[0].right.shape[-1]
    error = 3 * gamma(max(p, q) + 1, dtype) + gamma(t, dtype) + 2 * gamma(t * t, F64)
    lost = underflow(left_sum, right_sum, p, q, t * t, dtype)
    norm = (gram.clamp(min=0) + error * s.square() + lost).sqrt()
    # the sum: every position of the batch, one addition per site, the clip factor
    terms = rows * t + len(forms)
    summed = gamma(terms + 2, dtype) * s + summed_underflow(p, q, terms, dtype)
    return (norm + summed).square()


def form_norms(form: Outer | Sites | Tensor, batch: int | None = None) -> Tensor:
    """Each example's squared gradient norm, an upper bound on the contribution
    :func:`form_sum` sums (rounding included), float64 ``[B]``. Half forms are
    widened first (:func:`widen_form`), so the bounds are float32's.

    ``batch``: the rows the sum's rounding bound counts, at least ``B``; the
    physical (padded) rows of the micro-batch when padding rows were left
    out, so that no example's bound depends on how many examples are real.
    ``None``: ``B``."""
    if isinstance(form, Sites):
        return _sites_norms(Sites(tuple(widen_form(f) for f in form.forms)), batch)
    form = widen_form(form)
    if not isinstance(form, Outer):
        return formed_norms([form])[0]
    left, right = form
    b, rows = right.shape[0], math.prod(right.shape[1:-1])  # every position of the batch ...
    summed = (b if batch is None else batch) * rows
    if _is_index(left):
        return _index_norms(left, right, summed)  # ... is one term of the clipped sum
    groups = right.shape[1] if right.dim() == 4 else 1
    sq = linear_weight_norms(
        right.reshape(b * groups, -1, right.shape[-1]),
        left.reshape(b * groups, -1, left.shape[-1]),
        summed_over=summed // groups,
    )
    return sq.reshape(b, groups).sum(1)


def form_sum(
    form: Outer | Sites | Tensor, w: Tensor, shape: torch.Size, finite: bool = False
) -> Tensor:
    """``sum_i w_i grad_i`` shaped like the parameter; weight-0 rows add exactly 0.

    Accumulated in :func:`accumulation_dtype`: float32 for half forms.

    ``finite``: the caller has checked that every example's norm is finite,
    which bounds every entry of its forms, so ``0 * entry`` is exactly 0 and
    the weight goes into one side of the product only. Otherwise a NaN or
    infinite row (a padding row, an example dropped for its non-finite norm)
    is cut out of both sides with ``where`` first: ``0 * NaN`` is NaN. Eagerly
    on a CPU those three extra passes over the forms cost a fifth of a
    transformer's ghost step.
    """
    if isinstance(form, Sites):
        return sum(form_sum(f, w, shape, finite) for f in form.forms)
    form = widen_form(form)
    if not isinstance(form, Outer):
        return weighted_sum(form, w, finite).reshape(shape)
    left, right = form
    q = right.shape[-1]
    if _is_index(left):
        zeros = right.new_zeros(shape[0], q)
        rows = right * _expand(w, right).to(right.dtype) if finite else scaled(right, w)
        return zeros.index_add(0, left.reshape(-1), rows.reshape(-1, q)).reshape(shape)
    p = left.shape[-1]
    if finite:  # the weight on the smaller side
        if p <= q:
            left = left * _expand(w, left).to(left.dtype)
        else:
            right = right * _expand(w, right).to(right.dtype)
    else:
        left, right = scaled(left, w), keep(right, w)
    if right.dim() == 4:  # [B, G, T, d] -> [G, B * T, d]
        lhs = left.transpose(0, 1).reshape(left.shape[1], -1, p)
        rhs = right.transpose(0, 1).reshape(right.shape[1], -1, q)
        return torch.bmm(lhs.mT, rhs).reshape(shape)
    return (left.reshape(-1, p).mT @ right.reshape(-1, q)).reshape(shape)


def _dense(left: Tensor, rows: int, dtype: torch.dtype) -> Tensor:
    return F.one_hot(left.long(), rows).to(dtype) if _is_index(left) else left


def _formed(form: Outer | Tensor, shape: torch.Size) -> Tensor:
    if not isinstance(form, Outer):
        return form.reshape(form.shape[0], *shape)
    left, right = form
    left = _dense(left, shape[0], right.dtype)
    if right.dim() == 4:
        return torch.einsum("bgtp,bgtq->bgpq", left, right).reshape(right.shape[0], *shape)
    return torch.bmm(left.mT, right).reshape(right.shape[0], *shape)


def forming_is_cheaper(t: int, d_in: int, d_out: int) -> bool:
    """Whether the ghost pass forms a Linear weight's per-example gradients once, for
    its norm and its clipped sum, rather than keep the rows (Gram norms, then the rows'
    weighted product).

    ``t > 1`` and ``d_in d_out <= 2 T (d_in + d_out)``: the formed gradients hold at
    most twice the floats of the inputs and output gradients they replace. Both ways
    spend ``T d_in d_out`` multiply-adds an example on the sum's products (the forming,
    or the rows' product); the rows' way adds the Gram matrices, ``T^2 (d_in +
    d_out)``, the formed way writes and reads ``d_in d_out`` floats twice more, for
    the norm and the sum. Timed alone with the sum on 2-core CPUs (bench/gram_direct.md,
    float32, B = 8, T = 64 and 512, widths 128 to 11008), this picks the faster way at
    14 of 14 shapes on one machine and 12 on another (the two misses within 5%). At B =
    32 and T = 64, widths 128 and 512, rows timed alone come out 1-21% faster, yet in
    whole eager steps at that size (bench/long_sequences.md) forming was neutral for
    BERT and 4-5% faster for GPT-2 and Llama. Where it forms and the norm rule
    (:func:`gram_is_cheaper`) would take Gram norms, ``T < d_in d_out / (d_in + d_out)
    <= 2 T``: BERT-base's and GPT-2's 768 x 3072 layers at T = 512, width-128 models'
    128 x 512 layers at T = 64. Eager with a batched loss at width 768, T = 512, that
    band cut GPT-2's step by 12%, Llama's by 10% and BERT's by 5%. A step that keeps
    rows for the rank-one form (``t == 1``) needs no choice.
    """
    return t > 1 and d_in * d_out <= 2 * t * (d_in + d_out)


def formed_where_cheaper(form: Outer | Sites | Tensor, shape: torch.Size) -> Outer | Sites | Tensor:
    """The per-example gradients ``[B, *shape]`` of a dense :class:`Outer` form where
    :func:`forming_is_cheaper`; any other form unchanged (index rows, :class:`Sites`,
    forms already formed, and dense ones whose rows are cheaper kept).

    Formed once, they serve the norm (:func:`formed_norms`, exact for the
    contribution :func:`weighted_sum` then sums, so no rounding bound of a
    second product is needed) and the clipped sum, ``B d_in d_out``
    multiply-adds where :func:`form_sum` of the rows would spend ``B T d_in
    d_out`` forming them again: the instantiated layers of book-keeping
    (Bu et al. 2023). They hold at most twice the floats of the rows they
    replace, which are freed once no other form holds them (inputs shared by
    several layers, as ``q``, ``k`` and ``v`` projections, are freed with the
    last): the forms a step holds after its ghost pass are at most twice the
    rows it had, and equal to them where no layer is formed. At width 768,
    T = 512 the peak resident memory of BERT's, GPT-2's and Llama's steps moved
    by -1% to +2% (bench/long_sequences.md).
    """
    if not isinstance(form, Outer) or _is_index(form.left):
        return form
    left, right = form
    t, p, q = right.shape[-2], left.shape[-1], right.shape[-1]
    return _formed(form, shape) if forming_is_cheaper(t, p, q) else form


def combine(forms: list[Outer | Tensor], shape: torch.Size) -> Outer | Sites | Tensor:
    """One form for a parameter used at several sites (calls, or layers sharing it).

    Outer forms of one layout join along the positions (the gradient is the
    sum over all of them, cross terms included in the norm); index and dense
    rows together become :class:`Sites`; anything else is formed per example
    and added.
    """
    if len(forms) == 1:
        return forms[0]
    if all(isinstance(f, Outer) for f in forms):
        dims = {f.right.dim() for f in forms}
        if dims == {3} or (dims == {4} and len({f.right.shape[1] for f in forms}) == 1):
            if all(_is_index(f.left) for f in forms):
                return Outer(torch.cat([f.left for f in forms], 1),
                             torch.cat([f.right for f in forms], 1))  # fmt: skip
            if all(not _is_index(f.left) for f in forms):
                return Outer(torch.cat([f.left for f in forms], -2),
                             torch.cat([f.right for f in forms], -2))  # fmt: skip
            if dims == {3}:
                return Sites(tuple(forms))
    return sum(_formed(f, shape) for f in forms)


def group(form: Outer | Sites | Tensor, rows: Tensor, size: int) -> Outer | Sites | Tensor:
    """Each user's form from its examples': slots of ``size`` consecutive rows, summed.

    User-level privacy (:mod:`dpfunc.users`): a user's update is the sum of
    its slot's real rows (``rows``, bool ``[U * k]``) times ``1 / n``, which
    the caller applies to the norm and the weight. An :class:`Outer` form is
    a sum over positions, so the user's sum is the examples' forms joined
    along the positions, padding rows set to exact zeros on the right side:
    ``[U * k, T, .]`` becomes ``[U, k * T, .]`` (a view), and
    :func:`form_norms` takes the exact norm of the sum, the cross terms
    between a user's examples included. A formed gradient is summed over the
    slot. ``size = 1`` returns the form itself. Norm and sum both read the
    grouped form, so the bound holds for the contribution that is summed.
    """
    if size == 1:
        return form
    if isinstance(form, Sites):
        return Sites(tuple(group(f, rows, size) for f in form.forms))
    if not isinstance(form, Outer):
        return keep(form, rows).reshape(-1, size, *form.shape[1:]).sum(1)
    left, right = form
    right = keep(right, rows)

    def joined(t: Tensor) -> Tensor:  # [U * k, (G,) T, .] -> [U, (G,) k * T, .]
        if right.dim() == 4:  # a groups axis after the examples'
            t = t.reshape(-1, size, *t.shape[1:]).transpose(1, 2)
            return t.reshape(t.shape[0], t.shape[1], -1, *t.shape[4:])
        return t.reshape(-1, size * t.shape[1], *t.shape[2:])

    return Outer(joined(left), joined(right))
