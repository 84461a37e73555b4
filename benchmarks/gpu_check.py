"""One prepared GPU check for bnswap (a few minutes on one H200; a dry mode on CPU).

    python benchmarks/gpu_check.py            # on a machine with CUDA
    python benchmarks/gpu_check.py --dry      # anywhere: what can be checked on the CPU

With the torch profiler's kernel names it shows which batch-norm kernel runs, for
bnswap layers and for stock ``nn.BatchNorm``:

* ``eager``: a train step in eager mode (both should run cuDNN);
* ``compile``: a train step under ``torch.compile`` with the ``aot_eager`` backend (the
  aten graph as captured: bnswap should run cuDNN, stock the native kernel: pytorch
  issue 111384) and with ``inductor`` (which generates its own kernels for both);
* ``fsdp2_bf16``: FSDP2 with ``param_dtype=torch.bfloat16`` on a one-rank process group:
  stock raises, bnswap's step runs the native kernel (bfloat16 input: torch's rule), its
  output equals stock's on float32 weights;
* ``exported``: graphs exported with ``torch.export`` / ``aot_export_module`` **on the
  CPU** and then moved to CUDA: the decomposed forward graph (``run_decompositions({})``,
  which keeps bnswap's ops; the default table gives core ATen, stock's ops) and the joint
  forward+backward train graph (bnswap: cuDNN; stock: native);
* ``converted_program``: a *stock* model exported on the CPU, the program given to
  ``bnswap.convert``, both moved to CUDA (``torch.export.passes.move_to_device_pass``):
  both run cuDNN, as ``bnswap.plan`` predicts (stock's ``aten.batch_norm`` selects at run
  time: its ``cudnn_enabled=False`` is ignored, issue 45; dry mode: the two agree bitwise
  on the CPU and run on the meta device);
* ``moved_programs``: every ``affine`` x ``track_running_stats`` combination, train and
  eval, each program's kernels against ``bnswap.plan``'s prediction for it;
* ``predictions`` (issue 45): ``bnswap.plan``'s predictions against the profiler's kernel
  names for the AOT graphs (``aot_eager``, forward and backward) and ``affine=False``
  layers (stock's native; swapped: cuDNN in training, native in eval);
* ``qat_pt2e`` (issue 31): stock's and bnswap's nets exported on the CPU,
  ``prepare_qat_pt2e`` (torchao, XNNPACK's quantizer), the prepared graphs trained on
  CUDA: both are stock's graph (bnswap's torchao patch hands torchao stock's ops and
  puts nothing back): each graph's kernels against ``bnswap.plan``'s prediction (its
  ``aten.batch_norm`` cuDNN for both); losses and time per step side by side (dry: a few
  steps on the CPU, bitwise equal).

* ``sync`` (issues 18, 28): one synchronized layer forward + backward in a one-process
  NCCL group: bnswap's synchronized layer with the device's kernels in its slots
  (``bnswap.sync.DEVICE_KERNELS``: on CUDA stock SyncBatchNorm's ``batch_norm_stats``
  kernel, ``batch_norm_backward_reduce``, ``batch_norm_backward_elemt``), the same layer
  on the portable torch ops, and torch's synchronized Function: every GPU kernel name of
  each, time per call, and the difference of outputs and input gradients (dry: the same
  layer over a one-process gloo group on the CPU, both bnswap paths against stock
  BatchNorm).

It then times the inductor-compiled train step bnswap vs stock (interleaved pairs,
median of ratios), and trains the MobileNetV2-style net a few hundred steps with the
exported-on-CPU joint graph, bnswap vs stock, comparing both loss curves with eager
(cuDNN) training from the same initial weights and data.

Without CUDA (or with ``--dry``) it checks what the CPU allows: the backend
``torch._C._select_batch_norm_backend`` picks, the ops in the exported graphs, and a few
steps of every code path on the CPU (so a GPU run does not fail on a typo), and says what
it skipped. Every section reports its own failure; the script always writes its JSON:
``--json PATH``, else ``$OUT/gpu.json`` when ``$OUT`` is set, else
``benchmarks/results/gpu.json`` (``gpu_dry.json`` in dry mode).

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
import time
import traceback
from collections.abc import Callable

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
    (``all_kernels``: also every GPU kernel name, as ``gpu_kernels``)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if device == "cuda":
        acts.append(ProfilerActivity.CUDA)
    with profile(activities=acts) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
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
    if device == "cuda":
        torch.cuda.synchronize()


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
        # where graphs captured on the CPU are moved to: the GPU, or in dry mode the meta
        # device (the same moves and code; a tensor or device left on the CPU fails there)
        self.target = "meta" if dry else device
        self._ep: dict = {}

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
        """Batch-norm ops in graphs captured on the CPU, bnswap vs stock."""
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
            }
        bn, st = out["bnswap"], out["stock"]
        out["ok"] = (
            any("_batch_norm_with_update" in o for o in bn["export"])
            and any("_batch_norm_with_update_functional" in o for o in bn["export_decomposed"])
            and any("aten.batch_norm_backward" in o for o in bn["joint"])
            and not any("native_batch_norm" in o for o in bn["export_decomposed"] + bn["joint"])
            and any("_native_batch_norm_legit_functional" in o for o in st["export_decomposed"])
            and any("native_batch_norm_backward" in o for o in st["joint"])
            and bn["export_core_aten"] == st["export_core_aten"]
        )  # core ATen: stock's ops
        return out

    def _expect(self, res: dict, bnswap_kind: str, stock_kind: str) -> None:
        if self.device != "cuda":
            res["ok"] = None
            res["note"] = "kernel names need CUDA: CPU aten ops recorded only"
            return
        res["expected"] = {"bnswap": bnswap_kind, "stock": stock_kind}
        res["ok"] = res["bnswap"]["kinds"] == [bnswap_kind] and res["stock"]["kinds"] == [
            stock_kind
        ]

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

    def eager(self) -> dict:
        res = {"net": self.net}
        self._profile_pair(self.net, self.shape, None, res)
        self._expect(res, "cudnn", "cudnn")
        return res

    def compile_aot_eager(self) -> dict:
        res: dict = {}
        self._profile_pair("convnet4", self.compile_shape, "aot_eager", res)
        torch._dynamo.reset()
        self._expect(res, "cudnn", "native")
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
        """``fn`` once under the profiler on the target device (the meta device records
        the CPU side's aten ops only)."""
        return profile_names(fn, "cuda" if self.target == "cuda" else "cpu")

    def _expect_moved(
        self,
        res: dict,
        bnswap_kind: str,
        stock_kind: str,
        keys: tuple[str, ...] = ("bnswap", "stock"),
        predicted: dict[str, list[str]] | None = None,
    ) -> None:
        """``res[k]["kinds"]`` against the expected kernel kind on CUDA (``predicted``:
        the kinds ``bnswap.plan`` predicts per key, :func:`predicted_kinds`); on the meta
        device (dry) the moved graphs must have run there."""
        if predicted is not None:
            res["predicted"] = predicted
        if self.target != "cuda":
            res["ok"] = all(res[k].get("ran_on") == self.target for k in keys)
            res["note"] = "kernel names need CUDA; the graphs were moved to meta and ran there"
            return
        res["expected"] = (
            predicted
            if predicted is not None
            else {k: [bnswap_kind if k.startswith("bnswap") else stock_kind] for k in keys}
        )
        res["ok"] = all(res[k]["kinds"] == res["expected"][k] for k in keys)

    def exported(self) -> dict:
        """Graphs captured on the CPU, moved to the target device as a user moves them
        (``ep.module().to(device)``, ``graph_module.to(device)``), profiled there."""
        a, b = _pair(self.nets[self.net])
        n, hw = self.shape
        x_cpu, y_cpu = _batch(n, hw, "cpu")
        x, y = x_cpu.to(self.target), y_cpu.to(self.target)
        res: dict = {
            "net": self.net,
            "moved_to": self.target,
            "forward_decomposed": {},
            "joint": {},
        }
        for name, m in (("bnswap", a), ("stock", b)):
            # a fresh program: moving its module moves the program's own state too
            ep = torch.export.export(copy.deepcopy(m), (x_cpu,)).run_decompositions({})
            fwd = ep.module().to(self.target)  # bnswap's ops kept by the empty table
            with torch.no_grad():
                fwd(x)
                r = self._profile_on_target(lambda fwd=fwd: fwd(x))
                r["ran_on"] = fwd(x).device.type
            res["forward_decomposed"][name] = r
            js = JointStep(m, x_cpu, y_cpu, self.target, key=self._joint_key(name))
            js.step(x, y)
            r = self._profile_on_target(lambda js=js: js.step(x, y))
            r["ran_on"] = js.step(x, y).device.type
            r["graph_ops"] = js.ops
            res["joint"][name] = r
        self._expect_moved(res["forward_decomposed"], "cudnn", "native")
        self._expect_moved(res["joint"], "cudnn", "native")
        res["ok"] = res["forward_decomposed"]["ok"] and res["joint"]["ok"]
        return res

    def converted_program(self) -> dict:
        """A stock model exported on the CPU, ``bnswap.convert`` of the program, both
        moved to the target device with ``torch.export.passes.move_to_device_pass``; a
        training forward of each under the profiler. On the CPU (dry) the two programs
        also agree bitwise before they move."""
        from torch.export.passes import move_to_device_pass

        _, stock = _pair(self.nets[self.net])
        n, hw = self.shape
        x_cpu, _ = _batch(n, hw, "cpu")
        original = torch.export.export(stock, (x_cpu,))
        converted = bnswap.convert(original)  # a new program; the original unchanged
        res: dict = {
            "net": self.net,
            "moved_to": self.target,
            "graph_ops": {"stock": _bn_ops(original.graph), "bnswap": _bn_ops(converted.graph)},
        }
        ops_ok = res["graph_ops"]["stock"] == ["aten.batch_norm.default"] and all(
            "_batch_norm_with_update" in o or "_batch_norm_no_update" in o
            for o in res["graph_ops"]["bnswap"]
        )
        if self.target != "cuda":  # the same CPU kernel: bitwise, outputs and statistics
            a, b = copy.deepcopy(original.module()), copy.deepcopy(converted.module())
            res["bitwise_equal_on_cpu"] = all(
                torch.equal(a(x_cpu), b(x_cpu)) for _ in range(2)
            ) and all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
            ops_ok = ops_ok and res["bitwise_equal_on_cpu"]
        x = x_cpu.to(self.target)
        for name, prog in (("bnswap", converted), ("stock", original)):
            run = move_to_device_pass(prog, self.target).module()
            run(x)
            res[name] = self._profile_on_target(lambda run=run: run(x))
            res[name]["ran_on"] = run(x).device.type
        # stock's exported aten.batch_norm selects at run time (its cudnn_enabled=False is
        # ignored): cuDNN as the converted program's op, by torch's rule (issue 45)
        predicted = {"bnswap": predicted_kinds(converted), "stock": predicted_kinds(original)}
        self._expect_moved(res, "cudnn", "cudnn", predicted=predicted)
        res["ok"] = bool(res["ok"]) and ops_ok
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
        ``aten.batch_norm`` cuDNN for affine layers, native for affine=False ones; bnswap's
        training op cuDNN with its stand-ins; the joint graphs: stock's native, bnswap's
        cuDNN); outputs are compared
        with stock's moved program (the kernels round differently). Dry: the meta device,
        where each must run and match stock's output shape, dtype and device."""
        from torch.export.passes import move_to_device_pass

        c, n, hw = (8, 4, 8) if self.dry else (64, 32, 32)
        g = torch.Generator().manual_seed(7)
        x_cpu = torch.randn(n, 3, hw, hw, generator=g)
        y_cpu = torch.randint(0, 10, (n,), generator=g)
        x, y = x_cpu.to(self.target), y_cpu.to(self.target)
        keys = ("bnswap_exported", "bnswap_converted", "stock")
        res: dict = {"moved_to": self.target, "cases": {}}
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
                    outs: dict = {}
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
                                else move_to_device_pass(ep, self.target).module()
                            )
                            with torch.no_grad():
                                run(x)
                                row[name] = self._profile_on_target(lambda run=run: run(x))
                                outs[(move, name)] = run(x)
                            row[name]["ran_on"] = outs[(move, name)].device.type
                        self._expect_moved(row, "cudnn", "native", keys, predicted)
                        case[move] = row
                    if train:
                        row = {}
                        joint_predicted = {}
                        for name, m in (
                            ("bnswap_exported", bnswap.convert(copy.deepcopy(stock))),
                            ("stock", stock),
                        ):
                            js = JointStep(m, x_cpu, y_cpu, self.target)
                            joint_predicted[name] = predicted_kinds(
                                joint_export(m, x_cpu, y_cpu)[0]
                            )
                            js.step(x, y)
                            row[name] = self._profile_on_target(lambda js=js: js.step(x, y))
                            row[name]["ran_on"] = js.step(x, y).device.type
                        self._expect_moved(
                            row, "cudnn", "native", ("bnswap_exported", "stock"), joint_predicted
                        )
                        case["joint"] = row
                    # bnswap's moved outputs against stock's moved program
                    diffs = {}
                    for (move, name), out in outs.items():
                        ref = outs[(move, "stock")]
                        if name == "stock":
                            continue
                        same = (
                            out.shape == ref.shape
                            and out.dtype == ref.dtype
                            and out.device == ref.device
                        )
                        diffs[f"{move}/{name}"] = (
                            ("same shape, dtype, device" if same else "differs")
                            if out.device.type == "meta"
                            else float((out - ref).abs().max())
                        )
                    case["vs_stock"] = diffs
                    case["ok"] = all(
                        case[k]["ok"] for k in case if isinstance(case[k], dict) and "ok" in case[k]
                    ) and all(
                        v == "same shape, dtype, device" or (isinstance(v, float) and v < 1e-3)
                        for v in diffs.values()
                    )
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
            return res
        finally:
            if made:
                dist.destroy_process_group()

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
        res["ops_ok"] = (
            res["graph_ops"]["bnswap"] == res["graph_ops"]["stock"] == ["aten.batch_norm.default"]
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
        "sync,qat_pt2e,fsdp2_bf16",
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
            except Exception as e:  # every section reports its own failure
                res = {
                    "status": f"error: {type(e).__name__}: {e}",
                    "traceback": traceback.format_exc()[-3000:],
                    "ok": False,
                }
            report["sections"][name] = res
        report["sections"][name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(summary_line(name, report["sections"][name], dry), flush=True)
        finish()
    finish()
    verdict = "ALL OK" if report["all_ok"] else "PROBLEMS: " + ", ".join(report["problems"])
    print(
        f"{'DRY ' if dry else ''}{verdict} in {report['seconds']:.0f} s; JSON: {path}"
        + (f" (dry: {info['dry_reason']})" if dry else ""),
        flush=True,
    )
    return 0 if report["all_ok"] else 1


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
        detail = f"bnswap: {_kinds(s['bnswap'])}; stock: {_kinds(s['stock'])}"
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
            f"{_kinds(j['stock'])}"
        )
    elif name == "converted_program":
        detail = (
            f"moved to {s['moved_to']}: converted {_kinds(s['bnswap'])}; original "
            f"{_kinds(s['stock'])}"
        )
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
