#!/usr/bin/env bash
# Starts Redis, Webdis, the demo upstream, a gRPC service, an S3 object store (moto) and Envoy
# with the filter on loopback, shows the filter at work, and leaves the stack
# running.
# `make demo-down` stops it. Ports can be overridden from the environment.
set -euo pipefail
cd "$(dirname "$0")/.."

ENVOY_PORT=${ENVOY_PORT:-10000}
ADMIN_PORT=${ADMIN_PORT:-9901}
WEBDIS_PORT=${WEBDIS_PORT:-17379}
REDIS_PORT=${REDIS_PORT:-16379}
UPSTREAM_PORT=${UPSTREAM_PORT:-18080}
GRPC_UPSTREAM_PORT=${GRPC_UPSTREAM_PORT:-18081}
OBJECT_STORE_PORT=${OBJECT_STORE_PORT:-17900}
STACK=.stack
WASM=target/wasm32-wasip1/release/redis_guard.wasm
ENVOY=$(ls .venv/lib/python3*/site-packages/envoy/_bin/envoy 2>/dev/null | head -n1)

[ -f "$WASM" ] || { echo "missing $WASM: run 'make build'"; exit 1; }
[ -x "$ENVOY" ] || { echo "missing Envoy in .venv: run 'make deps'"; exit 1; }
[ -x .venv/bin/moto_server ] || { echo "missing moto_server in .venv: run 'make deps'"; exit 1; }

bash envoy/demo-down.sh >/dev/null 2>&1 || true
mkdir -p "$STACK"
for p in $ENVOY_PORT $ADMIN_PORT $WEBDIS_PORT $REDIS_PORT $UPSTREAM_PORT $GRPC_UPSTREAM_PORT $OBJECT_STORE_PORT; do
  if (exec 3<>/dev/tcp/127.0.0.1/$p) 2>/dev/null; then
    echo "port $p on 127.0.0.1 is in use; set ENVOY_PORT/ADMIN_PORT/WEBDIS_PORT/REDIS_PORT/UPSTREAM_PORT/GRPC_UPSTREAM_PORT/OBJECT_STORE_PORT"; exit 1
  fi
done

rcli() { # redis-cli as Redis' admin user (redis.acl)
  ( . "$STACK/redis.env"; redis-cli -p "$REDIS_PORT" --user admin --pass "$REDIS_ADMIN_PASSWORD" --no-auth-warning "$@" )
}

wait_port() { # port name
  for _ in $(seq 1 200); do (exec 3<>/dev/tcp/127.0.0.1/$1) 2>/dev/null && return 0; sleep 0.05; done
  echo "$2 did not start; see $STACK/*.log"; exit 1
}

# The demo's own JWT issuer (a key made for this run): the JWKS Envoy's
# jwt_authn verifies tokens with, and the secret the demo signs them with.
python3 envoy/demo_jwt.py keys "$STACK/jwks.json" "$STACK/jwt.secret"

# The same templates the tests and compose.yaml render, here for loopback.
python3 envoy/render.py --out "$STACK" --filter-config envoy/filter.json --jwks "$STACK/jwks.json" \
  --set BIND_ADDRESS=127.0.0.1 --set ADMIN_PORT="$ADMIN_PORT" --set LISTEN_PORT="$ENVOY_PORT" \
  --set UPSTREAM_HOST=127.0.0.1 --set UPSTREAM_PORT="$UPSTREAM_PORT" --set GRPC_UPSTREAM_PORT="$GRPC_UPSTREAM_PORT" \
  --set WEBDIS_HOST=127.0.0.1 --set WEBDIS_PORT="$WEBDIS_PORT" --set WASM_PATH="$PWD/$WASM" --set WASM_RUNTIME=v8 \
  --set REDIS_HOST=127.0.0.1 --set REDIS_PORT="$REDIS_PORT" --set WEBDIS_LOG="$PWD/$STACK/webdis.log" \
  --set OBJECT_STORE_HOST=127.0.0.1 --set OBJECT_STORE_PORT="$OBJECT_STORE_PORT" \
  --webdis-credentials "$STACK/webdis.env" --redis-users "$STACK/redis.env" --set KEY_PREFIX=rg \
  envoy/envoy.yaml envoy/webdis.json envoy/redis.acl

# Redis keeps every change in an append-only file fsynced before each reply
# (the book, Running it: Durability): an idempotency record acknowledged is on disk. The
# demo starts from an empty one each time, so its output is always the same.
rm -rf "$STACK/appendonlydir"
# Its users are redis.acl's: Webdis connects as the default user, which may
# run only the scripts' commands on rg: keys; this script reads as admin.
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly yes --appendfsync always \
  --aclfile "$PWD/$STACK/redis.acl" --dir "$STACK" --logfile "$PWD/$STACK/redis.log" --daemonize no </dev/null >/dev/null 2>&1 &
echo $! > "$STACK/redis.pid"; wait_port "$REDIS_PORT" redis-server

webdis "$STACK/webdis.json" </dev/null >/dev/null 2>&1 &
echo $! > "$STACK/webdis.pid"; wait_port "$WEBDIS_PORT" webdis

python3 envoy/upstream.py --port "$UPSTREAM_PORT" </dev/null > "$STACK/upstream.log" 2>&1 &
echo $! > "$STACK/upstream.pid"; wait_port "$UPSTREAM_PORT" upstream

# A gRPC service (demo.Orders, envoy/grpc_peer.py) for the gRPC part.
.venv/bin/python envoy/grpc_peer.py serve --port "$GRPC_UPSTREAM_PORT" </dev/null > "$STACK/grpc.log" 2>&1 &
echo $! > "$STACK/grpc.pid"; wait_port "$GRPC_UPSTREAM_PORT" "grpc service"

# The object store: moto's S3 server, as in the tests. A finite
# INITIAL_NO_AUTH_ACTION_COUNT turns its IAM access control on, so it checks
# the filter's SigV4 signatures; 0 lets nothing unsigned through until
# s3ctl.py bootstrap opens its own window. wait_port only connects: an HTTP
# probe would count as an action.
INITIAL_NO_AUTH_ACTION_COUNT=0 .venv/bin/moto_server -H 127.0.0.1 -p "$OBJECT_STORE_PORT" \
  </dev/null > "$STACK/moto.log" 2>&1 &
echo $! > "$STACK/moto.pid"; wait_port "$OBJECT_STORE_PORT" moto_server
# Bucket and key prefix as filter.json names them; the lifecycle rule expires
# objects ceil(recordTtlMs / 1 day) + 1 days after upload (longest offloading
# rule), so no object goes before the record that points at it.
read -r BUCKET KEY_PREFIX LIFECYCLE_DAYS < <(python3 -c '
import json, sys
c = json.load(open(sys.argv[1]))
ttl = max(r.get("recordTtlMs", 86400000) for r in c["idempotency"] if "offloadAboveBytes" in r)
print(c["objectStore"]["bucket"], c["objectStore"].get("keyPrefix", "redis-guard/"), -(-ttl // 86400000) + 1)
' envoy/filter.json)
s3ctl() { .venv/bin/python envoy/s3ctl.py "$@"; }
# Only the lifecycle rule read back is kept from its output (the key is in
# the env file).
LIFECYCLE=$(s3ctl bootstrap "$OBJECT_STORE_PORT" "$BUCKET" --env-file "$STACK/objectstore.env" \
  --lifecycle-days "$LIFECYCLE_DAYS" --lifecycle-prefix "$KEY_PREFIX" | python3 -c '
import json, sys
r = json.load(sys.stdin)["lifecycle"][0]
print("expire after %d days under %s" % (r["Expiration"]["Days"], r["Filter"]["Prefix"]))')
# s3ctl.py with the demo's key, which stays out of this shell's environment.
s3ctl_signed() { # cmd, args before the key...
  ( . "$STACK/objectstore.env"
    s3ctl "$1" "$OBJECT_STORE_PORT" "$BUCKET" "${@:2}" "$AWS_ACCESS_KEY_ID" "$AWS_SECRET_ACCESS_KEY" )
}

# filter.json takes the object store's key and Webdis' credentials (made by
# render.py for this run) fromEnvironment: they go into Envoy's environment
# only, and envoy.yaml passes them on to the filter's VM.
( set -a; . "$STACK/objectstore.env"; . "$STACK/webdis.env"; set +a
  exec "$ENVOY" -c "$STACK/envoy.yaml" --concurrency 2 --disable-hot-restart \
    --file-flush-interval-msec 200 \
    --log-level "${ENVOY_LOG_LEVEL:-warn}" ) </dev/null > "$STACK/envoy.log" 2>&1 &
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
echo "what Redis holds for alice's bucket, read by the operator's CLI (make cli; inspect spends nothing):"
# The CLI parses filter.json as the filter does, fromEnvironment credentials
# included, and reaches Redis as its admin user.
( set -a; . "$STACK/objectstore.env"; . "$STACK/webdis.env"; . "$STACK/redis.env"; set +a
  target/release/redis-guard inspect --config envoy/filter.json --limit per-user-burst \
    --value x-user=alice --redis "redis://admin:$REDIS_ADMIN_PASSWORD@127.0.0.1:$REDIS_PORT" ) | sed 's/^/  /'
echo "limit reports-gcra: GCRA, 2 per second with a burst of 3, per x-api-key (one value per key in Redis):"
for i in 1 2 3 4; do show "GET /api/reports (x-api-key: k1) #$i" -H 'x-api-key: k1' "$URL/api/reports"; done
sleep 0.5
echo "  half a second later one unit is back (GCRA spaces them 500 ms apart):"
show "GET /api/reports (x-api-key: k1) #5" -H 'x-api-key: k1' "$URL/api/reports"
echo "limit exports-concurrency: at most 2 exports in flight per x-api-key, across every Envoy"
echo "  (each request holds a slot in Redis until it ends); 4 exports of 1 s each at once:"
EXPORTS=()
for i in 1 2 3 4; do
  curl -s -o /dev/null -w "  GET /api/exports (x-api-key: k1) #$i           -> %{http_code}\n" \
    -H 'x-api-key: k1' -H 'x-upstream-delay-ms: 1000' "$URL/api/exports" &
  EXPORTS+=($!)
done
wait "${EXPORTS[@]}"
PEAK=$(curl -s "http://127.0.0.1:$UPSTREAM_PORT/__stats" \
  | python3 -c 'import json,sys; print(json.load(sys.stdin)["peakInFlight"].get("/api/exports", 0))')
echo "  the upstream ran at most $PEAK exports at once; they ended, so their slots are free again:"
show "GET /api/exports (x-api-key: k1) #5" -H 'x-api-key: k1' "$URL/api/exports"
echo "limit llm-tokens: 1000 tokens per x-api-key (10 back per second), charged by each completion's"
echo "  usage once its stream ends; a request must find its max_tokens left (50 without one), reserved"
echo "  until it settles:"
llm() { # description, prompt,completion, max_tokens
  show "$1" -X POST -d "{\"stream\":true,\"max_tokens\":$3}" -H 'x-api-key: k1' \
    -H 'x-upstream-llm: openai-sse' -H "x-upstream-tokens: $2" "$URL/v1/chat/completions"; sleep 0.2; }
llm "POST /v1/chat/completions (max_tokens 800, used 200 + 600)" 200,600 800
llm "POST /v1/chat/completions (max_tokens 500: about 200 left, 429)" 1,1 500
llm "POST /v1/chat/completions (max_tokens 150, used 100 + 250)" 100,250 150
echo "  that one cost 350 with about 200 left: the key is in debt until refill pays it back:"
llm "POST /v1/chat/completions (max_tokens 1)" 1,1 1
echo "limit per-subject: 3 a minute per verified JWT subject on /v1/me (Envoy's jwt_authn checks the"
echo "  token first and puts its claims where the filter reads them):"
TOKEN=$(python3 envoy/demo_jwt.py sign "$STACK/jwt.secret" '{"sub":"demo-user","plan":"free"}')
for i in 1 2 3 4; do show "GET /v1/me (token for demo-user) #$i" -H "authorization: Bearer $TOKEN" "$URL/v1/me"; done
show "GET /v1/me (another subject's token)" \
  -H "authorization: Bearer $(python3 envoy/demo_jwt.py sign "$STACK/jwt.secret" '{"sub":"other-user"}')" "$URL/v1/me"
show "GET /v1/me (a forged token)" -H "authorization: Bearer ${TOKEN%?????}AAAAA" "$URL/v1/me"
echo "limit failed-logins (envoy/recipes/login.json): wrong passwords (the upstream's 401) per account,"
echo "  5 per 15 minutes, each reserved as it is tried; the first rejection blocks the account for"
echo "  15 minutes, right password or not (here the upstream stands in: x-upstream-status 401 is a wrong one):"
for i in 1 2 3 4 5 6; do
  show "POST /login (x-login-user: eve, wrong) #$i" -X POST -H 'x-login-user: eve' -H 'x-upstream-status: 401' "$URL/login"
done
show "POST /login (x-login-user: eve, right)" -X POST -H 'x-login-user: eve' "$URL/login"
echo "  right passwords are never counted:"
for i in 1 2 3 4 5 6 7; do show "POST /login (x-login-user: dave) #$i" -X POST -H 'x-login-user: dave' "$URL/login"; done
echo "limit per-key-quota: 3 an hour per x-api-key, unless Redis holds the customer's own quota:"
for i in 1 2 3 4; do show "GET /quota/items (x-api-key: globex) #$i" -H 'x-api-key: globex' "$URL/quota/items"; done
echo "  initech's quota set with the CLI (every Envoy's next decision reads it, in the same call):"
( set -a; . "$STACK/objectstore.env"; . "$STACK/webdis.env"; . "$STACK/redis.env"; set +a
  target/release/redis-guard override set --config envoy/filter.json --limit per-key-quota \
    --value x-api-key=initech --capacity 10 --refill 10 \
    --redis "redis://admin:$REDIS_ADMIN_PASSWORD@127.0.0.1:$REDIS_PORT" ) | sed 's/^/  /'
for i in 1 2 3 4 5; do show "GET /quota/items (x-api-key: initech) #$i" -H 'x-api-key: initech' "$URL/quota/items"; done
echo "limits plan-per-second and monthly-plan (envoy/recipes/quota.json on /plan/): 20 at once and 10 a"
echo "  second per x-api-key, within a plan of 1,000,000 a month renewing on the 1st at 00:00 Europe/Berlin."
echo "  umbrella's plan set to 3 a month with the CLI; its 4th request waits for the renewal (retry-after):"
plan_cli() { ( set -a; . "$STACK/objectstore.env"; . "$STACK/webdis.env"; . "$STACK/redis.env"; set +a
  target/release/redis-guard "$@" --config envoy/filter.json --limit monthly-plan --value x-api-key=umbrella \
    --redis "redis://admin:$REDIS_ADMIN_PASSWORD@127.0.0.1:$REDIS_PORT" ) | sed 's/^/  /'; }
plan_cli override set --quota 3
for i in 1 2 3 4; do show "GET /plan/items (x-api-key: umbrella) #$i" -H 'x-api-key: umbrella' "$URL/plan/items"; done
echo "  what is used, what is left and the next renewal, on the plan's clock:"
plan_cli inspect | grep -E '^  (used|left|renews):'
echo "shadow limit search-trial (2 per 10 s) never rejects, it counts:"
for i in 1 2 3; do show "GET /api/search #$i" -H "x-user: carol$i" "$URL/api/search"; done
echo "idempotency rule payments: POST /api/payments with an Idempotency-Key runs once"
pay() { curl -s -D "$STACK/last-headers" -X POST -H "Idempotency-Key: $1" -d "$2" "$URL/api/payments"; }
echo "  first:   $(pay demo-pay-1 '{"amount":10}')"
echo "  retry:   $(pay demo-pay-1 '{"amount":10}')  ($(grep -i '^idempotent-replayed' "$STACK/last-headers" | tr -d '\r'))"
echo "  422:     $(pay demo-pay-1 '{"amount":99}')"
echo "large responses: above offloadAboveBytes (64 KiB) the body goes to the object store, Redis"
echo "keeps a reference and its SHA-256. A keyed POST answered with 1 MiB of random bytes, twice:"
BIG_PATH=/api/payments/statement
big() { # label
  local out; out=$(curl -s -o "$STACK/offload-$1.bin" -D "$STACK/last-headers" -w '%{http_code}' -X POST \
    -H 'Idempotency-Key: demo-offload-1' -H 'x-upstream-binary-bytes: 1048576' -d '{"month":"2026-11"}' "$URL$BIG_PATH")
  local replayed; replayed=$(grep -i '^idempotent-replayed' "$STACK/last-headers" | tr -d '\r' || true)
  printf '  %-7s %s  %s bytes  sha256 %s  %s\n' "$1:" "$out" "$(stat -c %s "$STACK/offload-$1.bin")" \
    "$(sha256sum "$STACK/offload-$1.bin" | cut -c1-16)..." "${replayed:-(executed)}"
}
big first
big retry
echo "  upstream executions of POST $BIG_PATH: $(curl -s "http://127.0.0.1:$UPSTREAM_PORT/__stats" |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["byPath"].get(sys.argv[1], 0))' "$BIG_PATH")"
rcli --scan --pattern '*demo-offload-1*' | while read -r k; do
  echo "  Redis record $k: MEMORY USAGE $(rcli memory usage "$k") bytes, for a 1 MiB body"
done
echo "  in bucket $BUCKET (lifecycle rule, as the store reports it: $LIFECYCLE):"
s3ctl_signed list | python3 -c '
import json, sys
for o in json.load(sys.stdin):
    print("    %s  %d bytes" % (o["key"], o["size"]))'
echo "gRPC: demo.Orders/Create through Envoy over HTTP/2, with gRPC's own client (grpcio)."
grpc_call() { # spec (JSON list)
  .venv/bin/python envoy/grpc_peer.py call --target "127.0.0.1:$ENVOY_PORT" "$1" | .venv/bin/python -c '
import json, sys
for r in json.load(sys.stdin):
    code = r["code"]
    msg = bytes.fromhex(r["messages"][0]).decode() if r["messages"] else ""
    trailing = dict(r["trailing"]); initial = dict(r["initial"])
    line = "    grpc-status %d" % code
    if msg: line += "  message %r" % msg
    if r["details"]: line += "  %r" % r["details"]
    if r.get("retry"): line += "  RetryInfo %d ms, retry-after %s" % (r["retry"]["ms"], trailing.get("retry-after"))
    if initial.get("idempotent-replayed"): line += "  (replayed, trailers %s)" % {k: v for k, v in trailing.items() if k.startswith("x-")}
    elif code == 0: line += "  (executed, trailers %s)" % {k: v for k, v in trailing.items() if k.startswith("x-")}
    print(line)'
}
echo "  the free plan: 2 calls a minute (limit orders-create); the third is RESOURCE_EXHAUSTED:"
FREE='{"method":"Create","data":"pen","metadata":{"x-plan":"free","x-tenant":"acme"}}'
grpc_call "[$FREE,$FREE,$FREE]"
echo "  a keyed call, then its retry (replayed: message and trailers as the first time):"
KEYED='{"method":"Create","data":"book","metadata":{"idempotency-key":"demo-grpc-1","x-tenant":"acme"}}'
grpc_call "[$KEYED,$KEYED]"
echo "  executions of demo.Orders/Create at the service: $(.venv/bin/python envoy/grpc_peer.py call \
  --target "127.0.0.1:$GRPC_UPSTREAM_PORT" '[{"method":"Stats"}]' |
  .venv/bin/python -c 'import json, sys; print(json.loads(bytes.fromhex(json.load(sys.stdin)[0]["messages"][0]))["Create"])')"
echo "Webdis runs nothing without the credentials render.py made for this run (the filter sends them):"
echo "  EVAL without them: HTTP $(curl -s -o /dev/null -w '%{http_code}' -X POST --data 'EVAL/return%207/0.raw' "http://127.0.0.1:$WEBDIS_PORT/")"
echo "  EVAL with them:    HTTP $( (. "$STACK/webdis.env"; curl -s -o /dev/null -w '%{http_code}' \
  -u "$REDIS_GUARD_WEBDIS_USERNAME:$REDIS_GUARD_WEBDIS_PASSWORD" -X POST --data 'EVAL/return%207/0.raw' "http://127.0.0.1:$WEBDIS_PORT/") )"
# The access log (JSON on Envoy's stdout, envoy.yaml): the filter's answers
# carry their own response code details and its record of the decision.
access_line() { # a response_code_details value
  for _ in $(seq 1 50); do
    grep -m1 "\"response_code_details\":\"$1\"" "$STACK/envoy.log" && return
    sleep 0.1
  done
  echo "  (no access-log line with $1)"
}
echo "the access-log line of the first 429 and of a replay (envoy.yaml's access_log, in $STACK/envoy.log):"
access_line redis_guard_rate_limited | sed 's/^/  /'
access_line redis_guard_idempotent_replay | sed 's/^/  /'
echo "the filter's Envoy stats:"
curl -s "http://127.0.0.1:$ADMIN_PORT/stats?filter=wasmcustom" | sed 's/^/  /'
echo "keys in Redis (every one with a TTL):"
rcli --scan | while read -r k; do echo "  $k  pttl=$(rcli pttl "$k")"; done
cat <<TXT

The stack keeps running. Try:
  curl -i -H 'x-user: alice' $URL/api/orders
  curl -i -H 'x-user: dave' -H 'x-tenant: acme' $URL/api/orders
  curl -i -X POST -H 'Idempotency-Key: my-key-1' -d '{"amount":5}' $URL/api/payments
  curl -s -X POST -H 'Idempotency-Key: my-key-2' -H 'x-upstream-binary-bytes: 200000' $URL/api/payments | sha256sum
  (. $STACK/objectstore.env; .venv/bin/python envoy/s3ctl.py list $OBJECT_STORE_PORT $BUCKET \$AWS_ACCESS_KEY_ID \$AWS_SECRET_ACCESS_KEY)
  .venv/bin/python envoy/grpc_peer.py call --target 127.0.0.1:$ENVOY_PORT '[{"method":"Create","data":"x","metadata":{"idempotency-key":"k1","x-tenant":"t"}}]'
  curl -s http://127.0.0.1:$ADMIN_PORT/stats/prometheus | grep redis_guard
  (. $STACK/redis.env; redis-cli -p $REDIS_PORT --user admin --pass \$REDIS_ADMIN_PASSWORD --no-auth-warning --scan)
Logs are in $STACK/ (envoy.log holds the JSON access log). Alert rules and their tests:
envoy/prometheus/; a Grafana dashboard: envoy/grafana/redis-guard.json. Stop it with: make demo-down
TXT
