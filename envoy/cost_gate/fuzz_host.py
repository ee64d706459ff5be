"""The fuzzer's Envoy (envoy/cost_gate/fuzz.py): the cost gate's recording
proxy-wasm host (host.py), extended where a fuzz case needs more than a
bench scenario does, and watching the properties that are about the ABI:

  Finding       a property broken (raised from a host call or a callback)
  FuzzHost      host.py's Host with several root contexts (Envoy keys a root
                context by its configuration: a new one is a new root in the
                same VM), per-stream properties, the VM's environment, a
                switch that refuses every dispatch, and the checks: no ABI
                call as a deleted context, no change to a stream after
                proxy_on_log, no critical log (the panic hook), no trap, fuel
                per callback within FUEL_BASE + FUEL_PER_BYTE a byte handed in
"""
from cost_gate import fuzz_config
from cost_gate.host import BAD_ARGUMENT, ROOT_ID, GateError, Host

FUEL_BASE = 40_000_000
FUEL_PER_BYTE = 120
ENV = {b"AWS_ACCESS_KEY_ID": b"AKIAFUZZ", b"AWS_SECRET_ACCESS_KEY": b"fuzz-secret",
       b"AWS_SESSION_TOKEN": b"fuzz-token", b"REDIS_GUARD_WEBDIS_USERNAME": b"guard",
       b"REDIS_GUARD_WEBDIS_PASSWORD": b"fuzz-password"}
# The stream calls that change it (after proxy_on_log, Envoy's stream is gone).
MUTATORS = {"proxy_continue_stream", "proxy_send_local_response", "proxy_set_header_map_pairs",
            "proxy_add_header_map_value", "proxy_replace_header_map_value",
            "proxy_remove_header_map_value", "proxy_set_buffer_bytes"}


class Finding(Exception):
    pass


class FuzzHost(Host):
    """host.py's Envoy, watching for calls on gone contexts and recording
    what each callback decided."""

    clusters = (fuzz_config.REDIS_CLUSTER, fuzz_config.STORE_CLUSTER)

    def __init__(self, compiled, seed):
        self.gone, self.ended = set(), set()
        self.events = []  # this callback's: ("resume", ctx) / ("local", ctx, details)
        self.refuse = False
        self.refused = 0
        self.props = {}  # ctx -> {dotted path: bytes}
        # Envoy keys a root context by root id and configuration: a new
        # configuration is a new root context in the same VM, and the old
        # one lives on while its streams do.
        self.roots = {ROOT_ID}
        self.ticks = {}  # root -> tick period (ms)
        self.queue_owner = {}  # queue id -> the root that registered it
        super().__init__(compiled, seed=seed)

    def _recorded(self, name, impl, unsigned):
        inner = super()._recorded(name, impl, unsigned)

        def call(caller, *args):
            if self.effective in self.gone and name != "proxy_set_effective_context":
                raise Finding(f"{name} called as context {self.effective}, deleted")
            if name in MUTATORS and self.effective in self.ended:
                raise Finding(f"{name} called as stream {self.effective} after it ended")
            return inner(caller, *args)
        return call

    def close(self):
        """Frees the VM. wasmtime's registry of host functions holds this
        host through their closures, and the host holds the store: a cycle
        the garbage collector cannot see, which kept every case's store (a
        4 GiB reservation of address space) until the process ran out."""
        self.store = self.instance = self.exports = self.memory = None
        self._malloc = self._caller = None

    def _proxy_set_effective_context(self, ctx):
        if ctx in self.gone:
            raise Finding(f"proxy_set_effective_context({ctx}): that context was deleted")
        if ctx in self.roots:
            self.effective = ctx
            return 0
        return super()._proxy_set_effective_context(ctx)

    def _proxy_set_tick_period_milliseconds(self, period):
        if self.effective not in self.roots:
            raise Finding(f"set_tick_period called as stream {self.effective}")
        self.ticks[self.effective] = period
        return 0

    def _proxy_register_shared_queue(self, nptr, nsize, id_ptr):
        status = super()._proxy_register_shared_queue(nptr, nsize, id_ptr)
        qid = self.queue_names[self._read(nptr, nsize)]
        self.queue_owner.setdefault(qid, self.effective)
        return status

    def _proxy_log(self, level, ptr, size):
        status = super()._proxy_log(level, ptr, size)
        if level >= 5:
            raise Finding(f"logged at critical: {self.logs[-1][1]}")
        return status

    def _environ_sizes_get(self, count_ptr, size_ptr):
        self._put_u32(count_ptr, len(ENV))
        self._put_u32(size_ptr, sum(len(k) + len(v) + 2 for k, v in ENV.items()))
        return 0

    def _environ_get(self, environ, buf):
        for i, (k, v) in enumerate(ENV.items()):
            entry = k + b"=" + v + b"\0"
            self.memory.write(self._caller, entry, buf)
            self._put_u32(environ + 4 * i, buf)
            buf += len(entry)
        return 0

    def _proxy_get_property(self, pptr, psize, ptr_ptr, size_ptr):
        path = self._read(pptr, psize).split(b"\0")
        value = self.props.get(self.effective, {}).get(b".".join(path).decode("latin-1"))
        if value is None:
            stream = self._stream()
            value = stream and stream.filter_state.get(tuple(p.decode("latin-1") for p in path))
        if value is None:
            return 1
        return self._give(value, ptr_ptr, size_ptr)

    def _proxy_set_property(self, pptr, psize, vptr, vsize):
        stream = self._stream()
        if stream is None:
            return BAD_ARGUMENT
        path = tuple(p.decode("latin-1") for p in self._read(pptr, psize).split(b"\0"))
        stream.filter_state[path] = self._read(vptr, vsize)
        return 0

    def _proxy_continue_stream(self, stream_type):
        if stream_type == 0:
            self.events.append(("resume", self.effective))
        return super()._proxy_continue_stream(stream_type)

    def _proxy_send_local_response(self, status, dptr, dsize, bptr, bsize, hptr, hsize, grpc):
        self.events.append(("local", self.effective, self._read(dptr, dsize).decode("latin-1")))
        return super()._proxy_send_local_response(status, dptr, dsize, bptr, bsize, hptr, hsize,
                                                  grpc)

    def _proxy_http_call(self, *args):
        if self.refuse:
            self.refused += 1
            return BAD_ARGUMENT
        return super()._proxy_http_call(*args)

    def callback(self, name, ctx, *args, size=0):
        before = self.store.get_fuel()
        try:
            result = super().callback(name, ctx, *args)
        except GateError as e:
            cause = e.__cause__
            while cause is not None and not isinstance(cause, Finding):
                cause = cause.__cause__ or cause.__context__
            raise cause if cause is not None else Finding(str(e)[:2000]) from None
        burnt = before - self.store.get_fuel()
        if burnt > FUEL_BASE + FUEL_PER_BYTE * size:
            raise Finding(f"{name}({ctx}) burnt {burnt:,} fuel on {size:,} bytes "
                          f"(bound {FUEL_BASE:,} + {FUEL_PER_BYTE} a byte)")
        self.max_fuel = max(getattr(self, "max_fuel", (0, "", 0)), (burnt, name, size))
        return result
