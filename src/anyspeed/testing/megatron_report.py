"""The summary of a Megatron-Core unit-test run under anyspeed (``scripts/megatron_tests.sh``):
``python -m anyspeed.testing.megatron_report OUT_DIR``. Per directory: passed, failed and
skipped tests (each rank's outcomes merged: a test fails if it failed on any rank), the files
that timed out or crashed, and every failure with its first error line and its class."""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

from anyspeed.testing.megatron_table import explain_failure, known_skip

RANK = {"passed": 0, "skipped": 1, "failed": 2}


def merged(out_dir: Path) -> dict[str, dict]:
    """Every test's worst outcome over ranks and phases (setup, call, teardown); a test the
    skip table names counts as skipped unless it passed."""
    tests: dict[str, dict] = {}
    for path in sorted(out_dir.glob("results/*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            have = tests.get(row["test"])
            if have is None or RANK[row["outcome"]] > RANK[have["outcome"]]:
                tests[row["test"]] = row
    for test, row in tests.items():  # the table as it is now (a run may predate an entry)
        reason = known_skip(test)
        if reason and row["outcome"] != "passed":
            tests[test] = {**row, "outcome": "skipped", "reason": reason}
    return tests


def directory(test: str) -> str:
    """``tests/unit_tests/transformer/moe/test_x.py::t`` -> ``transformer``."""
    parts = test.split("::")[0].split("/")
    return parts[2] if len(parts) > 3 else "(top level)"


def files_status(out_dir: Path) -> dict[str, str]:
    """Each test file's end: ``ok``, ``timeout`` or ``exit N`` (from the script's log)."""
    path = out_dir / "files.tsv"
    if not path.exists():
        return {}
    rows = (line.split("\t") for line in path.read_text(encoding="utf-8").splitlines() if line)
    return {f: s for f, s in rows}


def report(out_dir: Path) -> str:
    """The summary text."""
    tests = merged(out_dir)
    per_dir: dict[str, Counter] = defaultdict(Counter)
    for t, row in tests.items():
        per_dir[directory(t)][row["outcome"]] += 1
    lines = [f"{'directory':<20} {'passed':>7} {'failed':>7} {'skipped':>8} {'pass rate':>10}"]
    for d in sorted(per_dir):
        c = per_dir[d]
        ran = c["passed"] + c["failed"]
        rate = f"{100 * c['passed'] / ran:.0f}%" if ran else "-"
        lines.append(f"{d:<20} {c['passed']:>7} {c['failed']:>7} {c['skipped']:>8} {rate:>10}")
    bad_files = {f: s for f, s in files_status(out_dir).items() if s != "ok"}
    if bad_files:
        lines.append("\nfiles that did not finish (their unreported tests are not counted):")
        lines += [f"  {f}: {s}" for f, s in sorted(bad_files.items())]
    failed = {t: r for t, r in tests.items() if r["outcome"] == "failed"}
    if failed:
        lines.append("\nfailures:")
        for t in sorted(failed):
            lines.append(f"  {t}\n      [{explain_failure(t)}] {failed[t]['reason']}")
    reasons = Counter(r["reason"] for r in tests.values() if r["outcome"] == "skipped")
    if reasons:
        lines.append("\nskip reasons:")
        lines += [f"  {n:>4} x {r}" for r, n in reasons.most_common()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(Path(sys.argv[1])))
