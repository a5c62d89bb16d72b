"""Runs unittest tests and, under `bazel test`, writes one JUnit <testcase>
per test method to $XML_OUTPUT_FILE, so scripts/count_tests.py counts test
cases rather than one case per sh_test target. A test whose subtests fail
counts as one failed case.

  from junit_xml import run_tests
  run_tests(argv)   # instead of unittest.main(argv=argv); exits
"""
import os
import sys
import time
import unittest
import xml.etree.ElementTree as ET


class _Result(unittest.TextTestResult):
    """TextTestResult that also remembers every case's outcome and time."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cases = {}  # test id -> {"test", "seconds", "outcome", "text"}
        self._started = {}

    def startTest(self, test):
        self._started[test.id()] = time.monotonic()
        self.cases[test.id()] = {"test": test, "seconds": 0.0, "outcome": "passed", "text": ""}
        super().startTest(test)

    def stopTest(self, test):
        case = self.cases[test.id()]
        case["seconds"] = time.monotonic() - self._started.pop(test.id())
        super().stopTest(test)

    def _mark(self, test, outcome, err):
        case = self.cases.setdefault(test.id(), {"test": test, "seconds": 0.0,
                                                 "outcome": "passed", "text": ""})
        if case["outcome"] in ("passed", "skipped") or outcome == "error":
            case["outcome"] = outcome
        case["text"] += self._exc_info_to_string(err, test) if err else ""

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self._mark(test, "failure", err)

    def addError(self, test, err):
        super().addError(test, err)
        # setUpClass errors arrive with a _ErrorHolder "test": mark every case.
        self._mark(test, "error", err)

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self.cases[test.id()]["outcome"] = "skipped"
        self.cases[test.id()]["text"] = reason

    def addSubTest(self, test, subtest, err):
        super().addSubTest(test, subtest, err)
        if err is not None:
            outcome = "failure" if issubclass(err[0], test.failureException) else "error"
            self._mark(test, outcome, err)
            self.cases[test.id()]["text"] = (
                self.cases[test.id()]["text"].rstrip() + f"\n  in subtest {subtest._subDescription()}\n")


def _write_xml(path, result, suite_name):
    cases = list(result.cases.values())
    counts = {o: sum(c["outcome"] == o for c in cases) for o in ("failure", "error", "skipped")}
    suite = ET.Element("testsuite", name=suite_name, tests=str(len(cases)),
                       failures=str(counts["failure"]), errors=str(counts["error"]),
                       skipped=str(counts["skipped"]))
    for c in cases:
        test = c["test"]
        cls = type(test)
        case = ET.SubElement(suite, "testcase",
                             classname=f"{cls.__module__}.{cls.__name__}",
                             name=getattr(test, "_testMethodName", str(test)),
                             time=f"{c['seconds']:.3f}")
        if c["outcome"] != "passed":
            tag = "skipped" if c["outcome"] == "skipped" else c["outcome"]
            child = ET.SubElement(case, tag, message=c["text"].strip().splitlines()[-1][:200]
                                  if c["text"].strip() else tag)
            child.text = c["text"]
    root = ET.Element("testsuites")
    root.append(suite)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def run_tests(argv):
    """unittest.main over __main__'s tests; JUnit XML for Bazel; exits."""
    runner = unittest.TextTestRunner(resultclass=_Result, verbosity=2)
    program = unittest.main(module="__main__", argv=argv, testRunner=runner, exit=False)
    result = program.result
    xml_path = os.environ.get("XML_OUTPUT_FILE")
    if xml_path:
        _write_xml(xml_path, result, os.path.basename(argv[0]))
    sys.exit(0 if result.wasSuccessful() else 1)
