"""Attention under vmap: the math kernel where its scores are small, the same result."""

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import profile

from dpfunc import _batched_attention as ba
from dpfunc.per_sample import vmap_over_examples

B, H, T, D = 4, 2, 8, 4


def loss(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).square().sum()


def inputs(dtype=torch.float64):
    # one example is [1, H, T, D], as a model called on a batch of one sees it: the fused
    # kernel takes 4-d inputs (on 3-d ones torch picks the math kernel anyway)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, 1, H, T, D, dtype=dtype) for _ in range(3))
    mask = torch.randn(B, 1, 1, T, T, dtype=dtype)
    return q, k, v, mask


def kernels(fn) -> set[str]:
    with profile() as prof:
        fn()
    return {e.key for e in prof.key_averages() if "attention" in e.key}


def per_example_grads(*args):
    return torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)))(*args)


def test_small_calls_run_the_math_kernel_with_the_same_gradients():
    args = inputs()
    want = per_example_grads(*args)
    with ba.batched_attention(B):
        got = per_example_grads(*args)
        used = kernels(lambda: per_example_grads(*args))
    assert "aten::_scaled_dot_product_attention_math" in used
    assert not any("flash" in k for k in used)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_large_calls_keep_the_fused_kernel(monkeypatch):
    monkeypatch.setattr(ba, "MATH_SCORES", B * H * T * T - 1)  # one entry too many
    args = inputs(torch.float32)
    with ba.batched_attention(B):
        used = kernels(lambda: per_example_grads(*args))
    assert "aten::_scaled_dot_product_attention_math" not in used
    assert any("flash" in k for k in used)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_compiled_pass_holds_no_per_example_attention_calls():
    # without the math kernel the compiled graph unrolls vmap's fallback: one fused
    # attention call per example; with it, none
    args = inputs(torch.float32)
    per_example = vmap_over_examples(
        torch.func.grad(loss, argnums=(0, 1, 2)), in_dims=(0, 0, 0, 0), chunk_size=None
    )
    compiled = torch.compile(per_example, fullgraph=True, backend="aot_eager")
    got = compiled(*args)
    used = kernels(lambda: compiled(*args))
    assert not any("flash" in k for k in used), used
    for a, b in zip(got, per_example_grads(*args)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
