#!/usr/bin/env bash
# The deployment examples in deploy/ stay true to the broker: both parse as YAML, every flag the
# Kubernetes example passes is one bulkhead-broker knows, and both probe the health service name
# the broker reports on. Usage: deploy_examples_test.sh BIN_DIR SOURCE_DIR
set -euo pipefail
bin=$1
src=$2
help=$("$bin/bulkhead-broker" --help)
python3 - "$src/deploy" "$help" <<'PY'
import sys, yaml
deploy, help_text = sys.argv[1], sys.argv[2]
failures = []
envoy = yaml.safe_load(open(f"{deploy}/envoy.yaml"))
cluster = envoy["static_resources"]["clusters"][0]
service = cluster["health_checks"][0]["grpc_health_check"]["service_name"]
if service != "bulkhead.v1.Generator":
    failures.append(f"envoy.yaml checks health of {service!r}")
docs = list(yaml.safe_load_all(open(f"{deploy}/kubernetes.yaml")))
container = docs[0]["spec"]["template"]["spec"]["containers"][0]
for arg in container["args"]:
    flag = arg.split("=")[0]
    if flag not in help_text:
        failures.append(f"kubernetes.yaml passes {flag}, which bulkhead-broker does not know")
for probe in ("startupProbe", "readinessProbe"):
    if container[probe]["grpc"]["service"] != "bulkhead.v1.Generator":
        failures.append(f"kubernetes.yaml {probe} probes another service")
for f in failures:
    print("FAIL:", f)
if failures:
    sys.exit(1)
print(f"deploy examples: {len(container['args'])} broker flags known, health checks on bulkhead.v1.Generator")
PY
