"""Whether a swapped layer can run cuDNN, checked on any machine.

``torch._C._select_batch_norm_backend`` picks cuDNN for CUDA input only when, among
others, weight and bias are both defined and the running statistics are both defined
(or both absent in training), the input has at least 3 dimensions and is neither
bfloat16 nor float64 (aten/src/ATen/native/Normalization.cpp). On the CPU the test
checks the arguments bnswap's core hands the consolidated ops, recorded at dispatch
(a real ``TorchDispatchMode``, the ops themselves run); on a GPU it checks the choice.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import bnswap
from bnswap import kernels

plan_module = importlib.import_module("bnswap.plan")  # bnswap.plan is the function

aten = torch.ops.aten
#: what a swapped layer's batch norm dispatches to below autograd on the CPU: the
#: consolidated op with batch statistics; with running statistics stock's
#: aten.batch_norm, which decomposes (its kernel chosen when it runs) into
#: native_batch_norm on the CPU; _batch_norm_no_update never (no kernel off the CPU)
OPS = (
    aten._batch_norm_with_update.default,
    aten.native_batch_norm.default,
    aten._batch_norm_no_update.default,
)


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in OPS:
            self.calls.append((func, args))
        return func(*args, **(kwargs or {}))


FLAGS = list(itertools.product([True, False], [True, False], [True, False], [0.1, None]))


@pytest.mark.parametrize("affine,track,training,momentum", FLAGS)
def test_the_core_hands_the_ops_what_cudnn_needs(affine, track, training, momentum):
    """Guards: an affine=False layer passing None for its bias (or weight) still runs on
    the CPU, bitwise as stock, but can never select cuDNN (and batch_norm_backward needs
    a weight): the eager parity tests cannot see it. With running statistics the layer
    makes stock's call, with its own tensors (None for affine=False, as stock)."""
    bn = bnswap.convert(
        nn.BatchNorm2d(5, affine=affine, track_running_stats=track, momentum=momentum)
    ).train(training)
    x = torch.randn(4, 5, 3, 3)
    with Recorder() as rec:
        bn(x)
    assert len(rec.calls) == 1
    func, args = rec.calls[0]
    inp, weight, bias, mean, var = args[:5]
    uses_batch_stats = training or not track
    assert func is (OPS[0] if uses_batch_stats else OPS[1])
    if not uses_batch_stats:  # stock's evaluation call, stock's arguments
        assert (weight, bias, mean, var) == (bn.weight, bn.bias, bn.running_mean, bn.running_var)
        assert args[5] is False  # training
        return
    for t in (weight, bias, mean, var):
        assert isinstance(t, torch.Tensor) and t.shape == (5,) and t.dtype == torch.float32
    if affine:
        assert weight is bn.weight and bias is bn.bias
    else:
        assert torch.equal(weight, torch.ones(5)) and torch.equal(bias, torch.zeros(5))
    if track and not (training and momentum is None):
        assert mean is bn.running_mean and var is bn.running_var
    assert inp.dim() >= 3


def test_plan_kernel_for_cuda_says_what_it_knows():
    """Guards: the check accepted "Cudnn" or "n/a" or any answer on a CUDA machine."""
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    row = bnswap.plan(model, device="cuda")[0]
    if torch.cuda.is_available():
        assert row.kernel == "Cudnn"
    else:  # torch's rule, for what the core passes
        assert row.kernel == "Cudnn (predicted)"
        # cuDNN 9 (every supported release's CUDA wheels) takes any eps >= 0.0: a small
        # eps keeps cuDNN (it said "Native (predicted)": cuDNN 7's minimum, 1e-5)
        tiny_eps = nn.Sequential(nn.BatchNorm2d(4, eps=1e-6))
        assert bnswap.plan(tiny_eps, device="cuda")[0].kernel == "Cudnn (predicted)"
        bf16 = nn.Sequential(nn.BatchNorm2d(4)).to(torch.bfloat16)
        assert bnswap.plan(bf16, device="cuda")[0].kernel == "Native (predicted)"
    assert bnswap.plan(model, device="meta")[0].kernel == "n/a (meta)"
    assert bnswap.plan(model)[0].kernel == "Native"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("affine", [True, False])
def test_swapped_layers_select_cudnn_on_a_gpu(affine):
    bn = bnswap.convert(nn.BatchNorm2d(5, affine=affine)).cuda()
    x = torch.randn(4, 5, 3, 3, device="cuda")
    with Recorder() as rec:
        bn(x)
    ((_, args),) = rec.calls
    choice = torch._C._select_batch_norm_backend(*args[:5], True, args[6])
    assert str(choice).rsplit(".", 1)[-1] == "Cudnn"


class Dispatched(TorchDispatchMode):
    """Every batch-norm op the layer dispatches (the consolidated ops, or what stock's
    ``aten.batch_norm`` becomes on this device), with its arguments."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (
            *kernels.RUN_TIME_OPS,
            *kernels.NATIVE_OPS,
            *kernels.CPU_ONLY_OPS,
        ):
            self.calls.append((func, args))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "cls, rank", [(nn.BatchNorm1d, 3), (nn.BatchNorm2d, 4), (nn.BatchNorm3d, 5)]
)
@pytest.mark.parametrize(
    "kind",
    [{}, {"affine": False}, {"track_running_stats": False}, {"dtype": torch.float64}],
    ids=["affine", "no_affine", "no_stats", "float64"],
)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_the_rule_sees_what_the_core_passes(cls, rank, kind, training):
    """Guards: the call the kernel column judges (bnswap.kernels.layer_call: op, rank,
    dtypes, weight / bias / statistics passed, training, eps) drifting from what the
    core hands the op, recorded at dispatch on the CPU (where every answer is
    "Native", so the arguments are what can be checked)."""
    layer = bnswap.convert(cls(3, eps=1e-3, **kind)).train(training)
    dtype = kind.get("dtype", torch.float32)
    op, call = kernels.layer_call(layer, training=training)
    with Dispatched() as rec:
        layer(torch.randn((2, 3) + (4,) * (rank - 2), dtype=dtype))
    ((func, args),) = rec.calls
    if func.overloadpacket is torch.ops.aten._batch_norm_no_update:
        pytest.skip("the core still runs _batch_norm_no_update in eval (issue 44)")
    x, weight, bias, mean, var = args[:5]
    if op is torch.ops.aten.batch_norm:  # CompositeImplicit: dispatched as the CPU's op
        assert func.overloadpacket is torch.ops.aten.native_batch_norm
        assert args[5] == call.training
    else:
        assert func.overloadpacket is op
    seen = kernels.Call(
        x.dim(),
        x.dtype,
        None if weight is None else weight.dtype,
        None if bias is None else bias.dtype,
        mean is not None,
        var is not None,
        call.training,
        args[-1],
        batch=2,
        numel=x.numel(),
    )
    assert dataclasses.replace(call, batch=2, numel=x.numel()) == seen
    assert call.rank == rank and call.eps == 1e-3
    assert plan_module.select_kernel(layer) == "Native"


def test_kernel_selection_without_the_selector_or_when_it_fails(monkeypatch):
    """Guards the two "n/a" answers: a torch without ``_select_batch_norm_backend``, and a
    device the probe cannot run on (the selector raising)."""
    bn = nn.BatchNorm2d(3)
    monkeypatch.delattr(torch._C, "_select_batch_norm_backend")
    assert plan_module.select_kernel(bn) == "n/a (torch too old)"
    monkeypatch.undo()

    def fails(*args):
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(torch._C, "_select_batch_norm_backend", fails)
    assert plan_module.select_kernel(bn) == "n/a (RuntimeError)"


def test_cuda_prediction_follows_torchs_rule_at_its_edges():
    """Guards the predicted rule's edges: eps at cuDNN 9's minimum (0.0) selects cuDNN,
    below it native; cuDNN disabled selects native; the layer's own dtype and eps are
    read."""
    if torch.cuda.is_available():
        pytest.skip("predictions are made only without a CUDA device")
    assert plan_module.CUDNN_BN_MIN_EPSILON == 0.0
    assert plan_module.select_kernel(nn.BatchNorm2d(4, eps=1e-5), "cuda") == "Cudnn (predicted)"
    assert plan_module.select_kernel(nn.BatchNorm2d(4, eps=9.9e-6), "cuda") == "Cudnn (predicted)"
    assert plan_module.select_kernel(nn.BatchNorm2d(4, eps=0.0), "cuda") == "Cudnn (predicted)"
    assert plan_module.select_kernel(nn.BatchNorm2d(4, eps=-1e-3), "cuda") == "Native (predicted)"
    # an affine=False layer: stand-ins in training (cuDNN), none in eval, where it calls
    # stock's aten.batch_norm(training=False) with its own (absent) weight: native (it
    # said "Cudnn (predicted)" for both modes)
    assert (
        plan_module.select_kernel(nn.BatchNorm2d(4, affine=False), "cuda")
        == "Cudnn (predicted); eval Native"
    )
    # half input takes cuDNN only with float32 parameters (torch's rule): a float16 layer
    # runs native (it said Cudnn; a fresh user's review)
    assert plan_module.select_kernel(nn.BatchNorm2d(4).half(), "cuda") == "Native (predicted)"
    # the core's stand-ins are made like the layer's running_mean (float16 here), so a
    # float16 layer without affine parameters runs native too (it said Cudnn), and a
    # float32 one fed half input (autocast) keeps cuDNN
    assert (
        plan_module.select_kernel(nn.BatchNorm2d(4, affine=False).half(), "cuda")
        == "Native (predicted)"
    )
    assert (
        plan_module.select_kernel(nn.BatchNorm2d(4, affine=False), "cuda")
        == "Cudnn (predicted); eval Native"
    )
    assert plan_module.select_kernel(nn.BatchNorm2d(4).bfloat16(), "cuda") == "Native (predicted)"
    with torch.backends.cudnn.flags(enabled=False):
        assert plan_module.select_kernel(nn.BatchNorm2d(4), "cuda") == "Native (predicted)"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_constants_of_a_layer_without_tensors_follow_the_input(dtype, device):
    """Guards the dtype and device of the ones / zeros standing in for a missing weight,
    bias and statistics (affine=False, track_running_stats=False): the input's, on every
    device (stock's kernel runs in it; a graph captured from the layer must carry no
    dtype or device of bnswap's own, issue 25). A float16 layer of this kind runs the
    native kernel on a GPU, as stock's (cuDNN wants float32 parameters for half input,
    and stock passes none). The meta device stands in for a GPU here."""
    bn = bnswap.convert(nn.BatchNorm2d(3, affine=False, track_running_stats=False))
    with Recorder() as rec:
        out = bn(torch.randn(4, 3, 2, 2, device=device).to(dtype))
    ((_, args),) = rec.calls
    assert [(a.dtype, a.device.type) for a in args[1:5]] == [(dtype, device)] * 4
    assert out.dtype == dtype and out.device.type == device


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_constants_of_a_layer_with_statistics_follow_them(dtype):
    """Guards: an affine=False layer's stand-in weight and bias take its running_mean's
    dtype and device (float32 statistics with half input: stock's mixed-dtype path, and
    cuDNN selectable on a GPU), whatever the input's dtype."""
    bn = bnswap.convert(nn.BatchNorm2d(3, affine=False).to("meta"))
    with Recorder() as rec:
        bn(torch.randn(4, 3, 2, 2, device="meta").to(dtype))
    ((_, args),) = rec.calls
    assert [(a.dtype, a.device.type) for a in args[1:3]] == [(torch.float32, "meta")] * 2


@pytest.mark.parametrize("missing", ["weight", "bias"])
def test_a_layer_missing_one_affine_tensor_still_hands_both(missing):
    """Guards: with only the bias (or only the weight) set to None, the core passed None
    for it (cuDNN needs both defined)."""
    bn = nn.BatchNorm2d(3)
    setattr(bn, missing, None)
    bn = bnswap.convert(bn)
    with Recorder() as rec:
        bn(torch.randn(4, 3, 2, 2))
    ((_, args),) = rec.calls
    weight, bias = args[1:3]
    assert isinstance(weight, torch.Tensor) and isinstance(bias, torch.Tensor)
    kept = bias if missing == "weight" else weight
    assert kept is getattr(bn, "bias" if missing == "weight" else "weight")
    fill = torch.ones(3) if missing == "weight" else torch.zeros(3)
    assert torch.equal(weight if missing == "weight" else bias, fill)


def test_batchnorm1d_kernel_names_the_input_ranks_cudnn_takes():
    """Guards: plan --device cuda said Cudnn for a BatchNorm1d, which torch runs on the
    native kernel for (N, C) input (_select_batch_norm_backend needs input.dim() >= 3)."""
    cudnn = "Cudnn (predicted)" if not torch.cuda.is_available() else "Cudnn"
    model = nn.Sequential(
        nn.BatchNorm1d(3), nn.LazyBatchNorm1d(), nn.BatchNorm2d(3), nn.BatchNorm1d(3).bfloat16()
    )
    assert [r.kernel for r in bnswap.plan(model, device="cuda")] == [
        f"{cudnn} for (N, C, L); Native for (N, C)"
    ] * 2 + [cudnn, "Native (predicted)" if not torch.cuda.is_available() else "Native"]
    if torch.cuda.is_available():  # torch's own rule, by rank
        w = torch.ones(3, device="cuda")
        z = torch.zeros(3, device="cuda")
        for shape, want in (((4, 3), "Native"), ((4, 3, 5), "Cudnn")):
            x = torch.randn(shape, device="cuda")
            got = torch._C._select_batch_norm_backend(x, w, z, z, w, True, 1e-5)
            assert str(got).rsplit(".", 1)[-1] == want
    assert bnswap.plan(nn.BatchNorm1d(3))[0].kernel == "Native"  # CPU: as before
