"""The folder layering of shared/DESIGN.md ("Layout"), enforced.

Reads every #include "..." of the project's C++ and CUDA sources and fails on
an edge between two folders that the table below does not allow. "May
depend on" is transitive downward (engine may include kernels because
runner may, and runner may include model, which may include kernels) and
never upward, so no two folders include each other.

The table is DESIGN.md's, with these additions (each says why):
  - proto/ is the wire contract: the folders that speak gRPC or a wire
    format (rpc, kv_events for SMG's KV event messages, transfer, server)
    and tools/ may include its generated headers.
  - engine/ and transfer/ count into the metric families of metrics/
    (metrics depends only on dispatcher and common, so no cycle follows).
  - tools/ are programs over the libraries (tiny-model maker, probes,
    reference router): any library folder but server/ and the worker's
    own wiring.
The worker's wiring (worker/*.cc, *.h: main and flags), tests/ and bench/
sit on top and may include anything; nothing may include them.
"""
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "deploy"))
import unittest  # noqa: E402

from junit_xml import run_tests  # noqa: E402

# folder -> folders it may include directly (closed transitively below).
ALLOWED = {
    "proto": [],
    "common": [],
    "dispatcher": ["common"],
    "metrics": ["dispatcher", "common"],
    "worker/runtime": ["dispatcher", "common"],
    "worker/kernels": ["worker/runtime"],
    "worker/model": ["worker/kernels"],
    "worker/kv_cache": ["worker/runtime"],
    "worker/runner": ["worker/model", "worker/kv_cache"],
    "worker/kv_events": ["worker/kv_cache", "proto"],
    "worker/engine": ["worker/runner", "worker/kv_cache", "metrics"],
    "worker/rpc": ["common", "proto"],
    "worker/transfer": ["worker/engine", "worker/runner", "worker/kv_cache",
                        "worker/rpc", "metrics", "proto"],
    "worker/server": ["worker/engine", "worker/transfer", "worker/kv_events",
                      "worker/rpc", "metrics", "proto"],
    "tools": ["proto", "worker/transfer", "worker/kv_events", "metrics"],
}
# On top: may include anything, included by nothing.
TOP = ("worker", "tests", "bench")
SOURCE_EXTS = (".cc", ".h", ".cu", ".cuh")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def closure(allowed):
    """Every folder each folder may include, transitively."""
    result = {}

    def reach(folder, seen):
        for dep in allowed.get(folder, []):
            if dep not in seen:
                seen.add(dep)
                reach(dep, seen)
        return seen

    for folder in allowed:
        result[folder] = reach(folder, set())
    return result


def folder_of(path):
    """The table's folder for a repository-relative path, or None."""
    parts = path.split("/")
    if parts[0] == "worker":
        if len(parts) > 2:
            sub = "worker/" + parts[1]
            return sub if sub in ALLOWED else "worker/" + parts[1]
        return "worker"
    return parts[0]


def project_includes(root):
    """(file, line, included path) for every project include under root."""
    edges = []
    for top in list(ALLOWED) + list(TOP):
        if top == "worker":
            continue  # walked through its subfolders and files below
        base = os.path.join(root, top)
        if not os.path.isdir(base):
            continue
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith("bazel-")]
            for name in filenames:
                if name.endswith(SOURCE_EXTS):
                    edges.extend(_file_includes(root, os.path.join(dirpath, name)))
    worker = os.path.join(root, "worker")
    for name in os.listdir(worker):
        path = os.path.join(worker, name)
        if os.path.isfile(path) and name.endswith(SOURCE_EXTS):
            edges.extend(_file_includes(root, path))
    return edges


def _file_includes(root, path):
    rel = os.path.relpath(path, root)
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    out = []
    for m in INCLUDE.finditer(text):
        target = m.group(1)
        if target.split("/")[0] in ("proto",) or os.path.exists(os.path.join(root, target)):
            line = text.count("\n", 0, m.start()) + 1
            out.append((rel, line, target))
    return out


def violations(edges, allowed):
    reach = closure(allowed)
    bad = []
    for src, line, target in edges:
        a, b = folder_of(src), folder_of(target)
        if a == b:
            continue
        if b in TOP or (b == "worker" and a != "worker"):
            bad.append(f"{src}:{line} includes {target}: {b}/ is on top and "
                       f"may not be included")
            continue
        if a in TOP or a == "worker":
            continue
        if a not in allowed:
            bad.append(f"{src}:{line}: folder {a}/ is not in the layout table")
            continue
        if b not in reach[a]:
            bad.append(f"{src}:{line} includes {target}: {a}/ may not depend "
                       f"on {b}/")
    return bad


def source_root():
    """The source tree: README.md in the runfiles links to it (the test is
    tagged "external", so Bazel reruns it whatever changed)."""
    readme = "README.md"
    if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):
        readme = sys.argv.pop(1)
    return os.path.dirname(os.path.realpath(readme))


class LayeringTest(unittest.TestCase):
    root = "."

    def test_every_include_follows_the_table(self):
        edges = project_includes(self.root)
        # A tree this size has thousands; a broken walk would pass vacuously.
        self.assertGreater(len(edges), 500)
        bad = violations(edges, ALLOWED)
        self.assertEqual(bad, [], "\n" + "\n".join(bad))

    def test_no_two_folders_include_each_other(self):
        reach = closure(ALLOWED)
        for a, deps in reach.items():
            self.assertNotIn(a, deps, f"{a}/ reaches itself")

    def test_every_worker_folder_is_in_the_table(self):
        worker = os.path.join(self.root, "worker")
        for name in sorted(os.listdir(worker)):
            if os.path.isdir(os.path.join(worker, name)):
                self.assertIn("worker/" + name, ALLOWED)

    def test_the_checker_flags_upward_and_unlisted_edges(self):
        edges = [
            ("worker/kernels/linear.h", 3, "worker/model/dtype.h"),
            ("worker/transfer/x.cc", 9, "worker/server/parsed_call.h"),
            ("metrics/m.h", 1, "worker/runtime/stream.h"),
            ("worker/engine/e.h", 4, "tests/engine/util.h"),
            ("worker/engine/e.h", 5, "worker/kernels/linear.h"),  # allowed
        ]
        bad = violations(edges, ALLOWED)
        self.assertEqual(len(bad), 4, bad)
        self.assertIn("worker/kernels/ may not depend on worker/model/", bad[0])

    def test_the_readme_layout_lists_every_folder(self):
        with open(os.path.join(self.root, "README.md"), encoding="utf-8") as f:
            readme = f.read()
        for folder in ALLOWED:
            row = re.search(rf"^\|\s*`{re.escape(folder)}/`\s*\|", readme, re.M)
            self.assertTrue(row, f"README's layout table lacks {folder}/")


if __name__ == "__main__":
    LayeringTest.root = source_root()
    run_tests(sys.argv)
