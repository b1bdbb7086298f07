#!/usr/bin/env bash
# orderly's one entry point: does all set-up on a fresh machine, then runs what you ask.
#   ./run.sh demo [--messages N]   the main job: a real end-to-end run on the local services
#   ./run.sh test [pytest args]    ruff, mypy and the whole test suite (then, without args, its
#                                  end-to-end core again on RabbitMQ)
#   ./run.sh fast [pytest args]    ruff, mypy and every test but the end-to-end ones (< 1 min)
#   ./run.sh bench [NAME] [--quick]  a benchmark: intake (default), peers, profile, ordered_delivery, fanout, delayed, funnel, tracking, report, faults, purge, abuse, scheduling, outbound, front_door, light_load
#   ./run.sh image [--rebuild-base]  build the container image on a local Debian base and run it (podman)
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3}
VENV=.venv

log() { printf '\033[1m==> %s\033[0m\n' "$*"; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

ensure_apt() {
  # ensure_apt COMMAND PACKAGE: install a Debian package when its command is missing.
  command -v "$1" >/dev/null 2>&1 && return 0
  log "installing $2 (Debian)"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "$2" >/dev/null
}

ensure_file() {
  # ensure_file PATH PACKAGE: install a Debian package when a file it ships is missing.
  [ -e "$1" ] && return 0
  log "installing $2 (Debian)"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "$2" >/dev/null
}

ensure_spark_deps() {
  # Spark needs Java (17 here) and reads PostgreSQL through Debian's JDBC driver.
  ensure_apt java openjdk-17-jre-headless
  ensure_file /usr/share/java/postgresql.jar libpostgresql-jdbc-java
}

ensure_services() {
  if ! pg_isready -q -h 127.0.0.1 -p 5432; then
    # A cluster that is still starting (or recovering) answers pg_isready with "rejecting
    # connections" and pg_ctlcluster with "already running" (exit 2): wait for it below.
    log "starting PostgreSQL"
    as_root pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start \
      || log "PostgreSQL's cluster is already running; waiting for it to accept connections"
  fi
  if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
    log "starting Redis"
    as_root redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" \
      --appendonly no
  fi
  for _ in $(seq 1 300); do
    pg_isready -q -h 127.0.0.1 -p 5432 && redis-cli -h 127.0.0.1 ping >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "PostgreSQL or Redis did not come up on 127.0.0.1" >&2
  exit 1
}

ensure_venv() {
  [ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
  local stamp="$VENV/.installed" want
  want=$(sha256sum pyproject.toml | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    log "installing orderly and its dependencies into $VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
    "$VENV/bin/pip" install -q --disable-pip-version-check -e '.[all,dev,bench]' 2>&1 | grep -v '^WARNING: Location' || true
    "$VENV/bin/python" -c 'import celery, fastapi, sqlalchemy, pytest, pyspark, flower' # fail loudly if incomplete
    echo "$want" > "$stamp"
  fi
}

lint() {
  log "ruff"
  "$VENV/bin/ruff" check .
  "$VENV/bin/ruff" format --check .
  log "mypy"
  "$VENV/bin/mypy"
}

run_pytest() {
  # pytest's exit code 5 (no tests collected) is a failure here.
  log "pytest $*"
  set +e
  "$VENV/bin/pytest" "$@"
  local rc=$?
  set -e
  if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: that is a failure here" >&2
    return 1
  fi
  return "$rc"
}

ensure_rabbitmq() {
  # The broker profile's RabbitMQ: Debian's, started when it does not listen on 5672.
  ensure_apt rabbitmq-server rabbitmq-server
  if ! (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null; then
    log "starting RabbitMQ"
    as_root rabbitmq-server -detached
  fi
  as_root rabbitmqctl -q await_startup --timeout 120 >/dev/null
}

# The end-to-end core run again on RabbitMQ (ORDERLY_TEST_BROKER=rabbitmq, tests/conftest.py):
# the store, funnels, conversations, publish/subscribe, the rebuild and the broker itself.
RABBITMQ_CORE="tests/test_e2e.py tests/test_funnels_e2e.py tests/test_conversation_e2e.py
  tests/test_pubsub_durability.py tests/test_rebuild_e2e.py tests/test_broker.py"

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  demo)
    ensure_spark_deps
    ensure_services
    ensure_venv
    "$VENV/bin/orderly" migrate --create-database
    exec "$VENV/bin/python" -m tooling demo "$@"
    ;;
  test)
    ensure_apt pg_isready postgresql-client
    ensure_apt docker-compose docker-compose
    ensure_apt chromium chromium
    ensure_apt chromedriver chromium-driver
    ensure_apt promtool prometheus
    ensure_file /usr/sbin/pgbouncer pgbouncer
    ensure_spark_deps
    ensure_services
    ensure_venv
    lint
    run_pytest -n auto --maxprocesses 2 --dist loadgroup --no-loadscope-reorder "$@"
    if [ $# -eq 0 ]; then
      ensure_rabbitmq
      # shellcheck disable=SC2086
      ORDERLY_TEST_BROKER=rabbitmq run_pytest -n auto --maxprocesses 2 --dist loadgroup \
        --no-loadscope-reorder $RABBITMQ_CORE
    fi
    ;;
  fast)
    # Unit and integration tests only (tests/kinds.py): no process is started, so neither
    # Chromium, Spark nor docker-compose is needed.
    ensure_apt pg_isready postgresql-client
    ensure_services
    ensure_venv
    lint
    run_pytest -n auto --maxprocesses 2 --dist loadgroup --no-loadscope-reorder -m "not e2e" "$@"
    ;;
  bench)
    ensure_spark_deps
    ensure_apt wrk wrk
    ensure_services
    ensure_venv
    "$VENV/bin/orderly" migrate --create-database >/dev/null
    name=intake
    case "${1:-}" in intake|peers|profile|ordered_delivery|fanout|delayed|funnel|tracking|report|faults|purge|abuse|scheduling|outbound|front_door|light_load) name=$1; shift ;; esac
    exec "$VENV/bin/python" -m "benchmarks.$name" "$@"
    ;;
  image)
    # The Dockerfile built on a Debian base made here (mmdebstrap) and run with podman:
    # PostgreSQL, Redis, the API, a worker and beat in containers (tooling/image/).
    ensure_apt podman podman
    ensure_apt mmdebstrap mmdebstrap
    ensure_apt runc runc
    ensure_venv
    exec "$VENV/bin/python" -m tooling.image "$@"
    ;;
  *)
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
    ;;
esac
