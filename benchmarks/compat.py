"""Summarise ``make compat``: one row per torch release from the JUnit XML files pytest
wrote (``build/compat/<release>.xml``), as a Markdown table, printed and written to
``benchmarks/results/compat.md``. Standard library only (runs under any Python).

Usage: ``python3 benchmarks/compat.py build/compat/2.4.1.xml build/compat/2.9.1.xml ...``
"""

from __future__ import annotations

import datetime
import pathlib
import sys
import xml.etree.ElementTree as ET

OUT = pathlib.Path(__file__).resolve().parent / "results" / "compat.md"


def counts(path: pathlib.Path) -> dict[str, int]:
    """passed / skipped / failed (failures + errors) of one JUnit XML file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {
        k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")
    }
    failed = total["failures"] + total["errors"]
    return {
        "passed": total["tests"] - failed - total["skipped"],
        "skipped": total["skipped"],
        "failed": failed,
    }


def failures(path: pathlib.Path) -> list[str]:
    root = ET.parse(path).getroot()
    return [
        f"{c.get('classname')}::{c.get('name')}"
        for c in root.iter("testcase")
        if c.find("failure") is not None or c.find("error") is not None
    ]


def main(argv: list[str]) -> int:
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    lines = [
        "# torch releases: bnswap's core suite (`make compat`)",
        "",
        f"{date}; CPU; the test files: `COMPAT_TESTS` in the Makefile.",
        "",
        "| torch | passed | skipped | failed |",
        "|---|---|---|---|",
    ]
    bad: list[str] = []
    for arg in argv:
        path = pathlib.Path(arg)
        release = path.stem
        if not path.exists():
            lines.append(f"| {release} | - | - | no result (install or run failed) |")
            bad.append(f"{release}: no result")
            continue
        c = counts(path)
        lines.append(f"| {release} | {c['passed']} | {c['skipped']} | {c['failed']} |")
        bad += [f"{release}: {name}" for name in failures(path)]
    if bad:
        lines += ["", "Failed:", ""] + [f"- {b}" for b in bad]
    text = "\n".join(lines) + "\n"
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(text, end="")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
