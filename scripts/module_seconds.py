"""Seconds each test module took, from a pytest JUnit XML report, as tests/module_seconds.txt wants
them (the order pytest-xdist hands modules out in: longest first; tests/conftest.py).

    .venv/bin/python -m pytest -n 2 --dist loadfile --junitxml=/tmp/junit.xml ...
    .venv/bin/python scripts/module_seconds.py /tmp/junit.xml > tests/module_seconds.txt
"""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parents[1]


def module_of(classname: str) -> str:
    """``tests.tiers.test_cluster`` (or ``...test_cluster.TestClass``) -> ``tests/tiers/test_cluster.py``."""
    parts = classname.split(".")
    while parts and not (ROOT / Path(*parts).with_suffix(".py")).is_file():
        parts.pop()
    return str(Path(*parts).with_suffix(".py")) if parts else classname


def main(path: str) -> int:
    seconds: Counter[str] = Counter()
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        seconds[module_of(case.get("classname", ""))] += float(case.get("time") or 0)
    print("# seconds per test module in a whole run (scripts/module_seconds.py); longest first")
    for module, total in seconds.most_common():
        if total >= 1.0:
            print(f"{total:.0f} {module}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
