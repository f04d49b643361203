#!/usr/bin/env bash
# The compose stack for real, end to end, on a machine with no GPU and no image registry: builds
# the images from local parts (deploy/local-images.sh), starts docker-compose.yml with the cpu
# backend (deploy/compose.local-cpu.yml), waits for every service's health, deploys and calls a
# template function with the `gpufaas` CLI through the balancer, crashes a GPU manager and checks
# that its restart policy brings it back and calls succeed again, kills the leading scheduler under a
# load of 8 clients (deploy/compose_load.py) and checks that no call failed, that calls succeeded
# again within 2 s and that the other scheduler leads with a higher epoch, SIGKILLs a gateway under
# the same load and checks that only calls in flight at its death failed (the balancer sends the
# rest to the other gateway) and that it comes back, then takes everything down (volumes included) and
# removes the images built from the project. The cached images (base, torch, etcd, prometheus) stay.
# With deploy/monitoring/prometheus.yml present it also starts the `monitoring` profile's
# Prometheus and checks that every scrape target is up.
#
#   bash deploy/compose-e2e.sh       # root, docker-compose, dockerd (started here if none runs),
#                                    # debootstrap; the CLI from .venv (or $GPUFAAS_CLI)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
CLI=${GPUFAAS_CLI:-$ROOT/.venv/bin/gpufaas}
PROJECT=gpufaas-e2e-$$  # its own containers, volumes and network, beside any other run
HEALTH_TIMEOUT_S=240
RECOVERY_TIMEOUT_S=180
started_s=$SECONDS

say() { echo "[compose-e2e $((SECONDS - started_s))s] $*"; }
# A failure's reason is said again after the services' logs (CI keeps only the output's tail).
fail() { say "FAILED: $*" | tee -a "${verdict:-/dev/null}" >&2; exit 1; }

[ "$(id -u)" = 0 ] || fail "needs root (dockerd, debootstrap)"
command -v docker-compose >/dev/null || fail "docker-compose is missing: apt-get install -y docker-compose"
[ -x "$CLI" ] || fail "no gpufaas CLI at $CLI (bash scripts/setup.sh, or set GPUFAAS_CLI)"

work=$(mktemp -d /tmp/gpufaas-compose-e2e.XXXXXX)
verdict=$work/verdict  # the load runs' reports and the failure, repeated last
dockerd_pid=""
compose() { docker-compose --project-name "$PROJECT" --project-directory "$ROOT" --file "$work/compose.yml" "$@"; }

cleanup() {
  local status=$?
  set +e
  if [ "$status" != 0 ] && [ -f "$work/compose.yml" ]; then
    say "logs of the failed run (last 40 lines per service):"
    compose --profile monitoring logs --no-color --tail 40 2>&1 | tail -300
  fi
  if [ "$status" != 0 ] && [ -s "$verdict" ]; then
    say "the failed run, again:"
    tail -40 "$verdict"
  fi
  if [ -f "$work/compose.yml" ]; then
    compose --profile monitoring down --volumes --remove-orphans --timeout 10 >/dev/null 2>&1
  fi
  docker rmi gpufaas/control-plane:local gpufaas/gpu-manager:local >/dev/null 2>&1
  rm -rf "$work"
  if [ -n "$dockerd_pid" ]; then
    kill "$dockerd_pid" 2>/dev/null
    wait "$dockerd_pid" 2>/dev/null
  fi
  say "cleaned up (exit status $status)"
}
trap cleanup EXIT

if ! docker info >/dev/null 2>&1; then
  # As scripts/test.sh starts it: no default bridge, no iptables. Compose's own network is a
  # user-defined bridge, whose embedded DNS resolves the service names without either.
  dockerd --iptables=false --bridge=none >"$work/dockerd.log" 2>&1 &
  dockerd_pid=$!
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || fail "dockerd did not start: $(tail -5 "$work/dockerd.log")"
  say "started dockerd (pid $dockerd_pid)"
fi

monitoring=false
[ -f deploy/monitoring/prometheus.yml ] && monitoring=true

say "building the images"
if $monitoring; then bash deploy/local-images.sh --monitoring; else bash deploy/local-images.sh; fi

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
GPUFAAS_GATEWAY_PORT=$(free_port)
GPUFAAS_PROMETHEUS_PORT=$(free_port)
# The blob server at 8081 when it is free (deploy then reaches it there), else another port (deploy
# then uploads through the API).
blob_port() { python3 -c 'import socket, sys; s = socket.socket()
try: s.bind(("127.0.0.1", int(sys.argv[1]))); print(sys.argv[1])
except OSError: s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' "$1"; }
GPUFAAS_BLOB_PORT=$(blob_port 8081)  # gateway-0's
GPUFAAS_BLOB_PORT_1=$(blob_port 8082)  # gateway-1's
export GPUFAAS_GATEWAY_PORT GPUFAAS_PROMETHEUS_PORT GPUFAAS_BLOB_PORT GPUFAAS_BLOB_PORT_1
URL=http://127.0.0.1:$GPUFAAS_GATEWAY_PORT
docker-compose --project-directory "$ROOT" -f docker-compose.yml -f deploy/compose.local-cpu.yml config \
  | python3 deploy/drop_gpu_reservations.py >"$work/compose.yml"

say "docker-compose up ($(docker-compose version --short), gateway on $URL)"
compose up -d --no-build

health() { docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}' "$(compose ps -q "$1")"; }
wait_healthy() {
  local deadline=$((SECONDS + $2)) service
  while [ $SECONDS -lt $deadline ]; do
    local pending=()
    for service in $1; do [ "$(health "$service" 2>/dev/null)" = healthy ] || pending+=("$service"); done
    [ ${#pending[@]} = 0 ] && return 0
    sleep 2
  done
  fail "not healthy after $2 s: ${pending[*]}"
}
wait_healthy "etcd scheduler-0 scheduler-1 gateway-0 gateway-1 balancer gpu-manager-0 gpu-manager-1" "$HEALTH_TIMEOUT_S"
say "every service is healthy"
compose ps

export GPUFAAS_CONFIG_DIR=$work/config  # gpufaas login keeps the password here, not in ~/.config
unset GPUFAAS_URL GPUFAAS_PASSWORD
compose exec -T gateway-0 cat /run/gpufaas/admin-password | "$CLI" login --gateway "$URL" --password-stdin
"$CLI" new hello --template pytorch-custom --dir "$work"
"$CLI" deploy --file "$work/stack.yml" --gateway "$URL"

# invoke_until N DEADLINE_S: N successful calls in a row before the deadline; prints the tries.
invoke_until() {
  local wanted=$1 deadline=$((SECONDS + $2)) ok=0 tries=0
  while [ $ok -lt "$wanted" ]; do
    [ $SECONDS -lt $deadline ] || fail "$ok of $wanted calls in a row succeeded after $tries tries"
    tries=$((tries + 1))
    if "$CLI" invoke hello --gateway "$URL" -v -d '{"inputs": [[1, 2, 3, 4]]}' >"$work/out" 2>"$work/err"; then
      ok=$((ok + 1))
    else
      ok=0
      say "call $tries failed: $(tail -1 "$work/err")"
      sleep 2
    fi
  done
  say "$wanted calls in a row succeeded ($tries tries): $(head -c 200 "$work/out")"
  grep -i '^x-' "$work/err" || true
}
invoke_until 3 120

# The node that served the last call (X-Gpu names it) is the one to crash.
victim=gpu-manager-0
grep -qi '^x-gpu: .*gpu-manager-1' "$work/err" && victim=gpu-manager-1
container=$(compose ps -q "$victim")
restarts=$(docker inspect -f '{{.RestartCount}}' "$container")
# A crash, not `docker kill`: Docker counts `docker kill` (like `docker stop`) as a manual stop,
# which no restart policy undoes. SIGKILL to the container's first process from outside is what
# the kernel's OOM killer or a segfault looks like to Docker.
say "crashing $victim (kill -KILL its pid 1 from the host)"
kill -KILL "$(docker inspect -f '{{.State.Pid}}' "$container")"
deadline=$((SECONDS + 60))
until [ "$(docker inspect -f '{{.RestartCount}}' "$container")" -gt "$restarts" ]; do
  [ $SECONDS -lt $deadline ] || fail "$victim was not restarted"
  sleep 1
done
say "$victim restarted by its restart policy (restart count $(docker inspect -f '{{.RestartCount}}' "$container"))"
wait_healthy "$victim" "$RECOVERY_TIMEOUT_S"
say "$victim is healthy again"
invoke_until 5 "$RECOVERY_TIMEOUT_S"

compose exec -T gateway-0 cat /run/gpufaas/invoke-token >"$work/invoke-token"
compose exec -T gateway-0 cat /run/gpufaas/admin-password >"$work/admin-password"

# The leading scheduler (the overview names it) killed with `docker kill -s KILL` under 8 clients
# calling through the balancer: the gateways hold their calls while the standby takes the lease
# over (etcd runs with a 500 ms election timeout: 1 s leases), so no call may fail, a call sent
# after its death must succeed within 2 s of the kill, and the overview must then name the other
# scheduler with a higher epoch. `docker kill` counts as a manual stop, so it is started again.
say "killing the leading scheduler under load"
python3 deploy/compose_load.py leader "$URL" "$work/invoke-token" "$work/admin-password" \
  "scheduler-0=$(compose ps -q scheduler-0)" "scheduler-1=$(compose ps -q scheduler-1)" 2>&1 \
  | tee -a "$verdict" || fail "the leader's kill failed calls, or service or a new leader came late"
for service in scheduler-0 scheduler-1; do
  if [ "$(docker inspect -f '{{.State.Running}}' "$(compose ps -q "$service")")" != true ]; then
    compose start "$service"
    wait_healthy "$service" "$RECOVERY_TIMEOUT_S"
    say "$service is back (a standby)"
  fi
done
invoke_until 3 "$RECOVERY_TIMEOUT_S"

# A gateway SIGKILLed (its container's pid 1, as a crash) under 8 clients calling through the
# balancer: the calls that fail must be ones in flight at its death, every call sent after it
# succeeds (HAProxy retries a refused connection on the other gateway), and its restart policy
# brings it back.
container=$(compose ps -q gateway-0)
restarts=$(docker inspect -f '{{.RestartCount}}' "$container")
say "crashing gateway-0 under load"
python3 deploy/compose_load.py gateway "$URL" "$work/invoke-token" "$(docker inspect -f '{{.State.Pid}}' "$container")" 2>&1 \
  | tee -a "$verdict" || fail "the gateway's crash failed calls that were not in flight on it"
deadline=$((SECONDS + 60))
until [ "$(docker inspect -f '{{.RestartCount}}' "$container")" -gt "$restarts" ]; do
  [ $SECONDS -lt $deadline ] || fail "gateway-0 was not restarted"
  sleep 1
done
wait_healthy "gateway-0 balancer" "$RECOVERY_TIMEOUT_S"
say "gateway-0 is back"
invoke_until 3 "$RECOVERY_TIMEOUT_S"

if $monitoring; then
  say "starting the monitoring profile's prometheus"
  compose --profile monitoring up -d --no-build prometheus
  targets_url=http://127.0.0.1:$GPUFAAS_PROMETHEUS_PORT/api/v1/targets
  deadline=$((SECONDS + 90))
  until python3 - "$targets_url" <<'EOF'
import json, sys, urllib.request
try:
    targets = json.load(urllib.request.urlopen(sys.argv[1], timeout=5))["data"]["activeTargets"]
except OSError:
    sys.exit(1)
for t in targets:
    print(f"  {t['labels'].get('job')} {t['scrapeUrl']}: {t['health']} {t.get('lastError', '')}")
sys.exit(0 if targets and all(t["health"] == "up" for t in targets) else 1)
EOF
  do
    [ $SECONDS -lt $deadline ] || fail "prometheus: not every target is up"
    sleep 5
  done
  say "prometheus scrapes every target"
  # Every query of the Grafana dashboard is one Prometheus accepts, and the counters it reads saw
  # the calls made above (8 answered at least: 3, then 5 after the crash).
  python3 - "http://127.0.0.1:$GPUFAAS_PROMETHEUS_PORT" deploy/monitoring/grafana/gpufaas-dashboard.json <<'EOF' \
    || fail "prometheus: the dashboard's queries or the call counters are wrong"
import json, sys, urllib.error, urllib.parse, urllib.request
base, dashboard = sys.argv[1], sys.argv[2]

def query(expr):
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        return json.load(urllib.request.urlopen(url, timeout=10))
    except urllib.error.HTTPError as error:  # 400: a query Prometheus refuses, with its reason
        return json.load(error)

exprs = [t["expr"] for p in json.load(open(dashboard))["panels"] for t in p.get("targets", [])]
refused = [(e, a.get("error")) for e in exprs if (a := query(e.replace("$__rate_interval", "1m")))["status"] != "success"]
for expr, error in refused:
    print(f"  refused: {expr}: {error}")
result = query("sum(gpufaas_scheduler_calls_total)")["data"]["result"]
calls = float(result[0]["value"][1]) if result else 0.0
print(f"  {len(exprs) - len(refused)} of {len(exprs)} dashboard queries accepted; the scheduler counted {calls:.0f} calls")
sys.exit(1 if refused or calls < 8 else 0)
EOF
  say "the dashboard's queries run on the scraped series"
else
  say "no deploy/monitoring/prometheus.yml: the monitoring profile is not checked"
fi

say "PASSED"
