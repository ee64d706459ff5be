#!/usr/bin/env bash
# Starts Redis, Webdis, the demo upstream and Envoy with the filter on
# loopback, shows the filter at work, and leaves the stack running.
# `make demo-down` stops it. Ports can be overridden from the environment.
set -euo pipefail
cd "$(dirname "$0")/.."

ENVOY_PORT=${ENVOY_PORT:-10000}
ADMIN_PORT=${ADMIN_PORT:-9901}
WEBDIS_PORT=${WEBDIS_PORT:-17379}
REDIS_PORT=${REDIS_PORT:-16379}
UPSTREAM_PORT=${UPSTREAM_PORT:-18080}
STACK=.stack
WASM=target/wasm32-wasip1/release/redis_guard.wasm
ENVOY=$(ls .venv/lib/python3*/site-packages/envoy/_bin/envoy 2>/dev/null | head -n1)

[ -f "$WASM" ] || { echo "missing $WASM: run 'make build'"; exit 1; }
[ -x "$ENVOY" ] || { echo "missing Envoy in .venv: run 'make deps'"; exit 1; }

bash envoy/demo-down.sh >/dev/null 2>&1 || true
mkdir -p "$STACK"
for p in $ENVOY_PORT $ADMIN_PORT $WEBDIS_PORT $REDIS_PORT $UPSTREAM_PORT; do
  if (exec 3<>/dev/tcp/127.0.0.1/$p) 2>/dev/null; then
    echo "port $p on 127.0.0.1 is in use; set ENVOY_PORT/ADMIN_PORT/WEBDIS_PORT/REDIS_PORT/UPSTREAM_PORT"; exit 1
  fi
done

wait_port() { # port name
  for _ in $(seq 1 200); do (exec 3<>/dev/tcp/127.0.0.1/$1) 2>/dev/null && return 0; sleep 0.05; done
  echo "$2 did not start; see $STACK/*.log"; exit 1
}

# The same templates the tests and compose.yaml render, here for loopback.
python3 envoy/render.py --out "$STACK" --filter-config envoy/filter.json \
  --set BIND_ADDRESS=127.0.0.1 --set ADMIN_PORT="$ADMIN_PORT" --set LISTEN_PORT="$ENVOY_PORT" \
  --set UPSTREAM_HOST=127.0.0.1 --set UPSTREAM_PORT="$UPSTREAM_PORT" \
  --set WEBDIS_HOST=127.0.0.1 --set WEBDIS_PORT="$WEBDIS_PORT" --set WASM_PATH="$PWD/$WASM" \
  --set REDIS_HOST=127.0.0.1 --set REDIS_PORT="$REDIS_PORT" --set WEBDIS_LOG="$PWD/$STACK/webdis.log" \
  envoy/envoy.yaml envoy/webdis.json

redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
  --dir "$STACK" --logfile "$PWD/$STACK/redis.log" --daemonize no </dev/null >/dev/null 2>&1 &
echo $! > "$STACK/redis.pid"; wait_port "$REDIS_PORT" redis-server

webdis "$STACK/webdis.json" </dev/null >/dev/null 2>&1 &
echo $! > "$STACK/webdis.pid"; wait_port "$WEBDIS_PORT" webdis

python3 envoy/upstream.py --port "$UPSTREAM_PORT" </dev/null > "$STACK/upstream.log" 2>&1 &
echo $! > "$STACK/upstream.pid"; wait_port "$UPSTREAM_PORT" upstream

"$ENVOY" -c "$STACK/envoy.yaml" --concurrency 2 --disable-hot-restart --log-level ${ENVOY_LOG_LEVEL:-warn} \
  </dev/null > "$STACK/envoy.log" 2>&1 &
echo $! > "$STACK/envoy.pid"; wait_port "$ENVOY_PORT" envoy
for _ in $(seq 1 100); do curl -sf "http://127.0.0.1:$ADMIN_PORT/ready" >/dev/null && break; sleep 0.1; done

URL="http://127.0.0.1:$ENVOY_PORT"
show() { # description, curl args...
  local what=$1; shift
  local out
  out=$(curl -s -o /dev/null -w '%{http_code}' -D "$STACK/last-headers" "$@")
  printf '  %-44s -> %s' "$what" "$out"
  local rem; rem=$(grep -i '^x-ratelimit-remaining' "$STACK/last-headers" | tr -d '\r' | cut -d' ' -f2 || true)
  local ra; ra=$(grep -i '^retry-after' "$STACK/last-headers" | tr -d '\r' | cut -d' ' -f2 || true)
  [ -n "$rem" ] && printf '  remaining=%s' "$rem"
  [ -n "$ra" ] && printf '  retry-after=%s' "$ra"
  echo
}

echo
echo "redis-guard demo: Envoy :$ENVOY_PORT -> filter -> Webdis :$WEBDIS_PORT -> Redis :$REDIS_PORT"
echo "limit per-user-burst: token bucket, 5 tokens, 1 per second, per x-user header"
for i in 1 2 3 4 5 6 7; do show "GET /api/orders (x-user: alice) #$i" -H 'x-user: alice' "$URL/api/orders"; done
echo "bob has his own bucket:"
show "GET /api/orders (x-user: bob)" -H 'x-user: bob' "$URL/api/orders"
echo "the 429 body (RFC 9457 problem):"
curl -s -H 'x-user: alice' "$URL/api/orders"; echo
echo "shadow limit search-trial (2 per 10 s) never rejects, it counts:"
for i in 1 2 3; do show "GET /api/search #$i" -H "x-user: carol$i" "$URL/api/search"; done
echo "idempotency rule payments: POST /api/payments with an Idempotency-Key runs once"
pay() { curl -s -D "$STACK/last-headers" -X POST -H "Idempotency-Key: $1" -d "$2" "$URL/api/payments"; }
echo "  first:   $(pay demo-pay-1 '{"amount":10}')"
echo "  retry:   $(pay demo-pay-1 '{"amount":10}')  ($(grep -i '^idempotent-replayed' "$STACK/last-headers" | tr -d '\r'))"
echo "  422:     $(pay demo-pay-1 '{"amount":99}')"
echo "the filter's Envoy stats:"
curl -s "http://127.0.0.1:$ADMIN_PORT/stats?filter=wasmcustom" | sed 's/^/  /'
echo "keys in Redis (every one with a TTL):"
redis-cli -p "$REDIS_PORT" --scan | while read -r k; do echo "  $k  pttl=$(redis-cli -p "$REDIS_PORT" pttl "$k")"; done
cat <<TXT

The stack keeps running. Try:
  curl -i -H 'x-user: alice' $URL/api/orders
  curl -i -H 'x-user: dave' -H 'x-tenant: acme' $URL/api/orders
  curl -i -X POST -H 'Idempotency-Key: my-key-1' -d '{"amount":5}' $URL/api/payments
  curl -s http://127.0.0.1:$ADMIN_PORT/stats/prometheus | grep redis_guard
  redis-cli -p $REDIS_PORT --scan
Logs are in $STACK/. Stop it with: make demo-down
TXT
