"""Runs the chart's preStop hook against a real worker: the hook must start
the worker's drain (the worker drains on SIGTERM; there is no drain RPC) and
return only once the worker has exited, as kubelet would see it.

  prestop_drain_test.py --pdworker=BIN --make_tiny_model=BIN --renderer=BIN \
      --chart=DIR

In a pod the worker is PID 1 (the image's exec-form ENTRYPOINT) and the hook
signals PID 1; here the worker is a child of the test, so the hook's "1" is
replaced by the worker's PID and the hook runs under /bin/sh like kubelet's
exec. The worker's args are the chart's (a `both` worker on the CPU backend
with a tiny model, ports on loopback).
"""
import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import yaml

from junit_xml import run_tests

ARGS = None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tmpdir():
    return os.environ.get("TEST_TMPDIR") or tempfile.gettempdir()


def render(values):
    path = os.path.join(tmpdir(), "prestop-values.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(values, f)
    proc = subprocess.run([ARGS.renderer, "--chart=" + ARGS.chart, "--values=" + path],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


class PreStopDrainTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.model = os.path.join(tmpdir(), "model")
        subprocess.run([ARGS.make_tiny_model, "--out_dir=" + cls.model, "--shape=gqa"],
                       check=True, capture_output=True, timeout=120)

    def worker_and_hook(self, values):
        """(worker argv, preStop command) of the rendered `both` Deployment."""
        docs = render(values)
        (config,) = [d for d in docs if d["kind"] == "ConfigMap"
                     and d["metadata"]["name"].endswith("-compilation-config")]
        (dep,) = [d for d in docs if d["kind"] == "Deployment"]
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        override = {"model": self.model, "host": "127.0.0.1", "device": "cpu",
                    "port": str(free_port()), "metrics_port": str(free_port()),
                    "advertise_address": "127.0.0.1",
                    # What kubelet expands from the env (ConfigMap key).
                    "compilation_config": config["data"]["both.json"]}
        argv = [ARGS.pdworker]
        for a in c["args"]:
            name = a[2:].split("=", 1)[0]
            argv.append(f"--{name}={override[name]}" if name in override else a)
        self.assertFalse([a for a in argv if "$(" in a], argv)
        return argv, c["lifecycle"]["preStop"]["exec"]["command"]

    def start(self, argv):
        log = open(os.path.join(tmpdir(), f"worker-{time.monotonic_ns()}.log"), "w+")
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True)
        self.addCleanup(lambda: proc.poll() is None and proc.kill())
        line = proc.stdout.readline().strip()  # printed once serving
        log.seek(0)
        self.assertTrue(line.startswith("listening on"), (line, log.read()))
        return proc, log

    def run_hook(self, command, pid):
        self.assertEqual(command[:2], ["/bin/sh", "-c"])
        # In the pod the worker is PID 1; here it is `pid`.
        script, n = re.subn(r"\bkill (-TERM|-0) 1\b", rf"kill \g<1> {pid}", command[2])
        self.assertEqual(n, 2, command[2])
        return subprocess.Popen(["/bin/sh", "-c", script])

    def check_drain(self, values, delay):
        argv, command = self.worker_and_hook(values)
        worker, log = self.start(argv)
        # Reap the worker as soon as it exits, as PID 1's exit ends a pod's
        # PID namespace: a zombie would still answer the hook's `kill -0`.
        reaper = threading.Thread(target=worker.wait, daemon=True)
        reaper.start()
        started = time.monotonic()
        hook = self.run_hook(command, worker.pid)
        if delay:
            time.sleep(delay / 2)
            self.assertIsNone(worker.poll(), "the worker serves until the delay is over")
        self.assertEqual(hook.wait(timeout=60), 0)
        # The hook returned only after the worker was gone.
        reaper.join(timeout=1)
        self.assertIsNotNone(worker.poll(), "preStop returned while the worker still ran")
        self.assertEqual(worker.wait(), 0, "the worker exits 0 after a drain")
        self.assertGreaterEqual(time.monotonic() - started, delay)
        log.seek(0)
        text = log.read()
        self.assertIn("signal 15: draining", text)
        self.assertIn("drained", text)

    def test_hook_drains_the_worker(self):
        self.check_drain(self.values(delay=0), delay=0)

    def test_hook_delay_then_drain(self):
        self.check_drain(self.values(delay=2), delay=2)

    @staticmethod
    def values(delay):
        return {"roles": {"prefill": {"enabled": False}, "decode": {"enabled": False},
                          # Sizes for a tiny model on a CPU (starts in seconds).
                          "both": {"enabled": True, "gpus": 0, "maxNumSeqs": 8,
                                   "maxNumBatchedTokens": 256, "kvCacheBytes": 1048576,
                                   "compilationConfig": {"max_cudagraph_capture_size": 64}}},
                "preStop": {"enabled": True, "delaySeconds": delay},
                "worker": {"drainTimeout": "5s"}}


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    flags = ("pdworker", "make_tiny_model", "renderer", "chart")
    for flag in flags:
        parser.add_argument("--" + flag, required=True)
    ARGS, rest = parser.parse_known_args()
    for flag in flags:
        setattr(ARGS, flag, os.path.abspath(getattr(ARGS, flag)))
    run_tests([sys.argv[0]] + rest)


if __name__ == "__main__":
    main()
