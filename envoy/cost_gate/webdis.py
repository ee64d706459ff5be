"""Webdis and Redis as the filter's callouts meet them: each call is read as
Webdis reads it (src/webdis.rs writes it), and answered with the RESP bytes
the script it runs returns (lua/*.lua), the call's nonce first where the
script echoes it (lua/nonce.lua).

The replies are derived, not recorded: a small Redis keeps what the scripts
keep (a token bucket's credits, a quota window's count, an override, a block,
an idempotency record, a lease's give-back count) and computes each reply as
the script's file does, on Redis' clock (the host's virtual one). So a
bucket runs out and rejects, a quota counts in the window its edges place, a
stored override or anchor day decides, a completed key replays, a
settlement charges its bucket. The kinds the gate's scenarios only admit
with room to spare (sliding windows, GCRA, fixed windows, concurrency) keep
no state: their figures are the script's on a key with room.

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
KINDS = {1: "tb", 2: "sw", 3: "gcra", 4: "fw", 5: "swc", 6: "cc", 7: "cq"}


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


def override_key(key):
    """lua/keys.lua override_key(): `<prefix>:ov:{<tag>}:<name>:<descriptor>`
    of a state key `<prefix>:rl:{<tag>}:<name>:<signature>:<descriptor>`."""
    s = key.find(b":rl:{")
    t = key.find(b"}:", s + 5) if s >= 0 else -1
    n = key.find(b":", t + 2) if t >= 0 else -1
    g = key.find(b":", n + 1) if n >= 0 else -1
    if g < 0:
        return None
    return key[:s] + b":ov:{" + key[s + 5:n + 1] + key[g + 1:]


def block_key(key):
    """lua/keys.lua block_key()."""
    s = key.find(b":rl:{")
    return key + b":bl" if s < 0 else key[:s] + b":bl:{" + key[s + 5:]


def anchoring(edges):
    """lua/quota.lua cq_anchoring(): (sent, default, max) after the edges'
    `@`, or None."""
    at = edges.find(b"@")
    if at < 0:
        return None
    return tuple(int(v) for v in edges[at + 1:].split(b","))


def window(edges, now):
    """lua/quota.lua cq_window(): the (start, end) of the edges holding
    `now`."""
    e = [int(v) for v in edges.split(b"@")[0].split(b",")]
    for j in range(3):
        if e[j] <= now < e[j + 1]:
            return e[j], e[j + 1]
    raise ReplyError(f"no window of edges {edges!r} holds Redis' clock {now}")


def override_figures(text, kind, c):
    """lua/decide.lua override_figures(): the override's (a, b or None) for
    a limit of `kind`, or None when it does not apply."""
    parts = text.split()
    if kind == "cq" and len(parts) == 3 and parts[0] == b"cq":
        if (anchoring(c) or (None,))[0] != int(parts[2]):
            return None
        parts = parts[:2]
    if kind == "tb":
        return (int(parts[1]), int(parts[2])) if len(parts) == 3 and parts[0] == b"tb" else None
    if len(parts) == 2 and parts[0].decode() == kind and parts[1].isdigit():
        return int(parts[1]), None
    return None


class Redis:
    """What the scripts answer, from the state they keep (see the module's
    docstring)."""

    # Redis' clock when no host's is given.
    NOW_MS = 1_764_900_000_000

    def __init__(self, clock_ms=None):
        self.names = first_lines()
        self.loaded = {}  # sha1 -> lua/ file stem
        self.noscripts = 0
        self.clock_ms = clock_ms or (lambda: self.NOW_MS)
        self.now = self.NOW_MS  # Redis TIME, read once per call
        self.data = {}  # key -> value (a bucket: (credits, ms); a record: a dict)
        self.expiry = {}  # key -> ms

    # ---- the keyspace -----------------------------------------------------

    def get(self, key):
        at = self.expiry.get(key)
        if at is not None and at <= self.now:
            self.data.pop(key, None)
            self.expiry.pop(key, None)
        return self.data.get(key)

    def set(self, key, value, px=None):
        self.data[key] = value
        if px is None:
            self.expiry.pop(key, None)
        else:
            self.expiry[key] = self.now + max(1, math.ceil(px))

    def pttl(self, key):
        if self.get(key) is None:
            return -2
        at = self.expiry.get(key)
        return -1 if at is None else at - self.now

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
        self.now = self.clock_ms()
        return name, reply(keys, argv, nonce)

    # ---- the kinds (lua/token_bucket.lua, lua/quota.lua, the others) ------

    def tb_credits(self, key, a, b, c):
        full = a * c
        state = self.get(key)
        if state is None:
            return full
        credits, last = state
        return min(full, credits + max(0, self.now - last) * b)

    def check(self, kind, key, a, b, c, cost):
        """The verdict of one limit on its state: allowed, remaining, retry,
        reset, and how to charge it (or report it uncharged)."""
        if kind == "tb":
            c = float(c)
            full, credits, need = a * c, self.tb_credits(key, a, b, c), cost * c
            if credits >= need:
                def charge():
                    left = credits - need
                    self.set(key, (left, self.now), math.ceil((full - left) / b))
                return {"allowed": 1, "remaining": math.floor((credits - need) / c),
                        "retry": 0, "reset": math.ceil((full - (credits - need)) / b),
                        "charge": charge,
                        "uncharged": (math.floor(credits / c), math.ceil((full - credits) / b))}
            retry = math.ceil((need - credits) / b)
            return {"allowed": 0, "remaining": max(0, math.floor(credits / c)),
                    "retry": retry, "reset": retry}
        if kind == "cq":
            start, stop = window(c, self.now)
            wkey = key + b":%d" % start
            count, ends = int(self.get(wkey) or 0), stop - self.now
            if count + cost <= a:
                return {"allowed": 1, "remaining": a - count - cost, "retry": 0, "reset": ends,
                        "charge": lambda: self.set(wkey, count + cost, ends + 60_000),
                        "uncharged": (a - count, ends if count else 0)}
            retry = 0 if cost > a and count == 0 else ends
            return {"allowed": 0, "remaining": max(0, a - count), "retry": retry,
                    "reset": retry}
        # The stateless kinds: a key with room for the cost.
        if kind in ("gcra",):
            reset = max(1, math.ceil(cost * float(c) / b))
        elif kind in ("sw", "fw", "swc"):
            reset = int(b)
        elif kind == "cc":
            reset = 0
        else:
            raise ReplyError(f"unknown limit kind {kind!r}")
        return {"allowed": 1, "remaining": int(a - cost), "retry": 0, "reset": reset,
                "charge": lambda: None, "uncharged": (int(a), 0)}

    def decide(self, limits, idem=None):
        """lua/decide.lua decide_checked(): one request's reply. `limits`:
        (algorithm, a, b, c, cost, enforce, key) each; `idem`: (record key,
        owner, fingerprint, lock TTL) or None."""
        texts, moved = {}, [5]
        for i, (alg, _a, _b, c, _cost, _e, key) in enumerate(limits):
            if alg == "cq+o":
                texts[i] = text = self.get(override_key(key))
                sent, default, top = anchoring(c)
                want = default
                if text and len(text.split()) == 3 and text.startswith(b"cq "):
                    day = int(text.split()[2])
                    want = day if 1 <= day <= top else default
                if want != sent:
                    moved += [i + 1, want]
        if len(moved) > 1:
            return moved
        if idem is not None:
            rkey, owner, fingerprint, ttl = idem
            rec = self.get(rkey)
            if rec is not None:
                if rec["f"] != fingerprint:
                    return [4]
                if rec["s"] == "C":
                    return [3, int(rec["st"]), rec["h"], rec["b"]]
                return [2, max(1, self.pttl(rkey))]
        results, admit = [], 1
        for i, (alg, a, b, c, cost, e, key) in enumerate(limits):
            kind, ov = (alg[:-2], True) if alg.endswith("+o") else (alg, False)
            used, plan = 0, None
            if ov:
                text = texts[i] if i in texts else self.get(override_key(key))
                if text is not None:
                    figures = override_figures(text, kind, c)
                    if figures and figures[0] >= cost:
                        a, b, used = figures[0], figures[1] or b, 2
                        plan = [figures[0], figures[1] or 0]
                    else:
                        used = 4
            r = None
            if e > 1 or e < 0:
                left = self.pttl(block_key(key))
                if left > 0:
                    r = {"allowed": 0, "remaining": 0, "retry": left, "reset": left,
                         "blocked": True}
            r = r or self.check(kind, key, a, b, c, cost)
            r["used"], r["plan"], r["block"] = used, plan, (abs(e), e > 1, key)
            if e != 0 and r["allowed"] == 0:
                admit = 0
            results.append(r)
        if admit == 0:
            for r in results:
                block, starts, key = r["block"]
                if starts and r["allowed"] == 0 and not r.get("blocked"):
                    self.set(block_key(key), b"1", block)
                    r["retry"] = r["reset"] = int(block)
        if admit == 1 and idem is not None:
            self.set(idem[0], {"s": "P", "o": idem[1], "f": idem[2]}, idem[3])
        out = [admit]
        for r in results:
            if r["allowed"] == 1 and admit == 1:
                r["charge"]()
            elif r["allowed"] == 1:
                r["remaining"], r["reset"] = r["uncharged"]
            out += [r["allowed"] + r["used"], int(r["remaining"]), int(r["retry"]),
                    int(r["reset"])]
        # The plan that decided each overridden limit: its a and b.
        for r in results:
            out += r["plan"] or []
        return out

    # ---- lua/ratelimit.lua ------------------------------------------------

    def _ratelimit(self, keys, argv, nonce):
        n = int(argv[0])
        limits = []
        for i in range(n):
            alg, a, b, c, cost, enforce = argv[1 + 6 * i:7 + 6 * i]
            limits.append((alg.decode(), float(a), float(b), c, float(cost), float(enforce),
                           keys[i]))
        idem = None
        if len(argv) > 1 + 6 * n and argv[1 + 6 * n] == b"1":
            idem = (keys[n], argv[2 + 6 * n], argv[3 + 6 * n], int(argv[4 + 6 * n]))
        # decide_lone()'s reply to one token bucket has decide_checked()'s
        # layout: { allowed, allowed, remaining, retry, reset }.
        return array(self.decide(limits, idem), nonce)

    # ---- lua/batch.lua ----------------------------------------------------

    def _batch(self, _keys, argv, nonce):
        packed = argv[0]

        def string(at):
            (n,) = struct.unpack_from(">H", packed, at)
            return packed[at + 2:at + 2 + n], at + 2 + n

        version, nparams = struct.unpack_from(">BH", packed, 0)
        if version != 3:
            raise ReplyError(f"packed batch version {version}: the gate reads 3")
        at, params = 3, []
        for _ in range(nparams):
            kind, a, b, c, enforce = struct.unpack_from(">Bdddd", packed, at)
            at += 33
            alg = KINDS[kind & 127] + ("+o" if kind & 128 else "")
            params.append((alg, a, b, b"%d" % c if c == int(c) else repr(c).encode(), enforce))
        (m,) = struct.unpack_from(">H", packed, at)
        at += 2
        members = []
        for _ in range(m):
            (n,) = struct.unpack_from(">H", packed, at)
            at += 2
            limits = []
            for _ in range(n):
                p, key, cost = struct.unpack_from(">HHd", packed, at)
                at += 12
                alg, a, b, c, enforce = params[p - 1]
                if alg.startswith(("cc", "cq")):
                    c, at = string(at)
                limits.append([alg, a, b, c, cost, enforce, key])
            idem = None
            keyed = packed[at]
            at += 1
            if keyed:
                (k,) = struct.unpack_from(">H", packed, at)
                owner, at = string(at + 2)
                fingerprint, at = string(at)
                (ttl,) = struct.unpack_from(">d", packed, at)
                at += 8
                idem = [k, owner, fingerprint, int(ttl)]
            members.append((limits, idem))
        (nkeys,) = struct.unpack_from(">H", packed, at)
        at += 2
        table = []
        for _ in range(nkeys):
            (shared,) = struct.unpack_from(">H", packed, at)
            rest, at = string(at + 2)
            table.append((table[-1][:shared] if table else b"") + rest)
        out = [m]
        for limits, idem in members:
            for limit in limits:
                limit[6] = table[limit[6] - 1]
            if idem is not None:
                idem[0] = table[idem[0] - 1]
            reply = self.decide([tuple(l) for l in limits], idem and tuple(idem))
            out += [len(reply)] + reply
        return array(out, nonce)

    # ---- lua/lease.lua ----------------------------------------------------

    def _lease(self, keys, argv, nonce):
        capacity, refill, period, cost, lease = (int(v) for v in argv[:5])
        key, full = keys[0], capacity * period
        credits = self.tb_credits(key, capacity, refill, period)
        need = cost * period
        if credits < need:
            retry = math.ceil((need - credits) / refill)
            return array([0, 0, math.floor(credits / period), retry, retry, 0, 0, 0, 0], nonce)
        # A quarter of the whole tokens the charge leaves (SHARE).
        granted = min(lease, math.floor((credits - need) / period) // 4)
        left = credits - need - granted * period
        self.set(key, (left, self.now), math.ceil((full - left) / refill))
        at = level = returned = 0
        if granted > 0:
            record = self.get(key + b":ret") or {"count": 0}
            self.set(key + b":ret", record, 660_000)
            at, level, returned = self.now, math.ceil(left), record["count"]
        return array([1, 1, math.floor(left / period), 0, math.ceil((full - left) / refill),
                      granted, at, level, returned], nonce)

    # ---- lua/lease_return.lua ---------------------------------------------

    def _lease_return(self, keys, argv, _nonce):
        """What each give-back may return without over-admitting: the
        tokens the bucket can hold above the highest level it may have had
        since the grant (one Envoy: no other give-back counts in S)."""
        out = []
        for i, key in enumerate(keys):
            capacity, refill, period, tokens, t0, level, _returned = (
                int(v) for v in argv[7 * i:7 * i + 7])
            full = capacity * period
            record = self.get(key + b":ret")
            if record is None or t0 > self.now:
                out.append(0)
                continue
            highest = min(full, level + refill * (self.now - t0))
            back = min(tokens, math.floor((full - highest) / period))
            if back > 0:
                credits = self.tb_credits(key, capacity, refill, period)
                left = min(full, credits + back * period)
                self.set(key, (left, self.now), math.ceil((full - left) / refill))
                record["count"] += back
            out.append(back)
        return array(out)

    # ---- lua/settle.lua ---------------------------------------------------

    def _settle(self, keys, argv, _nonce):
        """Each settlement applied to its token bucket or quota window: the
        units left after it (negative: debt)."""
        out = []
        for i, key in enumerate(keys):
            alg, a, b, c, delta, age, _block = argv[7 * i:7 * i + 7]
            kind = alg.decode().removesuffix("+o")
            a, b, delta = float(a), float(b), int(delta)
            if alg.endswith(b"+o"):
                text = self.get(override_key(key))
                figures = text and override_figures(text, kind, c)
                if figures:
                    a, b = figures[0], figures[1] or b
            if kind == "tb":
                c = float(c)
                full, credits = a * c, self.tb_credits(key, a, b, c)
                left = credits - min(max(delta * c, credits - full), credits + 2**52)
                self.set(key, (left, self.now), math.ceil((full - left) / b))
                out.append(math.floor(left / c))
            elif kind == "cq":
                start, stop = window(c, self.now)
                if delta < 0 and self.now - int(age) < start:
                    delta = 0
                wkey = key + b":%d" % start
                count = int(self.get(wkey) or 0)
                delta = max(delta, -count)
                self.set(wkey, count + delta, stop - self.now + 60_000)
                out.append(int(a - count - delta))
            else:
                raise ReplyError(f"settle of a {kind!r} limit: the gate settles tb and cq")
        return array(out)

    # ---- lua/idempotency_complete.lua -------------------------------------

    def _idempotency_complete(self, keys, argv, _nonce):
        rec = self.get(keys[0])
        if rec is None or rec.get("o") != argv[0] or rec["s"] != "P":
            return integer(0)
        if len(argv) > 5:
            raise ReplyError("a completion with its body in the object store: the gate has none")
        rec.update(s="C", st=argv[1], h=argv[2], b=argv[3])
        del rec["o"]
        self.set(keys[0], rec, int(argv[4]))
        return integer(1)


def response_headers(body):
    """Webdis' answer as Envoy hands it to the filter."""
    return [(b":status", b"200"), (b"server", b"Webdis"),
            (b"allow", b"GET,POST,PUT,OPTIONS"), (b"access-control-allow-origin", b"*"),
            (b"content-type", b"binary/octet-stream"),
            (b"content-length", str(len(body)).encode()),
            (b"x-envoy-upstream-service-time", b"0")]
