"""``python -m benchmarks``: run the bnswap benchmark suite (P1-P6) on the CPU.

Writes ``benchmarks/results/latest.json``, ``latest.md`` and ``latest.png`` (or into
``--out``). ``--quick`` is a CI-size run (a few pairs, one network; not for quoting);
``--cases P1,P5`` runs a selection. See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--cases",
        default="P1,P2,P3,P4,P5,P6",
        help="comma-separated subset of P1..P6 (default: all)",
    )
    ap.add_argument(
        "--quick", action="store_true", help="CI-size run: one network, float32, 3 pairs"
    )
    ap.add_argument(
        "--full",
        action="store_true",
        help="P2 also in bfloat16 for mobilenetv2 and resnet18 (adds ~4 inductor "
        "compiles of minutes each on a cold cache)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads (default: $BNSWAP_BENCH_THREADS, else 1)",
    )
    ap.add_argument(
        "--pairs",
        type=int,
        default=None,
        help="override the number of interleaved pairs of every comparison",
    )
    ap.add_argument(
        "--out",
        default=os.path.join(HERE, "results"),
        help="output folder (default: benchmarks/results)",
    )
    ap.add_argument("--name", default="latest", help="output file stem (default: latest)")
    ap.add_argument(
        "--nets",
        default=None,
        help="comma-separated nets to run (default: all of each case's nets); P1 "
        "also has the zoo nets timm_mobilenetv2_100, tv_resnet18 (need timm / "
        "torchvision)",
    )
    ap.add_argument("--note", default=None, help="free text stored with the results")
    return ap.parse_args(argv)


CASE_TITLES = {
    "P1": "eager train step",
    "P2": "inductor train step",
    "P3": "layer over the raw op",
    "P4": "ORT train step",
    "P5": "convert / revert time",
    "P6": "peak memory",
}

#: Seconds each case took in the full run of 2026-11-29 (2-core Xeon, 1 thread), the
#: estimate when no earlier result is at hand; --quick runs take about a tenth.
TYPICAL_SECONDS = {"P1": 166.0, "P2": 87.0, "P3": 19.0, "P4": 204.0, "P5": 6.0, "P6": 62.0}


def expected_seconds(out_dir: str, quick: bool) -> dict[str, float]:
    """Per-case seconds of the last run written to ``out_dir`` (latest.json) when it was
    of the same kind (quick or not), else :data:`TYPICAL_SECONDS`."""
    try:
        with open(os.path.join(out_dir, "latest.json")) as f:
            last = json.load(f)
        if bool(last["config"].get("quick")) == quick:
            return {
                k: float(v["seconds"])
                for k, v in last["cases"].items()
                if v.get("seconds") is not None
            }
    except (OSError, ValueError, KeyError, TypeError):
        pass
    scale = 0.1 if quick else 1.0
    return {k: v * scale for k, v in TYPICAL_SECONDS.items()}


def eta(left: list[str], expected: dict[str, float]) -> str:
    """`` (about N min left)``: the expected seconds of the cases still to run."""
    total = sum(expected.get(k, TYPICAL_SECONDS.get(k, 60.0)) for k in left)
    return (
        f" (about {max(1, round(total / 60))} min left)"
        if total >= 60
        else f" (about {max(1, round(total))} s left)"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("MPLBACKEND", "Agg")
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR", os.path.join(os.path.dirname(HERE), "build", "inductor-cache")
    )
    import torch

    threads = args.threads or int(os.environ.get("BNSWAP_BENCH_THREADS", "1"))
    torch.set_num_threads(threads)

    from benchmarks import report
    from benchmarks.cases import ALL_NETS, CASES, Settings
    from benchmarks.harness import load_average, machine_info, python_loop_ms

    wanted = [c.strip().upper() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in wanted if c not in CASES]
    if unknown:
        print(f"unknown case(s) {unknown}; choose from {sorted(CASES)}", file=sys.stderr)
        return 2
    nets = None
    if args.nets:
        nets = tuple(n.strip() for n in args.nets.split(",") if n.strip())
        bad = [n for n in nets if n not in ALL_NETS]
        if bad:
            print(f"unknown net(s) {bad}; choose from {list(ALL_NETS)}", file=sys.stderr)
            return 2
    settings = Settings(
        quick=args.quick,
        full=args.full,
        pairs=args.pairs,
        nets=nets,
        log=lambda s: print(s, flush=True),
    )
    res: dict = {
        "schema": 1,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": {
            "cases": wanted,
            "quick": args.quick,
            "full": args.full,
            "threads": threads,
            "pairs": args.pairs,
            "nets": list(nets) if nets else None,
        },
        "machine": machine_info(),
        "note": args.note,
        "cases": {},
    }
    t_all = time.perf_counter()
    failed = False
    expected = expected_seconds(args.out, args.quick)
    for i, key in enumerate(wanted):
        print(
            f"{key} ({i + 1} of {len(wanted)}: {CASE_TITLES.get(key, key)}) ..."
            + eta(wanted[i:], expected),
            flush=True,
        )
        t0 = time.perf_counter()
        try:
            out = CASES[key](settings)
        except Exception as e:  # one failing case must not lose the others
            failed = True
            traceback.print_exc()
            out = {"status": f"error: {type(e).__name__}: {e}", "rows": []}
        out["seconds"] = round(time.perf_counter() - t0, 1)
        res["cases"][key] = out
        print(f"{key} done in {out['seconds']:.1f} s: {out['status']}", flush=True)
    res["machine"]["load_average_end"] = load_average()
    res["machine"]["python_loop_1m_ms_end"] = python_loop_ms()
    res["seconds"] = round(time.perf_counter() - t_all, 1)

    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, args.name)
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(report.to_markdown(res))
    try:
        report.to_png(res, stem + ".png")
    except Exception:  # the plot is a convenience; the JSON and table are the record
        traceback.print_exc()
    print(f"wrote {stem}.json, .md, .png in {res['seconds']:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
