#!/usr/bin/env bash
# Stops what envoy/demo.sh started.
cd "$(dirname "$0")/.."
for s in envoy upstream grpc webdis redis moto; do
  f=.stack/$s.pid
  if [ -f "$f" ]; then kill "$(cat "$f")" 2>/dev/null || true; rm -f "$f"; fi
done
# moto keeps nothing across restarts, so the next demo bootstraps a new
# store: no reason to leave the key lying around.
rm -f .stack/objectstore.env
echo "demo stack stopped"
