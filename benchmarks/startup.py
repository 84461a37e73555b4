"""Start-up time of the ``bnswap`` command (issue 21, item 1): wall seconds of a fresh
process for ``bnswap --help``, ``bnswap plan`` and ``bnswap`` with a mistyped
subcommand, beside ``python -c "import torch"`` (the floor of anything that builds a
model) and ``python -c pass`` (the interpreter alone), in one process, interleaved.

    python benchmarks/startup.py [--rounds 7] [--out benchmarks/results/startup]

Each round runs every command once, in turn, so a load on the machine falls on all of
them alike; the report gives each command's median and min over the rounds and its
median ratio to ``import torch`` (per round). It also records the modules each command
imported (``-X importtime``): ``--help`` must import no torch. Goal: ``--help`` under
1.5 s; ``plan`` is bounded below by ``import torch``.

The commands run as the console script does (``python -m _bnswap_command``), from a
folder outside the checkout, with this interpreter and the checkout first on
PYTHONPATH.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: name -> argv after the interpreter
COMMANDS: dict[str, list[str]] = {
    "python -c pass": ["-c", "pass"],
    "import torch": ["-c", "import torch"],
    "bnswap --help": ["-m", "_bnswap_command", "--help"],
    "bnswap nope": ["-m", "_bnswap_command", "nope"],
    "bnswap plan": [
        "-m",
        "_bnswap_command",
        "plan",
        "--model",
        "torch.nn.BatchNorm2d",
        "--model.num_features",
        "8",
    ],
}
#: exit status each command must give (a command that failed measured nothing)
EXPECTED_RC = {"bnswap nope": 2}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def time_once(argv: list[str], cwd: str, expected_rc: int = 0) -> float:
    """Wall seconds of one fresh ``python argv`` process run to its end."""
    start = time.perf_counter()
    p = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, cwd=cwd, env=_env(), timeout=120
    )
    seconds = time.perf_counter() - start
    if p.returncode != expected_rc:
        raise RuntimeError(f"{argv}: exit {p.returncode}, expected {expected_rc}\n{p.stderr}")
    return seconds


def imports(argv: list[str], cwd: str) -> set[str]:
    """The top-level packages a fresh ``python argv`` imports (``-X importtime``)."""
    p = subprocess.run(
        [sys.executable, "-X", "importtime", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=_env(),
        timeout=120,
    )
    return {
        line.rsplit("|", 1)[1].strip().split(".")[0]
        for line in p.stderr.splitlines()
        if line.startswith("import time:") and "|" in line and "cumulative" not in line
    }


def run(rounds: int, names: list[str] | None = None) -> dict:
    """Every command of :data:`COMMANDS` (or ``names``) once per round, interleaved."""
    names = names or list(COMMANDS)
    samples: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as cwd:
        for name in names:  # warm the file cache once, untimed
            time_once(COMMANDS[name], cwd, EXPECTED_RC.get(name, 0))
        for _ in range(rounds):
            for name in names:
                samples[name].append(time_once(COMMANDS[name], cwd, EXPECTED_RC.get(name, 0)))
        imported = {
            n: sorted(
                imports(COMMANDS[n], cwd)
                & {"torch", "lightning", "jsonargparse", "bnswap", "onnxruntime"}
            )
            for n in names
        }
    report: dict = {
        "date": datetime.date.today().isoformat(),
        "rounds": rounds,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "commands": {},
    }
    base = samples.get("import torch")
    for name in names:
        row = {
            "median_s": statistics.median(samples[name]),
            "min_s": min(samples[name]),
            "samples_s": samples[name],
            "imports": imported[name],
        }
        if base is not None:
            row["ratio_to_import_torch"] = statistics.median(
                s / b for s, b in zip(samples[name], base, strict=True)
            )
        report["commands"][name] = row
    return report


def markdown(report: dict) -> str:
    lines = [
        f"Start-up of the `bnswap` command, {report['date']}: {report['rounds']} "
        f"interleaved rounds, Python {report['python']}, {report['cpus']} CPUs; seconds "
        "of a fresh process (`python benchmarks/startup.py`).",
        "",
        "| command | median s | min s | / import torch | imports |",
        "|---|---|---|---|---|",
    ]
    for name, row in report["commands"].items():
        ratio = row.get("ratio_to_import_torch")
        lines.append(
            f"| `{name}` | {row['median_s']:.2f} | {row['min_s']:.2f} | "
            f"{'-' if ratio is None else f'{ratio:.2f}x'} | "
            f"{', '.join(row['imports']) or '-'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python benchmarks/startup.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    ap.add_argument(
        "--out",
        default=os.path.join(ROOT, "benchmarks", "results", "startup"),
        help="output stem: writes STEM.json and STEM.md",
    )
    ap.add_argument(
        "--commands", default=None, help="comma-separated subset of: " + ", ".join(COMMANDS)
    )
    args = ap.parse_args(argv)
    names = args.commands.split(",") if args.commands else None
    unknown = sorted(set(names or ()) - set(COMMANDS))
    if unknown:
        ap.error(f"unknown commands {unknown}")
    report = run(args.rounds, names)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=1)
    text = markdown(report)
    with open(args.out + ".md", "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
