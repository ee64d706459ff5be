"""make soak: a whole stack on loopback (three Envoys with the filter, a Redis
primary with a replica, two Webdis, the object store, the upstream) under
every kind of traffic at once while faults are injected at seeded random
moments; the invariants the book promises are checked from the clients' side
and from Redis, and a table of what happened is printed (the book, Inside it:
Reliability). Run: PYTHONPATH=envoy .venv/bin/python -m soak --minutes 10."""
