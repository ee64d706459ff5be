"""What the fuzzer (envoy/cost_gate/fuzz.py) feeds the filter besides its
configuration: client requests (headers, bodies, trailers), upstream
responses, and the replies of Webdis and the object store to the calls the
filter sends, each reference reply (what the Lua script would answer,
lua/*.lua's headers) then mutated at will.

Every draw is data a trace can hold (JSON): bytes as latin-1 strings, long
runs as {"rep": s, "n": k}, a reply as a spec (a verdict and the mutations
to apply) that is turned into bytes against the call it answers when it is
delivered, so a recorded case replays whatever nonce the call carries.
"""
import hashlib
import struct

from cost_gate.webdis import NOSCRIPT, Redis, array, bulk, read_call, response_headers

# ---- bytes in a trace ----------------------------------------------------


def enc(b):
    return b.decode("latin-1")


def dec(x):
    """Bytes of a trace value: a latin-1 string, {"rep": s, "n": k}, or a
    list of those, joined."""
    if isinstance(x, str):
        return x.encode("latin-1")
    if isinstance(x, dict):
        return x["rep"].encode("latin-1") * x["n"]
    return b"".join(dec(p) for p in x)


def pairs_dec(pairs):
    return [(dec(k), dec(v)) for k, v in pairs]


# ---- values ---------------------------------------------------------------

NUMBERS = ["0", "1", "2", "7", "-1", "-0", "+7", " 7", "7 ", "007", "1e3", "1.5", "NaN",
           "inf", "0x10", "4294967295", "4294967296", "9007199254740991", "9007199254740992",
           "9007199254740993", "9223372036854775807", "9223372036854775808",
           "18446744073709551615", "18446744073709551616", "1" + "0" * 40, "\xd9\xa3", ""]
HOSTILE = ["", "\xff", "\xc3\x28", "\xed\xa0\x80", "\xf4\x90\x80\x80", "a\tb", "%00", "\x7f",
           "../..", "{tag}", "\xc3\xa9", "\x01\x02", "a,b", "Bearer x.y.z", "*", ";", "%ff%fe"]
# JSON numbers as a body may carry them: past 2^53, past 2^64, fractions.
JSON_NUMBERS = ["0", "1", "100", "-5", "1.5", "1e2", "1e400", "-0", "9007199254740993",
                "18446744073709551616", "123456789012345678901234567890", '"12"', "null",
                "true", "[]", "{}"]
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "get", "HEAD", "OPTIONS"]
PATHS = ["/", "/api/", "/api/payments/1", "/api/orders/7", "/api/small/x", "/v1/chat/completions",
         "/v1/messages", "/search", "/upload/f", "/x?user=a&user=b&api_key=k", "/%ff/..",
         "//api/", "/api/payments/" + "p" * 2000, "/?q=%zz"]
AUTHORITIES = ["API.Example.com", "localhost:10000", "", "api.example.com:443", "\xff"]
CONTENT_TYPES = ["application/json", "application/grpc", "application/grpc+proto",
                 "application/grpc-web", "text/event-stream", "text/plain", "", "\xff"]
SOURCES = ["127.0.0.1:40000", "10.1.2.3:5", "[::1]:7", "[fe80::1%eth0]:1", "garbage", "",
           "255.255.255.255:0"]


def pick(rng, pool):
    return rng.choice(pool)


def value(rng, kind):
    """A header value of `kind`: number, key, or any."""
    r = rng.random()
    if kind == "number" and r < 0.8:
        return pick(rng, NUMBERS)
    if kind == "key" and r < 0.7:
        return rng.choice(["k-%d" % rng.randrange(4), "k" * 255, "k" * 256, "k-\x01", "\xff"])
    if r < 0.15:
        return pick(rng, HOSTILE)
    if r < 0.2:
        return {"rep": "v", "n": rng.choice([1000, 8000, 20000])}
    return rng.choice(["a", "b", "free", "pro", "u-%d" % rng.randrange(3), "1", "t1"])


def config_headers(cfg):
    """(name, kind) of every header a config reads: descriptor and tenant
    parts, matches, cost and usage headers, idempotency keys."""
    out = {}

    def walk(node, key=None):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "header" and isinstance(v, str):
                    out.setdefault(v.lower(), "any")
                if k == "name" and key in ("headers", "costHeader") and isinstance(v, str):
                    out.setdefault(v.lower(), "number" if key == "costHeader" else "any")
                walk(v, k)
        elif isinstance(node, list):
            for v in node:
                walk(v, key)
    walk(cfg)
    for rule in cfg.get("idempotency") or [] if isinstance(cfg, dict) else []:
        if isinstance(rule, dict) and isinstance(rule.get("header", ""), str):
            out[(rule.get("header") or "idempotency-key").lower()] = "key"
    for lim in cfg.get("limits") or [] if isinstance(cfg, dict) else []:
        if isinstance(lim, dict) and isinstance(lim.get("costHeader"), dict):
            name = lim["costHeader"].get("name")
            out[name.lower() if isinstance(name, str) else "x-units"] = "number"
        if isinstance(lim, dict) and isinstance(lim.get("usage"), dict):
            name = lim["usage"].get("header")
            if isinstance(name, str):
                out[name.lower()] = "number"
    out.setdefault("idempotency-key", "key")
    return sorted(out.items())


def config_pointers(cfg):
    """Every JSON pointer a config's usage terms read."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("pointer"), str):
                found.append(node["pointer"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(cfg)
    return found or ["/usage/total_tokens"]


def json_at(pointer, number):
    """A JSON document with `number` (JSON text) at `pointer`."""
    doc = number
    for part in reversed([p for p in pointer.split("/")[1:]]):
        part = part.replace("~1", "/").replace("~0", "~")
        doc = '{"%s":%s}' % (part.replace('"', '\\"'), doc) if not part.isdigit() \
            else "[" + ",".join(["0"] * int(part[:2]) + [doc]) + "]"
    return doc


def body(rng, cfg, sse=False):
    """A body recipe: JSON with usage figures, an event stream, junk, or a
    large one (up to a few MB, the limits' scale)."""
    r = rng.random()
    pointers = config_pointers(cfg)
    if r < 0.45:
        docs = [json_at(rng.choice(pointers), pick(rng, JSON_NUMBERS))
                for _ in range(rng.choice([1, 1, 2]))]
        if sse:
            return ["".join("data: %s\n\n" % d for d in docs) + rng.choice(["data: [DONE]\n\n",
                                                                             "", "data: {"])]
        return [docs[0]]
    if r < 0.6:
        return [pick(rng, HOSTILE) * rng.choice([1, 3])]
    if r < 0.7:
        return [{"rep": "[", "n": rng.choice([100, 10000, 100000])}]
    if r < 0.8:
        n = rng.choice([1024, 65536, 65537, 1048576, 1048577, 8388609])
        return ['{"max_tokens":1,"pad":"', {"rep": "x", "n": n}, '"}']
    return [""]


def chunks(rng, size):
    """Cut points of a body of `size` bytes into 1 to 4 pieces."""
    if size == 0:
        return []
    cuts = sorted({rng.randrange(1, size + 1) for _ in range(rng.choice([0, 1, 2, 3]))})
    return [c for c in cuts if c < size] + [size]


def targets(cfg):
    """What a request must carry to meet each rule of a config (its match:
    path, methods, headers; an idempotency rule's key header): the requests
    aim at them more often than chance would."""
    out = []
    rules = [(r, True) for r in cfg.get("idempotency") or [] if isinstance(r, dict)]
    rules += [(r, False) for r in cfg.get("limits") or [] if isinstance(r, dict)]
    for rule, keyed in rules:
        match = rule.get("match") if isinstance(rule.get("match"), dict) else {}
        path = match.get("pathExact") or (match.get("pathPrefix") or "/") + rule.get("name", "x")
        methods = [m.upper() for m in match.get("methods") or [] if isinstance(m, str)]
        headers = [[h["name"].lower(), h.get("exact") or h.get("prefix") or "pro"]
                   for h in match.get("headers") or [] if isinstance(h, dict)
                   and isinstance(h.get("name"), str) and h.get("present") is not False
                   and isinstance(h.get("exact") or h.get("prefix") or "pro", str)]
        key = (rule.get("header") or "idempotency-key").lower() if keyed else None
        out.append({"path": path, "methods": methods or (["POST"] if keyed else ["GET"]),
                    "headers": headers, "key": key, "host": match.get("host")})
    return out


def request(rng, cfg):
    """One client request: headers, per-stream properties, body and
    trailers (each optional), as trace data; aimed at one of the config's
    rules more often than not."""
    aims = targets(cfg) if isinstance(cfg, dict) else []
    aim = rng.choice(aims) if aims and rng.random() < 0.6 else None
    method = rng.choice(aim["methods"]) if aim else pick(rng, METHODS)
    path = aim["path"] if aim and isinstance(aim["path"], str) else pick(rng, PATHS)
    host = aim["host"] if aim and isinstance(aim["host"], str) else pick(rng, AUTHORITIES)
    headers = [[":method", method], [":path", path], [":authority", host], [":scheme", "http"]]
    for name, v in aim["headers"] if aim else []:
        headers.append([name, v])
    if aim and aim["key"]:
        headers.append([aim["key"], "k-%d" % rng.randrange(3)])
    for name, kind in config_headers(cfg):
        if name.startswith(":") or any(h[0] == name for h in headers):
            continue
        if rng.random() < 0.7:
            headers.append([name, value(rng, kind)])
            if rng.random() < 0.05:
                headers.append([name, value(rng, kind)])
    if rng.random() < 0.3:
        headers.append(["content-type", pick(rng, CONTENT_TYPES)])
    if rng.random() < 0.1:
        headers.append(["x-forwarded-for", rng.choice(["1.2.3.4", "1.2.3.4, 5.6.7.8", "::1", "x"])])
    if rng.random() < 0.03:
        headers.append(["x-big", {"rep": "b", "n": 60000}])
    props = {}
    if rng.random() < 0.9:
        props["source.address"] = pick(rng, SOURCES)
    for path in ("connection.mtls", "request.path", "xds.route_name"):
        if rng.random() < 0.1:
            props[path] = pick(rng, HOSTILE)
    has_body = method in ("POST", "PUT", "PATCH") and rng.random() < 0.8 or rng.random() < 0.05
    grpc = any(k == "content-type" and "grpc" in v for k, v in headers if isinstance(v, str))
    b = body(rng, cfg) if has_body else None
    if b is not None and grpc and rng.random() < 0.5:
        b = [enc(b"\x00" + struct.pack(">I", rng.choice([3, 2**32 - 1]))) + "abc"]
    trailers = None
    if rng.random() < 0.1:
        trailers = [[rng.choice(["x-usage-units", "grpc-status", "x-t"]), pick(rng, NUMBERS)]]
    return {"headers": headers, "props": props, "body": b, "trailers": trailers}


STATUSES = ["200", "200", "200", "201", "204", "304", "400", "404", "409", "429", "500",
            "503", "599", "99", "600", "abc", ""]


def response(rng, cfg, grpc=False):
    """One upstream response (status, headers, body recipe, trailers)."""
    ct = "application/grpc" if grpc and rng.random() < 0.7 else pick(rng, CONTENT_TYPES)
    headers = [[":status", pick(rng, STATUSES)], ["content-type", ct]]
    b = body(rng, cfg, sse="event-stream" in ct) if rng.random() < 0.8 else None
    size = len(dec(b)) if b is not None else 0
    if rng.random() < 0.6:
        headers.append(["content-length", rng.choice([str(size), str(size + 1), "0", "x",
                                                      "18446744073709551616"])])
    for name, kind in config_headers(cfg):
        if kind == "number" and rng.random() < 0.3:
            headers.append([name, pick(rng, NUMBERS)])
    if rng.random() < 0.2:
        headers.append(["grpc-status", rng.choice(["0", "5", "13", "99", "x"])])
    trailers = None
    if rng.random() < 0.2:
        trailers = [[rng.choice(["grpc-status", "grpc-message", "x-usage-units"]),
                     pick(rng, NUMBERS)]]
    return {"headers": headers, "body": b, "trailers": trailers}


# ---- replies --------------------------------------------------------------

# Ints a valid reply may carry (i64, as the filter reads them).
FIGURES = [0, 1, 2, 999, 2**31 - 1, 2**31, 2**53 + 1, 2**62, 2**63 - 1]
# Whole bodies in place of the reference reply.
JUNK = [b"", b"-ERR unknown command\r\n", b"-NOSCRIPT x\r\n", b":1\r\n", b"$-1\r\n", b"*-1\r\n",
        b"*0\r\n", b"*3\r\n:1\r\n", b"*99999999999\r\n", b"*1\r\n*1\r\n:1\r\n",
        b"$5\r\nabc\r\n", b"$-9\r\n", b":18446744073709551616\r\n", b"*1\r\n:-9223372036854775809\r\n",
        b'{"EVALSHA":[1,0,0]}', b"<html>503</html>", b"+OK\r\n", b"\r\n\r\n", b"*2\r\n$1\r\n~\r\n:1\r\n"]
MUTATIONS = ("trunc", "flip", "item", "junk", "wrap", "big", "nest")


def resp_items(body):
    """The top-level items of a RESP array reply (byte strings, each a whole
    item), or None when it is not one this reads."""
    if not body.startswith(b"*"):
        return None
    head, _, rest = body.partition(b"\r\n")
    try:
        n = int(head[1:])
    except ValueError:
        return None
    items = []
    for _ in range(max(n, 0)):
        if not rest:
            break
        line, _, tail = rest.partition(b"\r\n")
        if line[:1] == b"$" and line[1:].lstrip(b"-").isdigit() and int(line[1:]) >= 0:
            size = int(line[1:])
            items.append(rest[:len(line) + 2 + size + 2])
            rest = rest[len(line) + 2 + size + 2:]
        else:
            items.append(line + b"\r\n")
            rest = tail
    return items


def mutate(rng):
    """One mutation, as trace data."""
    m = pick(rng, MUTATIONS)
    if m == "trunc":
        return [m, rng.randrange(0, 64)]
    if m == "flip":
        return [m, rng.randrange(0, 64), rng.randrange(256)]
    if m == "item":
        return [m, rng.randrange(0, 12), rng.choice([":%d\r\n" % v for v in
                                                     (-1, 2, 2**63, -(2**63) - 1)] +
                                                    ["$3\r\nabc\r\n", "$20\r\n18446744073709551616\r\n",
                                                     "$16\r\n9007199254740993\r\n", "*1\r\n:1\r\n",
                                                     "$-1\r\n", ":1\r\n", ":0\r\n"])]
    if m == "junk":
        return [m, rng.randrange(len(JUNK))]
    if m == "big":
        return [m, rng.choice([1 << 16, 1 << 23])]
    return [m]


def apply_mutation(body, m):
    op = m[0]
    if op == "trunc":
        return body[:min(m[1], max(len(body) - 1, 0))]
    if op == "flip":
        if not body:
            return body
        i = m[1] % len(body)
        return body[:i] + bytes([m[2]]) + body[i + 1:]
    if op == "item":
        items = resp_items(body)
        if not items:
            return body
        items[m[1] % len(items)] = m[2].encode("latin-1")
        return b"*%d\r\n" % len(items) + b"".join(items)
    if op == "junk":
        return JUNK[m[1]]
    if op == "wrap":
        return bulk(body)
    if op == "big":
        return b"$%d\r\n" % m[1] + b"7" * m[1] + b"\r\n"
    if op == "nest":
        return b"*1\r\n" * 100 + body
    return body


class Webdis(Redis):
    """Webdis, Redis and the object store for one case: a fresh Redis (every
    script NOSCRIPT until sent as EVAL), answering each call with the reply
    a spec asks for."""

    def __init__(self):
        super().__init__()
        self.objects = {}  # object key -> bytes (stored responses the replies name)

    def script(self, call):
        """(lua/ file stem or None, keys, argv, nonce) of a Redis call; the
        stem None for an unknown SHA-1 (Redis answers NOSCRIPT)."""
        command, args = read_call(call)
        if command == "EVAL":
            source = args[0]
            name = self.names.get(source.decode("latin-1").split("\n", 1)[0])
            self.loaded[hashlib.sha1(source).hexdigest()] = name
        else:
            name = self.loaded.get(args[0].decode("latin-1"))
        nkeys = int(args[1])
        keys, argv = args[2:2 + nkeys], args[2 + nkeys:]
        nonce = None
        if argv and argv[0].startswith(b"~"):
            nonce, argv = argv[0], argv[1:]
        return name, keys, argv, nonce

    def choices(self, call):
        """The verdicts a valid reply to this call may carry."""
        if call["cluster"] != "webdis":
            return ["object"]
        name, _keys, argv, _ = self.script(call)
        if name is None:
            return ["noscript"]
        if name == "ratelimit":
            n = int(argv[0])
            out = ["admit"]
            if any(argv[6 + 6 * i] != b"0" for i in range(n)):
                out.append("reject")
            if len(argv) > 1 + 6 * n and argv[1 + 6 * n] == b"1":
                out += ["busy", "replay", "replay-object", "mismatch"]
            if any(argv[1 + 6 * i].startswith(b"cq") for i in range(n)):
                out.append("anchors")
            return out
        if name in ("batch", "lease"):
            return ["admit", "reject", "mixed"] if name == "batch" else ["admit", "reject"]
        return ["ok", "nothing"]

    def reply(self, call, spec):
        """(headers, body, category) of the answer `spec` describes."""
        if spec.get("fail"):
            return [], b"", "fail"
        body, category = self.reference(call, spec)
        for m in spec.get("mut", []):
            body = apply_mutation(body, m)
            category = "garbage"
        headers = response_headers(body)
        status = spec.get("status", "200")
        if call["cluster"] != "webdis" or status != "200" or not spec.get("server", True):
            headers = [(b":status", status.encode()), (b"content-length", b"%d" % len(body))]
            if spec.get("server", True) and call["cluster"] == "webdis":
                headers.append((b"server", b"Webdis"))
            # A 200 from elsewhere is still read (a proxy in between may
            # name itself), but its nonce is not: a call sent with one
            # then fails.
            if call["cluster"] == "webdis" and (status != "200" or self.script(call)[3]):
                category = "fail"
        return headers, body, category

    def reference(self, call, spec):
        v = spec.get("v", "admit")
        if call["cluster"] != "webdis":
            return self.object_reply(call, spec), "object"
        name, keys, argv, nonce = self.script(call)
        if name is None or v == "noscript":
            return NOSCRIPT, "noscript"
        nonce_out = {"keep": nonce, "drop": None, "wrong": b"~" + b"0" * 16}[spec.get("nonce", "keep")]
        category = v if v in ("admit", "reject") else "other"
        figures = [FIGURES[i % len(FIGURES)] for i in spec.get("fig", [1, 0, 3])]
        if name == "ratelimit":
            items = self.ratelimit_reply(argv, v, figures)
        elif name == "batch":
            items = self.batch_reply(argv[0], v, spec.get("members", []), figures)
            category = {"admit": "admit", "reject": "reject"}.get(v, "other")
        elif name == "lease":
            items = self.lease_reply(argv, v, figures)
        elif name in ("lease_return", "concurrency_renew"):
            items = [int(v == "ok") for _ in keys]
        elif name == "settle":
            items = [figures[i % 3] if v == "ok" else b"ERR redis-guard settle: limit %d fuzz" % (i + 1)
                     for i in range(len(keys))]
        else:
            return b":%d\r\n" % int(v == "ok"), "other"
        # Not this call's nonce first (or one where it sent none): a reply
        # the filter must not take for its own.
        return array(items, nonce_out), category if nonce_out == nonce else "fail"

    def ratelimit_reply(self, argv, v, figures):
        n = int(argv[0])
        enforced = [argv[6 + 6 * i] != b"0" for i in range(n)]
        if v == "busy":
            return [2, max(1, figures[0])]
        if v == "mismatch":
            return [4]
        if v == "anchors":
            return [5, 1, 1 + figures[0] % 31]
        if v in ("replay", "replay-object"):
            headers = b"12:content-type10:text/plain"
            if v == "replay":
                return [3, 200, headers, b"stored"]
            data = b"object-%d" % len(self.objects)
            key = b"obj/%d" % len(self.objects)
            self.objects[key.decode()] = data
            return [3, 200, headers, b"", key, hashlib.sha256(data).hexdigest().encode(),
                    len(data)]
        out = [1 if v == "admit" else 0]
        first = enforced.index(True) if v == "reject" and True in enforced else -1
        for i in range(n):
            allowed = 0 if i == first else 1
            out += [allowed, figures[0], 0 if allowed else figures[1], figures[2]]
        return out

    def batch_reply(self, packed, v, members, figures):
        shapes = batch_shapes(packed)
        out = [len(shapes)]
        for i, n in enumerate(shapes):
            mv = v if v != "mixed" else (members[i % len(members)] if members else "admit")
            if mv == "err":
                reply = [b"ERR redis-guard ratelimit: fuzz"]
            else:
                reply = [1 if mv == "admit" else 0]
                for j in range(n):
                    allowed = 0 if (mv == "reject" and j == 0) else 1
                    reply += [allowed, figures[0], 0 if allowed else figures[1], figures[2]]
            out += [len(reply)] + reply
        return out

    def lease_reply(self, argv, v, figures):
        if v == "reject":
            return [0, 0, figures[0], max(1, figures[1]), max(1, figures[1]), 0, 0, 0, 0]
        granted = figures[2] % 8
        return [1, 1, figures[0], 0, figures[2], granted, self.NOW_MS if granted else 0,
                figures[0], 0]

    def object_reply(self, call, spec):
        method = call["headers"].get(b":method", b"")
        if method == b"PUT":
            return b""
        path = call["headers"].get(b":path", b"").decode("latin-1")
        data = next((d for k, d in self.objects.items() if path.endswith(k)), b"")
        return data if spec.get("v") != "nothing" else data[:-1]


def batch_shapes(packed):
    """The limit count of each member of a packed batch (lua/batch.lua's
    layout, version 3)."""
    _version, nparams = struct.unpack_from(">BH", packed, 0)
    at, kinds = 3, []
    for _ in range(nparams):
        kinds.append(packed[at] & 127)
        at += 33
    (m,) = struct.unpack_from(">H", packed, at)
    at += 2
    shapes = []
    for _ in range(m):
        (n,) = struct.unpack_from(">H", packed, at)
        at += 2
        for _ in range(n):
            p = struct.unpack_from(">H", packed, at)[0]
            at += 12
            if kinds[p - 1] in (6, 7):
                (slen,) = struct.unpack_from(">H", packed, at)
                at += 2 + slen
        keyed = packed[at]
        at += 1
        if keyed:
            _k, olen = struct.unpack_from(">HH", packed, at)
            at += 4 + olen
            (flen,) = struct.unpack_from(">H", packed, at)
            at += 2 + flen + 8
        shapes.append(n)
    return shapes


def reply_spec(rng, webdis, call):
    """A reply to `call`, as trace data: mostly valid (a verdict drawn from
    what the script may answer), else a failure or a mutated body."""
    r = rng.random()
    if r < 0.08:
        return {"fail": rng.choice(["timeout", "reset"])}
    spec = {"v": rng.choice(webdis.choices(call))}
    if spec["v"] == "mixed":
        spec["members"] = [rng.choice(["admit", "reject", "err"]) for _ in range(4)]
    if rng.random() < 0.3:
        spec["fig"] = [rng.randrange(len(FIGURES)) for _ in range(3)]
    if r < 0.16:
        spec["status"] = rng.choice(["503", "500", "404", "429", "403"])
        spec["server"] = rng.random() < 0.5
    elif r < 0.19:
        spec["server"] = False
    elif r < 0.23:
        spec["nonce"] = rng.choice(["drop", "wrong"])
    elif r < 0.35:
        spec["mut"] = [mutate(rng) for _ in range(rng.choice([1, 1, 2]))]
    return spec
