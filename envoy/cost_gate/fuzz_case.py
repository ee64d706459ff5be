"""One fuzz case (envoy/cost_gate/fuzz.py): a fresh VM under FuzzHost, then
steps, each a dict a trace holds (JSON): a configuration (a root context),
a stream opened with its request headers, a piece of its body or its
trailers, a piece of its response, its end (done and log: the client hung
up, or the stream completed) and deletion, a reply to a call, a tick, a
queue wake-up, time passing, dispatch refused. A step that no longer applies
(a trace cut short) is skipped. After each step the decision properties
are checked against what the step delivered (Case.check).
"""
import json
from collections import Counter

from cost_gate import fuzz_inputs as fi
from cost_gate.fuzz_host import Finding, FuzzHost
from cost_gate.host import Stream as HostStream
from cost_gate.host import (EPOCH_NS, REQUEST_BODY, REQUEST_HEADERS, REQUEST_TRAILERS,
                            RESPONSE_BODY, RESPONSE_HEADERS, RESPONSE_TRAILERS, ROOT_ID)


class Stream:
    """One client stream as the driver plays it."""

    def __init__(self, idx, ctx, req):
        self.idx, self.ctx, self.req = idx, ctx, req
        self.body = fi.dec(req["body"]) if req["body"] is not None else b""
        self.trailers = req["trailers"]
        self.bytes = 0  # handed to the filter so far (the fuel bound's)
        self.cuts = None
        self.sent = 0  # request body bytes delivered
        self.req_done = False
        self.headers_done = False
        self.stopped = False  # a request callback returned Pause, not resumed since
        self.passed = False  # the request went upstream
        self.local = None  # the filter's local reply details
        self.resp = None  # the upstream's (or the local reply's) response
        self.resp_sent = 0
        self.resp_headers = False
        self.resp_done = False
        self.resp_held = False
        self.resp_passed = False  # the response's headers went on to the client
        self.ended = False
        self.deleted = False


def config_facts(cfg):
    """(every request Redis decides fails closed, none does, any limit
    falls back to local budgets, the Redis timeout in ms) of a parsed
    config. A request only shadow limits apply to fails open whatever they
    say (they never deny), so a shadow limit makes the first false."""
    top = cfg.get("failureMode") or "allow"
    limits = [lim for lim in cfg.get("limits") or [] if isinstance(lim, dict)]
    modes = [lim.get("failureMode") or top for lim in limits if not lim.get("shadow")]
    modes += [r.get("failureMode") or top for r in cfg.get("idempotency") or []
              if isinstance(r, dict)]
    timeout = (cfg.get("redis") or {}).get("timeoutMs") or 50
    closed = bool(modes) and all(m == "deny" for m in modes)
    return (closed and not any(lim.get("shadow") for lim in limits), "deny" not in modes,
            "local" in modes, timeout)


class Case:
    """One case: a fresh VM, then steps (drawn live, or read from a trace)."""

    def __init__(self, compiled, seed):
        self.host = FuzzHost(compiled, seed)
        self.host.properties = {("plugin_root_id",): b"redis-guard"}
        self.webdis = fi.Webdis()
        self.streams = []
        self.trace = []
        self.cfg = None
        self.configured = False
        self.failed_plugin = False
        self.root = None  # the root context new streams belong to
        self.facts = {}  # root -> config_facts of its configuration
        self.rejected = False  # a reply said over limit (or could have)
        self.failures = False  # a call failed or was refused
        self.steps = 0
        self.stats = Counter()  # what the case exercised (--stats)
        self.t0 = EPOCH_NS  # when the case's clock starts

    # ---- steps ------------------------------------------------------------

    def play(self, step):
        """Runs one step; False if it no longer applies (a trace cut short)."""
        op = step["op"]
        fn = getattr(self, "op_" + op)
        h = self.host
        h.events = []
        refused = h.refused
        self.trace.append(step)
        out = fn(step)
        if out is False:
            self.trace.pop()
            return False
        self.steps += 1
        self.stats["op " + op] += 1
        self.check(step, out, h.refused > refused)
        return True

    def op_config(self, step):
        """A plugin configuration: the VM's first root context, or a new one
        beside the others (Envoy's key for a root context holds its
        configuration); new streams go to it if it takes the configuration."""
        raw = fi.dec(step["raw"])
        try:
            cfg = json.loads(raw)
        except (ValueError, RecursionError):
            cfg = None
        h = self.host
        if not self.steps:
            before = h.store.get_fuel()
            h.now_ns = self.t0 = step.get("t0", h.now_ns)
            h.exports["_initialize"](h.store)
            h.fuel["_initialize"] += before - h.store.get_fuel()
            root = ROOT_ID
        else:
            root = h.next_ctx
            h.next_ctx += 1
            h.roots.add(root)
        h.plugin_config = raw
        h.callback("proxy_on_context_create", root, 0)
        h.callback("proxy_on_vm_start", root, 0)
        ok = h.callback("proxy_on_configure", root, len(raw), size=len(raw))
        # A refused configuration fails the plugin: Envoy makes no stream
        # of it (the streams of the one before go on).
        self.failed_plugin = not (ok and isinstance(cfg, dict))
        self.stats["config " + ("taken" if not self.failed_plugin else "refused")] += 1
        if not self.failed_plugin:
            self.configured, self.cfg, self.root = True, cfg, root
            self.facts[root] = config_facts(cfg)
        return None

    def op_retire(self, step):
        """A root context whose configuration was replaced, once its last
        stream is gone: done, then deleted (its calls cancelled)."""
        h = self.host
        root = step["root"]
        if root == self.root or root not in h.roots or any(
                s.root == root and not s.deleted for s in self.streams):
            return False
        h.callback("proxy_on_done", root)
        h.callback("proxy_on_delete", root)
        h.roots.discard(root)
        h.gone.add(root)
        h.ticks.pop(root, None)
        for token in [t for t, c in h.calls_out.items() if c["context"] == root]:
            del h.calls_out[token]
        return None

    def op_open(self, step):
        h = self.host
        s = Stream(len(self.streams), h.next_ctx, step["req"])
        s.root, s.facts = self.root, self.facts[self.root]
        self.streams.append(s)
        h.props[s.ctx] = {k: fi.dec(v) for k, v in step["req"]["props"].items()}
        headers = fi.pairs_dec(step["req"]["headers"])
        h.next_ctx += 1
        h.streams[s.ctx] = HostStream(s.ctx, headers)
        h.callback("proxy_on_context_create", s.ctx, s.root)
        eos = not s.body and not s.trailers
        s.headers_done = True
        size = sum(len(k) + len(v) for k, v in headers)
        self.after_request(s, h.callback("proxy_on_request_headers", s.ctx, len(headers),
                                         int(eos), size=self.held(s, size)), eos)
        return None

    def held(self, s, n):
        """What the fuel bound allows a callback of stream `s` handed `n`
        bytes: every byte the stream handed the filter so far (work on what
        the filter holds, a stored response hashed at its end, is linear in
        it)."""
        s.bytes += n
        return s.bytes

    def after_request(self, s, action, eos):
        if eos:
            s.req_done = True
        local = any(e[0] == "local" and e[1] == s.ctx for e in self.host.events)
        if action == 0 and s.local is None and not local:
            s.passed, s.stopped = True, False
        elif action != 0:
            s.stopped = True

    def stream(self, step, want):
        s = self.streams[step["s"]] if step["s"] < len(self.streams) else None
        return s if s is not None and want(s) else None

    def op_body(self, step):
        s = self.stream(step, lambda s: s.headers_done and not s.req_done and not s.ended
                        and s.local is None and s.sent < len(s.body))
        if s is None:
            return False
        h = self.host
        end = min(step["to"], len(s.body))
        chunk = s.body[s.sent:end]
        st = h.streams[s.ctx]
        keep = st.buffers[REQUEST_BODY] if s.stopped else b""
        st.buffers[REQUEST_BODY] = keep + chunk
        s.sent = end
        eos = end == len(s.body) and not s.trailers
        size = len(st.buffers[REQUEST_BODY])
        self.after_request(s, h.callback("proxy_on_request_body", s.ctx, size, int(eos),
                                         size=self.held(s, size)), eos)
        return None

    def op_trailers(self, step):
        s = self.stream(step, lambda s: s.headers_done and not s.req_done and not s.ended
                        and s.local is None and s.sent == len(s.body) and s.trailers)
        if s is None:
            return False
        h = self.host
        trailers = fi.pairs_dec(s.trailers)
        h.streams[s.ctx].maps[REQUEST_TRAILERS] = trailers
        self.after_request(s, h.callback("proxy_on_request_trailers", s.ctx, len(trailers),
                                         size=self.held(s, sum(len(k) + len(v)
                                                               for k, v in trailers))), True)
        return None

    def op_response(self, step):
        """The next piece of the response: headers, a body chunk, trailers.
        `resp` (the first time): the upstream's, or None for the local reply."""
        s = self.stream(step, lambda s: (s.passed or s.local is not None) and not s.resp_done
                        and not s.ended)
        if s is None:
            return False
        h = self.host
        st = h.streams[s.ctx]
        if s.resp is None:
            if s.local is not None:
                status, _details, body, headers, _grpc = st.local_reply
                s.resp = {"headers": [[":status", str(status)]] + [[fi.enc(k), fi.enc(v)]
                                                                   for k, v in headers],
                          "body": fi.enc(body) if body else None, "trailers": None}
            else:
                s.resp = step["resp"]
            s.resp_body = fi.dec(s.resp["body"]) if s.resp["body"] is not None else b""
        if not s.resp_headers:
            headers = fi.pairs_dec(s.resp["headers"])
            st.maps[RESPONSE_HEADERS] = headers
            eos = s.resp["body"] is None and s.resp["trailers"] is None
            s.resp_headers = True
            act = h.callback("proxy_on_response_headers", s.ctx, len(headers), int(eos),
                             size=self.held(s, sum(len(k) + len(v) for k, v in headers)))
        elif s.resp_sent < len(s.resp_body):
            end = min(max(step.get("to", 0), s.resp_sent + 1), len(s.resp_body))
            chunk = s.resp_body[s.resp_sent:end]
            st.buffers[RESPONSE_BODY] = (st.buffers[RESPONSE_BODY] if s.resp_held else b"") + chunk
            s.resp_sent = end
            eos = end == len(s.resp_body) and s.resp["trailers"] is None
            size = len(st.buffers[RESPONSE_BODY])
            act = h.callback("proxy_on_response_body", s.ctx, size, int(eos),
                             size=self.held(s, len(chunk)))
        else:
            trailers = fi.pairs_dec(s.resp["trailers"] or [])
            st.maps[RESPONSE_TRAILERS] = trailers
            eos = True
            act = h.callback("proxy_on_response_trailers", s.ctx, len(trailers),
                             size=self.held(s, sum(len(k) + len(v) for k, v in trailers)))
        s.resp_held = act != 0 and not st.response_resumed
        s.resp_passed |= act == 0 or st.response_resumed
        st.response_resumed = False
        s.resp_done = eos
        return None

    def op_end(self, step):
        """The stream ends (done, or the client hung up): done and log."""
        s = self.stream(step, lambda s: not s.ended)
        if s is None:
            return False
        h = self.host
        h.callback("proxy_on_done", s.ctx)
        h.callback("proxy_on_log", s.ctx)
        s.ended = True
        h.ended.add(s.ctx)
        return None

    def op_delete(self, step):
        """Envoy deletes the context: its own calls are cancelled."""
        s = self.stream(step, lambda s: s.ended and not s.deleted)
        if s is None:
            return False
        h = self.host
        h.callback("proxy_on_delete", s.ctx)
        s.deleted = True
        h.gone.add(s.ctx)
        del h.streams[s.ctx]
        for token in [t for t, c in h.calls_out.items() if c["context"] == s.ctx]:
            del h.calls_out[token]
        return None

    def op_reply(self, step):
        h = self.host
        call = h.calls_out.get(step["token"])
        if call is None:
            return False
        headers, body, category = self.webdis.reply(call, step["spec"])
        name = self.webdis.script(call)[0] if call["cluster"] == "webdis" else "object store"
        self.stats[f"reply {name or 'NOSCRIPT'} {category}"] += 1
        h.calls_out.pop(step["token"])
        h.call_response = (headers, body)
        try:
            h.callback("proxy_on_http_call_response", call["context"], step["token"],
                       len(headers), len(body), 0, size=len(body) + sum(
                           s.bytes for s in self.streams
                           if s.ctx == call["context"] or call["context"] in h.roots))
        finally:
            h.call_response = None
        return category

    def op_tick(self, step):
        h = self.host
        period = h.ticks.get(step.get("root", ROOT_ID), 0)
        if not period:
            return False
        h.now_ns += period * 1_000_000
        h.callback("proxy_on_tick", step.get("root", ROOT_ID))
        return None

    def op_queue(self, step):
        """Envoy runs a queue's wake-up on the root that registered it."""
        h = self.host
        if not h.queue_ready:
            return False
        qid = h.queue_ready.popleft()
        root = h.queue_owner.get(qid)
        if root in h.roots:
            h.callback("proxy_on_queue_ready", root, qid)
        return None

    def op_advance(self, step):
        self.host.now_ns += step["ns"]
        return None

    def op_refuse(self, step):
        self.host.refuse = step["on"]
        return None

    # ---- properties -------------------------------------------------------

    def check(self, step, category, refused):
        h = self.host
        if category in ("fail", "garbage"):
            self.failures = True
        self.failures |= refused
        by_ctx = {s.ctx: s for s in self.streams}
        for event in h.events:
            s = by_ctx.get(event[1])
            all_deny, none_deny, any_local, timeout_ms = s.facts if s else (False,) * 4
            # A call's budget is whole ms: it is spent within a ms of its
            # deadline, which is after the case's start.
            late = h.now_ns - self.t0 + 1_000_000 >= timeout_ms * 1_000_000
            if event[0] == "resume":
                if s is not None and s.local is not None:
                    raise Finding(f"stream {s.idx} resumed after its local reply ({s.local})")
                # (A refused dispatch in the same callback, the next batch's,
                # or a budget spent while queued for it fails other requests,
                # which their failure mode may admit.)
                if category == "reject" and not refused and not late:
                    raise Finding(f"stream {event[1]} admitted on a reply that rejected it")
                if category == "fail" and all_deny and not refused:
                    raise Finding(f"stream {event[1]} admitted on a failed call, every limit "
                                  "and rule failing closed")
                if s is not None:
                    s.passed, s.stopped = True, False
                continue
            details = event[2]
            self.stats["local " + details] += 1
            if s is not None:
                if s.passed and s.local is None and step["op"] != "response":
                    # Only the response may still be answered locally (the
                    # replay route's): a request already upstream has run.
                    raise Finding(f"local reply {details} to stream {s.idx} after its "
                                  "request went upstream")
                if s.resp_passed and s.local is None:
                    raise Finding(f"local reply {details} to stream {s.idx} after its "
                                  "response's headers went to the client")
                if s.resp_headers:
                    # In place of the response it holds: Envoy sends the
                    # local reply through the filter instead.
                    s.resp, s.resp_headers, s.resp_sent = None, False, 0
                    s.resp_done = s.resp_held = False
                s.local = details
            if details == "redis_guard_rate_limited" and category not in ("reject", "other",
                                                                          "garbage"):
                raise Finding(f"429 ({details}) on a {category or step['op']} callback")
            if details == "redis_guard_rate_limited_cached" and not self.rejected:
                raise Finding("a cached 429 where no reply ever said over limit")
            if details == "redis_guard_rate_limited_locally" and not any_local:
                raise Finding("a local 429 where no limit fails to local budgets")
            if details == "redis_guard_failure_mode_denied":
                if none_deny:
                    raise Finding("failure mode denied where no limit or rule says deny")
                if not (self.failures or late or category in ("other", "noscript")):
                    raise Finding("failure mode denied with no call failed or refused")
                if category == "admit" and not refused and not late:
                    raise Finding("failure mode denied on a reply that admitted")
        if category in ("reject", "other", "garbage"):
            self.rejected = True
        for s in self.streams:
            st = h.streams.get(s.ctx)
            if st is not None and st.response_resumed:
                s.resp_passed, s.resp_held = s.resp_headers or s.resp_passed, False
                st.response_resumed = False

    def stuck(self):
        """Streams paused with nothing left that could resume them."""
        h = self.host
        if h.calls_out or h.queue_ready or any(h.ticks.values()):
            return []
        return [s for s in self.streams if s.req_done and s.stopped and not s.passed
                and s.local is None and not s.ended]
