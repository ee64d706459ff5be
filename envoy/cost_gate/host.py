"""A proxy-wasm host (ABI 0.2.1, as Envoy implements it) for the release
filter under wasmtime, recording every import the module calls and the fuel
each callback burns.

Only what Envoy does matters here, not how fast: the host answers every
import the module declares the way Envoy's would (statuses included, since
the SDK panics on one it does not expect), and traps on the ones a bench
scenario has no business calling (gRPC, foreign functions), so a new kind of
host call cannot go unnoticed. Deterministic by construction: the clock is
virtual (it moves only when the driver or a reading moves it), WASI's random
bytes come from a seeded generator, tokens and ids are counters.
"""
import random
import struct
from collections import Counter, deque

from wasmtime import Config, Engine, Linker, Module, Store

OK, NOT_FOUND, BAD_ARGUMENT, EMPTY, CAS_MISMATCH = 0, 1, 2, 7, 8

# MapType and BufferType, as the SDK numbers them.
REQUEST_HEADERS, REQUEST_TRAILERS, RESPONSE_HEADERS, RESPONSE_TRAILERS = 0, 1, 2, 3
CALL_RESPONSE_HEADERS, CALL_RESPONSE_TRAILERS = 6, 7
REQUEST_BODY, RESPONSE_BODY, CALL_RESPONSE_BODY, VM_CONFIG, PLUGIN_CONFIG = 0, 1, 4, 6, 7

LOG_LEVELS = ["trace", "debug", "info", "warn", "error", "critical"]

# 2026-01-01T00:00:00Z: the virtual clock's start.
EPOCH_NS = 1_767_225_600_000_000_000
# Each reading of the clock moves it on by this much: time passes while the
# filter works, so a call's latency is not zero.
READ_STEP_NS = 1_000

ROOT_ID = 1


class GateError(Exception):
    """The module did something the scenario does not allow (an import it
    must not call, a trap, a panic)."""


class Stream:
    """One HTTP stream as Envoy holds it for the filter."""

    def __init__(self, ctx, headers, body=b""):
        self.ctx = ctx
        self.maps = {REQUEST_HEADERS: list(headers), REQUEST_TRAILERS: [],
                     RESPONSE_HEADERS: [], RESPONSE_TRAILERS: []}
        self.buffers = {REQUEST_BODY: body, RESPONSE_BODY: b""}
        self.request_resumed = False
        self.response_resumed = False
        self.local_reply = None
        self.filter_state = {}


def serialize_pairs(pairs):
    out = struct.pack("<I", len(pairs))
    for k, v in pairs:
        out += struct.pack("<II", len(k), len(v))
    for k, v in pairs:
        out += k + b"\0" + v + b"\0"
    return out


def deserialize_pairs(data):
    (n,) = struct.unpack_from("<I", data, 0)
    sizes = [struct.unpack_from("<II", data, 4 + 8 * i) for i in range(n)]
    at, pairs = 4 + 8 * n, []
    for klen, vlen in sizes:
        k = bytes(data[at:at + klen])
        at += klen + 1
        v = bytes(data[at:at + vlen])
        at += vlen + 1
        pairs.append((k, v))
    return pairs


def compile_module(wasm_path):
    """(engine, module) with fuel metering on, shared by every scenario's
    VM."""
    config = Config()
    config.consume_fuel = True
    # Compiled code is cached on disk: a warm run skips Cranelift.
    config.cache = True
    engine = Engine(config)
    return engine, Module.from_file(engine, str(wasm_path))


class Host:
    """The filter's VM (one Envoy worker) and the Envoy around it."""

    def __init__(self, compiled, properties=None, seed=43):
        self.engine, self.module = compiled
        self.store = Store(self.engine)
        self.store.set_fuel(1 << 62)
        self.random = random.Random(seed)
        self.properties = dict(properties or {})
        self.now_ns = EPOCH_NS
        self.effective = ROOT_ID
        self.streams = {}
        self.next_ctx = ROOT_ID + 1
        self.shared = {}  # key -> (value, cas)
        self.next_cas = 1
        self.queues = {}  # id -> deque
        self.queue_names = {}
        self.queue_ready = deque()
        self.metrics = {}  # id -> [type, name, value]
        self.tick_ms = 0
        self.next_token = 1
        self.calls_out = {}  # token -> dict (the callout as sent)
        self.call_response = None  # (headers, body) while one is delivered
        self.plugin_config = b""
        self.logs = []  # (level, message)
        self.stdout = b""
        # The recorder: import calls by name, and by the kind of context
        # effective when made; fuel by callback.
        self.calls = Counter()
        self.calls_by_role = Counter()
        self.fuel = Counter()
        self.callbacks = Counter()
        self._caller = None
        # run.py --segments: fuel between consecutive imports within a
        # callback, by (callback, import before, import after); None: off.
        self.segments = None
        self._segment = None  # (callback, import before, fuel then)
        linker = Linker(self.engine)
        for imp in self.module.imports:
            impl = getattr(self, "_" + imp.name, None)
            if impl is None:
                impl = self._unsupported(imp.name)
            # i32 arguments arrive signed: sizes and pointers are unsigned
            # (usize::MAX is a "whole buffer" the SDK asks for).
            unsigned = [str(p) == "i32" for p in imp.type.params]
            linker.define_func(imp.module, imp.name, imp.type,
                               self._recorded(imp.name, impl, unsigned), access_caller=True)
        self.instance = linker.instantiate(self.store, self.module)
        self.exports = self.instance.exports(self.store)
        self.memory = self.exports["memory"]
        self._malloc = self.exports["proxy_on_memory_allocate"]

    # ---- recording --------------------------------------------------------

    def reset_counts(self):
        self.calls, self.calls_by_role = Counter(), Counter()
        self.fuel, self.callbacks = Counter(), Counter()
        self.logs = []
        if self.segments is not None:
            self.segments = Counter()

    def _mark(self, what):
        """Ends the segment open in this callback at `what` (an import's
        name, or "end"), and opens the next: fuel the host's own work inside
        an import burns (its allocation in the module) is left out."""
        if self.segments is None or self._segment is None:
            return
        callback, before, fuel = self._segment
        key = (callback, before, what)
        self.segments[key] = self.segments.get(key, 0) + fuel - self.store.get_fuel()

    def _recorded(self, name, impl, unsigned):
        def call(caller, *args):
            self._caller = caller
            self.calls[name] += 1
            role = "root" if self.effective == ROOT_ID else "stream"
            self.calls_by_role[(name, role)] += 1
            self._mark(name)
            try:
                return impl(*(a & 0xFFFFFFFF if u else a for a, u in zip(args, unsigned)))
            finally:
                if self._segment is not None:
                    self._segment = (self._segment[0], name, self.store.get_fuel())
        return call

    def _unsupported(self, name):
        def trap(*_args):
            raise GateError(f"the filter called {name}, which no bench scenario should reach")
        return trap

    def callback(self, name, ctx, *args):
        """Envoy calls the filter: `name` (an export) as context `ctx`."""
        self.effective = ctx
        before = self.store.get_fuel()
        if self.segments is not None:
            self._segment = (name, "start", before)
        try:
            result = self.exports[name](self.store, ctx, *args)
        except GateError:
            raise
        except Exception as e:
            raise GateError(f"{name}({ctx}, {args}) trapped: {e}; stdout: {self.stdout!r}; "
                            f"logs: {self.logs[-3:]}") from e
        self._mark("end")
        self._segment = None
        burnt = before - self.store.get_fuel()
        self.fuel[name] += burnt
        self.callbacks[name] += 1
        self.effective = ctx
        return result

    # ---- memory -----------------------------------------------------------

    def _read(self, ptr, size):
        return bytes(self.memory.read(self._caller, ptr, ptr + size)) if size else b""

    def _put_u32(self, ptr, value):
        self.memory.write(self._caller, struct.pack("<I", value), ptr)

    def _give(self, data, ptr_ptr, size_ptr):
        """Hands `data` to the module in memory it allocates, as Envoy does."""
        ptr = 0
        if data:
            ptr = self._malloc(self._caller, len(data))
            self.memory.write(self._caller, data, ptr)
        self._put_u32(ptr_ptr, ptr)
        self._put_u32(size_ptr, len(data))
        return OK

    # ---- state the imports read -------------------------------------------

    def _stream(self):
        return self.streams.get(self.effective)

    def _map(self, map_type):
        if map_type in (CALL_RESPONSE_HEADERS, CALL_RESPONSE_TRAILERS):
            if self.call_response is None:
                return None
            return self.call_response[0] if map_type == CALL_RESPONSE_HEADERS else []
        stream = self._stream()
        return None if stream is None else stream.maps.get(map_type)

    # ---- WASI (the few functions std's runtime imports) -------------------

    def _random_get(self, ptr, size):
        self.memory.write(self._caller, self.random.randbytes(size), ptr)
        return 0

    def _environ_sizes_get(self, count_ptr, size_ptr):
        self._put_u32(count_ptr, 0)
        self._put_u32(size_ptr, 0)
        return 0

    def _environ_get(self, _environ, _buf):
        return 0

    def _fd_write(self, _fd, iovs, iovs_len, nwritten_ptr):
        total = 0
        for i in range(iovs_len):
            ptr, size = struct.unpack("<II", self._read(iovs + 8 * i, 8))
            self.stdout += self._read(ptr, size)
            total += size
        self._put_u32(nwritten_ptr, total)
        return 0

    def _proc_exit(self, code):
        raise GateError(f"the filter exited ({code}); stdout: {self.stdout!r}")

    # ---- proxy-wasm: logs, clock, timers ----------------------------------

    def _proxy_log(self, level, ptr, size):
        self.logs.append((LOG_LEVELS[level] if level < 6 else str(level),
                          self._read(ptr, size).decode("utf-8", "replace")))
        return OK

    def _proxy_get_current_time_nanoseconds(self, ptr):
        self.memory.write(self._caller, struct.pack("<Q", self.now_ns), ptr)
        self.now_ns += READ_STEP_NS
        return OK

    def _proxy_set_tick_period_milliseconds(self, period):
        if self.effective != ROOT_ID:
            # Envoy sets the period of the effective context's root; the
            # filter always switches to its root first.
            raise GateError("set_tick_period called as a stream")
        self.tick_ms = period
        return OK

    def _proxy_set_effective_context(self, ctx):
        if ctx != ROOT_ID and ctx not in self.streams:
            return BAD_ARGUMENT
        self.effective = ctx
        return OK

    # ---- buffers ----------------------------------------------------------

    def _buffer(self, buffer_type):
        if buffer_type == PLUGIN_CONFIG:
            return self.plugin_config
        if buffer_type == VM_CONFIG:
            return b""
        if buffer_type == CALL_RESPONSE_BODY:
            return None if self.call_response is None else self.call_response[1]
        stream = self._stream()
        return None if stream is None else stream.buffers.get(buffer_type)

    def _proxy_get_buffer_bytes(self, buffer_type, start, max_size, ptr_ptr, size_ptr):
        data = self._buffer(buffer_type)
        if data is None:
            return NOT_FOUND
        return self._give(data[start:start + max_size], ptr_ptr, size_ptr)

    def _proxy_set_buffer_bytes(self, buffer_type, start, size, ptr, data_size):
        stream = self._stream()
        if stream is None or buffer_type not in stream.buffers:
            return BAD_ARGUMENT
        old = stream.buffers[buffer_type]
        stream.buffers[buffer_type] = old[:start] + self._read(ptr, data_size) + old[start + size:]
        return OK

    # ---- header maps ------------------------------------------------------

    def _proxy_get_header_map_pairs(self, map_type, ptr_ptr, size_ptr):
        pairs = self._map(map_type)
        if pairs is None:
            return BAD_ARGUMENT
        return self._give(serialize_pairs(pairs), ptr_ptr, size_ptr)

    def _proxy_set_header_map_pairs(self, map_type, ptr, size):
        stream = self._stream()
        if stream is None or map_type not in stream.maps:
            return BAD_ARGUMENT
        stream.maps[map_type] = deserialize_pairs(self._read(ptr, size))
        return OK

    def _proxy_get_header_map_value(self, map_type, kptr, ksize, ptr_ptr, size_ptr):
        pairs = self._map(map_type)
        if pairs is None:
            return BAD_ARGUMENT
        key = self._read(kptr, ksize).lower()
        for k, v in pairs:
            if k == key:
                return self._give(v, ptr_ptr, size_ptr)
        return NOT_FOUND

    def _edit_map(self, map_type, kptr, ksize, value, replace):
        pairs = self._map(map_type)
        if pairs is None or map_type in (CALL_RESPONSE_HEADERS, CALL_RESPONSE_TRAILERS):
            return BAD_ARGUMENT
        key = self._read(kptr, ksize).lower()
        kept = [(k, v) for k, v in pairs if not (replace and k == key)]
        if value is not None:
            kept.append((key, value))
        pairs[:] = kept
        return OK

    def _proxy_add_header_map_value(self, map_type, kptr, ksize, vptr, vsize):
        return self._edit_map(map_type, kptr, ksize, self._read(vptr, vsize), False)

    def _proxy_replace_header_map_value(self, map_type, kptr, ksize, vptr, vsize):
        return self._edit_map(map_type, kptr, ksize, self._read(vptr, vsize), True)

    def _proxy_remove_header_map_value(self, map_type, kptr, ksize):
        return self._edit_map(map_type, kptr, ksize, None, True)

    # ---- properties (filter state) ----------------------------------------

    def _proxy_get_property(self, pptr, psize, ptr_ptr, size_ptr):
        path = tuple(self._read(pptr, psize).decode().split("\0"))
        value = self.properties.get(path)
        if value is None:
            stream = self._stream()
            value = stream and stream.filter_state.get(path)
        if value is None:
            return NOT_FOUND
        return self._give(value, ptr_ptr, size_ptr)

    def _proxy_set_property(self, pptr, psize, vptr, vsize):
        stream = self._stream()
        if stream is None:
            return BAD_ARGUMENT
        path = tuple(self._read(pptr, psize).decode().split("\0"))
        stream.filter_state[path] = self._read(vptr, vsize)
        return OK

    # ---- shared data and queues -------------------------------------------

    def _proxy_get_shared_data(self, kptr, ksize, ptr_ptr, size_ptr, cas_ptr):
        entry = self.shared.get(self._read(kptr, ksize))
        if entry is None:
            return NOT_FOUND
        self._put_u32(cas_ptr, entry[1])
        return self._give(entry[0], ptr_ptr, size_ptr)

    def _proxy_set_shared_data(self, kptr, ksize, vptr, vsize, cas):
        key = self._read(kptr, ksize)
        entry = self.shared.get(key)
        if cas and entry is not None and entry[1] != cas:
            return CAS_MISMATCH
        self.shared[key] = (self._read(vptr, vsize), self.next_cas)
        self.next_cas += 1
        return OK

    def _proxy_register_shared_queue(self, nptr, nsize, id_ptr):
        name = self._read(nptr, nsize)
        qid = self.queue_names.setdefault(name, len(self.queue_names) + 1)
        self.queues.setdefault(qid, deque())
        self._put_u32(id_ptr, qid)
        return OK

    def _proxy_enqueue_shared_queue(self, qid, vptr, vsize):
        if qid not in self.queues:
            return NOT_FOUND
        self.queues[qid].append(self._read(vptr, vsize))
        # Envoy posts the wake-up to the registering worker's dispatcher: it
        # runs after the current callback.
        self.queue_ready.append(qid)
        return OK

    def _proxy_dequeue_shared_queue(self, qid, ptr_ptr, size_ptr):
        queue = self.queues.get(qid)
        if queue is None:
            return NOT_FOUND
        if not queue:
            return EMPTY
        return self._give(queue.popleft(), ptr_ptr, size_ptr)

    # ---- metrics ----------------------------------------------------------

    def _proxy_define_metric(self, metric_type, nptr, nsize, id_ptr):
        mid = len(self.metrics) + 1
        self.metrics[mid] = [metric_type, self._read(nptr, nsize).decode(), 0]
        self._put_u32(id_ptr, mid)
        return OK

    def _proxy_increment_metric(self, mid, delta):
        if mid not in self.metrics:
            return NOT_FOUND
        self.metrics[mid][2] += delta
        return OK

    def _proxy_record_metric(self, mid, value):
        if mid not in self.metrics:
            return NOT_FOUND
        self.metrics[mid][2] = value
        return OK

    # ---- the stream -------------------------------------------------------

    def _proxy_continue_stream(self, stream_type):
        stream = self._stream()
        if stream is None or stream_type not in (0, 1):
            return BAD_ARGUMENT
        if stream_type == 0:
            stream.request_resumed = True
        else:
            stream.response_resumed = True
        return OK

    def _proxy_send_local_response(self, status, dptr, dsize, bptr, bsize, hptr, hsize, grpc):
        stream = self._stream()
        if stream is None:
            return BAD_ARGUMENT
        stream.local_reply = (status, self._read(dptr, dsize), self._read(bptr, bsize),
                              deserialize_pairs(self._read(hptr, hsize)), grpc)
        return OK

    # ---- callouts ---------------------------------------------------------

    def _proxy_http_call(self, uptr, usize, hptr, hsize, bptr, bsize, tptr, tsize, timeout,
                         token_ptr):
        upstream = self._read(uptr, usize).decode()
        if upstream not in self.clusters:
            return BAD_ARGUMENT
        token = self.next_token
        self.next_token += 1
        self.calls_out[token] = {
            "token": token,
            "context": self.effective,
            "cluster": upstream,
            "headers": dict(deserialize_pairs(self._read(hptr, hsize))),
            "body": self._read(bptr, bsize),
            "timeout_ms": timeout,
        }
        self._put_u32(token_ptr, token)
        return OK

    clusters = ("webdis",)

    # ---- what the driver does, as Envoy ----------------------------------

    def start(self, plugin_config):
        """The VM starts and its root context takes the configuration."""
        self.plugin_config = plugin_config
        self.effective = ROOT_ID
        before = self.store.get_fuel()
        self.exports["_initialize"](self.store)
        self.fuel["_initialize"] += before - self.store.get_fuel()
        self.callback("proxy_on_context_create", ROOT_ID, 0)
        if not self.callback("proxy_on_vm_start", ROOT_ID, 0):
            raise GateError("proxy_on_vm_start refused")
        if not self.callback("proxy_on_configure", ROOT_ID, len(plugin_config)):
            raise GateError(f"the filter refused its configuration: {self.logs}")

    def open_stream(self, headers, body=b""):
        ctx = self.next_ctx
        self.next_ctx += 1
        self.streams[ctx] = Stream(ctx, headers, body)
        self.callback("proxy_on_context_create", ctx, ROOT_ID)
        return self.streams[ctx]

    def close_stream(self, stream):
        """The stream ends: done, log, delete (the order of proxy-wasm's ABI
        spec and Envoy's)."""
        self.callback("proxy_on_done", stream.ctx)
        self.callback("proxy_on_log", stream.ctx)
        self.callback("proxy_on_delete", stream.ctx)
        del self.streams[stream.ctx]

    def respond(self, token, headers, body):
        """A callout's answer arrives, to the context that sent it."""
        call = self.calls_out.pop(token)
        self.call_response = (headers, body)
        try:
            self.callback("proxy_on_http_call_response", call["context"], token, len(headers),
                          len(body), 0)
        finally:
            self.call_response = None

    def drain_queues(self):
        """Runs the wake-ups queued meanwhile (Envoy posts each to its
        worker's event loop)."""
        while self.queue_ready:
            qid = self.queue_ready.popleft()
            self.callback("proxy_on_queue_ready", ROOT_ID, qid)

    def tick(self):
        self.now_ns += self.tick_ms * 1_000_000
        self.callback("proxy_on_tick", ROOT_ID)

    def advance(self, ns):
        self.now_ns += ns
