"""Render a results dict (see :mod:`benchmarks.__main__`) as Markdown and as a PNG plot."""

from __future__ import annotations

from benchmarks.cases import TITLES


def _ci(r: dict) -> str:
    lo, hi = r["ratio_ci95"]
    return f"{lo:.3f}-{hi:.3f}"


def _short(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16"}.get(dtype, dtype)


def _cpu(r: dict) -> str:
    v = r.get("cpu_ratio_median")
    return "-" if v is None else f"{v:.3f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def to_markdown(res: dict) -> str:
    m = res["machine"]
    lines = [
        "# bnswap benchmarks",
        "",
        f"Run {res['created']} with `{res['command']}`"
        + (" (quick mode: CI-size, not for quoting)" if res["config"]["quick"] else "")
        + ".",
        "",
        f"Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, {m['memory_gib']} GiB, "
        f"{m['os']}; Python {m['python']}, torch {m['torch']} "
        f"({m.get('cpu_capability', '?')}), {m['torch_threads']} torch thread(s); "
        f"load average {m['load_average_start']} at start, {m.get('load_average_end')} at end; "
        f"a 1M-iteration Python loop took {m.get('python_loop_1m_ms_start')} / "
        f"{m.get('python_loop_1m_ms_end')} ms (start / end); "
        f"commit {m['git_commit']}.",
        "",
        "Ratios are bnswap / reference: the median of per-pair ratios of interleaved runs "
        "(A, B, A, B, ... in one process, after warm-up), with its 95 % confidence interval, "
        "in wall-clock time (`time.perf_counter`); the CPU-time ratio is the same samples in "
        "process CPU time. Lower is better; goals are upper bounds.",
    ]
    if res.get("note"):
        lines += ["", f"Note: {res['note']}"]
    cases = res["cases"]
    for key in sorted(cases):
        c = cases[key]
        lines += ["", f"## {key}: {TITLES.get(key, key)}", ""]
        if c["status"] != "ok":
            lines.append(f"{c['status']}" + (f" ({c['detail']})" if c.get("detail") else ""))
            continue
        lines.append(f"Goal: {c['goal']}.")
        if c.get("note"):
            lines.append(f"Note: {c['note']}.")
        lines.append("")
        rows = c["rows"]
        if key == "P1":
            lines += _table(
                [
                    "net",
                    "dtype",
                    "BN layers",
                    "bnswap ms",
                    "stock ms",
                    "ratio (median)",
                    "95 % CI",
                    "CPU-time ratio",
                    "pairs",
                    "fixed-cost estimate",
                    "verdict",
                ],
                [
                    [
                        r["net"],
                        r["dtype"],
                        str(r.get("bn_layers", "")),
                        f"{r['a_median_ms']:.2f}",
                        f"{r['b_median_ms']:.2f}",
                        f"{r['ratio_median']:.3f}",
                        _ci(r),
                        _cpu(r),
                        str(r["pairs"]),
                        f"{r['fixed_cost_estimate']:.4f}" if "fixed_cost_estimate" in r else "-",
                        r["verdict"],
                    ]
                    if "ratio_median" in r
                    # a skipped zoo net
                    else [r["net"], r["dtype"], *["-"] * 8, r["verdict"]]
                    for r in rows
                ],
            )
            f = c.get("fixed_layer_cost")
            if f:
                lines += [
                    "",
                    f"Fixed-cost estimate: 1 + BN layers x (bnswap - stock layer time, "
                    f"forward+backward on a (4,8,2,2) input: {f['bnswap_us']:.1f} - "
                    f"{f['stock_us']:.1f} = {f['delta_us']:+.1f} us) / stock step time. "
                    "Both variants run the same ATen kernels, so this size-independent "
                    "per-layer cost (Python and op dispatch) is the whole expected "
                    "difference; it is not subject to the step-time noise.",
                ]
            if c.get("control"):
                r = c["control"]
                lines += [
                    "",
                    f"A/A control (stock / an identical stock copy, convnet4 float32, "
                    f"same harness): {r['ratio_median']:.3f} ({_ci(r)}): the noise floor "
                    "of this run.",
                ]
        elif key == "P4":
            lines += _table(
                [
                    "net",
                    "dtype",
                    "ORT ms",
                    "stock ms",
                    "ratio (median)",
                    "95 % CI",
                    "CPU-time ratio",
                    "pairs",
                    "verdict",
                ],
                [
                    [
                        r["net"],
                        r["dtype"],
                        f"{r['a_median_ms']:.2f}",
                        f"{r['b_median_ms']:.2f}",
                        f"{r['ratio_median']:.3f}",
                        _ci(r),
                        _cpu(r),
                        str(r["pairs"]),
                        r["verdict"],
                    ]
                    for r in rows
                ],
            )
            for b in c.get("breakdown", []):
                fams = b["families"]
                tot_o, tot_a = sum(f["ort_ms"] for f in fams), sum(f["aten_ms"] for f in fams)
                lines += [
                    "",
                    f"Where the time goes, {b['net']} ({b['threads']} thread(s), ms "
                    f"per train step, mean of {b['steps']}): ORT kernel time by its "
                    "session profiler, eager ATen self time by the torch profiler.",
                    "",
                ]
                lines += _table(
                    ["kernel family", "ORT ms", "eager ATen ms", "ORT - eager ms"],
                    [
                        [
                            f["family"],
                            f"{f['ort_ms']:.2f}",
                            f"{f['aten_ms']:.2f}",
                            f"{f['ort_ms'] - f['aten_ms']:+.2f}",
                        ]
                        for f in fams
                    ]
                    + [["total", f"{tot_o:.2f}", f"{tot_a:.2f}", f"{tot_o - tot_a:+.2f}"]],
                )
            m = c.get("relu_grad")
            if m:
                lines += [
                    "",
                    f"ReLU backward kernel alone, {tuple(m['shape'])} float32, one "
                    f"thread: ORT `ReluGrad` {m['ort_relugrad_ms']:.2f} ms, ATen "
                    f"`threshold_backward` {m['aten_threshold_backward_ms']:.2f} ms "
                    f"(ratio {m['ratio_median']:.1f}, 95 % CI "
                    f"{m['ratio_ci95'][0]:.1f}-{m['ratio_ci95'][1]:.1f}); outputs equal.",
                ]
        elif key == "P2":
            lines += _table(
                [
                    "net",
                    "dtype",
                    "bnswap ms",
                    "stock ms",
                    "ratio (median)",
                    "95 % CI",
                    "CPU-time ratio",
                    "pairs",
                    "graph breaks bnswap / stock",
                    "first step s bnswap / stock",
                    "identical generated kernels",
                    "verdict",
                ],
                [
                    [
                        r["net"],
                        r["dtype"],
                        f"{r['a_median_ms']:.2f}",
                        f"{r['b_median_ms']:.2f}",
                        f"{r['ratio_median']:.3f}",
                        _ci(r),
                        _cpu(r),
                        str(r["pairs"]),
                        f"{r['graph_breaks_bnswap']} / {r['graph_breaks_stock']}",
                        f"{r['first_step_s_bnswap']:.1f} / {r['first_step_s_stock']:.1f}",
                        {
                            True: f"yes ({r['kernels_bnswap']})",
                            False: f"no ({r['kernels_bnswap']} / {r['kernels_stock']})",
                            None: "n/a",
                        }[r["same_kernels"]],
                        r["verdict"],
                    ]
                    for r in rows
                ],
            )
            lines += [
                "",
                "Identical generated kernels: inductor's C++ kernel sources (names "
                "and wrapper argument order aside) are the same multiset for both "
                "models, so any time difference is noise or Python-side (guards, "
                "optimizer).",
            ]
        elif key == "P3":
            lines += _table(
                [
                    "input",
                    "pass",
                    "layer us",
                    "raw op us",
                    "overhead (median)",
                    "95 % CI",
                    "fixed-cost estimate",
                    "pairs x calls (layer/op)",
                    "verdict",
                ],
                [
                    [
                        f"{r['size']} {tuple(r['shape'])}",
                        r["mode"],
                        f"{r['a_median_us']:.1f}",
                        f"{r['b_median_us']:.1f}",
                        f"{r['overhead_pct']:+.2f} %",
                        f"{(r['ratio_ci95'][0] - 1) * 100:+.2f} "
                        f"to {(r['ratio_ci95'][1] - 1) * 100:+.2f} %",
                        (
                            f"{r['fixed_overhead_us']:.1f} us "
                            f"= {r['fixed_cost_overhead_pct']:+.3f} %"
                            if "fixed_cost_overhead_pct" in r
                            else "-"
                        ),
                        f"{r['pairs']} x {r['inner']}/{r['inner_b']}",
                        r["verdict"],
                    ]
                    for r in rows
                ],
            )
            lines += [
                "",
                "Fixed-cost estimate: the layer's extra time over the op at tiny size "
                "(size-independent work) divided by the op's time at ResNet size.",
            ]
            if c.get("vs_stock"):
                lines += [
                    "",
                    "For context (no goal), the bnswap layer against stock "
                    "`nn.BatchNorm2d` on the same input:",
                    "",
                ]
                lines += _table(
                    [
                        "input",
                        "pass",
                        "bnswap layer us",
                        "stock layer us",
                        "ratio (median)",
                        "95 % CI",
                        "pairs x calls",
                    ],
                    [
                        [
                            f"{r['size']} {tuple(r['shape'])}",
                            r["mode"],
                            f"{r['a_median_us']:.1f}",
                            f"{r['b_median_us']:.1f}",
                            f"{r['ratio_median']:.3f}",
                            _ci(r),
                            f"{r['pairs']} x {r['inner']}/{r['inner_b']}",
                        ]
                        for r in c["vs_stock"]
                    ],
                )
            if c.get("dispatcher"):
                lines += [
                    "",
                    "The class dispatcher's own cost (no goal), in one process where a swap "
                    "has put it on `_BatchNorm`: a stock layer's `forward` (the dispatcher "
                    "finds no mark, calls the class's own forward) against that forward "
                    "called directly; a swapped layer's `forward` against its adapter "
                    "called directly; an A/A control. `nn.Module.__call__` is left out "
                    "on both sides:",
                    "",
                ]
                lines += _table(
                    [
                        "mode",
                        "compare",
                        "via dispatcher us",
                        "direct us",
                        "extra ns",
                        "ratio (median)",
                        "95 % CI",
                        "pairs x calls",
                    ],
                    [
                        [
                            r["mode"],
                            r["compare"],
                            f"{r['a_median_us']:.3f}",
                            f"{r['b_median_us']:.3f}",
                            f"{r['extra_ns']:+.0f}",
                            f"{r['ratio_median']:.3f}",
                            _ci(r),
                            f"{r['pairs']} x {r['inner']}/{r['inner_b']}",
                        ]
                        for r in c["dispatcher"]
                    ],
                )
            lines += [
                "",
                "Bandwidth of `aten._batch_norm_with_update` (bytes it must move: "
                "forward reads x and writes y, backward reads dy and x and writes dx) "
                "against `clone()` (reads and writes the tensor once) on the same tensor:",
                "",
            ]
            lines += _table(
                ["input", "pass", "op us", "op GB/s", "clone us", "clone GB/s", "op / clone"],
                [
                    [
                        f"{r['size']} {tuple(r['shape'])}",
                        r["mode"],
                        f"{r['op_median_us']:.1f}",
                        f"{r['op_gbps']:.2f}",
                        f"{r['clone_median_us']:.1f}",
                        f"{r['clone_gbps']:.2f}",
                        f"{r['fraction_of_clone'] * 100:.0f} %",
                    ]
                    for r in c["bandwidth"]
                ],
            )
        elif key == "P5":
            lines += _table(
                [
                    "BN layers",
                    "modules",
                    "convert ms",
                    "revert ms",
                    "convert us/layer",
                    "revert us/layer",
                    "`list(modules())` ms",
                    "convert / traversal",
                    "revert / traversal",
                    "verdict",
                ],
                [
                    [
                        f"{r['layers']:,}",
                        f"{r['modules']:,}",
                        f"{r['convert_ms']:.2f}",
                        f"{r['revert_ms']:.2f}",
                        f"{r['convert_us_per_layer']:.1f}",
                        f"{r['revert_us_per_layer']:.1f}",
                        f"{r['traversal_ms']:.2f}",
                        f"{r['convert_over_traversal']:.1f}",
                        f"{r['revert_over_traversal']:.1f}",
                        r.get("verdict", ""),
                    ]
                    for r in rows
                ],
            )
            g = c["per_layer_growth"]
            rel = c.get("growth_relative_to_traversal")
            lines += [
                "",
                f"Per-layer cost at {g['to']:,} layers / at {g['from']:,}: convert "
                f"{g['convert']:.2f}, revert {g['revert']:.2f}"
                + (
                    f", a bare `list(model.modules())` {g['traversal']:.2f} per module"
                    if "traversal" in g
                    else ""
                )
                + (
                    f"; relative to that traversal: convert {rel['convert']:.2f}, revert "
                    f"{rel['revert']:.2f}"
                    if rel
                    else ""
                )
                + f". {'Linear' if c['linear'] else 'NOT linear'} (per-layer growth < 1.5, "
                "or < 1.2 relative to the traversal, which slows per module as the model "
                "outgrows the CPU caches).",
            ]
        elif key == "P6":
            lines += _table(
                [
                    "net",
                    "dtype",
                    "bnswap step peak MiB",
                    "stock step peak MiB",
                    "ratio",
                    "max RSS MiB bnswap / stock",
                    "verdict",
                ],
                [
                    [
                        r["net"],
                        r["dtype"],
                        f"{r['bnswap_peak_mib']:.2f}",
                        f"{r['stock_peak_mib']:.2f}",
                        f"{r['ratio']:.4f}",
                        f"{r['bnswap_maxrss_mib']:.0f} / {r['stock_maxrss_mib']:.0f}",
                        r["verdict"],
                    ]
                    for r in rows
                ],
            )
            lines += ["", f"Method: {c['method']}."]
        if c.get("errors"):
            lines += ["", "Errors: " + "; ".join(c["errors"])]
    lines.append("")
    return "\n".join(lines)


def to_png(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = res["cases"]
    ok = {k: c for k, c in cases.items() if c["status"] == "ok"}
    panels = []
    ratio_rows = []  # (label, median, lo, hi, goal)
    for key in ("P1", "P2", "P4"):
        for r in ok.get(key, {}).get("rows", []):
            if "ratio_median" not in r:  # skipped (a zoo net without its package)
                continue
            ratio_rows.append(
                (
                    f"{key} {r['net']} {_short(r['dtype'])}",
                    r["ratio_median"],
                    *r["ratio_ci95"],
                    r["goal"],
                )
            )
    for r in ok.get("P6", {}).get("rows", []):
        ratio_rows.append(
            (f"P6 mem {r['net']} {_short(r['dtype'])}", r["ratio"], r["ratio"], r["ratio"], 1.0)
        )
    if ratio_rows:
        panels.append("ratios")
    if "P3" in ok:
        panels.append("P3")
    if "P5" in ok:
        panels.append("P5")
    if not panels:
        panels = ["empty"]
    fig, axes = plt.subplots(
        1, len(panels), figsize=(6.2 * len(panels), max(4.0, 0.32 * len(ratio_rows) + 1.5))
    )
    if len(panels) == 1:
        axes = [axes]
    for ax, panel in zip(axes, panels, strict=True):
        if panel == "ratios":
            labels = [r[0] for r in ratio_rows][::-1]
            med = [r[1] for r in ratio_rows][::-1]
            err = [[r[1] - r[2] for r in ratio_rows][::-1], [r[3] - r[1] for r in ratio_rows][::-1]]
            colors = [
                "tab:gray" if r[4] is None else "tab:green" if r[1] <= r[4] else "tab:red"
                for r in ratio_rows
            ][::-1]
            ax.barh(
                range(len(labels)),
                [m - 1 for m in med],
                left=1,
                xerr=err,
                color=colors,
                alpha=0.8,
                capsize=3,
            )
            ax.set_yticks(range(len(labels)), labels, fontsize=8)
            ax.axvline(1.0, color="k", lw=1)
            ax.set_xlabel("bnswap / reference (median of pair ratios, 95 % CI)")
            ax.set_title("P1/P2/P4 time ratios, P6 memory ratio")
        elif panel == "P3":
            rows = [r for r in ok["P3"]["rows"] if r["size"] != "tiny"]
            tiny = [r for r in ok["P3"]["rows"] if r["size"] == "tiny"]
            labels = [f"{r['size']} {'fwd' if r['mode'] == 'forward' else 'fwd+bwd'}" for r in rows]
            vals = [r["overhead_pct"] for r in rows]
            err = [
                [(r["ratio_median"] - r["ratio_ci95"][0]) * 100 for r in rows],
                [(r["ratio_ci95"][1] - r["ratio_median"]) * 100 for r in rows],
            ]
            ax.bar(
                range(len(rows)),
                vals,
                yerr=err,
                capsize=3,
                color=[
                    "tab:gray"
                    if r["goal"] is None
                    else ("tab:green" if r["ratio_median"] <= r["goal"] else "tab:red")
                    for r in rows
                ],
            )
            ax.axhline(2.0, color="tab:red", ls="--", lw=1, label="goal (ResNet size): 2 %")
            ax.set_xticks(range(len(rows)), labels, fontsize=8)
            ax.set_ylabel("layer overhead over raw aten op, % (95 % CI)")
            ax.set_ylim(min(-5.0, ax.get_ylim()[0]), max(10.0, ax.get_ylim()[1]) * 1.6)
            for i, r in enumerate(rows):
                if "fixed_cost_overhead_pct" in r:
                    ax.plot(
                        [i],
                        [r["fixed_cost_overhead_pct"]],
                        "kD",
                        ms=5,
                        label="fixed-cost estimate" if i == 0 else None,
                    )
            bw = ok["P3"].get("bandwidth", [])
            txt = "\n".join(
                [
                    f"tiny {'fwd' if r['mode'] == 'forward' else 'f+b'}: "
                    f"layer {r['a_median_us']:.0f} us, "
                    f"op {r['b_median_us']:.0f} us ({r['overhead_pct']:+.0f} %)"
                    for r in tiny
                ]
                + [
                    f"{b['size']} {'fwd' if b['mode'] == 'forward' else 'f+b'} op: "
                    f"{b['op_gbps']:.3g} GB/s = {b['fraction_of_clone'] * 100:.0f} % of clone"
                    for b in bw
                ]
            )
            if txt:
                ax.text(
                    0.02,
                    0.98,
                    txt,
                    transform=ax.transAxes,
                    va="top",
                    fontsize=7,
                    family="monospace",
                    bbox={"facecolor": "white", "alpha": 0.8},
                )
            ax.legend(loc="upper right", fontsize=8)
            ax.set_title("P3 layer overhead over the raw op, ResNet size")
        elif panel == "P5":
            rows = ok["P5"]["rows"]
            n = [r["layers"] for r in rows]
            ax.loglog(n, [r["convert_ms"] for r in rows], "o-", label="convert")
            ax.loglog(n, [r["revert_ms"] for r in rows], "s-", label="revert")
            ref = next((r for r in rows if r["layers"] == 1000), rows[-1])
            ax.loglog(
                n,
                [ref["convert_ms"] * k / ref["layers"] for k in n],
                "k:",
                lw=1,
                label="linear through convert at 1,000",
            )
            ax.loglog(
                n,
                [r["traversal_ms"] for r in rows],
                "^--",
                color="gray",
                lw=1,
                label="list(model.modules())",
            )
            ax.axhline(20, color="tab:red", ls="--", lw=1, label="20 ms goal (at 1,000)")
            ax.set_xlabel("BatchNorm layers")
            ax.set_ylabel("ms")
            ax.legend(fontsize=8)
            ax.set_title("P5 convert / revert")
        else:
            ax.text(0.5, 0.5, "no results", ha="center")
            ax.set_axis_off()
    m = res["machine"]
    fig.suptitle(
        f"bnswap benchmarks: {m['cpu']}, {m['torch_threads']} thread(s), torch {m['torch']}"
        + (" (quick)" if res["config"]["quick"] else ""),
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
