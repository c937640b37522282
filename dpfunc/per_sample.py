"""Per-example gradients: ``vmap`` of ``grad`` over the batch.

The loss function sees ONE example, without a batch dimension, and returns
that example's scalar loss. ``vmap`` maps it over the leading dimension of the
batch, so each row of the result is exactly that example's own gradient:
there is no batch-size rescaling and no ``loss_reduction`` to get wrong.
Because the loss is any function ``torch.func`` can differentiate, losses
that contain their own derivatives (a Laplacian, a Hessian trace, a gradient
penalty) compose.

Under ``vmap`` the loss runs once for all examples, so Python code inside it
cannot read one example's values: no ``.item()``, no ``if loss > 0:``, no
``logits[y]`` with a 0-d label, no ``x[:length]``, no packed sequences.
:func:`explain_loss_errors` turns vmap's one generic message for all of
these into one that names the likely cause, the line, and the rewrite
(``docs/writing-a-loss.md`` shows each), and :func:`explain_example_error`
turns torch's errors for data that does not fit the model (a dtype, float
labels, a label out of range) into one that names the fix, once a step has
failed. :func:`vmap_over_examples` also
tells Hugging Face transformers that it is being traced: transformers checks
``padding_mask.all()`` to skip building an attention mask unless its
``is_tracing()`` says dynamo, jit or fx is tracing, and it knows nothing of
vmap. Its tracing path builds the mask always, which gives the same outputs.
"""

from __future__ import annotations

import ast
import linecache
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import optree
import torch
from torch import Tensor
from torch.func import grad_and_value, vmap
from torch.nn.utils.rnn import PackedSequence

from ._batched_attention import batched_attention
from ._checks import check_devices, check_int
from .tree import Params, PyTree, leaves_in_any_order, tree_leaves

LossFn = Callable[[Params, PyTree], Any]


def per_sample_grads(
    loss_fn: LossFn,
    params: Params,
    batch: PyTree,
    *,
    chunk_size: int | None = None,
    has_aux: bool = False,
):
    """Each example's gradient of ``loss_fn`` with respect to ``params``.

    Args:
        loss_fn: ``loss_fn(params, example) -> loss`` (or ``(loss, aux)`` with
            ``has_aux``) where ``example`` is one row of ``batch`` (every
            tensor leaf without its leading dimension) and ``loss`` is a
            0-d tensor.
        params: the pytree to differentiate (e.g. from ``functionalize``).
        batch: a pytree whose tensor leaves share a leading dimension ``B``.
        chunk_size: evaluate at most this many examples at once, bounding
            memory at the cost of speed; ``None`` does all ``B`` together.
            The result does not depend on it.
        has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` is batched too.

    Returns:
        ``grads`` (a tree like ``params`` whose leaves have shape
        ``[B, *param.shape]``), or ``(grads, aux)`` with ``has_aux``.
        ``grads[k][i]`` equals the gradient a batch-size-1 backward of
        ``loss_fn(params, example_i)`` gives, so ``grads[k].mean(0)`` is the
        gradient of the mean loss:

        >>> import torch
        >>> w = {"w": torch.tensor([1.0, 2.0])}
        >>> x = torch.tensor([[1.0, 0.0], [0.0, 3.0]])
        >>> per_sample_grads(lambda p, xi: (p["w"] * xi).sum() ** 2 / 2, w, x)["w"]
        tensor([[ 1.,  0.],
                [ 0., 18.]])

    Random operations in the loss (dropout) draw independently per example.

    Raises:
        ValueError: leading dimensions of ``batch`` disagree, ``batch`` has no
            tensor leaf, ``chunk_size`` < 1, or the loss is not a scalar.
    """
    grads, _, aux = _grads_and_losses(loss_fn, params, batch, chunk_size, has_aux)
    return (grads, aux) if has_aux else grads


def per_sample_grads_and_losses(
    loss_fn: LossFn, params: Params, batch: PyTree, *, chunk_size: int | None = None
) -> tuple[Params, Tensor]:
    """Like :func:`per_sample_grads`, also returning each example's loss ``[B]``."""
    grads, losses, _ = _grads_and_losses(loss_fn, params, batch, chunk_size, False)
    return grads, losses


def batch_size(batch: PyTree, name: str = "batch") -> int:
    """The shared leading dimension of the tensor leaves of ``batch``.

    Raises ``ValueError`` when there is no tensor leaf with a leading
    dimension or the leading dimensions disagree.
    """
    leaves = leaves_in_any_order(batch)  # the order only shows in the messages
    sizes = [x.shape[0] if x.dim() else None for x in leaves if isinstance(x, Tensor)]
    if not sizes or None in sizes:
        raise ValueError(
            f"every tensor in {name} needs a leading batch dimension; got leaf "
            f"shapes {[tuple(x.shape) for x in tree_leaves(batch) if isinstance(x, Tensor)]}"
        )
    if len(set(sizes)) != 1:
        raise ValueError(f"{name}'s tensors must share one leading dimension, got sizes {sizes}")
    return sizes[0]


def _grads_and_losses(loss_fn, params, batch, chunk_size, has_aux):
    batch_size(batch)
    check_devices(params, batch)
    if chunk_size is not None:
        check_int("chunk_size", chunk_size, minimum=1)

    def example_loss(p, example):
        out = loss_fn(p, example)
        loss, aux = out if has_aux else (out, None)
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(
                "loss_fn must return one example's loss as a 0-d tensor, got "
                f"{shape}; loss_fn sees a single example without a batch dimension"
            )
        return (loss, aux) if has_aux else loss

    per_example = vmap_over_examples(
        grad_and_value(example_loss, has_aux=has_aux), in_dims=(None, 0), chunk_size=chunk_size
    )
    grads, value = per_example(params, batch)
    losses, aux = value if has_aux else (value, None)
    return grads, losses, aux


def vmap_over_examples(fn: Callable, *, in_dims: tuple, chunk_size: int | None) -> Callable:
    """``vmap(fn)`` over the examples, as every dpfunc path runs the user's loss.

    Random operations draw independently per example (``randomness=
    "different"``). Compiled, attention calls run torch's math kernel where it
    is small (:func:`dpfunc._batched_attention.batched_attention`): vmap has no
    batching rule for the fused kernels. While it runs eagerly, Hugging Face transformers' tracing
    guard answers yes (see the module docstring), so its models take their
    trace-safe path with padding masks, and :func:`explain_loss_errors`
    names the cause and the fix of vmap's errors for code that reads one
    example's values.
    """
    mapped = vmap(fn, in_dims=in_dims, chunk_size=chunk_size, randomness="different")

    def run(*args):
        mapped_rows = [
            x.shape[0]
            for arg, dim in zip(args, in_dims)
            if dim is not None
            for x in tree_leaves(arg)
            if isinstance(x, Tensor)
        ]
        rows = min(mapped_rows[0], chunk_size or mapped_rows[0]) if mapped_rows else 1
        if torch.compiler.is_compiling():  # dynamo traces the loss: libraries see that
            with batched_attention(rows):
                return mapped(*args)
        with _libraries_see_tracing(), explain_loss_errors():
            return mapped(*args)

    return run


@contextmanager
def explain_loss_errors() -> Iterator[None]:
    """Re-raises vmap's errors for a loss that reads one example's values, explained.

    Under ``torch.func.vmap`` a loss runs once for the whole batch, so Python
    cannot see one example's values. torch 2.13 says so with one message for
    ``.item()``, ``float(t)``, a Python ``if`` on a tensor and ``logits[y]``
    alike ("vmap: It looks like you're either (1) calling .item() ... (2)
    attempting to use a Tensor in some data-dependent control flow"), and
    with others for shapes that depend on values (boolean-mask indexing,
    ``masked_select``, ``pack_padded_sequence``). Inside this context those
    errors are raised again, as the same exception type and chained with
    ``from`` to the original, with a message that names the likely cause
    from the failing line of the user's code (the innermost frame outside
    torch and dpfunc), the line, the rewrite that works, and the original
    message. Every other error passes through unchanged.

    The cause is read from the source of the failing expression, so it is
    named only where the source is available (files, notebook cells) and
    Python reports expression positions (3.11+); otherwise the message
    lists every usual cause and its fix.
    """
    try:
        yield
    except RuntimeError as error:
        message = _explanation(error)
        if message is None:
            raise
        try:
            explained = type(error)(message)
        except Exception:  # an exception type with another signature
            explained = RuntimeError(message)
        raise explained from error


_EXPLAINED = "per-example gradients failed:"  # how explain_loss_errors' messages begin
_VMAP_READS_VALUES = (
    "data-dependent control flow",  # .item(), bool(), int(), a 0-d tensor index, a Python branch
    "doesn't have storage",  # .tolist(), .numpy(): a batched tensor has no one value to read
    "batching operators that can",  # nonzero, boolean-mask indexing, unique: shape from values
    "differently shaped Tensor",  # masked_select
)
# vmap's per-example fallback loop stacking outputs of different lengths; as a user's own
# torch.stack raises the same text, it is explained only where a packed sequence is involved
_UNEQUAL_STACK = "stack expects each tensor to be equal size"

_CAUSES = {
    "index": (
        "indexes a tensor with a tensor from the example (`logits[y]` or `table[y]` with a "
        "0-d `y`): Python turns the index into one int, which cannot follow each example",
        "pick the entry with tensor operations: `logits.gather(-1, y[..., None]).squeeze(-1)`, "
        "`F.cross_entropy(logits[None], y[None])` for a classification loss, a one-hot mask "
        "`(logits * (torch.arange(num_classes) == y)).sum(-1)`, or a 1-d index "
        "`table[y[None]]`",
    ),
    "slice": (
        "slices a tensor by a length from the example (`x[:n]`), which gives each example "
        "another shape",
        "keep the padded length and mask the positions past it: `valid = "
        "torch.arange(x.shape[0]) < n`, then `(per_position_loss * valid).sum() / valid.sum()`",
    ),
    "host": (
        "reads a tensor's value into Python (`.item()`, `float(t)`, `int(t)`, `bool(t)`, "
        "`.tolist()`, `.numpy()`)",
        "keep it a tensor: `loss * w` rather than `loss * w.item()`, `t.to(loss.dtype)` "
        "rather than `float(t)`",
    ),
    "branch": (
        "branches on a value of one example (a Python `if`, `while`, `assert`, `and`/`or` or "
        "`a if c else b` on a tensor, e.g. `if loss > 0:`)",
        "compute both sides and select with `torch.where(cond, a, b)` or a multiplication by "
        "a mask; a loop whose count comes from the example runs to the largest count and masks "
        "the extra steps; or decide outside loss_fn and pass the decision in with the example",
    ),
    "packed": (
        "packs a padded sequence by the example's length (`pack_padded_sequence`, a "
        "`PackedSequence`), whose shape depends on the length",
        "run the model on the padded sequence and mask the positions past the length: "
        "`out, _ = rnn(x[None])`, `valid = torch.arange(x.shape[0]) < length`, a loss summed "
        "over the valid positions, and the last valid output by "
        "`out[0].gather(0, (length - 1).reshape(1, 1).expand(1, out.shape[-1]))` "
        "(for a unidirectional RNN this equals the packed result)",
    ),
    "shape": (
        "makes a tensor whose shape depends on the example's values (boolean-mask indexing "
        "`x[x > 0]`, `nonzero`, `masked_select`, `unique`)",
        "keep the full shape and zero out what is not selected: `torch.where(x > 0, x, 0)` "
        "or `x * (x > 0)`",
    ),
    "call": (
        "calls a function that reads a value of the example (a size, a count or a range "
        "check, e.g. `torch.arange(n)`, `F.one_hot(y, num_classes)`)",
        "give sizes that do not depend on the example and build masks by comparison: "
        "`torch.arange(max_length) < n` rather than `torch.arange(n)`, "
        "`torch.arange(num_classes) == y` rather than `F.one_hot(y, num_classes)`",
    ),
}
_HOST_READS = {"item", "tolist", "numpy", "float", "int", "bool", "complex"}
_LIBRARY_DIRS = tuple(os.path.dirname(f) + os.sep for f in (torch.__file__, __file__))


def _explanation(error: RuntimeError) -> str | None:
    """vmap's message for ``error`` explained, or ``None`` if it is another error."""
    text = str(error)
    known = any(known in text for known in _VMAP_READS_VALUES)
    packed = (known or _UNEQUAL_STACK in text) and _uses_packed_sequence(error)
    if not (known or packed):
        return None
    site = _user_frame(error)
    if packed:
        cause = "packed"
    elif "differently shaped" in text or "batching operators that can" in text:
        cause = "shape"
    else:
        cause = _cause_at(site) if site else None
    where = ""
    if site is not None:
        code, part = (site.line or "").strip(), _expression(site)
        where = f" (at {site.filename}:{site.lineno}" + (f": `{code}`" if code else "")
        where += f", in `{part}`)" if part and part != code else ")"
    if cause is None:
        usual = "\n".join(f"- it {what}. Fix: {fix}." for what, fix in _CAUSES.values())
        body = f"the loss reads a value of one example{where}. The usual causes:\n{usual}"
    else:
        what, fix = _CAUSES[cause]
        body = f"the loss {what}{where}.\nFix: {fix}."
    return (
        f"{_EXPLAINED} {body}\nWhy: dpfunc runs loss_fn on all examples at "
        "once with torch.func.vmap, where Python code cannot read one example's values "
        "(Hugging Face transformers' own mask checks are handled by dpfunc); "
        f"docs/writing-a-loss.md shows each rewrite.\ntorch's message: {text}"
    )


def _uses_packed_sequence(error: BaseException) -> bool:
    for frame, _ in traceback.walk_tb(error.__traceback__):
        if frame.f_code.co_name in ("pack_padded_sequence", "pack_sequence"):
            return True
        if any(isinstance(v, PackedSequence) for v in frame.f_locals.values()):
            return True
    return False


def _user_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of ``error``'s traceback outside torch and dpfunc."""
    frames = traceback.extract_tb(error.__traceback__)
    for summary in reversed(frames):
        path = os.path.abspath(summary.filename) if os.path.exists(summary.filename) else ""
        if not path.startswith(_LIBRARY_DIRS):
            return summary
    return None


def _expression(site: traceback.FrameSummary) -> str | None:
    """The source of the expression that failed at ``site``, if it spans one line."""
    if getattr(site, "colno", None) is None or site.end_lineno != site.lineno:
        return None
    line = linecache.getline(site.filename, site.lineno).encode()  # offsets count bytes
    return line[site.colno : site.end_colno].decode(errors="replace").strip() or None


def _cause_at(site: traceback.FrameSummary) -> str | None:
    """Which of ``_CAUSES`` the expression that failed at ``site`` is, if its source says."""
    position = (site.lineno, getattr(site, "colno", None), site.end_lineno, site.end_colno)
    if None in position:
        return None
    try:
        tree = ast.parse("".join(linecache.getlines(site.filename)))
    except (SyntaxError, ValueError):
        return None
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.expr)
        and (node.lineno, node.col_offset, node.end_lineno, node.end_col_offset) == position
    ]
    if not found:
        return None
    node = found[-1]  # the innermost of nodes sharing the span (ast.walk is breadth-first)
    if _is_condition(node, parents):
        return "branch"
    if isinstance(node, ast.Subscript):
        index = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        return "slice" if any(isinstance(i, ast.Slice) for i in index) else "index"
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name == "range":
            return "branch"
        return "host" if name in _HOST_READS else "call"
    return None


def _is_condition(node: ast.expr, parents: dict) -> bool:
    """``node`` is (part of) the test of an ``if``, ``while``, ``assert`` or ``a if c else b``."""
    parent = parents.get(node)
    while isinstance(parent, ast.BoolOp) or (
        isinstance(parent, ast.UnaryOp) and isinstance(parent.op, ast.Not)
    ):
        node, parent = parent, parents.get(parent)
    if isinstance(parent, (ast.If, ast.While, ast.IfExp, ast.Assert)):
        return parent.test is node
    return isinstance(parent, ast.comprehension) and node in parent.ifs


# --------------------------------------------------------------------------- data misfits

_DIAGNOSED = "_dpfunc_diagnosed"  # set on an error this module has looked at once
_CONVERT = {
    torch.float32: "float",
    torch.float64: "double",
    torch.float16: "half",
    torch.bfloat16: "bfloat16",
}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _squeezed(example: list, k: int) -> list:
    """``example`` with leaf ``k``'s trailing dimension of size 1 dropped."""
    return [x.squeeze(-1) if j == k else x for j, x in enumerate(example)]


def _conversion(dtype: torch.dtype) -> str:
    """The method call that converts a tensor or a module to ``dtype``: ``.double()``."""
    method = _CONVERT.get(dtype)
    return f".{method}()" if method else f".to({dtype})"


def explain_example_error(
    loss_fn: LossFn, params: Params, batch: PyTree, mask: Tensor | None, error: BaseException
) -> BaseException:
    """The error to raise for ``error``, raised by a per-example pass over ``batch``: explained.

    Called only once the pass has failed, so it costs a step nothing. It runs
    ``loss_fn(params, example)`` on the batch's real examples one by one,
    eagerly and without vmap, up to the first that fails (dpfunc's own
    machinery is then not involved), and tries on that example the one
    conversion that would fix a data/model misfit, so a fix it names is one
    it has seen work:

    - floating data of another dtype than the parameters' (``model.double()``
      with float32 data, float16/bfloat16 data into a float32 model): a
      ``TypeError`` naming both dtypes and both fixes, converting the data
      (``x.double()``) or the model (``model.float()``);
    - integer data where the model needs floating point: a ``TypeError``
      naming the leaf and the conversion (``x.float()``);
    - floating labels where the loss needs class indices: a ``TypeError``
      naming the leaf and ``y.long()``;
    - integer labels of another dtype than int64 (int32, numpy's int32 on
      Windows or from ``astype``) where the loss needs int64 class indices: a
      ``TypeError`` naming the leaf and ``y.long()`` / ``y.astype(np.int64)``;
    - labels of shape ``(n, 1)`` where the loss needs one index per example,
      ``(n,)``: a ``ValueError`` naming the leaf and ``y.squeeze(1)`` /
      ``y.view(-1)`` (tried as each example's trailing dimension of size 1
      dropped);
    - an index out of range (a class label outside ``[0, classes)``, a token
      id past an embedding): a ``ValueError`` saying so and how to check.

    The new error is chained (``from``) to ``error``. Any other failure, or
    one that no example reproduces (the failure is the pass's own), comes
    back as ``error`` itself, marked so that an outer caller does not look
    again. RNG state is restored after the runs (dropout draws stay as
    they were).
    """
    if (
        getattr(error, _DIAGNOSED, False)
        or not isinstance(error, Exception)
        or str(error).startswith(_EXPLAINED)  # explain_loss_errors' own: the loss, not the data
    ):
        return error
    try:
        explained = _diagnose(loss_fn, params, batch, mask, error)
    except Exception:  # the diagnosis must never hide the error itself
        explained = None
    found = error if explained is None else explained
    with suppress(AttributeError):  # an exception type that refuses attributes
        setattr(found, _DIAGNOSED, True)
    if explained is not None:
        explained.__cause__, explained.__suppress_context__ = error, True
    return found


def _diagnose(loss_fn, params, batch, mask, error) -> Exception | None:
    paths, leaves, spec = optree.tree_flatten_with_path(batch)
    sizes = [x.shape[0] for x in leaves if isinstance(x, Tensor) and x.dim()]
    if not sizes:
        return None
    rows = range(sizes[0]) if mask is None else mask.to(torch.bool).nonzero().flatten().tolist()
    params = {name: p.detach() for name, p in params.items()}
    devices = sorted({p.device.index for p in params.values() if p.device.type == "cuda"})

    def run(example_leaves) -> Exception | None:
        example = optree.tree_unflatten(spec, example_leaves)
        try:
            with torch.random.fork_rng(devices=devices):
                loss_fn(params, example)
        except Exception as failure:
            return failure
        return None

    failed = None
    for i in rows:
        example = [x[i] if isinstance(x, Tensor) and x.dim() else x for x in leaves]
        failure = run(example)
        if failure is not None:
            failed = example, failure
            break
    if failed is None:  # every example runs alone: the failure is not the data's
        return None
    example, failure = failed
    said = f"loss_fn(params, example) raised {type(failure).__name__}: {str(failure).rstrip('.')}"
    where = ["".join(f"[{key!r}]" for key in path) or "<root>" for path in paths]
    tensors = [k for k, x in enumerate(example) if isinstance(x, Tensor)]
    floating = {p.dtype for p in params.values() if p.dtype.is_floating_point}
    model = next(iter(floating)) if len(floating) == 1 else None

    if model is not None:
        other = [k for k in tensors if example[k].is_floating_point() and example[k].dtype != model]
        if other and run(_converted(example, other, model)) is None:
            data = sorted({_name(example[k].dtype) for k in other})
            return TypeError(
                f"the data is {', '.join(data)} but the model's parameters are {_name(model)}: "
                f"convert the data (x{_conversion(model)} for batch leaf "
                f"{', '.join(where[k] for k in other)}, e.g. when building the dataset) or the "
                f"model (model{_conversion(example[other[0]].dtype)}, before building the run). "
                f"{said}"
            )
        for k in tensors:
            x = example[k]
            numeric = not (x.is_floating_point() or x.is_complex())
            if numeric and run(_converted(example, [k], model)) is None:
                return TypeError(
                    f"batch leaf {where[k]} is {_name(x.dtype)}, but the model computes with it "
                    f"in {_name(model)}: convert it to floating point (x{_conversion(model)} "
                    "when building the dataset; integer data is for class labels and token "
                    f"ids). {said}"
                )
    labels = _label_fix(example, tensors, where, run, said)
    if labels is not None:
        return labels
    text = str(failure)
    if isinstance(failure, IndexError) or "out of bounds" in text or "out of range" in text:
        return ValueError(
            f"an index in the data is out of range: {said}. Most often a class label lies "
            "outside [0, number of classes) (F.cross_entropy, F.nll_loss) or a token id at or "
            "past an nn.Embedding's num_embeddings: check the data's range against the model "
            "(labels: 0 <= y.min() and y.max() < the model's number of outputs), or give the "
            "model as many outputs (embeddings) as the data has classes (ids)"
        )
    return None


def _converted(example: list, ks: list[int], dtype: torch.dtype) -> list:
    """``example``'s leaves with those at ``ks`` converted to ``dtype``."""
    return [x.to(dtype) if k in ks else x for k, x in enumerate(example)]


def _label_fix(example: list, tensors: list[int], where: list[str], run, said: str):
    """The error naming a label fix that makes ``run`` pass (float, int32, ``(n, 1)``), or None."""
    for floating in (True, False):  # float labels first: they may also hold a feature leaf
        for k in tensors:
            x = example[k]
            if (
                x.is_floating_point() == floating
                and not x.is_complex()
                and x.dtype != torch.int64
                and run(_converted(example, [k], torch.int64)) is None
            ):
                held = f"holds {_name(x.dtype)} values" if floating else f"is {_name(x.dtype)}"
                return TypeError(
                    f"batch leaf {where[k]} {held} where loss_fn needs int64 class indices "
                    "(class labels: F.cross_entropy and F.nll_loss take int64): convert them "
                    "(y.long(), or y.astype(np.int64) for a numpy array, when building the "
                    f"dataset). {said}"
                )
    for k in tensors:
        x = example[k]
        if (
            not (x.is_floating_point() or x.is_complex())
            and x.dim()
            and x.shape[-1] == 1
            and run(_squeezed(example, k)) is None
        ):
            one = x.dim() == 1  # the dataset's labels are (n, 1)
            shape, want = (f"({', '.join(['n', *map(str, d)])})" for d in (x.shape, x.shape[:-1]))
            fix = "y.squeeze(1) or y.view(-1); numpy: y.reshape(-1)" if one else "y.squeeze(-1)"
            return ValueError(
                f"batch leaf {where[k]} has shape {shape} where loss_fn needs class indices of "
                f"shape {'(n,), one per example' if one else want} (F.cross_entropy and "
                "F.nll_loss read a trailing dimension of 1 as several targets per example): "
                f"drop that dimension when building the dataset ({fix}). {said}"
            )
    return None


def _trace_safe() -> bool:
    return True


@contextmanager
def _libraries_see_tracing() -> Iterator[None]:
    """Hugging Face transformers' ``is_tracing()`` answers ``True`` inside this context.

    ``is_tracing`` is imported by name into every transformers module, so its
    global ``is_jit_tracing`` (which only ``is_tracing`` calls) is swapped in
    the one module that defines it, and restored on exit.
    """
    utils = sys.modules.get("transformers.utils.import_utils")
    original = getattr(utils, "is_jit_tracing", None)
    if original is None:
        yield
        return
    utils.is_jit_tracing = _trace_safe
    try:
        yield
    finally:
        utils.is_jit_tracing = original


__all__ = [
    "per_sample_grads",
    "per_sample_grads_and_losses",
    "batch_size",
    "vmap_over_examples",
    "explain_loss_errors",
    "explain_example_error",
]
