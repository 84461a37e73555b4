"""One prepared GPU check for bnswap (a few minutes on one H200; a dry mode without one).

    python benchmarks/gpu_check.py            # on a machine with CUDA
    python benchmarks/gpu_check.py --dry      # anywhere: the CPU and torch's Lazy device

It runs every mode of a swapped model next to stock ``nn.BatchNorm`` on the device, and
checks two things in each: bnswap's values against stock's (outputs, losses, gradients,
running statistics), and, with the torch profiler's kernel names, that the batch-norm
kernels which run are the ones torch's rule predicts (``bnswap.kernels``, ``bnswap.plan``;
issue 45). Swapped layers in evaluation make stock's own call (``aten.batch_norm``,
docs/design.md, "The evaluation op"), so their kernels there are stock's. Sections:

* ``backend``, ``graph_ops``: the backend ``torch._C._select_batch_norm_backend`` picks;
  the batch-norm ops of graphs captured on the CPU (training IR, decomposed, core ATen,
  the joint graph; and the evaluation export, stock's for both);
* ``eager``: training (two SGD steps) and evaluation (two forwards), each profiled
  (cuDNN for both models in both modes);
* ``compile_aot_eager``: the same under ``torch.compile`` with an ``aot_autograd`` backend
  that runs the captured graphs as they are (``aot_eager``'s graphs): training bnswap
  cuDNN, stock native (its ``_native_batch_norm_legit_functional`` binds the native kernel:
  ``bnswap.kernels.NATIVE_OPS``); evaluation native for both (the graphs'
  ``_native_batch_norm_legit_no_training``); ``compile_inductor``: inductor's kernels
  (its own, for both), graph breaks, and the compiled train step timed bnswap vs stock
  (interleaved pairs, median of ratios);
* ``exported``: graphs exported with ``torch.export`` / ``aot_export_module`` **on the
  CPU** and moved to the device as users move them: the decomposed forward program
  (``run_decompositions({})``, which keeps bnswap's ops) and the joint forward+backward
  train graph (bnswap cuDNN, stock native);
* ``converted_program``: a *stock* model exported on the CPU, the program given to
  ``bnswap.convert``, both moved with ``torch.export.passes.move_to_device_pass``: both
  cuDNN (stock's ``aten.batch_norm`` selects at run time: its ``cudnn_enabled=False`` is
  ignored, issue 45);
* ``moved_programs``: every ``affine`` x ``track_running_stats`` combination, train and
  eval, three programs (stock's, a converted model exported, ``bnswap.convert`` of
  stock's) moved two ways, and the joint graphs: each program's kernels against
  ``bnswap.plan``'s prediction for it, its values against stock's;
* ``predictions`` (issue 45): ``bnswap.plan``'s predictions against the profiler's kernel
  names for the AOT graphs and ``affine=False`` layers (stock's native; swapped: cuDNN
  in training, native in eval);
* ``training``: the MobileNetV2-style net trained a few hundred steps with the
  exported-on-CPU joint graph, bnswap vs stock, both loss curves against eager (cuDNN)
  training from the same weights and data;
* ``sync`` (issues 18, 28): one synchronized layer forward + backward in a one-process
  NCCL group: bnswap's layer with the device's kernels in its slots
  (``bnswap.sync.DEVICE_KERNELS``: on CUDA stock SyncBatchNorm's), the same layer on the
  portable torch ops, and torch's synchronized Function: kernel names, time per call,
  differences of outputs and input gradients; the normalization must be
  ``aten::batch_norm``;
* ``sync_two_ranks`` (issue 44): 2 spawned NCCL processes on 2 GPUs (skipped, saying so,
  with fewer), each a synchronized layer forward + backward on its share of an uneven
  global batch, then evaluation, against one process's stock BatchNorm on the global
  batch; the processes are killed after a timeout (a hung collective cannot hang the
  script);
* ``qat_pt2e`` (issue 31): stock's and bnswap's nets exported on the CPU,
  ``prepare_qat_pt2e`` (torchao, XNNPACK's quantizer), the prepared graphs trained on the
  device: both are stock's graph (bnswap's torchao patch hands torchao stock's ops and
  puts nothing back), each graph's kernels against ``bnswap.plan``'s prediction, losses
  and time per step side by side;
* ``fsdp2_bf16``: FSDP2 with ``param_dtype=torch.bfloat16`` on a one-rank process group:
  stock raises, bnswap's step runs the native kernel (bfloat16 input: torch's rule), its
  output equals stock's on float32 weights.

**Dry mode** (``--dry``, or no CUDA): the same code on torch's **Lazy device**
(``torch._lazy``'s TorchScript backend, in every wheel) where the GPU run uses CUDA: a
device other than the CPU whose dispatch of the batch-norm ops is CUDA's, so a shared
kernel that calls CPU code raises there as on a GPU (how ``aten._batch_norm_no_update``
failed every swapped layer's evaluation off the CPU; the meta device, used before, never
reaches kernels). Models and moved graphs run there and their values are compared with
stock's on the CPU (the Lazy device drops stock ``native_batch_norm``'s running-statistics
update in some graphs: no reference for stock; see ``Check.ref_device``); compiled graphs
run there through the same ``aot_autograd`` backend; the 2-process synchronized check runs
its code with gloo on the CPU; the rest (``predictions``, ``training``, ``sync``,
``qat_pt2e``, ``fsdp2_bf16``) on the CPU with small shapes; kernel names need CUDA, so
the aten ops that ran are recorded instead. The Lazy device's limit: ops it cannot lower
run on the CPU (its eager fallback), so it catches kernels that call CPU code, not a
missing CUDA kernel (tests/test_devices.py checks a CUDA build's dispatch table for
those). ``--rehearse`` also runs the GPU-only section (inductor) on the CPU.

Fails loudly: every section reports its own failure (an ``[ERROR]`` line, its traceback
on stderr and in the JSON), a section that cannot run here says why (``[SKIP ]``), and the
script ends with ``ALL OK`` (exit 0) or ``PROBLEMS:`` naming the sections (exit 1). It
always writes its JSON: ``--json PATH``, else ``$OUT/gpu.json`` when ``$OUT`` is set,
else ``benchmarks/results/gpu.json`` (``gpu_dry.json`` in dry mode).

Needs only torch (with the consolidated batch-norm ops, torch >= 2.4) and this
repository's ``bnswap`` package; no Lightning, no scikit-learn (the training data is
synthetic).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(ROOT, "build", "inductor-cache"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import bnswap  # noqa: E402
import bnswap.kernels  # noqa: E402

T0 = time.perf_counter()


# ----------------------------------------------------------------------------- nets
def _nets() -> dict[str, Callable[[], nn.Module]]:
    """The networks of ``bnswap.app.models`` on 3-channel input, 10 classes (the MobileNetV2 is
    the main job's, width 1.0)."""
    from bnswap.app.models import ConvNet4, MobileNetV2

    return {
        "convnet4": lambda: ConvNet4(num_classes=10, in_channels=3),
        "mobilenetv2": lambda: MobileNetV2(num_classes=10, in_channels=3),
    }


# -------------------------------------------------------------------- kernel names
_CUDNN_BN = re.compile(r"bn_fw|bn_bw|batchnorm|cudnn.*batch_?norm|batch_?norm.*cudnn", re.I)
_NATIVE_BN = re.compile(r"batch_norm|welford", re.I)
_ATEN_CUDNN = {
    "aten::cudnn_batch_norm",
    "aten::cudnn_batch_norm_backward",
    "aten::miopen_batch_norm",
    "aten::miopen_batch_norm_backward",
}


def classify_kernel(name: str) -> str | None:
    """'cudnn', 'native', 'triton' for a batch-norm-looking GPU kernel name, else None.

    inductor names its kernels after the aten ops they fuse
    (``triton_red_fused__native_batch_norm_legit_functional_0``): those are 'triton'."""
    if name.startswith("triton_"):
        return "triton" if re.search(r"batch_norm", name) else None
    if _CUDNN_BN.search(name):
        return "cudnn"
    if _NATIVE_BN.search(name):
        return "native"
    return None


def profile_names(fn: Callable[[], object], device: str, all_kernels: bool = False) -> dict:
    """Run ``fn`` once under the profiler; the batch-norm aten ops and GPU kernels seen
    (``all_kernels``: also every GPU kernel name, as ``gpu_kernels``). On the Lazy device
    the traced graph runs (``mark_step``) inside the profiled span."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if device == "cuda":
        acts.append(ProfilerActivity.CUDA)
    with profile(activities=acts) as prof:
        fn()
        _sync(device)
    ops: set[str] = set()
    kernels: dict[str, set[str]] = {"cudnn": set(), "native": set(), "triton": set()}
    every: set[str] = set()
    n_gpu = 0
    for e in prof.events():
        name = e.name
        on_gpu = str(getattr(e, "device_type", "")).endswith("CUDA")
        if on_gpu:
            n_gpu += 1
            every.add(name[:120])
            kind = classify_kernel(name)
            if kind:
                kernels[kind].add(name)
        elif "batch_norm" in name and name.startswith("aten::"):
            ops.add(name)
    # fall back on the aten ops the CPU side dispatched to
    if device == "cuda" and not (kernels["cudnn"] or kernels["native"]) and ops & _ATEN_CUDNN:
        kernels["cudnn"].add("(from aten ops) " + ", ".join(sorted(ops & _ATEN_CUDNN)))
    kinds = sorted(k for k, v in kernels.items() if v)
    out = {
        "aten_ops": sorted(ops),
        "bn_kernels": {k: sorted(v)[:6] for k, v in kernels.items() if v},
        "kinds": kinds,
        "gpu_events": n_gpu,
    }
    if all_kernels:
        out["gpu_kernels"] = sorted(every)[:40]
    return out


# ------------------------------------------------------------------------ helpers
def _pair(factory, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """(bnswap, stock) with identical initial weights, in train mode, on the CPU."""
    torch.manual_seed(seed)
    stock = factory().train()
    return bnswap.convert(copy.deepcopy(stock)), stock


def _batch(n: int, hw: int, device: str, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, 3, hw, hw, generator=g).to(device),
        torch.randint(0, 10, (n,), generator=g).to(device),
    )


def _sync(device: str) -> None:
    """Wait for the device: CUDA's queue, or the Lazy device's traced graph run
    (``torch._lazy.mark_step``)."""
    if device == "cuda":
        torch.cuda.synchronize()
    elif device == "lazy":
        torch._lazy.mark_step()


_LAZY: list[str] = []


def lazy_device() -> str:
    """torch's Lazy device (its TorchScript backend, in every torch wheel), initialized
    once: ``"lazy"``. The dry mode's device other than the CPU: its dispatch of the
    batch-norm ops is CUDA's (a kernel registered for the CPU alone is not reached; a
    shared kernel that calls CPU code raises there as on a GPU: how
    ``aten._batch_norm_no_update`` fails off the CPU, docs/design.md, "The evaluation
    op"), and it computes real values. Its limit: ops it cannot lower run on the CPU (its
    eager fallback), so a missing CUDA kernel shows on a GPU only."""
    if not _LAZY:
        import torch._lazy
        import torch._lazy.ts_backend

        torch._lazy.ts_backend.init()
        _LAZY.append("lazy")
    return _LAZY[0]


def max_abs_diff(a: torch.Tensor | Sequence | dict, b: torch.Tensor | Sequence | dict) -> float:
    """The largest ``|a - b|`` over two tensors, two equally long sequences of tensors or
    two state dicts with the same keys, in float64 on the CPU (``inf`` where the count, a
    shape or a dtype differs; ``nan`` where either holds one). Moving a Lazy tensor to
    the CPU runs its graph."""
    if isinstance(a, dict) or isinstance(b, dict):  # state dicts: the same keys
        if not (isinstance(a, dict) and isinstance(b, dict)) or list(a) != list(b):
            return float("inf")
        a, b = list(a.values()), list(b.values())
    xs = [a] if isinstance(a, torch.Tensor) else list(a)
    ys = [b] if isinstance(b, torch.Tensor) else list(b)
    if len(xs) != len(ys):
        return float("inf")
    worst = 0.0
    for u, v in zip(xs, ys, strict=True):
        u, v = u.detach().cpu(), v.detach().cpu()
        if u.shape != v.shape or u.dtype != v.dtype:
            return float("inf")
        if u.numel():
            d = float((u.double() - v.double()).abs().max())
            if d != d:
                return d
            worst = max(worst, d)
    return worst


class Skipped(Exception):
    """A section that cannot run here (its status says why; not a failure)."""


def _eager_step(model: nn.Module, x, y, forward=None, lr: float = 0.05) -> Callable[[], float]:
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    fwd = forward if forward is not None else model

    def step():
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(fwd(x), y)
        loss.backward()
        opt.step()
        return loss

    return step


class _Loss(nn.Module):
    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x, y):
        return (F.cross_entropy(self.net(x), y),)


_JOINT_CACHE: dict = {}


def _bn_ops(graph) -> list[str]:
    """The batch-norm ops an fx graph calls, sorted."""
    return sorted(
        {
            str(n.target)
            for n in graph.nodes
            if n.op == "call_function" and "batch_norm" in str(n.target)
        }
    )


#: bnswap.kernels' kernel names as the profiler's kinds (classify_kernel)
_KIND = {"Cudnn": "cudnn", "Native": "native", "Miopen": "miopen"}


def kind_of(kernel: str) -> str:
    """The profiler kind a plan's kernel cell predicts (``"Cudnn (predicted)"`` ->
    ``"cudnn"``; ``"CPU only (no CUDA kernel)"`` -> ``"cpu only"``: no CUDA kernel)."""
    return _KIND.get(kernel.split(" ")[0], kernel.split(" (")[0].lower())


def predicted_kinds(program) -> list[str]:
    """The kernel kinds ``bnswap.plan(program, device="cuda")`` predicts for the
    batch-norm nodes of ``program`` (an ExportedProgram or a GraphModule) as they are
    (``kernel_before``), sorted: what the profiler should see when it runs on CUDA."""
    return sorted({kind_of(r.kernel_before) for r in bnswap.plan(program, device="cuda")})


def joint_export(model: nn.Module, x_cpu, y_cpu, key=None):
    """``aot_export_module(trace_joint=True)`` of cross_entropy(model(x), y) on the CPU:
    (graph module, graph signature, batch-norm ops in it); cached under ``key``."""
    from torch._functorch.aot_autograd import aot_export_module

    if key is not None and key in _JOINT_CACHE:
        return _JOINT_CACHE[key]
    gm, sig = aot_export_module(
        _Loss(copy.deepcopy(model)).train(), (x_cpu, y_cpu), trace_joint=True, output_loss_index=0
    )
    ops = _bn_ops(gm.graph)
    if key is not None:
        _JOINT_CACHE[key] = (gm, sig, ops)
    return gm, sig, ops


class JointStep:
    """A train step that runs a joint forward+backward graph exported on the CPU with
    ``aot_export_module(trace_joint=True)`` (see :func:`joint_export`), moved to
    ``device``, on a copy of ``model``'s parameters and buffers; SGD with momentum."""

    def __init__(self, model: nn.Module, x_cpu, y_cpu, device: str, lr: float = 0.05, key=None):
        gm, sig, self.ops = joint_export(model, x_cpu, y_cpu, key)
        self.gm = copy.deepcopy(gm).to(device)  # as a user moves a graph module
        wrapper = _Loss(model)
        named_p = dict(wrapper.named_parameters())
        named_b = dict(wrapper.named_buffers())
        self.params = [named_p[n].detach().to(device).clone() for n in sig.parameters]
        self.buffers = [named_b[n].detach().to(device).clone() for n in sig.buffers]
        self.pnames, self.bnames = list(sig.parameters), list(sig.buffers)
        out_node = next(n for n in gm.graph.nodes if n.op == "output")
        outs = [str(a) for a in out_node.args[0]]
        grads = sig.backward_signature.gradients_to_parameters
        self.layout = []  # per output: ("buffer", index) / ("loss", None) / ("grad", index)
        for o in outs:
            if o in sig.buffers_to_mutate:
                self.layout.append(("buffer", self.bnames.index(sig.buffers_to_mutate[o])))
            elif o in grads:
                self.layout.append(("grad", self.pnames.index(grads[o])))
            elif o in sig.user_outputs:
                self.layout.append(("loss", None))
            else:
                self.layout.append(("other", None))
        if sum(k == "grad" for k, _ in self.layout) != len(self.params):
            raise RuntimeError("joint graph: not one gradient output per parameter")
        self.opt = torch.optim.SGD(self.params, lr=lr, momentum=0.9)

    def step(self, x, y):
        outs = self.gm(*self.params, *self.buffers, x, y)
        loss = None
        with torch.no_grad():
            for (kind, i), t in zip(self.layout, outs, strict=False):
                if kind == "buffer":
                    self.buffers[i].copy_(t)
                elif kind == "grad":
                    self.params[i].grad = t
                elif kind == "loss":
                    loss = t
        self.opt.step()
        return loss


def graphs_on(target: str, home: str, graphs: list, ran_on: set[str]):
    """An ``aot_autograd`` backend for ``torch.compile`` that keeps the forward and
    backward graphs it is given (in ``graphs``) and runs each as it is on ``target``:
    inputs moved there, outputs moved back to ``home``, where the model lives, and the
    device they were computed on added to ``ran_on``. On CUDA (``target == home``) it is
    ``aot_eager``; in dry mode the graphs dynamo captured with CPU tensors run on the
    Lazy device op for op."""
    import contextlib

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch.utils._python_dispatch import _disable_current_modes

    def compiler(gm, _example_inputs):
        graphs.append(gm)

        def run(*args):
            # Moved off the model's device, the graph runs without the Python dispatch
            # modes of the call (AOT's first call checks custom ops' aliasing in one,
            # torch >= 2.10: none here; its re-dispatch of a view op on a Lazy tensor
            # misses the Lazy device's functionalization and raises).
            with _disable_current_modes() if target != home else contextlib.nullcontext():
                outs = gm(*(a.to(target) if isinstance(a, torch.Tensor) else a for a in args))
            if target != home:
                _sync(target)
            ran_on.update(o.device.type for o in outs if isinstance(o, torch.Tensor))
            return type(outs)(o.to(home) if isinstance(o, torch.Tensor) else o for o in outs)

        return make_boxed_func(run)

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)


def _time_pairs(fa, fb, pairs: int, inner: int, device: str) -> dict:
    for _ in range(2):
        fa()
        fb()
    _sync(device)
    ta, tb = [], []
    for _ in range(pairs):
        for f, acc in ((fa, ta), (fb, tb)):
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(inner):
                f()
            _sync(device)
            acc.append((time.perf_counter() - t0) / inner)
    ratios = sorted(a / b for a, b in zip(ta, tb, strict=True))
    return {
        "bnswap_ms": statistics.median(ta) * 1e3,
        "stock_ms": statistics.median(tb) * 1e3,
        "ratio_median": statistics.median(ratios),
        "ratio_range": [ratios[0], ratios[-1]],
        "pairs": pairs,
        "inner": inner,
    }


#: Seconds a collective of the 2-process check waits for the other rank before it raises,
#: and seconds the processes get in all (spawn, import, one step) before they are killed.
SYNC_COLLECTIVE_TIMEOUT_S = 30
SYNC_PROCESS_TIMEOUT_S = 150


def sync_rank(
    rank: int, world: int, backend: str, init_file: str, data_file: str, out_dir: str
) -> None:
    """One rank of :meth:`Check.sync_two_ranks` (a spawned process): a synchronized layer
    (``bnswap.convert(nn.SyncBatchNorm(C))``) on ``cuda:<rank>`` (NCCL) or the CPU (gloo),
    one training forward + backward of this rank's share of the global batch under the
    profiler, then an evaluation forward; its output, gradients, state and aten ops saved
    to ``out_dir/rank<rank>.pt``, or its traceback to ``rank<rank>.err``."""
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        cuda = backend == "nccl"
        if cuda:
            torch.cuda.set_device(rank)
        device = f"cuda:{rank}" if cuda else "cpu"
        dist.init_process_group(
            backend,
            init_method="file://" + init_file,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=SYNC_COLLECTIVE_TIMEOUT_S),
        )
        try:
            d = torch.load(data_file)
            lo, hi = d["bounds"][rank], d["bounds"][rank + 1]
            layer = bnswap.convert(nn.SyncBatchNorm(d["channels"]))
            layer.load_state_dict(d["state"])
            layer.to(device).train()
            x = d["x"][lo:hi].to(device).requires_grad_(True)
            dy = d["dy"][lo:hi].to(device)
            outs: list = []

            def step() -> None:
                out = layer(x)
                out.backward(dy)
                outs.append(out.detach())

            prof = profile_names(step, "cuda" if cuda else "cpu")
            layer.eval()
            with torch.no_grad():
                eval_out = layer(d["x_eval"][lo:hi].to(device))
            assert layer.weight.grad is not None and layer.bias.grad is not None
            torch.save(
                {
                    "device": str(outs[0].device),
                    "out": outs[0].cpu(),
                    "grad_input": x.grad.cpu(),
                    "grad_weight": layer.weight.grad.cpu(),
                    "grad_bias": layer.bias.grad.cpu(),
                    "state": {k: v.cpu() for k, v in layer.state_dict().items()},
                    "eval_out": eval_out.cpu(),
                    "profile": prof,
                },
                os.path.join(out_dir, f"rank{rank}.pt"),
            )
        finally:
            dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def run_ranks(target: Callable, args: tuple, world: int, timeout_s: float) -> list[int]:
    """Start ``world`` spawned processes ``target(rank, *args)`` and wait for them at most
    ``timeout_s`` seconds in all; a process still running then (a hung collective) is
    killed. Returns the exit codes; raises TimeoutError naming the ranks killed."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, *args), daemon=True) for r in range(world)]
    deadline = time.perf_counter() + timeout_s
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(max(0.0, deadline - time.perf_counter()))
    finally:
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    if hung:
        raise TimeoutError(
            f"rank(s) {hung} of {world} still running after {timeout_s:.0f} s: killed "
            "(a collective that never completed?)"
        )
    return [p.exitcode if p.exitcode is not None else -1 for p in procs]


# ---------------------------------------------------------------------- sections
class Check:
    def __init__(self, dry: bool, device: str, quick: bool, net: str | None):
        self.dry, self.device, self.quick = dry, device, quick
        self.nets = _nets()
        # The GPU run uses the main job's net and the shapes; dry mode the small
        # conv net on small inputs (the same code paths, fast on a CPU).
        self.net = net or ("convnet4" if dry else "mobilenetv2")
        self.shape = (8, 16) if dry else (32, 64 if self.net == "mobilenetv2" else 32)
        self.compile_shape = (8, 16) if dry else (32, 32)
        # Where models, and graphs captured on the CPU, run: the GPU, or in dry mode torch's
        # Lazy device (the same moves and code; a kernel that calls CPU code, or a tensor
        # left on the CPU, fails there).
        self.target = "lazy" if dry else device
        # bnswap's values against the reference's: in dry mode the same CPU kernels run
        # (through the Lazy device's TorchScript backend; measured: max |d| <= 2e-6); on a
        # GPU cuDNN and native kernels round differently
        self.tol = 1e-5 if dry else 1e-3
        # The reference bnswap's values are held to: stock's on the same device on CUDA;
        # in dry mode stock's on the CPU. The Lazy device is no reference for stock's
        # training: its native_batch_norm (stock's training kernel there) drops the
        # running-statistics update in some graphs (measured: a stock layer's
        # running_mean stays 0 there when its output is not used, and stock's exported
        # training program moved there leaves its statistics as they were), while
        # bnswap's consolidated op updates them there.
        self.ref_device = "cpu" if dry else device
        self._ep: dict = {}

    def _target(self) -> str:
        """The target device, ready (the Lazy device initialized in dry mode)."""
        return lazy_device() if self.target == "lazy" else self.target

    def _export(self, variant: str, model: nn.Module, x_cpu) -> torch.export.ExportedProgram:
        if variant not in self._ep:
            self._ep[variant] = torch.export.export(model, (x_cpu,))
        return self._ep[variant]

    def _joint_key(self, variant: str):
        return (self.net, variant, self.shape)

    def backend(self) -> dict:
        from bnswap.plan import select_kernel

        layer = bnswap.convert(nn.BatchNorm2d(16))
        out = {"cpu": select_kernel(layer, "cpu")}
        if torch.cuda.is_available():
            out["cuda"] = select_kernel(layer.to("cuda"), "cuda")
        else:
            out["cuda"] = "skipped: no CUDA device"
        out["ok"] = out["cpu"] == "Native" and (out["cuda"] in ("Cudnn", "Miopen") or self.dry)
        return out

    def graph_ops(self) -> dict:
        """Batch-norm ops in graphs captured on the CPU, bnswap vs stock: in training
        (consolidated ops for bnswap) and in evaluation (``export_eval``: stock's
        ``aten.batch_norm`` for both, docs/design.md, "The evaluation op")."""
        a, b = _pair(self.nets[self.net])
        n, hw = self.shape
        x, y = _batch(n, hw, "cpu")
        out: dict = {"net": self.net}
        for name, m in (("bnswap", a), ("stock", b)):
            ep = self._export(name, m, x)
            _, _, joint_ops = joint_export(m, x, y, self._joint_key(name))
            out[name] = {
                "export": _bn_ops(ep.graph),
                "export_decomposed": _bn_ops(ep.run_decompositions({}).graph),
                "export_core_aten": _bn_ops(ep.run_decompositions().graph),
                "joint": joint_ops,
                "export_eval": _bn_ops(torch.export.export(copy.deepcopy(m).eval(), (x,)).graph),
            }
        bn, st = out["bnswap"], out["stock"]
        out["ok"] = (
            # evaluation: stock's program (aten.batch_norm in torch >= 2.5's export)
            bool(st["export_eval"])
            and bn["export_eval"] == st["export_eval"]
            and any("_batch_norm_with_update" in o for o in bn["export"])
            and any("_batch_norm_with_update_functional" in o for o in bn["export_decomposed"])
            and any("aten.batch_norm_backward" in o for o in bn["joint"])
            and not any("native_batch_norm" in o for o in bn["export_decomposed"] + bn["joint"])
            and any("_native_batch_norm_legit_functional" in o for o in st["export_decomposed"])
            and any("native_batch_norm_backward" in o for o in st["joint"])
            and bn["export_core_aten"] == st["export_core_aten"]
        )  # core ATen: stock's ops
        return out

    def _profile_pair(
        self, net: str, shape: tuple[int, int], compile_backend: str | None, res: dict
    ) -> dict:
        """One warmed-up train step of the bnswap and the stock model of ``net``, each
        under the profiler; with ``compile_backend``, under ``torch.compile`` with it, and
        the first (compiling) step's time and dynamo's graph breaks are recorded too.
        Returns the two step functions."""
        import torch._dynamo
        from torch._dynamo.utils import counters

        a, b = _pair(self.nets[net])
        x, y = _batch(*shape, self.device)
        steps = {}
        if compile_backend is not None:
            torch._dynamo.reset()  # once: a reset between them would drop bnswap's graphs
        for name, m in (("bnswap", a), ("stock", b)):
            m.to(self.device)
            forward = None
            if compile_backend is not None:
                counters.clear()
                forward = torch.compile(m, backend=compile_backend)
            step = _eager_step(m, x, y, forward=forward)
            t0 = time.perf_counter()
            step()
            _sync(self.device)
            if compile_backend is not None:
                res[f"first_step_s_{name}"] = round(time.perf_counter() - t0, 1)
                res[f"graph_breaks_{name}"] = sum(counters["graph_break"].values())
            res[name] = profile_names(step, self.device)
            steps[name] = step
        return steps

    def _layer_kinds(self, model: nn.Module, swapped: bool, training: bool) -> list[str]:
        """The kernel kinds torch's rule (``bnswap.kernels.layer_kernel``) predicts on CUDA
        for the batch-norm layers of ``model`` in one mode, sorted."""
        return sorted(
            {
                kind_of(bnswap.kernels.layer_kernel(m, "cuda", swapped=swapped, training=training))
                for m in model.modules()
                if isinstance(m, nn.modules.batchnorm._BatchNorm)
            }
        )

    def _modes(self, net: str, shape: tuple[int, int], compiled: bool) -> dict:
        """Both modes of the bnswap and the stock model of ``net`` on the target device:
        training (two SGD steps; the second profiled) then evaluation (two forwards; the
        second profiled). ``compiled``: under ``torch.compile`` with an ``aot_autograd``
        backend that runs the captured forward and backward graphs as they are on the
        target (:func:`graphs_on`; on CUDA, ``aot_eager``'s graphs; in dry mode the model
        stays on the CPU, where dynamo traces it, and its graphs run on the Lazy device).
        Per mode and model: the batch-norm aten ops and kernels that ran, where they ran,
        and what torch's rule predicts (``bnswap.kernels``; the graphs' predictions by
        ``bnswap.plan``); bnswap's losses, state after training and evaluation outputs
        against the reference's (``vs_stock``, max |d|: stock's on the reference device,
        :attr:`ref_device`; in dry mode also stock's on the Lazy device against it,
        ``stock_vs_reference``, for information)."""
        target = self._target()
        a, b = _pair(self.nets[net])
        x_cpu, y_cpu = _batch(*shape, "cpu")
        res: dict = {"net": net, "ran_on_expected": target, "train": {}, "eval": {}}
        values: dict = {}
        runs = [("bnswap", a, target), ("stock", b, target)]
        if self.ref_device != target:
            runs.append(("reference", copy.deepcopy(b), self.ref_device))
        if compiled:
            torch._dynamo.reset()  # once: a reset between them would drop bnswap's graphs
        for name, m, device in runs:
            home = self.device if compiled else device  # compiled: where dynamo traces it
            x, y = x_cpu.to(home), y_cpu.to(home)
            m.to(home)
            graphs: list = []
            ran_on: set[str] = set()
            fwd = m
            if compiled:
                fwd = torch.compile(m, backend=graphs_on(device, home, graphs, ran_on))
            step = _eager_step(m, x, y, forward=fwd)
            losses: list = []
            outs: list = []

            def train(step=step, losses=losses) -> None:
                losses.append(step().detach())

            def evaluate(fwd=fwd, outs=outs, x=x) -> None:
                with torch.no_grad():
                    outs.append(fwd(x))

            for mode, fn in (("train", train), ("eval", evaluate)):
                m.train(mode == "train")
                n_graphs = len(graphs)
                ran_on.clear()
                fn()
                _sync(device)
                if name == "reference":
                    fn()
                else:
                    r = profile_names(fn, device)
                    last = (losses if mode == "train" else outs)[-1]
                    r["ran_on"] = sorted(ran_on) if compiled else [last.device.type]
                    r["predicted"] = (
                        sorted({k for gm in graphs[n_graphs:] for k in predicted_kinds(gm)})
                        if compiled
                        else self._layer_kinds(m, name == "bnswap", mode == "train")
                    )
                    res[mode][name] = r
                if mode == "train":
                    values[name] = {"losses": losses, "state": m.state_dict()}
            values[name]["eval_outputs"] = outs
        ref = values["reference" if "reference" in values else "stock"]
        res["vs_stock"] = {k: max_abs_diff(values["bnswap"][k], v) for k, v in ref.items()}
        if "reference" in values:
            res["stock_vs_reference"] = {
                k: max_abs_diff(values["stock"][k], v) for k, v in ref.items()
            }
        cases = [res[mode][name] for mode in ("train", "eval") for name in ("bnswap", "stock")]
        values_ok = self._values_ok(res["vs_stock"])
        if target == "cuda":
            res["ok"] = values_ok and all(r["kinds"] == r["predicted"] for r in cases)
        else:
            res["ok"] = values_ok and all(r["ran_on"] == [target] for r in cases)
            res["note"] = (
                "kernel names need CUDA: ran on the Lazy device, values against stock's on the CPU"
            )
        return res

    def eager(self) -> dict:
        """Eager mode, training and evaluation (:meth:`_modes`): on CUDA cuDNN for both
        models in both modes (torch's rule: bnswap's evaluation is stock's call)."""
        return self._modes(self.net, self.shape, compiled=False)

    def compile_aot_eager(self) -> dict:
        """``torch.compile``'s AOT graphs, training and evaluation (:meth:`_modes`): on
        CUDA bnswap cuDNN in training (its consolidated op), stock native (its graph's
        ``_native_batch_norm_legit_functional``, bound to it: ``bnswap.kernels.NATIVE_OPS``);
        in evaluation both native (``_native_batch_norm_legit_no_training``, the
        decomposition's)."""
        res = self._modes("convnet4", self.compile_shape, compiled=True)
        torch._dynamo.reset()
        return res

    def compile_inductor(self) -> dict:
        """Kernels and timing of the inductor-compiled train step (GPU only)."""
        res: dict = {}
        steps = self._profile_pair("convnet4", self.compile_shape, "inductor", res)
        res["timing"] = _time_pairs(
            steps["bnswap"],
            steps["stock"],
            pairs=5 if self.quick else 30,
            inner=5,
            device=self.device,
        )
        res["ok"] = res["graph_breaks_bnswap"] == 0
        res["note"] = (
            "inductor generates its own (triton) normalization kernels for both; "
            "bnswap / stock time ratio in 'timing'"
        )
        torch._dynamo.reset()
        return res

    def _profile_on_target(self, fn: Callable[[], object]) -> dict:
        """``fn`` once under the profiler on the target device (on the Lazy device: the
        aten ops traced and run, no kernel names)."""
        return profile_names(fn, self.target)

    def _expect_moved(
        self,
        res: dict,
        keys: tuple[str, ...] = ("bnswap", "stock"),
        predicted: dict[str, list[str]] | None = None,
    ) -> None:
        """``res[k]["kinds"]`` against the kinds ``bnswap.plan`` predicts per key on CUDA
        (``predicted``, :func:`predicted_kinds`); on the Lazy device (dry) each moved
        graph must have run there. (Values: the caller's ``vs_stock``.)"""
        if predicted is not None:
            res["predicted"] = predicted
        if self.target != "cuda":
            res["ok"] = all(res[k].get("ran_on") == self.target for k in keys)
            res["note"] = "kernel names need CUDA; the graphs were moved to the Lazy device"
            return
        res["expected"] = predicted
        res["ok"] = predicted is not None and all(res[k]["kinds"] == predicted[k] for k in keys)

    def _values_ok(self, diffs: dict) -> bool:
        return all(d <= self.tol for d in diffs.values())

    def _compare(self, res: dict, vals: dict, ref: dict, stock: dict | None) -> bool:
        """``res["vs_stock"]``: bnswap's values ``vals`` against the reference's ``ref``
        (max |d| per key); in dry mode ``res["stock_vs_reference"]``: stock's on the Lazy
        device against it, for information (:attr:`ref_device`). True when bnswap's are
        within the tolerance."""
        res["vs_stock"] = {k: max_abs_diff(vals[k], v) for k, v in ref.items()}
        if stock is not None and stock is not ref:
            res["stock_vs_reference"] = {k: max_abs_diff(stock[k], v) for k, v in ref.items()}
        return self._values_ok(res["vs_stock"])

    def exported(self) -> dict:
        """Graphs captured on the CPU, moved to the target device as a user moves them
        (``ep.module().to(device)``, ``graph_module.to(device)``), run and profiled there
        in training: the decomposed forward program (``run_decompositions({})``, which
        keeps bnswap's ops; two forwards) and the joint forward + backward graph
        (``aot_export_module(trace_joint=True)``, two SGD steps). Each graph's kernels
        against ``bnswap.plan``'s prediction for it (bnswap cuDNN, stock native); bnswap's
        outputs, losses and state against the reference's (stock's graphs on
        :attr:`ref_device`: ``vs_stock``)."""
        target = self._target()
        a, b = _pair(self.nets[self.net])
        n, hw = self.shape
        x_cpu, y_cpu = _batch(n, hw, "cpu")
        res: dict = {"net": self.net, "moved_to": target, "forward_decomposed": {}, "joint": {}}
        predicted: dict = {"forward_decomposed": {}, "joint": {}}
        vals: dict = {}
        runs = [("bnswap", a, target), ("stock", b, target)]
        if self.ref_device != target:
            runs.append(("reference", b, self.ref_device))
        for name, m, device in runs:
            x, y = x_cpu.to(device), y_cpu.to(device)
            # a fresh program: moving its module moves the program's own state too
            ep = torch.export.export(copy.deepcopy(m), (x_cpu,)).run_decompositions({})
            fwd = ep.module().to(device)  # bnswap's ops kept by the empty table
            js = JointStep(
                m, x_cpu, y_cpu, device, key=self._joint_key("bnswap" if m is a else "stock")
            )
            outs: list = []
            losses: list = []
            with torch.no_grad():
                outs.append(fwd(x))
            losses.append(js.step(x, y))
            if name == "reference":
                with torch.no_grad():
                    outs.append(fwd(x))
                losses.append(js.step(x, y))
            else:
                predicted["forward_decomposed"][name] = predicted_kinds(ep)
                predicted["joint"][name] = predicted_kinds(
                    joint_export(m, x_cpu, y_cpu, self._joint_key(name))[0]
                )
                with torch.no_grad():
                    r = self._profile_on_target(lambda fwd=fwd, outs=outs, x=x: outs.append(fwd(x)))
                r["ran_on"] = outs[-1].device.type
                res["forward_decomposed"][name] = r
                r = self._profile_on_target(
                    lambda js=js, losses=losses, x=x, y=y: losses.append(js.step(x, y))
                )
                r["ran_on"] = losses[-1].device.type
                r["graph_ops"] = js.ops
                res["joint"][name] = r
            vals[name] = {
                "forward_outputs": outs,
                "forward_state": fwd.state_dict(),
                "joint_losses": losses,
                "joint_state": js.params + js.buffers,
            }
        for part in ("forward_decomposed", "joint"):
            self._expect_moved(res[part], predicted=predicted[part])
        values_ok = self._compare(
            res, vals["bnswap"], vals.get("reference", vals["stock"]), vals["stock"]
        )
        res["ok"] = res["forward_decomposed"]["ok"] and res["joint"]["ok"] and values_ok
        return res

    def converted_program(self) -> dict:
        """A stock model exported on the CPU (training), ``bnswap.convert`` of the program,
        both moved to the target device with ``torch.export.passes.move_to_device_pass``;
        two training forwards of each, the second under the profiler; its kernels against
        ``bnswap.plan``'s prediction (both cuDNN: stock's ``aten.batch_norm`` selects at
        run time, issue 45), the converted program's outputs and state against the
        reference's (the original program on :attr:`ref_device`: ``vs_stock``). On the
        CPU (dry) the two programs also agree bitwise before they move."""
        from torch.export.passes import move_to_device_pass

        target = self._target()
        _, stock = _pair(self.nets[self.net])
        n, hw = self.shape
        x_cpu, _ = _batch(n, hw, "cpu")
        original = torch.export.export(stock, (x_cpu,))
        converted = bnswap.convert(original)  # a new program; the original unchanged
        res: dict = {
            "net": self.net,
            "moved_to": target,
            "graph_ops": {"stock": _bn_ops(original.graph), "bnswap": _bn_ops(converted.graph)},
        }
        # training: the consolidated op (evaluation would keep stock's aten.batch_norm)
        ops_ok = res["graph_ops"]["stock"] == ["aten.batch_norm.default"] and res["graph_ops"][
            "bnswap"
        ] == ["aten._batch_norm_with_update.default"]
        vals: dict = {}
        if self.dry:  # the same CPU kernel: bitwise, outputs and statistics
            a, b = copy.deepcopy(original.module()), copy.deepcopy(converted.module())
            outs = [a(x_cpu) for _ in range(2)]
            res["bitwise_equal_on_cpu"] = all(torch.equal(o, b(x_cpu)) for o in outs) and all(
                torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items()
            )
            ops_ok = ops_ok and res["bitwise_equal_on_cpu"]
            vals["reference"] = {"outputs": outs, "state": a.state_dict()}
        x = x_cpu.to(target)
        for name, prog in (("bnswap", converted), ("stock", original)):
            run = move_to_device_pass(prog, target).module()
            outs = [run(x)]
            res[name] = self._profile_on_target(lambda run=run, outs=outs: outs.append(run(x)))
            res[name]["ran_on"] = outs[-1].device.type
            vals[name] = {"outputs": outs, "state": run.state_dict()}
        # stock's exported aten.batch_norm selects at run time (its cudnn_enabled=False is
        # ignored): cuDNN as the converted program's op, by torch's rule (issue 45)
        predicted = {"bnswap": predicted_kinds(converted), "stock": predicted_kinds(original)}
        self._expect_moved(res, predicted=predicted)
        values_ok = self._compare(
            res, vals["bnswap"], vals.get("reference", vals["stock"]), vals["stock"]
        )
        res["ok"] = bool(res["ok"]) and ops_ok and values_ok
        return res

    def moved_programs(self) -> dict:
        """Every ``affine`` x ``track_running_stats`` combination of a BatchNorm2d, in
        training and in evaluation: a conv + batch-norm net captured on the CPU, as three
        programs (``stock``: stock's; ``bnswap_exported``: a converted model exported;
        ``bnswap_converted``: ``bnswap.convert`` of stock's program), each moved to the
        target device the two ways users move programs (``ep.module().to(device)``;
        ``move_to_device_pass(ep, device).module()``), plus in training the joint
        forward + backward graph (``aot_export_module(trace_joint=True)``, then
        ``graph_module.to(device)``); the batch-norm kernel (profiler name) each runs. On
        CUDA each must run what ``bnswap.plan`` predicts for it (torch's rule: stock's
        ``aten.batch_norm`` cuDNN for affine layers, native for affine=False ones, in
        both modes; bnswap's training op cuDNN with its stand-ins; in evaluation bnswap's
        programs are stock's; the joint graphs: stock's native, bnswap's cuDNN). Every
        moved program's outputs and state after its two runs, and the joint graphs'
        losses and state, are compared with the reference's (``vs_stock``): stock's moved
        program on CUDA, stock's program run on the CPU in dry mode (:attr:`ref_device`;
        stock's on the Lazy device against it in ``stock_vs_reference``, for
        information)."""
        from torch.export.passes import move_to_device_pass

        target = self._target()
        c, n, hw = (8, 4, 8) if self.dry else (64, 32, 32)
        g = torch.Generator().manual_seed(7)
        x_cpu = torch.randn(n, 3, hw, hw, generator=g)
        y_cpu = torch.randint(0, 10, (n,), generator=g)
        x, y = x_cpu.to(target), y_cpu.to(target)
        keys = ("bnswap_exported", "bnswap_converted", "stock")
        res: dict = {"moved_to": target, "cases": {}}
        oks = []
        for affine in (True, False):
            for trs in (True, False):
                for train in (True, False):
                    torch.manual_seed(0)
                    stock = nn.Sequential(
                        nn.Conv2d(3, c, 3, padding=1),
                        nn.BatchNorm2d(c, affine=affine, track_running_stats=trs),
                        nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1),
                        nn.Flatten(),
                        nn.Linear(c, 10),
                    ).train(train)
                    makers = {
                        "stock": lambda stock=stock: torch.export.export(
                            copy.deepcopy(stock), (x_cpu,)
                        ),
                        "bnswap_exported": lambda stock=stock: torch.export.export(
                            bnswap.convert(copy.deepcopy(stock)), (x_cpu,)
                        ),
                        "bnswap_converted": lambda stock=stock: bnswap.convert(
                            torch.export.export(copy.deepcopy(stock), (x_cpu,))
                        ),
                    }
                    case: dict = {}
                    vals: dict = {}  # (move, program) -> what it computed
                    # what bnswap.plan predicts for each program (torch's rule, issue 45):
                    # stock's affine=False layers run native, bnswap's cuDNN in training
                    predicted = {name: predicted_kinds(makers[name]()) for name in keys}
                    for move in ("module_to", "move_to_device_pass"):
                        row: dict = {}
                        for name in keys:
                            ep = makers[name]()  # fresh: a move moves the program's state
                            run = (
                                ep.module().to(self.target)
                                if move == "module_to"
                                else move_to_device_pass(ep, target).module()
                            )
                            with torch.no_grad():
                                outs = [run(x)]
                                row[name] = self._profile_on_target(
                                    lambda run=run, outs=outs: outs.append(run(x))
                                )
                            row[name]["ran_on"] = outs[-1].device.type
                            vals[(move, name)] = {"outputs": outs, "state": run.state_dict()}
                        self._expect_moved(row, keys, predicted)
                        case[move] = row
                    if train:
                        row = {}
                        joint_predicted = {}
                        for name, m in (
                            ("bnswap_exported", bnswap.convert(copy.deepcopy(stock))),
                            ("stock", stock),
                        ):
                            js = JointStep(m, x_cpu, y_cpu, target)
                            joint_predicted[name] = predicted_kinds(
                                joint_export(m, x_cpu, y_cpu)[0]
                            )
                            losses = [js.step(x, y)]
                            row[name] = self._profile_on_target(
                                lambda js=js, losses=losses: losses.append(js.step(x, y))
                            )
                            row[name]["ran_on"] = losses[-1].device.type
                            vals[("joint", name)] = {
                                "losses": losses,
                                "state": js.params + js.buffers,
                            }
                        self._expect_moved(row, ("bnswap_exported", "stock"), joint_predicted)
                        case["joint"] = row
                    # the reference: stock's moved program (CUDA), or stock's program
                    # and joint graph run on the CPU (dry: see ref_device)
                    refs = {move: vals[(move, "stock")] for move in case}
                    if self.ref_device != target:
                        run = makers["stock"]().module()
                        with torch.no_grad():
                            outs = [run(x_cpu) for _ in range(2)]
                        refs["module_to"] = refs["move_to_device_pass"] = {
                            "outputs": outs,
                            "state": run.state_dict(),
                        }
                        if train:
                            js = JointStep(stock, x_cpu, y_cpu, "cpu")
                            losses = [js.step(x_cpu, y_cpu) for _ in range(2)]
                            refs["joint"] = {"losses": losses, "state": js.params + js.buffers}
                    got = {
                        f"{move}/{name}": v
                        for (move, name), v in vals.items()
                        if name != "stock" or self.ref_device != target
                    }
                    case["vs_stock"] = {
                        f"{key}/{k}": max_abs_diff(v, refs[key.split("/")[0]][k])
                        for key, values in got.items()
                        if not key.endswith("/stock")
                        for k, v in values.items()
                    }
                    if self.ref_device != target:  # (information: see ref_device)
                        case["stock_vs_reference"] = {
                            f"{key}/{k}": max_abs_diff(v, refs[key.split("/")[0]][k])
                            for key, values in got.items()
                            if key.endswith("/stock")
                            for k, v in values.items()
                        }
                    case["ok"] = all(
                        case[k]["ok"] for k in case if isinstance(case[k], dict) and "ok" in case[k]
                    ) and self._values_ok(case["vs_stock"])
                    oks.append(case["ok"])
                    res["cases"][
                        f"affine={affine},track_running_stats={trs},{'train' if train else 'eval'}"
                    ] = case
        res["ok"] = all(oks)
        return res

    def predictions(self) -> dict:
        """``bnswap.plan``'s kernel predictions (torch's rule, ``bnswap.kernels``; issue
        45) against the profiler's kernel names: the AOT graphs of a train step under
        ``torch.compile(backend=aot_eager)`` (forward and backward, stock's and
        bnswap's), and ``affine=False`` layers, stock's and swapped, in training and in
        eval (stock: native, no weight; swapped: cuDNN in training with its stand-ins,
        native in eval). Stock's exported program and QAT graph are checked against
        their predictions in ``converted_program``, ``moved_programs`` and ``qat_pt2e``.
        Dry: the predictions, and every path run on the CPU (no kernel names)."""
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        c, n, hw = (8, 4, 8) if self.dry else (64, 32, 32)
        x = torch.randn(n, c, hw, hw, device=self.device)
        res: dict = {"aot_eager": {}, "affine_false": {}}
        for name in ("stock", "bnswap"):
            torch.manual_seed(0)
            m = nn.Sequential(
                nn.Conv2d(c, c, 3, padding=1),
                nn.BatchNorm2d(c),
                nn.ReLU(),
                nn.BatchNorm2d(c, affine=False),
            ).to(self.device)
            if name == "bnswap":
                m = bnswap.convert(m)
            graphs: list = []

            def keep(gm, _inputs, graphs=graphs):
                graphs.append(gm)
                return make_boxed_func(gm.forward)

            torch._dynamo.reset()
            compiled = torch.compile(m, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))

            def step(compiled=compiled):
                compiled(x).sum().backward()

            step()  # (compiles)
            r = profile_names(step, self.device)
            r["predicted"] = sorted({k for gm in graphs for k in predicted_kinds(gm)})
            res["aot_eager"][name] = r
            torch._dynamo.reset()
        for name in ("stock", "bnswap"):
            for training in (True, False):
                layer = nn.BatchNorm2d(c, affine=False).to(self.device).train(training)
                if name == "bnswap":
                    layer = bnswap.convert(layer)
                r = profile_names(lambda layer=layer: layer(x), self.device)
                kernel = bnswap.kernels.layer_kernel(
                    layer, "cuda", swapped=name == "bnswap", training=training
                )
                r["predicted"] = [kind_of(kernel)]
                res["affine_false"][f"{name}_{'train' if training else 'eval'}"] = r
        cases = [*res["aot_eager"].values(), *res["affine_false"].values()]
        if self.device != "cuda":
            res["ok"] = None
            res["note"] = "kernel names need CUDA: the predictions, and the paths run on the CPU"
        else:
            res["ok"] = all(r["kinds"] == r["predicted"] for r in cases)
        return res

    def sync(self) -> dict:
        """Synchronized BatchNorm on the device (issues 18, 28): bnswap's synchronized
        layer (``bnswap.sync``: one all_gather forward, one backward collective) with the
        device's own kernels in its three slots (on CUDA stock SyncBatchNorm's:
        ``batch_norm_stats``'s kernel through ``batch_norm_update_stats``,
        ``batch_norm_backward_reduce``, ``batch_norm_backward_elemt``; on the CPU ATen's
        native ones), the same layer on the portable torch ops
        (``bnswap.sync.DEVICE_KERNELS`` emptied), and torch's own synchronized Function
        (``torch.nn.modules._functions.SyncBatchNorm``, CUDA only), forward + backward of
        one layer on (32, 64, 32, 32), in a process group of this one process (NCCL on
        CUDA, gloo on the CPU; the collectives run, over one rank): kernel names, time per
        call (interleaved pairs), and the difference of outputs and input gradients.
        Checks that the kernels the plan's kernel column names (``sync_kernel``) run, and
        agree with torch's (docs/design.md, "Synchronized BatchNorm")."""
        from unittest import mock

        import torch.distributed as dist
        from torch.nn.modules._functions import SyncBatchNorm as TorchSync

        from bnswap import sync

        backend = "nccl" if self.device == "cuda" else "gloo"
        made = not dist.is_initialized()
        if made:
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1)
        try:
            group = dist.group.WORLD
            n, c, hw = (4, 8, 8) if self.dry else (32, 64, 32)
            g = torch.Generator().manual_seed(5)
            x0 = torch.randn(n, c, hw, hw, generator=g).to(self.device)
            dy = torch.randn(n, c, hw, hw, generator=g).to(self.device)
            layer = nn.BatchNorm2d(c).to(self.device)
            stock = copy.deepcopy(layer)

            def ours():
                x = x0.detach().requires_grad_(True)
                out = sync.synchronized_batch_norm(layer, x, group)
                out.backward(dy)
                return out, x.grad

            def portable():
                with mock.patch.dict(sync.DEVICE_KERNELS, clear=True):
                    return ours()

            def torchs():
                x = x0.detach().requires_grad_(True)
                out = TorchSync.apply(
                    x,
                    stock.weight,
                    stock.bias,
                    stock.running_mean,
                    stock.running_var,
                    stock.eps,
                    0.1,
                    group,
                    1,
                )
                out.backward(dy)
                return out, x.grad

            res: dict = {
                "backend": backend,
                "shape": [n, c, hw, hw],
                "kernel_column": sync.sync_kernel(self.device),
                "bnswap": profile_names(ours, self.device, all_kernels=True),
                "bnswap_portable": profile_names(portable, self.device, all_kernels=True),
            }
            if self.device == "cuda":
                res["torch_sync"] = profile_names(torchs, self.device, all_kernels=True)
                ob, gb = torchs()
                for key, fn in (("", ours), ("_portable", portable)):
                    oa, ga = fn()
                    res[f"max_abs_diff_out{key}"] = float((oa - ob).abs().max())
                    res[f"max_abs_diff_grad{key}"] = float((ga - gb).abs().max())
                pairs = 10 if self.quick else 30
                res["timing"] = _time_pairs(ours, torchs, pairs, 20, self.device)
                res["timing_portable"] = _time_pairs(portable, torchs, pairs, 20, self.device)
                res["ok"] = all(
                    res[f"max_abs_diff_{k}"] < 1e-4
                    for k in ("out", "grad", "out_portable", "grad_portable")
                )
            else:
                res["note"] = "torch's synchronized kernels need CUDA; kernel names need CUDA"
                # over one rank the global batch is the local one: stock BatchNorm's result
                xr = x0.detach().requires_grad_(True)
                ref = nn.BatchNorm2d(c)(xr)
                ref.backward(dy)
                for key, fn in (("", ours), ("_portable", portable)):
                    out, grad = fn()
                    res[f"max_abs_diff_vs_batchnorm{key}"] = max(
                        float((out - ref).detach().abs().max()), float((grad - xr.grad).abs().max())
                    )
                res["ok"] = (
                    max(res["max_abs_diff_vs_batchnorm"], res["max_abs_diff_vs_batchnorm_portable"])
                    < 1e-5
                )
            # the normalization with the global statistics is stock's evaluation call,
            # aten::batch_norm (training=False), on every device: never
            # _batch_norm_no_update, which has no kernel off the CPU
            res["normalization_ok"] = all(
                "aten::batch_norm" in res[k]["aten_ops"]
                and "aten::_batch_norm_no_update" not in res[k]["aten_ops"]
                for k in ("bnswap", "bnswap_portable")
            )
            res["ok"] = res["ok"] and res["normalization_ok"]
            return res
        finally:
            if made:
                dist.destroy_process_group()

    def sync_two_ranks(self) -> dict:
        """Synchronized layers on 2 processes (issue 44): 2 spawned processes, each a
        synchronized layer (``bnswap.convert(nn.SyncBatchNorm(C))``) on its own GPU (NCCL;
        needs ``torch.cuda.device_count() >= 2``, else skipped) or, in dry mode, on the CPU
        over gloo (the same code path rehearsed), one training forward + backward of its
        share of an uneven global batch, then an evaluation forward; against one process's
        stock ``nn.BatchNorm2d`` on the global batch (on :attr:`ref_device`): the
        concatenated outputs and input gradients, the parameter gradients summed over the
        ranks (each rank's is its share, as stock SyncBatchNorm's), every rank's running
        statistics and evaluation output. Each rank's normalization must be stock's
        evaluation call (``aten::batch_norm``), never ``_batch_norm_no_update``. The
        processes are killed after ``SYNC_PROCESS_TIMEOUT_S`` (a collective raises after
        ``SYNC_COLLECTIVE_TIMEOUT_S``)."""
        if self.dry:
            backend = "gloo"
        else:
            n_gpus = torch.cuda.device_count()
            if n_gpus < 2:
                raise Skipped(
                    f"needs 2 GPUs, {n_gpus} present (the 2-process path is rehearsed "
                    "by the dry mode, with gloo on the CPU)"
                )
            backend = "nccl"
        sizes, c, hw = ([3, 5], 4, 4) if self.dry else ([16, 24], 32, 16)
        g = torch.Generator().manual_seed(11)
        x = torch.randn(sum(sizes), c, hw, hw, generator=g)
        dy = torch.randn(sum(sizes), c, hw, hw, generator=g)
        x_eval = torch.randn(sum(sizes), c, hw, hw, generator=g)
        stock = nn.BatchNorm2d(c)
        with torch.no_grad():
            stock.weight.copy_(torch.rand(c, generator=g) + 0.5)
            stock.bias.copy_(torch.randn(c, generator=g))
            stock.running_mean.copy_(torch.randn(c, generator=g))
            stock.running_var.copy_(torch.rand(c, generator=g) + 0.5)
        res: dict = {"backend": backend, "world": 2, "batch_per_rank": sizes, "shape": [c, hw, hw]}
        with tempfile.TemporaryDirectory() as tmp:
            data_file = os.path.join(tmp, "data.pt")
            bounds = [0, sizes[0], sum(sizes)]
            torch.save(
                {
                    "x": x,
                    "dy": dy,
                    "x_eval": x_eval,
                    "bounds": bounds,
                    "channels": c,
                    "state": copy.deepcopy(stock.state_dict()),
                },
                data_file,
            )
            t0 = time.perf_counter()
            codes = run_ranks(
                sync_rank,
                (2, backend, os.path.join(tmp, "store"), data_file, tmp),
                2,
                SYNC_PROCESS_TIMEOUT_S,
            )
            res["processes_s"] = round(time.perf_counter() - t0, 1)
            for r, code in enumerate(codes):
                if code != 0:
                    err = os.path.join(tmp, f"rank{r}.err")
                    text = ""
                    if os.path.exists(err):
                        with open(err) as f:
                            text = f.read()[-3000:]
                    raise RuntimeError(f"rank {r} exited with code {code}:\n{text}")
            ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)]
        # one process's stock BatchNorm on the global batch
        dev = self.ref_device
        ref = copy.deepcopy(stock).to(dev).train()
        xr = x.to(dev).requires_grad_(True)
        out = ref(xr)
        out.backward(dy.to(dev))
        ref.eval()
        with torch.no_grad():
            eval_out = ref(x_eval.to(dev))
        assert ref.weight.grad is not None and ref.bias.grad is not None
        res["ranks"] = [
            {"device": r["device"], **{k: r["profile"][k] for k in ("aten_ops", "kinds")}}
            for r in ranks
        ]
        res["max_abs_diff"] = {
            "out": max_abs_diff(torch.cat([r["out"] for r in ranks]), out),
            "grad_input": max_abs_diff(torch.cat([r["grad_input"] for r in ranks]), xr.grad),
            "grad_weight": max_abs_diff(sum(r["grad_weight"] for r in ranks), ref.weight.grad),
            "grad_bias": max_abs_diff(sum(r["grad_bias"] for r in ranks), ref.bias.grad),
            "state": max(max_abs_diff(r["state"], ref.state_dict()) for r in ranks),
            "eval_out": max_abs_diff(torch.cat([r["eval_out"] for r in ranks]), eval_out),
        }
        res["normalization_ok"] = all(
            "aten::batch_norm" in r["aten_ops"]
            and "aten::_batch_norm_no_update" not in r["aten_ops"]
            for r in res["ranks"]
        )
        tol = 1e-5 if self.dry else 1e-4
        res["ok"] = (
            res["normalization_ok"]
            and [r["device"] for r in res["ranks"]]
            == (["cpu", "cpu"] if self.dry else ["cuda:0", "cuda:1"])
            and all(d <= tol for d in res["max_abs_diff"].values())
        )
        return res

    def training(self) -> dict:
        """The net (MobileNetV2-style on the GPU) trained with the exported-on-CPU joint
        graph, bnswap and stock, against eager stock training (cuDNN on the GPU) from the
        same initial weights and batches."""
        steps = 5 if self.dry else (60 if self.quick else 300)
        n, hw = self.shape
        # synthetic 10-class data: a fixed smooth template per class plus noise
        g = torch.Generator().manual_seed(123)
        templates = F.interpolate(
            torch.randn(10, 3, 8, 8, generator=g),
            size=(hw, hw),
            mode="bilinear",
            align_corners=False,
        )
        n_train = n * 32
        labels = torch.randint(0, 10, (n_train,), generator=g)
        data = templates[labels] + 1.5 * torch.randn(n_train, 3, hw, hw, generator=g)
        data, labels = data.to(self.device), labels.to(self.device)
        order = torch.randint(0, n_train // n, (steps,), generator=g).tolist()
        batches = [(data[i * n : (i + 1) * n], labels[i * n : (i + 1) * n]) for i in order]

        a, b = _pair(self.nets[self.net])
        x0, y0 = batches[0][0].cpu(), batches[0][1].cpu()
        runs: dict[str, Callable] = {}
        ja = JointStep(a, x0, y0, self.device, key=self._joint_key("bnswap"))
        jb = JointStep(b, x0, y0, self.device, key=self._joint_key("stock"))
        runs["exported_bnswap"] = ja.step
        runs["exported_stock"] = jb.step
        eager = copy.deepcopy(b).to(self.device)
        opt = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9)

        def eager_step(x, y):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(eager(x), y)
            loss.backward()
            opt.step()
            return loss

        runs["eager_stock"] = eager_step
        curves: dict[str, list[float]] = {}
        secs: dict[str, float] = {}
        for name, fn in runs.items():
            _sync(self.device)
            t0 = time.perf_counter()
            curves[name] = [float(fn(x, y).detach()) for x, y in batches]
            _sync(self.device)
            secs[name] = round(time.perf_counter() - t0, 2)
        ref = curves["eager_stock"]
        k = min(20, steps)
        summary = {}
        for name, c in curves.items():
            summary[name] = {
                "first_loss": c[0],
                "final_loss_mean_last": statistics.mean(c[-k:]),
                "max_abs_diff_vs_eager": max(abs(u - v) for u, v in zip(c, ref, strict=True)),
                "mean_abs_diff_vs_eager": statistics.mean(
                    abs(u - v) for u, v in zip(c, ref, strict=True)
                ),
                "seconds": secs[name],
                "finite": all(v == v and abs(v) != float("inf") for v in c),
            }
        every = max(1, steps // 30)
        return {
            "net": self.net,
            "steps": steps,
            "batch": n,
            "hw": hw,
            "summary": summary,
            "curves_every": every,
            "curves": {k2: v[::every] for k2, v in curves.items()},
            "ok": all(s["finite"] for s in summary.values()),
        }

    def qat_pt2e(self) -> dict:
        """pt2e QAT (torchao, docs/qat.md): stock's and bnswap's nets exported on the CPU,
        ``prepare_qat_pt2e`` (XNNPACK's quantizer), the prepared graphs trained on the
        device: their batch-norm ops, the kernel names of one step, a few steps' losses and
        time per step side by side (the same initial weights and batches). Both graphs
        hold stock's ``aten.batch_norm`` (bnswap's prepared graph is stock's). On the CPU
        (dry) the two runs must agree bitwise; on CUDA each graph must run the kernels
        ``bnswap.plan`` predicts for it (``aten.batch_norm`` selects cuDNN at run time: its
        ``cudnn_enabled=False`` is ignored, issue 45)."""
        try:
            from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e
            from torchao.testing.pt2e._xnnpack_quantizer import (
                XNNPACKQuantizer,
                get_symmetric_quantization_config,
            )
        except ImportError as e:
            return {"ok": None, "note": f"torchao is not installed ({e})"}
        import warnings

        a, b = _pair(self.nets[self.net])
        n, hw = self.shape
        x_cpu, y_cpu = _batch(n, hw, "cpu")
        x, y = x_cpu.to(self.device), y_cpu.to(self.device)
        steps = 3 if self.dry else (20 if self.quick else 60)
        res: dict = {"net": self.net, "steps": steps, "graph_ops": {}, "losses": {}, "step_ms": {}}
        for name, m in (("bnswap", a), ("stock", b)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "XNNPACKQuantizer is deprecated!"
                quantizer = XNNPACKQuantizer().set_global(
                    get_symmetric_quantization_config(is_qat=True)
                )
            prepared = prepare_qat_pt2e(torch.export.export(m, (x_cpu,)).module(), quantizer)
            res["graph_ops"][name] = _bn_ops(prepared.graph)
            res.setdefault("predicted", {})[name] = predicted_kinds(prepared)
            step = _eager_step(prepared.to(self.device), x, y, lr=0.01)
            losses = [float(step().detach())]  # (the first step builds the observers' state)
            res[name] = profile_names(step, self.device)
            _sync(self.device)
            t0 = time.perf_counter()
            losses += [float(step().detach()) for _ in range(steps)]
            _sync(self.device)
            res["step_ms"][name] = (time.perf_counter() - t0) / steps * 1e3
            res["losses"][name] = losses
        # bnswap's prepared graph is stock's (its torchao patch hands torchao stock's ops
        # and puts nothing back), so bnswap.plan predicts the same kernels for both
        res["ops_ok"] = (
            res["graph_ops"]["bnswap"] == res["graph_ops"]["stock"] == ["aten.batch_norm.default"]
            and res["predicted"]["bnswap"] == res["predicted"]["stock"]
        )
        res["max_abs_loss_diff"] = max(
            abs(u - v) for u, v in zip(res["losses"]["bnswap"], res["losses"]["stock"], strict=True)
        )
        if self.device != "cuda":
            res["ok"] = res["ops_ok"] and res["max_abs_loss_diff"] == 0.0
            res["note"] = "kernel names need CUDA: graph ops and bitwise losses checked"
        else:
            # stock's prepared graph holds aten.batch_norm, which selects at run time
            # (cuDNN: its cudnn_enabled=False is ignored, issue 45); bnswap.plan's
            # prediction for each graph is what the profiler must see
            res["expected"] = res["predicted"]
            res["ok"] = (
                res["ops_ok"]
                and res["bnswap"]["kinds"] == res["predicted"]["bnswap"]
                and res["stock"]["kinds"] == res["predicted"]["stock"]
            )
        return res

    def fsdp2_bf16(self) -> dict:
        """FSDP2 mixed precision (``fully_shard(..., mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16))``) on a one-rank process group (nccl on CUDA, gloo on
        the CPU): stock BatchNorm raises, bnswap trains a step (its batch-norm kernels
        recorded: bfloat16 input runs the native kernel by torch's rule, as stock's layer
        would if it ran), and a bnswap layer's
        output equals stock BatchNorm's with float32 weight and bias equal to the bfloat16
        ones, on the same input (docs/lightning.md, "FSDP2 mixed precision")."""
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        backend = "nccl" if self.device == "cuda" else "gloo"
        own = not dist.is_initialized()
        if own:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        try:
            mesh = init_device_mesh(self.device, (1,))
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
            # bfloat16 input with float32 weight (bnswap's mixed-precision upcast): no
            # bfloat16 input for cuDNN (torch's rule, bnswap.kernels)
            call = bnswap.kernels.Call(
                4, torch.bfloat16, torch.float32, torch.float32, True, True, True, 1e-5
            )
            res: dict = {
                "process_group": backend,
                "predicted": kind_of(bnswap.kernels.rule(call, rocm=False)),
            }
            a, b = _pair(self.nets["convnet4"])
            x, y = _batch(*self.compile_shape, self.device)
            for name, m in (("bnswap", a), ("stock", b)):
                fully_shard(m.to(self.device), mesh=mesh, mp_policy=policy)
                step = _eager_step(m, x, y)
                try:
                    step()
                except RuntimeError as e:
                    res[name] = {"error": str(e)}
                    continue
                res[name] = profile_names(step, self.device)
            torch.manual_seed(2)
            bn = nn.BatchNorm2d(16).to(self.device)
            with torch.no_grad():
                bn.weight.uniform_(0.5, 1.5), bn.bias.uniform_(-0.5, 0.5)
            ref = copy.deepcopy(bn)
            with torch.no_grad():  # float32 holding the bfloat16-cast values
                ref.weight.copy_(ref.weight.bfloat16().float())
                ref.bias.copy_(ref.bias.bfloat16().float())
            fully_shard(bnswap.convert(bn), mesh=mesh, mp_policy=policy)
            xb = torch.randn(8, 16, 8, 8, device=self.device).bfloat16()
            with torch.no_grad():
                out, want = bn(xb), ref(xb)
            res["reference"] = {
                "out_dtype": str(out.dtype),
                "running_var_dtype": str(bn.running_var.dtype),
                "max_abs_diff": float((out.float() - want.float()).abs().max()),
                "running_var_max_abs_diff": float((bn.running_var - ref.running_var).abs().max()),
            }
        finally:
            if own:
                dist.destroy_process_group()
        r = res["reference"]
        res["ok"] = (
            "error" in res["stock"]
            and "error" not in res["bnswap"]
            and r["out_dtype"] == "torch.bfloat16"
            and r["running_var_dtype"] == "torch.float32"
            and r["max_abs_diff"] == 0.0
            and r["running_var_max_abs_diff"] == 0.0
            and (self.device != "cuda" or res["bnswap"]["kinds"] == [res["predicted"]])
        )
        return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry", action="store_true", help="CPU-only checks (forced without CUDA)")
    ap.add_argument("--quick", action="store_true", help="fewer pairs and training steps")
    ap.add_argument(
        "--rehearse",
        action="store_true",
        help="dry mode that also runs the GPU-only sections (inductor compile and "
        "timing) on the CPU, to rehearse every code path before a GPU run",
    )
    ap.add_argument("--json", default=None, help="where to write the JSON report")
    ap.add_argument(
        "--budget",
        type=float,
        default=240.0,
        help="seconds after which remaining sections are skipped (default 240)",
    )
    ap.add_argument(
        "--net",
        default=None,
        choices=("convnet4", "mobilenetv2"),
        help="net for the eager / exported / training sections (default: "
        "mobilenetv2 on the GPU, convnet4 in dry mode)",
    )
    ap.add_argument(
        "--sections",
        default=None,
        help="comma-separated subset of: backend,graph_ops,eager,compile_aot_eager,"
        "compile_inductor,exported,converted_program,moved_programs,predictions,training,"
        "sync,sync_two_ranks,qat_pt2e,fsdp2_bf16",
    )
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dry = args.dry or args.rehearse or not cuda
    device = "cpu" if dry else "cuda"
    info = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "cuda_available": cuda,
        "dry": dry,
        "device": device,
        "dry_reason": None
        if not dry
        else ("--rehearse" if args.rehearse else "--dry" if args.dry else "no CUDA device"),
    }
    if cuda:
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
        info["cudnn"] = (
            torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        )
    if dry:  # small CPU work: one thread avoids oversubscribing a shared CI machine
        torch.set_num_threads(1)
    info["torch_threads"] = torch.get_num_threads()
    chk = Check(dry, device, args.quick or args.rehearse, args.net)
    # Most telling first; inductor's compile (the least predictable time) last.
    sections: list[tuple[str, Callable[[], dict], bool]] = [
        ("backend", chk.backend, True),
        ("graph_ops", chk.graph_ops, True),
        ("eager", chk.eager, True),
        ("compile_aot_eager", chk.compile_aot_eager, True),
        ("exported", chk.exported, True),
        ("converted_program", chk.converted_program, True),
        ("moved_programs", chk.moved_programs, True),
        ("predictions", chk.predictions, True),
        ("training", chk.training, True),
        ("sync", chk.sync, True),
        ("sync_two_ranks", chk.sync_two_ranks, True),
        ("qat_pt2e", chk.qat_pt2e, True),
        ("fsdp2_bf16", chk.fsdp2_bf16, True),
        ("compile_inductor", chk.compile_inductor, not dry or args.rehearse),
    ]
    wanted = set(args.sections.split(",")) if args.sections else None
    path = args.json
    if path is None:
        out_dir = os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "results")
        path = os.path.join(
            out_dir, "gpu_dry.json" if dry and not os.environ.get("OUT") else "gpu.json"
        )
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    report: dict = {"info": info, "sections": {}}

    def finish() -> None:
        report["seconds"] = round(time.perf_counter() - T0, 1)
        oks = [s.get("ok") for s in report["sections"].values() if s["status"] == "ok"]
        errors = [k for k, s in report["sections"].items() if s["status"].startswith("error")]
        report["all_ok"] = not errors and all(o is not False for o in oks)
        report["problems"] = errors + [
            k for k, s in report["sections"].items() if s.get("ok") is False and k not in errors
        ]
        budget = [k for k, s in report["sections"].items() if "time budget" in s["status"]]
        if budget:
            report["all_ok"] = False
            report["problems"] += [f"{k} (not run: time budget)" for k in budget]
        with open(path, "w") as f:  # after every section: a killed run keeps what it had
            json.dump(report, f, indent=1, default=str)

    for name, fn, enabled in sections:
        if wanted is not None and name not in wanted:
            continue
        t0 = time.perf_counter()
        if not enabled:
            report["sections"][name] = {"status": "skipped: dry mode (needs CUDA)"}
        elif t0 - T0 > args.budget:
            report["sections"][name] = {
                "status": f"skipped: time budget of {args.budget:.0f} s spent"
            }
        else:
            try:
                res = fn()
                res["status"] = "ok"
            except Skipped as e:  # cannot run here: says why, not a failure
                res = {"status": f"skipped: {e}"}
            except Exception as e:  # every section reports its own failure
                res = {
                    "status": f"error: {type(e).__name__}: {e}",
                    "traceback": traceback.format_exc()[-3000:],
                    "ok": False,
                }
            report["sections"][name] = res
        report["sections"][name]["seconds"] = round(time.perf_counter() - t0, 1)
        try:
            line = summary_line(name, report["sections"][name], dry)
        except Exception as e:  # a section whose report lacks what its line shows
            report["sections"][name].update(
                status=f"error: its report: {type(e).__name__}: {e}", ok=False
            )
            line = summary_line(name, report["sections"][name], dry)
        print(line, flush=True)
        if report["sections"][name]["status"].startswith("error"):
            # loudly: the section's traceback on stderr too (and in the JSON)
            print(
                f"--- {name} failed:\n{report['sections'][name].get('traceback', '')}",
                file=sys.stderr,
                flush=True,
            )
        finish()
    finish()
    verdict = "ALL OK" if report["all_ok"] else "PROBLEMS: " + ", ".join(report["problems"])
    print(
        f"{'DRY ' if dry else ''}{verdict} in {report['seconds']:.0f} s; JSON: {path}"
        + (f" (dry: {info['dry_reason']})" if dry else ""),
        flush=True,
    )
    return 0 if report["all_ok"] else 1


def _worst(diffs: dict) -> float:
    """The largest of a section's max |d| figures (``nan`` where one is)."""
    vals = list(diffs.values())
    return float("nan") if any(v != v for v in vals) else max(vals, default=0.0)


def _kinds(r: dict) -> str:
    k = r.get("kinds") or []
    if k:
        return "+".join(k)
    ops = ",".join(o.removeprefix("aten::") for o in r.get("aten_ops", []))
    return f"ops {ops}" if ops else "-"


def summary_line(name: str, s: dict, dry: bool) -> str:
    status = s["status"]
    mark = {True: "PASS", False: "FAIL", None: "info"}.get(s.get("ok"), "info")
    if status != "ok":
        mark = "SKIP" if status.startswith("skipped") else "ERROR"
        return f"[{mark:5s}] {name:18s} {status} ({s.get('seconds', 0)} s)"
    if name == "backend":
        detail = f"select_batch_norm_backend: cpu={s['cpu']} cuda={s['cuda']}"
    elif name == "graph_ops":
        detail = (
            f"bnswap decomposed {s['bnswap']['export_decomposed']} joint {s['bnswap']['joint']}; "
            f"stock decomposed {s['stock']['export_decomposed']} joint {s['stock']['joint']}"
        )
        detail = detail.replace("aten.", "").replace(".default", "").replace("'", "")
    elif name in ("eager", "compile_aot_eager"):
        detail = "; ".join(
            f"{mode}: bnswap {_kinds(s[mode]['bnswap'])}, stock {_kinds(s[mode]['stock'])}"
            for mode in ("train", "eval")
        )
        detail += f"; on {'/'.join(s['train']['bnswap']['ran_on'])}: max |d| vs stock " + ", ".join(
            f"{k} {v:.1e}" for k, v in s["vs_stock"].items()
        )
    elif name == "compile_inductor":
        t = s["timing"]
        detail = (
            f"bnswap: {_kinds(s['bnswap'])}; stock: {_kinds(s['stock'])}; breaks "
            f"{s['graph_breaks_bnswap']}/{s['graph_breaks_stock']}; step {t['bnswap_ms']:.3f} / "
            f"{t['stock_ms']:.3f} ms, ratio {t['ratio_median']:.3f}"
        )
    elif name == "exported":
        f, j = s["forward_decomposed"], s["joint"]
        detail = (
            f"moved to {s['moved_to']}: fwd: bnswap {_kinds(f['bnswap'])}, stock "
            f"{_kinds(f['stock'])}; joint: bnswap {_kinds(j['bnswap'])}, stock "
            f"{_kinds(j['stock'])}; max |d| vs stock {_worst(s['vs_stock']):.1e}"
        )
    elif name == "converted_program":
        detail = (
            f"moved to {s['moved_to']}: converted {_kinds(s['bnswap'])}; original "
            f"{_kinds(s['stock'])}"
        )
        detail += f"; max |d| vs stock {_worst(s['vs_stock']):.1e}"
        if "bitwise_equal_on_cpu" in s:
            detail += f"; bitwise on cpu {s['bitwise_equal_on_cpu']}"
    elif name == "moved_programs":
        kinds: dict[str, set[str]] = {}
        for case in s["cases"].values():
            for move in ("module_to", "move_to_device_pass", "joint"):
                for prog, r in case.get(move, {}).items():
                    if isinstance(r, dict) and "ran_on" in r:
                        kinds.setdefault(prog, set()).add(_kinds(r))
        detail = f"{len(s['cases'])} cases moved to {s['moved_to']}: " + "; ".join(
            f"{prog} {'/'.join(sorted(k))}" for prog, k in kinds.items()
        )
        worst = max(_worst(c["vs_stock"]) for c in s["cases"].values())
        detail += f"; max |d| vs stock {worst:.1e}"
    elif name == "predictions":
        detail = "; ".join(
            f"{group} {k}: {_kinds(r)} (predicted {'+'.join(r['predicted'])})"
            for group in ("aot_eager", "affine_false")
            for k, r in s[group].items()
        )
    elif name == "sync":
        detail = (
            f"{s['backend']}: bnswap ({s['kernel_column']}) {_kinds(s['bnswap'])}, "
            f"portable {_kinds(s['bnswap_portable'])}"
        )
        if "torch_sync" in s:
            t, tp = s["timing"], s["timing_portable"]
            detail += (
                f"; torch's sync kernels {_kinds(s['torch_sync'])}; fwd+bwd / torch's: "
                f"{t['bnswap_ms']:.3f} / {t['stock_ms']:.3f} ms (ratio "
                f"{t['ratio_median']:.3f}), portable {tp['ratio_median']:.3f}; max |d| "
                f"out {s['max_abs_diff_out']:.1e} grad {s['max_abs_diff_grad']:.1e}, "
                f"portable {s['max_abs_diff_out_portable']:.1e} / "
                f"{s['max_abs_diff_grad_portable']:.1e}"
            )
    elif name == "sync_two_ranks":
        detail = (
            f"{s['backend']}, ranks on {'/'.join(r['device'] for r in s['ranks'])}: "
            + "; ".join(f"rank {i} {_kinds(r)}" for i, r in enumerate(s["ranks"]))
            + "; max |d| vs stock BatchNorm on the global batch "
            + ", ".join(f"{k} {v:.1e}" for k, v in s["max_abs_diff"].items())
            + f" ({s['processes_s']} s in the processes)"
        )
    elif name == "training":
        sm = s["summary"]
        detail = f"{s['steps']} steps: " + "; ".join(
            f"{k} final {v['final_loss_mean_last']:.4f} "
            f"(max |d| vs eager {v['max_abs_diff_vs_eager']:.2e})"
            for k, v in sm.items()
        )
    elif name == "qat_pt2e":
        ops = {
            k: ",".join(o.removeprefix("aten.").removesuffix(".default") for o in v)
            for k, v in s["graph_ops"].items()
        }
        detail = (
            f"prepared graphs: bnswap {ops['bnswap']} ({_kinds(s['bnswap'])}), stock "
            f"{ops['stock']} ({_kinds(s['stock'])}); {s['steps']} steps: loss "
            f"{s['losses']['bnswap'][-1]:.4f} / {s['losses']['stock'][-1]:.4f}, "
            f"{s['step_ms']['bnswap']:.2f} / {s['step_ms']['stock']:.2f} ms per step, "
            f"max |d loss| {s['max_abs_loss_diff']:.1e}"
        )
    elif name == "fsdp2_bf16":
        r = s["reference"]
        detail = (
            f"{s['process_group']}: "
            "bnswap "
            f"{_kinds(s['bnswap']) if 'error' not in s['bnswap'] else s['bnswap']['error']}; "
            f"stock {s['stock'].get('error', _kinds(s['stock']))}; "
            f"out {r['out_dtype']}, running_var "
            f"{r['running_var_dtype']}, max |d| vs float32-weight stock {r['max_abs_diff']:.1e}"
        )
    else:
        detail = ""
    if dry and s.get("note"):
        detail += f" [{s['note']}]"
    return f"[{mark:5s}] {name:18s} {detail} ({s.get('seconds', 0)} s)"


if __name__ == "__main__":
    sys.exit(main())
