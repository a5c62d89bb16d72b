#!/usr/bin/env bash
# The alert rules, checked by Prometheus's own tool:
#   promtool check rules  deploy/prometheus/alerts.yaml   (syntax, lint)
#   promtool test rules   tests/deploy/testdata/alerts_test.yaml
#     (unit tests: synthetic series in, exactly the expected alerts out)
# Arguments: the rules file, the rule unit-test file.
set -euo pipefail
rules=$1
tests=$2
promtool=/usr/bin/promtool
if [ ! -x "$promtool" ]; then
  echo "FAIL: $promtool is missing: install Debian's 'prometheus' package (scripts/install-deps)" >&2
  exit 1
fi
"$promtool" check rules "$rules"
# promtool test rules resolves rule_files relative to the test file.
work="${TEST_TMPDIR:-$(mktemp -d)}/promtool_rules"
mkdir -p "$work"
cp "$rules" "$work/alerts.yaml"
cp "$tests" "$work/alerts_test.yaml"
cd "$work"
"$promtool" test rules alerts_test.yaml
