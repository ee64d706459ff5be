"""Filter configurations for the fuzzer (envoy/cost_gate/fuzz.py), drawn from
the schema the parser is derived from (envoy/filter.schema.json).

Three sources, each deterministic in the generator it is handed:
  seeds     the configurations the project ships and tests (the good
            fixtures, envoy/filter.json, the recipes, the bench scenarios)
  spliced   a seed with some of its subtrees replaced by values the schema
            allows at that place (bounds, enums, patterns; optional fields
            added or dropped): mostly accepted, so traffic runs through them
  drawn     a whole configuration drawn from the schema: mostly refused by
            the cross-field checks, which is what the parser must survive
Values come from pools that mix what a real config holds (header names the
requests will carry, cluster "webdis") with the schema's edges (its minimum
and maximum, one past them, 2^53 and 2^64) and hostile strings.
"""
import copy
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
SCHEMA = json.loads((ROOT / "envoy" / "filter.schema.json").read_text())
DEFS = SCHEMA["definitions"]

# The clusters the fuzz host knows (a dispatch to another is refused, as
# Envoy refuses an unknown cluster).
REDIS_CLUSTER = "webdis"
STORE_CLUSTER = "objectstore"

# Header names the requests draw from (fuzz_inputs.py): a config that names
# them is a config the traffic reaches.
HEADERS = ["x-user", "x-tenant", "x-api-key", "x-plan", "idempotency-key",
           "x-idempotency-key", "x-units", "x-usage-units", "x-cost", "x-internal",
           "content-type", "grpc-timeout", "x-forwarded-for", ":authority", ":path",
           ":method", "authorization", "x-request-id"]
NAMES = ["a", "per-user", "tb", "quota.monthly", "x" * 64, "A-b_c.9"]
STRINGS = ["", "/", "/api/", "/v1/chat/completions", "/api/payments/", "GET", "post",
           "API.Example.com", "10.0.0.0/8", "::/0", "127.0.0.1/32", "fe80::/10", "^a.*$",
           "(a+)+$", "[", "\u00e9t\u00e9", "a\u0000b", "x" * 300, "2xx", "200", "599",
           "NOT_FOUND", "INTERNAL", "UTC", "Europe/Berlin", "America/New_York",
           "Asia/Kolkata", "Pacific/Chatham", "Mars/Olympus", "/usage/total_tokens",
           "/usage/prompt_tokens", "/max_tokens", "/a~1b/~0c", "bad-pointer", "month",
           "week", "day", "hour", "metadata", "filter_metadata", "envoy.filters.http.jwt_authn",
           "sub", "jwt_payload", "request.path", "connection.mtls", "source.address",
           "minioadmin", "bodies", "us-east-1", "rg", "prod/idempotency/"]
INTS = [0, 1, 2, 3, 7, 10, 100, 255, 256, 300, 999, 1000, 1001, 60000, 65535, 2**31 - 1,
        2**31, 2**32, 2**52, 2**53 - 1, 2**53, 2**53 + 1, 2**63 - 1, 2**64 - 1, 2**64, -1]

# By property name: values a real config holds there.
BY_NAME = {
    "name": NAMES, "header": HEADERS, "cluster": [REDIS_CLUSTER, REDIS_CLUSTER, STORE_CLUSTER],
    "timeZone": ["UTC", "Europe/Berlin", "America/New_York", "Asia/Kolkata",
                 "Australia/Lord_Howe", "Nowhere/City"],
    "per": ["month", "week", "day", "hour", "year"],
    "pointer": ["/usage/total_tokens", "/usage/prompt_tokens", "/max_tokens", "",
                "/usage/completion_tokens", "/a/0", "/~1"],
    "pathPrefix": ["/", "/api/", "/v1/", "/api/payments/"], "pathExact": ["/", "/search"],
    "methods": ["GET", "POST", "put", "PATCH", "DELETE"],
    "clientNetworks": ["127.0.0.0/8", "10.0.0.0/8", "::1/128", "0.0.0.0/0", "1.2.3.4/33"],
    "storeStatuses": ["2xx", "4xx", "200", "409", "5xx", "100"],
    "grpcStoreStatuses": ["OK", "NOT_FOUND", "INTERNAL", "ALREADY_EXISTS", "7"],
    "countStatuses": ["2xx", "200", "4xx"], "storeHeaders": ["content-type", "location", "etag"],
    "query": ["user", "api_key", "q"], "literal": ["v1", "", "{x}"],
    "attribute": ["request.path", "source.address", "connection.mtls", "xds.route_name"],
    "namespace": ["envoy.filters.http.jwt_authn", "route"], "path": ["sub", "jwt_payload"],
    "bucket": ["bodies", "redis-guard", "a.b-c"], "region": ["us-east-1", "eu-west-1"],
    "regex": ["^pro$", "a.*", "(", "[a-z]{1,5}"], "exact": ["free", "pro", ""],
    "prefix": ["Bearer ", "x"], "oneOf": ["free", "pro"],
    "host": ["API.Example.com", "localhost"], "authority": ["webdis.internal", None],
    "keyPrefix": ["rg", "prod.rg", "a{b}", "x" * 64], "accessKeyId": ["AKIAFUZZ"],
    "secretAccessKey": ["fuzz-secret"], "sessionToken": ["fuzz-token", None],
    "username": ["guard"], "password": ["fuzz-password"],
}


def seed_configs():
    """(origin, config) of every configuration the project ships or tests
    as valid."""
    import sys
    sys.path.insert(0, str(ROOT / "envoy"))
    from bench_scenarios import SCENARIOS
    out = []
    for path in sorted((ROOT / "tests" / "fixtures" / "config" / "good").glob("*.json")):
        out.append((f"fixture:{path.stem}", json.loads(path.read_text())))
    out.append(("envoy/filter.json", json.loads((ROOT / "envoy" / "filter.json").read_text())))
    for path in sorted((ROOT / "envoy" / "recipes").glob("*.json")):
        out.append((f"recipe:{path.stem}", json.loads(path.read_text())))
    for sc in SCENARIOS:
        if sc.get("filter"):
            out.append((f"bench:{sc['id']}", sc["filter"]))
    for _, cfg in out:
        localize(cfg)
    return out


def localize(cfg):
    """Points a config at the fuzz host's clusters."""
    if isinstance(cfg, dict):
        # A recipe is the limits part of a config.
        cfg.setdefault("redis", {"cluster": REDIS_CLUSTER})
        if isinstance(cfg.get("redis"), dict):
            cfg["redis"]["cluster"] = REDIS_CLUSTER
        if isinstance(cfg.get("objectStore"), dict):
            cfg["objectStore"]["cluster"] = STORE_CLUSTER
    return cfg


def resolve(node):
    while isinstance(node, dict) and "$ref" in node:
        node = DEFS[node["$ref"].rsplit("/", 1)[1]]
    if isinstance(node, dict) and "allOf" in node and len(node["allOf"]) == 1:
        merged = {k: v for k, v in node.items() if k != "allOf"}
        merged.update(resolve(node["allOf"][0]))
        return merged
    return node


def branches(node):
    """The alternatives of an anyOf / oneOf (a Limit's oneOf only says which
    one kind it holds: that is handled as an object)."""
    alts = node.get("anyOf") or (node.get("oneOf") if "properties" not in node else None)
    return [resolve(a) for a in alts] if alts else None


class Drawer:
    """Draws values the schema allows (and, at rate `edge`, one just
    outside: the parser must refuse those without harm)."""

    def __init__(self, rng, edge=0.05, depth=6):
        self.rng = rng
        self.edge = edge
        self.depth = depth

    def value(self, node, name=None, depth=0):
        rng = self.rng
        node = resolve(node)
        alts = branches(node)
        if alts:
            real = [a for a in alts if a.get("type") != "null"]
            if real and rng.random() < 0.9:
                return self.value(rng.choice(real), name, depth)
            return self.value(rng.choice(alts), name, depth)
        if "const" in node:
            return node["const"]
        if "enum" in node:
            return rng.choice(node["enum"])
        types = node.get("type", "object")
        if isinstance(types, list):
            real = [t for t in types if t != "null"]
            types = rng.choice(real) if real and rng.random() < 0.9 else rng.choice(types)
        if types == "null":
            return None
        if types == "boolean":
            return rng.random() < 0.5
        if types == "integer":
            return self.integer(node)
        if types == "number":
            return rng.choice([0.001, 0.25, 0.5, 1.0, 1e-300, 1.5, 0.0])
        if types == "string":
            return self.string(node, name)
        if types == "array":
            if depth >= self.depth:
                return []
            n = rng.choice([0, 1, 1, 1, 2, 3])
            return [self.value(node.get("items", {}), name, depth + 1) for _ in range(n)]
        return self.object(node, depth)

    def integer(self, node):
        rng = self.rng
        lo, hi = node.get("minimum", 0), node.get("maximum", 2**64 - 1)
        r = rng.random()
        if r < self.edge:
            return rng.choice([lo - 1, hi + 1])
        if r < 0.35:
            return rng.choice([lo, hi, lo + 1, max(lo, hi - 1)])
        pool = [v for v in INTS if lo <= v <= hi]
        if pool and r < 0.8:
            return rng.choice(pool)
        return rng.randint(lo, min(hi, lo + 10**6))

    def string(self, node, name):
        rng = self.rng
        pool = BY_NAME.get(name)
        if pool and rng.random() < 0.85:
            v = rng.choice(pool)
            return v if v is not None else rng.choice(STRINGS)
        return rng.choice(STRINGS)

    def object(self, node, depth):
        rng = self.rng
        props = node.get("properties", {})
        required = list(node.get("required", []))
        if "oneOf" in node and all("required" in o for o in node["oneOf"]):
            # A Limit: exactly one kind.
            required += rng.choice(node["oneOf"])["required"]
        out = {}
        for key, sub in props.items():
            kinds = [o["required"][0] for o in node.get("oneOf", []) if "required" in o]
            if key in kinds and key not in required:
                continue
            if key in required or (depth < self.depth and rng.random() < 0.3):
                out[key] = self.value(sub, key, depth + 1)
        return out


def schema_at(path):
    """The schema node of a config path (keys and list indexes)."""
    node = resolve(SCHEMA)
    for step in path:
        node = resolve(node)
        alts = branches(node)
        if alts:
            node = next((a for a in alts if a.get("type") != "null"), alts[0])
        if isinstance(step, int):
            node = node.get("items", {})
        else:
            node = node.get("properties", {}).get(step)
            if node is None:
                return None
    return resolve(node)


def places(cfg, path=()):
    """Every (path, value) of a config, subtrees first."""
    out = [(path, cfg)]
    if isinstance(cfg, dict):
        for k, v in cfg.items():
            out += places(v, path + (k,))
    elif isinstance(cfg, list):
        for i, v in enumerate(cfg):
            out += places(v, path + (i,))
    return out


def splice(rng, cfg, edits):
    """`cfg` with `edits` subtrees replaced by schema draws (or dropped when
    optional, or an optional field added)."""
    cfg = copy.deepcopy(cfg)
    drawer = Drawer(rng)
    for _ in range(edits):
        spots = [p for p, _ in places(cfg) if p]
        if not spots:
            break
        path = rng.choice(spots)
        parent = cfg
        for step in path[:-1]:
            parent = parent[step]
        node = schema_at(path)
        r = rng.random()
        pnode = schema_at(path[:-1]) or {}
        required = path[-1] in pnode.get("required", ()) if isinstance(path[-1], str) else False
        if r < 0.15 and isinstance(parent, (dict, list)) and not required:
            del parent[path[-1]]
        elif r < 0.35 and isinstance(parent, dict):
            pnode = schema_at(path[:-1]) or {}
            pnode = next((a for a in (branches(pnode) or [pnode]) if "properties" in a), pnode)
            key = rng.choice(sorted(pnode.get("properties", {"x": {}})))
            parent[key] = drawer.value(pnode.get("properties", {}).get(key, {}), key)
        elif node is not None:
            parent[path[-1]] = drawer.value(node, path[-1] if isinstance(path[-1], str)
                                            else (path[-2] if len(path) > 1 else None))
    return localize(cfg)


def draw(rng, seeds):
    """(origin, config bytes) for one case."""
    r = rng.random()
    origin, seed = rng.choice(seeds)
    if r < 0.35:
        cfg, origin = copy.deepcopy(seed), origin
    elif r < 0.9:
        cfg, origin = splice(rng, seed, rng.choice([1, 1, 1, 2, 3])), f"spliced:{origin}"
    else:
        cfg, origin = localize(Drawer(rng, edge=0.02).value(SCHEMA)), "drawn"
    raw = json.dumps(cfg).encode()
    if rng.random() < 0.03:
        # Bytes the JSON parser must refuse cleanly.
        cut = rng.randrange(len(raw) + 1)
        raw = rng.choice([raw[:cut], raw[:cut] + b"\xff\xfe" + raw[cut:], raw + b"}",
                          b"[" * 5000, raw.replace(b'"', b"'", 1)])
        origin = f"bytes:{origin}"
    return origin, raw
