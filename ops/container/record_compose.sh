#!/usr/bin/env bash
# compose.yaml up with podman-compose (valkey, the gateway, two backends from the image record_run.sh built), the
# README's question asked through the gateway, both backends seen in its pool, then down; the record goes to
# benchmarks/results/container.compose.json.
#   ops/container/record_compose.sh       (needs podman-compose: pip install podman-compose)
set -euo pipefail
PC="${PODMAN_COMPOSE:-podman-compose}"
export EDGEINFER_BASE="${EDGEINFER_BASE:-localhost/edgeinfer-base:bookworm}"   # ops/container/make_base.sh's
OUT="${OUT:-benchmarks/results/container.compose.json}"
ARGS=(--podman-args "${PODMAN_GLOBAL_ARGS:---runtime runc}"
      --podman-build-args "${PODMAN_BUILD_ARGS:---isolation chroot}"
      --podman-run-args "${PODMAN_RUN_ARGS:---ulimit nofile=4096:4096 --ulimit nproc=4096:4096}")
"$PC" "${ARGS[@]}" down >/dev/null 2>&1 || true
# fresh secrets and a tenant key, as a new operator makes them (kept only for this run)
rm -f .env deploy/compose/tenants.toml
KEY=$(edgeinfer ops gen-secrets --compose . 2>/dev/null)
trap 'rm -f .env deploy/compose/tenants.toml' EXIT
t0=$(date +%s)
"$PC" "${ARGS[@]}" up -d --build >/tmp/edgeinfer-compose.log 2>&1   # compose.yaml builds the image
nodes=0
for _ in $(seq 1 120); do
  nodes=$(curl -s http://127.0.0.1:8080/metrics 2>/dev/null | awk '/^edgeinfer_gateway_pool_nodes\{/ {print int($2)}' | head -1 || true)
  [ "${nodes:-0}" -ge 2 ] && break
  sleep 1
done
t1=$(date +%s)
ANSWERS=()
for q in "What is the capital of France?" "What is the capital of Italy?" "Name a color."; do
  ANSWERS+=("$(curl -s http://127.0.0.1:8080/v1/chat/completions -H "Authorization: Bearer $KEY" \
    -H "Content-Type: application/json" -d "{\"model\": \"SmolLM2-135M-Instruct\", \"max_tokens\": 30, \
    \"temperature\": 0, \"messages\": [{\"role\": \"user\", \"content\": \"$q\"}]}")")
done
ROUTED=$(podman logs "$(podman ps -q --filter name=gateway)" 2>&1 | grep -o '"node":"backend-[01]"' | sort | uniq -c | tr '\n' ' ')
t2=$(date +%s)
"$PC" "${ARGS[@]}" stop >/dev/null 2>&1
t3=$(date +%s)
EXITS=$(podman ps -a --format '{{.Names}}={{.ExitCode}}' | tr '\n' ' ')
"$PC" "${ARGS[@]}" down >/dev/null 2>&1
python3 - "$OUT" "$nodes" "$ROUTED" "$EXITS" "${ANSWERS[@]}" <<PY
import json, sys
out, nodes, routed, exits, *answers = sys.argv[1:]
rec = {"bench": "container.compose", "compose": "compose.yaml", "pool_nodes_seen_by_the_gateway": int(nodes or 0),
       "up_to_two_nodes_in_pool_s": $t1 - $t0, "requests_s": $t2 - $t1, "stop_s": $t3 - $t2,
       "answers": [json.loads(a)["choices"][0]["message"]["content"] for a in answers],
       "routed": routed.strip(), "exit_codes": exits.strip(),
       "command": "ops/container/record_run.sh && ops/container/record_compose.sh"}
open(out, "w").write(json.dumps(rec, indent=2) + "\n")
print(json.dumps(rec, indent=2))
PY
