#!/usr/bin/env bash
# Runs a Python test with Debian's interpreter (/usr/bin/python3 and its
# dist-packages: python3-yaml, python3-jsonschema, python3-grpcio), never a
# python3 that happens to be first on PATH. Arguments: the script, then its
# flags (runfiles paths, relative to the test's working directory).
set -euo pipefail
exec /usr/bin/python3 -B "$@"
