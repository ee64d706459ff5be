"""Webdis and Redis as the filter's callouts meet them: each call is read as
Webdis reads it (src/webdis.rs writes it), and answered with the RESP bytes
the script it runs would return on a bucket that admits (lua/*.lua), the
call's nonce first where the script echoes it (lua/nonce.lua).

Scripts are known the way Redis knows them: a fresh Redis answers an
EVALSHA it has not seen with NOSCRIPT, the filter sends the script again as
EVAL (src/filter/call.rs), and its SHA-1 is then remembered under the name
of the lua/ file whose first line the source starts with. The warm-up
requests pay that; the measured ones find every script loaded.
"""
import hashlib
import math
import struct
from pathlib import Path
from urllib.parse import unquote_to_bytes

LUA = Path(__file__).resolve().parent.parent.parent / "lua"
NOSCRIPT = b"-NOSCRIPT No matching script. Please use EVAL.\r\n"
KINDS = {1: "tb", 2: "sw", 3: "gcra", 4: "fw", 5: "swc", 6: "cc"}


class ReplyError(Exception):
    """A call the gate cannot answer as Redis would (a script it has no
    reply for, a call it cannot read)."""


def first_lines():
    """lua/ file stem by its first line: a composed script starts with its
    main file's."""
    out = {}
    for path in sorted(LUA.glob("*.lua")):
        out.setdefault(path.read_text().split("\n", 1)[0], path.stem)
    return out


def integer(n):
    """A number as lua/wire.lua hands it over: an integer reply below 2^31,
    a decimal bulk string from there (Webdis 0.1.9 cannot carry more)."""
    n = int(n)
    if n >= 2**31 or n <= -(2**31) - 1:
        return bulk(str(n).encode())
    return b":%d\r\n" % n


def bulk(b):
    return b"$%d\r\n%s\r\n" % (len(b), b)


def array(items, nonce=None):
    parts = [bulk(nonce)] if nonce is not None else []
    parts += [integer(v) if isinstance(v, int) else bulk(v) for v in items]
    return b"*%d\r\n" % len(parts) + b"".join(parts)


def read_call(call):
    """(command, args) of a callout as Webdis splits it: a POST's body is
    the whole command, a PUT's path all but its last argument (the body)."""
    method = call["headers"].get(b":method")
    if method == b"POST":
        text, tail = call["body"], []
    elif method == b"PUT":
        text, tail = call["headers"][b":path"][1:], [call["body"]]
    else:
        raise ReplyError(f"a {method!r} callout: the filter sends POST or PUT")
    if not text.endswith(b".raw"):
        raise ReplyError(f"not a .raw command: {text[:60]!r}")
    parts = [unquote_to_bytes(p) for p in text[:-4].split(b"/")]
    return parts[0].decode(), parts[1:] + tail


class Redis:
    """What the scripts answer. Every limit admits: the bench's limits are
    never exhausted, and every figure is what the script computes on a
    bucket or window that has room (constant from call to call, so every
    steady-state request meets the same reply)."""

    def __init__(self):
        self.names = first_lines()
        self.loaded = {}  # sha1 -> lua/ file stem
        self.noscripts = 0

    def answer(self, call):
        """(name of the script run or None, RESP body) for one callout."""
        command, args = read_call(call)
        if command == "EVAL":
            source = args[0]
            first = source.decode().split("\n", 1)[0]
            name = self.names.get(first)
            if name is None:
                raise ReplyError(f"EVAL of a script no lua/ file starts as: {first[:60]!r}")
            self.loaded[hashlib.sha1(source).hexdigest()] = name
        elif command == "EVALSHA":
            name = self.loaded.get(args[0].decode())
            if name is None:
                self.noscripts += 1
                return None, NOSCRIPT
        else:
            raise ReplyError(f"{command}: the filter sends scripts only")
        nkeys = int(args[1])
        keys, argv = args[2:2 + nkeys], args[2 + nkeys:]
        nonce = None
        if name in ("ratelimit", "batch", "lease") and argv and argv[0].startswith(b"~"):
            nonce, argv = argv[0], argv[1:]
        reply = getattr(self, "_" + name, None)
        if reply is None:
            raise ReplyError(f"no reply for lua/{name}.lua in the gate")
        return name, reply(keys, argv, nonce)

    # ---- lua/ratelimit.lua ------------------------------------------------

    @staticmethod
    def limit_figures(kind, a, b, c, cost):
        """allowed, remaining, retry_ms, reset_ms of one limit that admits
        `cost` on a key nothing else has charged (lua/token_bucket.lua and
        the other kinds): the bench's buckets refill a billion tokens a
        second, so each call finds them full again."""
        kind = kind.split("+")[0]
        if kind == "tb":
            return [1, int(a - cost), 0, max(1, math.ceil(cost * c / b))]
        if kind == "gcra":
            return [1, int(a - cost), 0, max(1, math.ceil(cost * c / b))]
        if kind in ("sw", "fw", "swc"):
            return [1, int(a - cost), 0, int(b)]
        if kind == "cc":
            return [1, int(a - cost), 0, 0]
        raise ReplyError(f"unknown limit kind {kind!r}")

    def decision(self, limits, charged=None):
        """lua/decide.lua's admitted reply: 1, then four figures a limit;
        `limits`: (kind, a, b, c, cost, enforce, key) each. `charged`: what
        earlier members of the same batch charged each key (they were
        decided first, at the same instant), updated."""
        charged = {} if charged is None else charged
        out = [1]
        for kind, a, b, c, cost, _enforce, key in limits:
            before = charged.get(key, 0)
            figures = self.limit_figures(kind, a, b, c, before + cost)
            out += figures
            charged[key] = before + cost
        return out

    def _ratelimit(self, _keys, argv, nonce):
        n = int(argv[0])
        limits = []
        for i in range(n):
            kind, a, b, c, cost, enforce = argv[1 + 6 * i:7 + 6 * i]
            c = float(c) if kind.split(b"+")[0] in (b"tb", b"gcra") else 0
            limits.append((kind.decode(), float(a), float(b), c, float(cost), enforce, i))
        # decide_lone()'s reply to one token bucket has decide_checked()'s
        # layout: { allowed, allowed, remaining, retry, reset }.
        return array(self.decision(limits), nonce)

    # ---- lua/batch.lua ----------------------------------------------------

    def _batch(self, _keys, argv, nonce):
        packed = argv[0]
        version, nparams = struct.unpack_from(">BH", packed, 0)
        if version != 3:
            raise ReplyError(f"packed batch version {version}: the gate reads 3")
        at, params = 3, []
        for _ in range(nparams):
            kind, a, b, c, enforce = struct.unpack_from(">Bdddd", packed, at)
            at += 33
            params.append((KINDS[kind & 127], a, b, c, enforce))
        (m,) = struct.unpack_from(">H", packed, at)
        at += 2
        out, charged = [m], {}
        for _ in range(m):
            (n,) = struct.unpack_from(">H", packed, at)
            at += 2
            limits = []
            for _ in range(n):
                p, key, cost = struct.unpack_from(">HHd", packed, at)
                at += 12
                kind, a, b, c, enforce = params[p - 1]
                if kind == "cc":
                    (slen,) = struct.unpack_from(">H", packed, at)
                    at += 2 + slen
                limits.append((kind, a, b, c, cost, enforce, key))
            keyed = packed[at]
            at += 1
            if keyed:
                _k, olen = struct.unpack_from(">HH", packed, at)
                at += 4 + olen
                (flen,) = struct.unpack_from(">H", packed, at)
                at += 2 + flen + 8
            reply = self.decision(limits, charged)
            out += [len(reply)] + reply
        return array(out, nonce)

    # ---- lua/lease.lua ----------------------------------------------------

    # Redis' clock in the replies that carry one: a constant, as every
    # figure here is.
    NOW_MS = 1_764_900_000_000

    def _lease(self, _keys, argv, nonce):
        capacity, refill, period, cost, lease = (int(v) for v in argv[:5])
        # A quarter of the whole tokens the charge leaves (lua/lease.lua).
        granted = min(lease, (capacity - cost) // 4)
        left = (capacity - cost - granted) * period
        reset = math.ceil((capacity * period - left) / refill)
        tuple_ = [self.NOW_MS, left, 0] if granted > 0 else [0, 0, 0]
        return array([1, 1, left // period, 0, reset, granted] + tuple_, nonce)

    # ---- lua/lease_return.lua ---------------------------------------------

    def _lease_return(self, keys, argv, _nonce):
        # Every token comes back (the bench's buckets are never near full).
        return array([int(argv[7 * i + 3]) for i in range(len(keys))])

    # ---- lua/idempotency_complete.lua -------------------------------------

    def _idempotency_complete(self, _keys, _argv, _nonce):
        return integer(1)


def response_headers(body):
    """Webdis' answer as Envoy hands it to the filter."""
    return [(b":status", b"200"), (b"server", b"Webdis"),
            (b"allow", b"GET,POST,PUT,OPTIONS"), (b"access-control-allow-origin", b"*"),
            (b"content-type", b"binary/octet-stream"),
            (b"content-length", str(len(body)).encode()),
            (b"x-envoy-upstream-service-time", b"0")]
