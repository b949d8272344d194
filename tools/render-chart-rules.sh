#!/usr/bin/env bash
# Writes deploy/helm/kubeloop/files/kubeloop-alerts.yaml, the chart's copy of the alerting rules
# deploy/prometheus/kubeloop-alerts.yaml (their one source, tested by promtool), which the chart's
# PrometheusRule (metrics.prometheusRule.enabled) renders: Helm reads only files inside a chart, and
# a symlink out of it would not survive `helm package`. tests/unit/test_helm_chart.py fails when
# the copy is not what this script writes. Usage: tools/render-chart-rules.sh
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$repo/deploy/helm/kubeloop/files/kubeloop-alerts.yaml
{
  echo "# Copied by tools/render-chart-rules.sh from deploy/prometheus/kubeloop-alerts.yaml; do not edit."
  cat "$repo/deploy/prometheus/kubeloop-alerts.yaml"
} > "$out.tmp"
mv "$out.tmp" "$out"
echo "wrote ${out#"$repo"/}"
