#!/usr/bin/env python3
"""Write the fault-injection suite's figures into README.md's reliability section.

    PEAGLE_RELIABILITY_OUT=reliability.json .venv/bin/python -m pytest tests/faults
    python scripts/reliability_report.py reliability.json            # rewrite the README section
    python scripts/reliability_report.py reliability.json --check    # exit 1 if the README is stale

The suite (tests/faults/conftest.py) writes one JSON summary: per test its area, outcome, trials,
faults injected and survived, bad inputs tried and handled, and data lost. This script renders that
as a Markdown table and replaces exactly the text between the two marker lines below in README.md;
every other byte of the README stays as it is. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BEGIN = "<!-- reliability:begin -->"
END = "<!-- reliability:end -->"

AREAS = {  # summary area -> table row label, in table order
    "extract": "`kill -9` during `peagle extract` (1, 2 and 4 workers)",
    "train": "`kill -9` during `peagle train`; damaged checkpoints",
    "store": "damaged shard store (sizes, sha256, records)",
    "disk full": "disk full (file-size limit, tmpfs)",
    "bad inputs": "malformed input records",
    "half-made writes": "`kill -9` of `peagle export`, `store convert` and a store's first run; unusable stores",
    "damaged exports": "damaged exports (config.json fields, cut short, sizes)",
    "secrets": "secrets in a `--config` file and the environment (every file and line of train, export, eval)",
    "hostile input": "a received run, planted pickles, hostile servers and config files; a held lock",
    "files from elsewhere": "a store or run from elsewhere naming files outside it (`../`, absolute paths, links)",
}
COLUMNS = ("trials", "faults_injected", "faults_survived", "bad_inputs_tried", "bad_inputs_handled", "data_lost")
HEADER = ("| What | Tests passed | Trials | Faults injected | Faults survived | Bad inputs tried | "
          "Bad inputs handled | Data lost |")


def load_summary(path: Path) -> dict:
    try:
        summary = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SystemExit(f"reliability_report: cannot read {path}: {err}")
    if not isinstance(summary, dict) or not isinstance(summary.get("tests"), list):
        raise SystemExit(f"reliability_report: {path} is not a fault-suite summary (no 'tests' list)")
    return summary


def _row(label: str, tests: list[dict]) -> str:
    run = [t for t in tests if t.get("outcome") != "skipped"]
    passed = sum(t.get("outcome") == "passed" for t in run)
    sums = [sum(int(t.get(c, 0)) for t in run) for c in COLUMNS]
    return f"| {label} | {passed}/{len(run)} | " + " | ".join(f"{v:,}" for v in sums) + " |"


def render(summary: dict) -> str:
    """The Markdown that goes between the markers (no leading/trailing blank lines)."""
    tests = summary["tests"]
    areas = list(AREAS) + sorted({t.get("area", "other") for t in tests} - set(AREAS))
    lines = [
        f"Figures from the fault-injection suite `tests/faults/` (its own output, "
        f"`scripts/reliability_report.py`): {summary.get('tests_passed', 0)} tests passed, "
        f"{summary.get('tests_failed', 0)} failed, {summary.get('tests_skipped', 0)} skipped in "
        f"{summary.get('wall_s', 0):.0f} s on {summary.get('machine', '?')} "
        f"(Python {summary.get('python', '?')}, torch {summary.get('torch', '?')}, CPU).",
        "",
        HEADER,
        "|" + "---|" * (len(COLUMNS) + 2),
    ]
    for area in areas:
        rows = [t for t in tests if t.get("area", "other") == area]
        if rows:
            lines.append(_row(AREAS.get(area, area), rows))
    total = _row("**total**", tests)
    lines.append(total)
    lines.append("")
    catalogue = summary.get("bad_records_catalogue")
    lines.append(
        "A trial is one run-to-completion scenario (a job killed one or more times and re-run, a damaged store "
        "or checkpoint, a full disk); a fault survived means the re-run ended byte-identical to the "
        "uninterrupted run (extract), with identical per-step losses and final weights (train), or the damage "
        "was refused with one clear line and no traceback. Data lost counts good samples (extract, inputs) or "
        "training steps (train) that differ from the uninterrupted run."
        + (f" The malformed-record catalogue (`peagle.testing.bad_records`) holds {catalogue} distinct records; "
           "the bad-input counts add up its uses (per record in process on two tokenizers, through "
           "`peagle extract`, and with `--strict`)." if catalogue else ""))
    failed = [t for t in tests if t.get("outcome") == "failed"]
    if failed:
        lines += ["", "Failing tests (open bugs the suite found):", ""]
        for t in failed:
            claim = t.get("claim") or "; ".join(n for n in t.get("notes", []) if len(n) < 200)
            lines.append(f"- `{t.get('test')}` ({t.get('area')})" + (f": {claim}" if claim else ""))
    return "\n".join(lines)


def replace_section(readme: str, body: str) -> str:
    """``readme`` with the text between the markers replaced by ``body``; nothing else changes."""
    if readme.count(BEGIN) != 1 or readme.count(END) != 1:
        raise SystemExit(f"reliability_report: README must contain exactly one {BEGIN} and one {END} line")
    start = readme.index(BEGIN) + len(BEGIN)
    end = readme.index(END)
    if end < start:
        raise SystemExit(f"reliability_report: {END} comes before {BEGIN} in the README")
    return readme[:start] + "\n" + body + "\n" + readme[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("summary", type=Path, help="JSON summary written by the fault suite (PEAGLE_RELIABILITY_OUT)")
    parser.add_argument("--readme", type=Path, default=Path(__file__).resolve().parents[1] / "README.md")
    parser.add_argument("--check", action="store_true", help="exit 1 if the README section is not up to date")
    parser.add_argument("--print", action="store_true", help="print the section instead of writing the README")
    args = parser.parse_args(argv)

    body = render(load_summary(args.summary))
    if args.print:
        print(body)
        return 0
    try:
        readme = args.readme.read_text()
    except OSError as err:
        raise SystemExit(f"reliability_report: cannot read {args.readme}: {err}")
    updated = replace_section(readme, body)
    if args.check:
        if updated != readme:
            print(f"{args.readme}: reliability section is out of date; run scripts/reliability_report.py",
                  file=sys.stderr)
            return 1
        return 0
    if updated != readme:
        tmp = args.readme.with_name(f".{args.readme.name}.tmp")
        tmp.write_text(updated)
        tmp.replace(args.readme)
    print(f"{args.readme}: reliability section {'updated' if updated != readme else 'already up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
