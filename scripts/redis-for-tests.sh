# SPDX-License-Identifier: Apache-2.0
# Sourced (not run) by scripts/test.sh and .ci/run: a Redis server for the Redis block store's
# tests. kvcache_start_redis starts redis-server on a free port of 127.0.0.1 (no persistence),
# exports KVCACHE_REDIS_PORT, which the tests read, and sets an EXIT trap that stops it, so it
# stops also when a build or a test fails. It does nothing if KVCACHE_REDIS_PORT is already set
# (a server someone started), nor, outside CI, if redis-server is not installed (the tests then
# start their own if they can, or are skipped saying why); under CI=true that is an error.

kvcache_stop_redis() {
  if [[ -n "${KVCACHE_REDIS_PID:-}" ]]; then
    kill "$KVCACHE_REDIS_PID" 2>/dev/null || true
    wait "$KVCACHE_REDIS_PID" 2>/dev/null || true
    rm -f "${TMPDIR:-/tmp}/kvcache-redis-$KVCACHE_REDIS_PORT.log"
    echo "kvcache: stopped the test Redis server on port $KVCACHE_REDIS_PORT"
    unset KVCACHE_REDIS_PID KVCACHE_REDIS_PORT
  fi
}

# Whether a Redis server answers PING on 127.0.0.1:$1 (bash's /dev/tcp: no client needed).
kvcache_redis_answers() {
  local reply=""
  { exec 3<>"/dev/tcp/127.0.0.1/$1"; } 2>/dev/null || return 1
  printf 'PING\r\n' >&3
  IFS= read -r -t 2 reply <&3 || true
  exec 3<&- 3>&-
  [[ "$reply" == "+PONG"* ]]
}

kvcache_start_redis() {
  if [[ -n "${KVCACHE_REDIS_PORT:-}" ]]; then return 0; fi
  if ! command -v redis-server >/dev/null; then
    if [[ "${CI:-}" == "true" ]]; then
      echo "kvcache: CI=true but redis-server is not installed (apt-get install redis-server)" >&2
      return 1
    fi
    echo "kvcache: redis-server is not installed: the Redis block store's tests will be skipped" >&2
    return 0
  fi
  local attempt port pid try
  for attempt in 1 2 3 4 5 6 7 8 9 10; do
    port=$((20000 + RANDOM % 40000))
    if { exec 3<>"/dev/tcp/127.0.0.1/$port"; } 2>/dev/null; then  # taken
      exec 3<&- 3>&-
      continue
    fi
    redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --daemonize no \
      --logfile "${TMPDIR:-/tmp}/kvcache-redis-$port.log" &
    pid=$!
    for try in $(seq 50); do
      if kvcache_redis_answers "$port"; then
        export KVCACHE_REDIS_PORT="$port"
        KVCACHE_REDIS_PID="$pid"
        trap kvcache_stop_redis EXIT
        echo "kvcache: a Redis server for the tests on 127.0.0.1:$port (pid $pid)"
        return 0
      fi
      kill -0 "$pid" 2>/dev/null || break  # it exited (the port was taken meanwhile: see its log)
      sleep 0.1
    done
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  echo "kvcache: could not start redis-server on a free port" >&2
  return 1
}
