#!/usr/bin/env bash
# Build the image with podman, run it, ask it the README's question, stop it; the record goes to
# benchmarks/results/container.json (what ran, how long each part took, the answer, the exit status).
#   ops/container/record_run.sh        (from the repository root; needs podman; the base image from make_base.sh
#                                        unless BASE names another)
# On this project's VMs (Firecracker, cgroup v1 hybrid, no CAP_SYS_RESOURCE for the OCI runtime): the build runs
# with chroot isolation (crun refuses hybrid cgroups), the container with runc and ulimits at or below the host's
# (PODMAN_BUILD_ARGS / PODMAN_GLOBAL_ARGS / PODMAN_RUN_ARGS override these defaults elsewhere).
set -euo pipefail
BASE="${BASE:-localhost/edgeinfer-base:bookworm}"
VERSION="${VERSION:-$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')}"
TAG="${TAG:-localhost/edgeinfer:$VERSION}"
PORT="${PORT:-18480}"
OUT="${OUT:-benchmarks/results/container.json}"
LOG="$(mktemp /tmp/edgeinfer-container.XXXXXX.log)"
mkdir -p .container-wheels
# a machine whose torch is a local file (pip's find-links): hand that wheel to the build
for d in ${PIP_FIND_LINKS:-} $(pip config get global.find-links 2>/dev/null || true); do
  cp -n "$d"/torch-2.13.0*-cp311-*.whl .container-wheels/ 2>/dev/null || true
done
[ -f "${PIP_CERT:-}" ] && cp "$PIP_CERT" .container-wheels/ca.crt   # this machine's CA bundle, for the build only
t0=$(date +%s)
podman build ${PODMAN_BUILD_ARGS:---isolation chroot} --build-arg BASE="$BASE" --build-arg VERSION="$VERSION" -t localhost/edgeinfer:cpu --build-arg TORCH_INDEX="${TORCH_INDEX:-https://pypi.org/simple}" \
  -t "$TAG" . >"$LOG" 2>&1 || { tail -30 "$LOG"; echo "build failed: $LOG"; exit 1; }
t1=$(date +%s)
SIZE=$(podman image inspect "$TAG" --format '{{.Size}}')
podman rm -f edgeinfer-record >/dev/null 2>&1 || true
podman ${PODMAN_GLOBAL_ARGS:---runtime runc} run ${PODMAN_RUN_ARGS:---ulimit nofile=4096:4096 --ulimit nproc=4096:4096} -d --name edgeinfer-record -p "127.0.0.1:$PORT:8080" -e EDGEINFER_ARG_ALLOW_PUBLIC_DEMO_KEY=1 "$TAG" >/dev/null
USER_ID=$(podman exec edgeinfer-record id -u)
ready=""
for _ in $(seq 1 180); do
  if podman logs edgeinfer-record 2>&1 | grep -q "edgeinfer serve: ready"; then ready=1; break; fi
  sleep 1
done
t2=$(date +%s)
[ -n "$ready" ] || { podman logs edgeinfer-record | tail -30; podman rm -f edgeinfer-record; exit 1; }
ANSWER=$(curl -s "http://127.0.0.1:$PORT/v1/chat/completions" -H "Authorization: Bearer sk-edgeinfer-demo" \
  -H "Content-Type: application/json" \
  -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 30, "temperature": 0}')
t3=$(date +%s)
podman stop -t 30 edgeinfer-record >/dev/null
EXIT=$(podman inspect edgeinfer-record --format '{{.State.ExitCode}}')
t4=$(date +%s)
STOPLOG=$(podman logs edgeinfer-record 2>&1 | tail -5)
podman rm edgeinfer-record >/dev/null
python3 - "$OUT" <<PY
import json, sys, platform
answer = json.loads('''$ANSWER''')
rec = {"bench": "container", "image": "$TAG", "base": "$BASE", "podman": "$(podman --version)",
       "host": platform.platform(), "image_bytes": int("$SIZE"), "build_s": $t1 - $t0,
       "start_to_ready_s": $t2 - $t1, "request_s": $t3 - $t2, "stop_s": $t4 - $t3, "exit_code": int("$EXIT"),
       "runs_as_uid": int("$USER_ID"), "answer": answer["choices"][0]["message"]["content"],
       "usage": answer.get("usage"), "last_log_lines": """$STOPLOG""".splitlines(),
       "command": "ops/container/make_base.sh && ops/container/record_run.sh"}
open(sys.argv[1], "w").write(json.dumps(rec, indent=2) + "\n")
print(json.dumps(rec, indent=2))
PY
