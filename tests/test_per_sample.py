"""Per-example gradients against a batch-size-1 autograd loop in float64."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.func import functional_call, jacrev

import dpfunc
from dpfunc.tree import tree_map

B = 4


def assert_per_sample_matches_loop(model, batch, forward, *, chunk_size=None):
    """``forward(call, example) -> scalar`` where ``call`` runs the model on one example."""
    model = model.double()
    batch = tree_map(lambda t: t.double() if t.is_floating_point() else t, batch)
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        return forward(
            lambda *args, **kwargs: functional_call(model, (p, buffers), args, kwargs), example
        )

    grads = dpfunc.per_sample_grads(loss_fn, params, batch, chunk_size=chunk_size)
    assert list(grads) == list(params)
    size = dpfunc.per_sample.batch_size(batch)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for i in range(size):
        example = tree_map(lambda t, i=i: t[i], batch)
        expected = torch.autograd.grad(forward(model, example), trainable, allow_unused=True)
        for (name, got), want in zip(grads.items(), expected):
            want = torch.zeros_like(got[i]) if want is None else want
            torch.testing.assert_close(got[i], want, rtol=1e-9, atol=1e-10, msg=name)
    return grads


def projected(out):
    """A scalar that depends on every output coordinate differently."""
    out = out[0] if isinstance(out, tuple) else out
    weights = torch.linspace(-1.0, 2.0, out.numel(), dtype=out.dtype).reshape(out.shape)
    return (out * weights).sum() + 0.5 * out.pow(2).sum()


def on_unsqueezed(call, x):
    return projected(call(x.unsqueeze(0)))


@pytest.mark.parametrize(
    "model, shape",
    [
        (nn.Linear(5, 3), (5,)),
        (nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)), (5,)),
        (nn.Linear(5, 3), (6, 5)),  # a sequence: the weight sums over positions
        (nn.LayerNorm(6), (3, 6)),
        (nn.GroupNorm(2, 4), (4, 5)),
        (nn.InstanceNorm1d(4, affine=True), (4, 7)),
        (nn.InstanceNorm2d(3, affine=True), (3, 4, 4)),
        (nn.RMSNorm(6), (3, 6)),
        (nn.Conv1d(3, 4, 3, stride=2, padding=1), (3, 9)),
        (nn.Conv2d(2, 4, 3, padding="same", dilation=2, groups=2), (2, 6, 6)),
        (nn.Conv3d(2, 3, 2, stride=(1, 2, 1)), (2, 4, 4, 4)),
        (nn.ConvTranspose1d(4, 2, 3, stride=2, groups=2, output_padding=1), (4, 5)),
        (nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1, dilation=2), (3, 4, 4)),
        (nn.ConvTranspose3d(2, 2, 2, stride=2), (2, 3, 3, 3)),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else str(v),
)
def test_layers_match_autograd_loop(model, shape):
    x = torch.randn(B, *shape)
    assert_per_sample_matches_loop(model, x, on_unsqueezed)


def test_bilinear():
    model = nn.Bilinear(3, 4, 2)
    batch = (torch.randn(B, 3), torch.randn(B, 4))
    assert_per_sample_matches_loop(
        model, batch, lambda call, ex: projected(call(ex[0].unsqueeze(0), ex[1].unsqueeze(0)))
    )


def test_embedding_with_repeated_tokens():
    model = nn.Sequential(nn.Embedding(10, 4, padding_idx=0), nn.Flatten(), nn.Linear(12, 2))
    tokens = torch.tensor([[1, 1, 2], [0, 3, 3], [9, 9, 9], [4, 0, 5]])
    assert_per_sample_matches_loop(model, tokens, on_unsqueezed)


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("batch_first", [True, False])
def test_recurrent_layers_without_initial_state(cell, batch_first):
    model = cell(3, 4, num_layers=2, bidirectional=True, batch_first=batch_first)
    x = torch.randn(B, 5, 3)
    dim = 0 if batch_first else 1
    assert_per_sample_matches_loop(model, x, lambda call, xi: projected(call(xi.unsqueeze(dim))))


def test_recurrent_layer_called_with_none_as_initial_state():
    model = nn.GRU(3, 4, batch_first=True)
    x = torch.randn(B, 5, 3)
    assert_per_sample_matches_loop(
        model, x, lambda call, xi: projected(call(xi.unsqueeze(0), None))
    )


def test_recurrent_layer_with_explicit_initial_state():
    model = nn.GRU(3, 4, batch_first=True)
    batch = (torch.randn(B, 5, 3), torch.randn(B, 1, 1, 4))
    assert_per_sample_matches_loop(
        model, batch, lambda call, ex: projected(call(ex[0].unsqueeze(0), ex[1]))
    )


@pytest.mark.parametrize("kdim, vdim", [(None, None), (5, 3)])
def test_multihead_attention(kdim, vdim):
    model = nn.MultiheadAttention(8, 2, kdim=kdim, vdim=vdim, batch_first=True)
    q = torch.randn(B, 4, 8)
    k = torch.randn(B, 6, kdim or 8)
    v = torch.randn(B, 6, vdim or 8)
    assert_per_sample_matches_loop(
        model,
        (q, k, v),
        lambda call, ex: projected(call(*(t.unsqueeze(0) for t in ex), need_weights=False)),
    )


@pytest.mark.parametrize("layer", ["encoder", "decoder"])
def test_transformer_layers(layer):
    if layer == "encoder":
        block = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        model = nn.TransformerEncoder(block, num_layers=2, enable_nested_tensor=False)
        batch = torch.randn(B, 5, 8)
        assert_per_sample_matches_loop(model, batch, on_unsqueezed)
    else:
        model = nn.TransformerDecoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        batch = (torch.randn(B, 4, 8), torch.randn(B, 5, 8))
        assert_per_sample_matches_loop(
            model, batch, lambda call, ex: projected(call(ex[0].unsqueeze(0), ex[1].unsqueeze(0)))
        )


def test_tied_weights_sum_both_uses(tied_language_model):
    model = tied_language_model
    params, _ = dpfunc.functionalize(model)
    assert list(params) == ["embed.weight"]
    tokens = torch.randint(0, 7, (B, 3))
    assert_per_sample_matches_loop(model, tokens, on_unsqueezed)


class Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3))
        self.scale = nn.Parameter(torch.tensor(0.3))

    def forward(self, x):
        h = torch.sin(x @ self.w) * self.scale.exp()
        return (
            torch.cumsum(h, -1) + self.w.norm() * torch.einsum("bi,ij,bj->b", x, self.w, x)[:, None]
        )


def test_custom_module_with_arbitrary_ops():
    assert_per_sample_matches_loop(Custom(), torch.randn(B, 3), on_unsqueezed)


def test_frozen_parameters_are_not_trained_but_used():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    params, buffers = dpfunc.functionalize(model)
    assert list(params) == ["0.bias", "2.weight", "2.bias"]
    assert "0.weight" in buffers
    assert_per_sample_matches_loop(model, torch.randn(B, 3), on_unsqueezed)


@settings(max_examples=12, deadline=None)
@given(
    transpose=st.booleans(),
    dims=st.sampled_from([1, 2]),
    kernel=st.integers(1, 3),
    stride=st.integers(1, 2),
    padding=st.sampled_from([0, 1, "same"]),
    dilation=st.integers(1, 2),
    groups=st.sampled_from([1, 2]),
    size=st.integers(5, 7),  # >= the widest dilated kernel, (3 - 1) * 2 + 1, so every draw is valid
)
def test_conv_shapes(transpose, dims, kernel, stride, padding, dilation, groups, size):
    if padding == "same" and (stride != 1 or transpose):
        padding = 0  # torch accepts "same" only for stride-1 forward convolutions
    cls = {
        (False, 1): nn.Conv1d,
        (False, 2): nn.Conv2d,
        (True, 1): nn.ConvTranspose1d,
        (True, 2): nn.ConvTranspose2d,
    }[(transpose, dims)]
    model = cls(2, 4, kernel, stride=stride, padding=padding, dilation=dilation, groups=groups)
    x = torch.randn(3, 2, *([size] * dims))
    assert_per_sample_matches_loop(model, x, on_unsqueezed)


def test_dropout_draws_per_example():
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.5), nn.Linear(16, 1))
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, x):
        return functional_call(model, (p, buffers), (x.unsqueeze(0),)).sum()

    grads = dpfunc.per_sample_grads(loss_fn, params, torch.ones(8, 4))
    masks = (grads["2.weight"][:, 0] != 0).float()
    assert masks.sum(1).min() > 0 and not torch.all(masks == masks[0])  # examples differ


def pinn_problem():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    model = model.double()
    x = torch.rand(B, 2, dtype=torch.float64)
    f = torch.randn(B, dtype=torch.float64)
    return model, x, f


def test_pinn_laplacian_loss_matches_double_backward_loop():
    model, x, f = pinn_problem()
    params, buffers = dpfunc.functionalize(model)

    def loss_fn(p, example):
        xi, fi = example

        def u(z):
            return functional_call(model, (p, buffers), (z,)).squeeze()

        laplacian = torch.trace(jacrev(jacrev(u))(xi))
        return (laplacian - fi) ** 2

    grads = dpfunc.per_sample_grads(loss_fn, params, (x, f))
    for i in range(B):
        xi = x[i].clone().requires_grad_(True)
        u = model(xi).squeeze()
        (du,) = torch.autograd.grad(u, xi, create_graph=True)
        laplacian = sum(torch.autograd.grad(du[d], xi, create_graph=True)[0][d] for d in range(2))
        loss = (laplacian - f[i]) ** 2
        expected = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
        for got, want in zip(grads.values(), expected):
            want = torch.zeros_like(got[i]) if want is None else want  # the last bias
            torch.testing.assert_close(got[i], want, rtol=1e-9, atol=1e-10)


def test_chunked_equals_unchunked_and_mean_is_batch_gradient():
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    params, buffers = dpfunc.functionalize(model)
    x, y = torch.randn(10, 5, dtype=torch.float64), torch.randint(0, 3, (10,))

    def loss_fn(p, ex):
        out = functional_call(model, (p, buffers), (ex[0].unsqueeze(0),))
        return F.cross_entropy(out, ex[1].unsqueeze(0))

    full = dpfunc.per_sample_grads(loss_fn, params, (x, y))
    for chunk in (1, 3, 10):
        chunked = dpfunc.per_sample_grads(loss_fn, params, (x, y), chunk_size=chunk)
        for k in full:
            torch.testing.assert_close(chunked[k], full[k], rtol=1e-12, atol=1e-12)
    mean_loss = F.cross_entropy(model(x), y)
    expected = torch.autograd.grad(mean_loss, list(model.parameters()))
    for got, want in zip(full.values(), expected):
        torch.testing.assert_close(got.mean(0), want, rtol=1e-10, atol=1e-12)


def test_has_aux_returns_batched_aux():
    params = {"w": torch.randn(3)}

    def loss_fn(p, x):
        out = (p["w"] * x).sum()
        return out**2, {"out": out}

    x = torch.randn(5, 3)
    grads, aux = dpfunc.per_sample_grads(loss_fn, params, x, has_aux=True)
    torch.testing.assert_close(aux["out"], x @ params["w"])
    torch.testing.assert_close(grads["w"], 2 * (x @ params["w"])[:, None] * x)


def test_bad_batches_and_losses_raise():
    params = {"w": torch.randn(3)}
    ok = lambda p, ex: (p["w"] * ex[0]).sum() + ex[1].sum()  # noqa: E731
    with pytest.raises(ValueError, match="leading dimension"):
        dpfunc.per_sample_grads(ok, params, (torch.randn(4, 3), torch.randn(5)))
    with pytest.raises(ValueError, match="0-d tensor"):
        dpfunc.per_sample_grads(lambda p, x: p["w"] * x, params, torch.randn(4, 3))
    with pytest.raises(ValueError, match="chunk_size"):
        dpfunc.per_sample_grads(ok, params, (torch.randn(4, 3), torch.randn(4)), chunk_size=0)


def test_batchnorm_is_rejected_with_its_path_and_replaced():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Sequential(nn.BatchNorm2d(8), nn.ReLU()))
    with pytest.raises(ValueError, match=r"module '1\.0' is BatchNorm2d.*replace_batchnorm"):
        dpfunc.functionalize(model)
    with pytest.warns(UserWarning) as record:
        model = dpfunc.replace_batchnorm(model)
    assert [str(w.message) for w in record] == [
        "replace_batchnorm replaced 1 BatchNorm module(s): 1.0: BatchNorm2d(8) -> GroupNorm(4, 8)"
    ]
    assert isinstance(model[1][0], nn.GroupNorm) and model[1][0].num_groups == 4
    params, _ = dpfunc.functionalize(model)
    assert list(params) == ["0.weight", "0.bias", "1.0.weight", "1.0.bias"]
    with pytest.warns(UserWarning, match=r"\(root\): BatchNorm1d\(12\) -> GroupNorm\(6, 12\)"):
        assert isinstance(dpfunc.replace_batchnorm(nn.BatchNorm1d(12)), nn.GroupNorm)


# the largest divisor g of C with g <= 32 and at least two channels per group (C // g >= 2)
GROUPS = {2: 1, 3: 1, 6: 3, 32: 16, 64: 32, 96: 32}


@pytest.mark.parametrize("channels", sorted(GROUPS))
def test_replace_batchnorm_group_counts(channels):
    with pytest.warns(UserWarning, match=rf"BatchNorm1d\({channels}\) -> GroupNorm"):
        norm = dpfunc.replace_batchnorm(nn.BatchNorm1d(channels), max_groups=32)
    assert (norm.num_groups, norm.num_channels) == (GROUPS[channels], channels)
    assert channels % norm.num_groups == 0 and channels // norm.num_groups >= 2


def test_replace_batchnorm_refuses_one_channel_and_changes_nothing():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1), nn.BatchNorm1d(1))
    with pytest.raises(ValueError, match=r"module '3' is BatchNorm1d\(1\).*two channels"):
        dpfunc.replace_batchnorm(model)
    assert isinstance(model[1], nn.BatchNorm1d)  # nothing was replaced
    with pytest.raises(ValueError, match="max_groups"):
        dpfunc.replace_batchnorm(model, max_groups=0)


def test_replaced_batchnorm_normalises_one_example_and_keeps_affine():
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(32, eps=1e-3).double()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 2.0)
        bn.bias.normal_()
    bn.bias.requires_grad_(False)
    with pytest.warns(UserWarning):
        norm = dpfunc.replace_batchnorm(bn)
    assert norm.eps == 1e-3 and norm.weight.dtype == torch.float64
    assert torch.equal(norm.weight, bn.weight) and torch.equal(norm.bias, bn.bias)
    assert norm.weight.requires_grad and not norm.bias.requires_grad
    x = torch.randn(1, 32, dtype=torch.float64)  # one example, no positions
    groups = x.reshape(1, norm.num_groups, -1)
    mean = groups.mean(-1, keepdim=True)
    var = groups.var(-1, unbiased=False, keepdim=True)
    expected = ((groups - mean) / torch.sqrt(var + 1e-3)).reshape(1, 32) * bn.weight + bn.bias
    out = norm(x)
    torch.testing.assert_close(out, expected)
    with pytest.warns(UserWarning):
        plain = dpfunc.replace_batchnorm(nn.BatchNorm1d(32))  # weight 1, bias 0
    one = plain(x.float())
    assert torch.isfinite(one).all() and (one != 0).all()
    with pytest.warns(UserWarning):
        bare = dpfunc.replace_batchnorm(nn.BatchNorm1d(32, affine=False))
    assert not bare.affine and bare.weight is None


def test_replaced_batchnorm_model_trains_per_example_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3))
    with pytest.warns(UserWarning, match=r"1: BatchNorm1d\(32\) -> GroupNorm\(16, 32\)"):
        model = dpfunc.replace_batchnorm(model)
    grads = assert_per_sample_matches_loop(model, torch.randn(B, 5), on_unsqueezed)
    assert grads["1.weight"].abs().sum() > 0
    assert_per_sample_matches_loop(model, torch.randn(1, 5), on_unsqueezed)  # a batch of one
