#!/usr/bin/env bash
# Stops what envoy/demo.sh started.
cd "$(dirname "$0")/.."
for s in envoy upstream webdis redis; do
  f=.stack/$s.pid
  if [ -f "$f" ]; then kill "$(cat "$f")" 2>/dev/null || true; rm -f "$f"; fi
done
echo "demo stack stopped"
