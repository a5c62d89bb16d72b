#!/usr/bin/env python3
"""Counts test *cases* (not targets) from Bazel's JUnit XML files.

usage: scripts/count_tests.py LABEL...   (labels from `bazel query`)

Prints one line "N passed, N failed, N skipped" and exits 1 when any test case
failed or a test target left no XML (which Bazel only does if it never ran).
A target that crashed before writing its own XML still gets a Bazel-written
XML with an <error>, which counts as one failed case.
"""
import glob
import os
import sys
import xml.etree.ElementTree as ET


def xml_paths(label: str):
    """The target's test.xml, or one per shard (shard_K_of_N/test.xml) when
    it sets shard_count; [] when it never ran. Bazel leaves the other kind
    behind when shard_count changes, so the newer kind is this run's."""
    pkg, _, name = label.lstrip("/").partition(":")
    base = os.path.join("bazel-testlogs", pkg, name)
    single = os.path.join(base, "test.xml")
    shards = sorted(glob.glob(os.path.join(base, "shard_*_of_*", "test.xml")))
    if shards and (not os.path.exists(single) or
                   min(map(os.path.getmtime, shards)) >=
                   os.path.getmtime(single)):
        expected = int(shards[0].split(os.sep)[-2].rsplit("_", 1)[1])
        # A shard that never ran leaves a hole: the target counts as missing.
        return shards if len(shards) == expected else []
    return [single] if os.path.exists(single) else []


def first_line(case) -> str:
    """The first lines of a failed case's message (gtest writes the file:line
    and the expectation there), so a log's tail names what broke."""
    for tag in ("failure", "error"):
        node = case.find(tag)
        if node is not None:
            text = node.get("message") or node.text or ""
            return " | ".join(text.strip().splitlines()[:3])[:400]
    return ""


def count(path: str, label: str = ""):
    passed = failed = skipped = 0
    root = ET.parse(path).getroot()
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
            name = ".".join(filter(None, (case.get("classname"),
                                          case.get("name"))))
            print(f"FAILED case {label} {name}: {first_line(case)}",
                  file=sys.stderr)
        elif (case.find("skipped") is not None
              or case.get("result") == "skipped"
              or case.get("status") == "notrun"):
            skipped += 1
        else:
            passed += 1
    return passed, failed, skipped


def main(labels):
    totals = [0, 0, 0]
    missing = []
    for label in labels:
        paths = xml_paths(label)
        if not paths:
            missing.append(label)
            continue
        result = (0, 0, 0)
        for path in paths:
            try:
                one = count(path, label)
            except ET.ParseError as err:
                print(f"unreadable {path}: {err}", file=sys.stderr)
                one = (0, 1, 0)
            result = tuple(a + b for a, b in zip(result, one))
        for i, v in enumerate(result):
            totals[i] += v
        if result[1]:
            print(f"FAILED in {label}", file=sys.stderr)
    for label in missing:
        print(f"no test.xml for {label} (did not run)", file=sys.stderr)
    totals[1] += len(missing)
    print(f"{totals[0]} passed, {totals[1]} failed, {totals[2]} skipped")
    return 1 if totals[1] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
