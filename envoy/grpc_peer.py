#!/usr/bin/env python3
"""A gRPC service and a gRPC client (grpcio) for the demo and the tests.

serve: `demo.Orders`, raw-bytes messages (no generated code needed):
  Create  unary. Answers b"order <n> for <request>" with initial metadata
          x-order-id and trailing metadata x-trace (binary x-sig-bin too).
          A request starting with b"fail" ends INTERNAL (13); b"missing"
          ends NOT_FOUND (5) before any message; b"slow" waits 2 s first.
  Watch   server streaming: three messages.
  Upload  client streaming: counts the messages it got.
  Stats   unary: {"<method>": executions, ...} as JSON (not counted).
Each execution is counted, per method, for the tests to read through Stats.

call: sends calls described as JSON (a list; --parallel sends them at once;
a call's own "target" overrides --target) and prints one JSON result per call: code, details, the response
message(s) in hex, initial and trailing metadata (binary values in hex), and
the RetryInfo delay in ms when grpc-status-details-bin carries one.
"""
import argparse
import json
import sys
import threading
import time
from concurrent import futures

import grpc

SERVICE = "demo.Orders"


def serve(port):
    counts = {}
    lock = threading.Lock()

    def count(method):
        with lock:
            counts[method] = counts.get(method, 0) + 1
            return counts[method]

    def create(request, context):
        n = count("Create")
        if request.startswith(b"slow"):
            time.sleep(2.0)
        if request.startswith(b"missing"):
            context.abort(grpc.StatusCode.NOT_FOUND, "no such order")
        context.send_initial_metadata((("x-order-id", str(n)),))
        context.set_trailing_metadata((("x-trace", f"t{n}"), ("x-sig-bin", bytes([0, 255, n % 256]))))
        if request.startswith(b"fail"):
            context.abort(grpc.StatusCode.INTERNAL, "boom")
        return b"order %d for " % n + request

    def watch(request, context):
        n = count("Watch")
        for i in range(3):
            yield b"event %d.%d" % (n, i)

    def upload(request_iterator, context):
        count("Upload")
        return b"%d messages" % sum(1 for _ in request_iterator)

    def stats(request, context):
        with lock:
            return json.dumps(counts).encode()

    handler = grpc.method_handlers_generic_handler(SERVICE, {
        "Create": grpc.unary_unary_rpc_method_handler(create),
        "Watch": grpc.unary_stream_rpc_method_handler(watch),
        "Upload": grpc.stream_unary_rpc_method_handler(upload),
        "Stats": grpc.unary_unary_rpc_method_handler(stats),
    })
    # grpcio sets SO_REUSEPORT by default: a second server on a port already
    # taken would then bind silently and share its connections, mixing two
    # tests' execution counts. Without it a taken port fails at start.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16),
                         options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((handler,))
    if server.add_insecure_port(f"127.0.0.1:{port}") != port:
        sys.exit(f"grpc_peer: cannot listen on 127.0.0.1:{port}")
    server.start()
    print(f"serving {SERVICE} on 127.0.0.1:{port}", flush=True)
    server.wait_for_termination()


def metadata(pairs):
    out = []
    for key, value in pairs or ():
        out.append([key, value.hex() if isinstance(value, bytes) else value])
    return out


def retry_ms(trailing):
    for key, value in trailing or ():
        if key == "grpc-status-details-bin":
            from google.rpc import error_details_pb2, status_pb2
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                info = error_details_pb2.RetryInfo()
                if detail.Unpack(info):
                    d = info.retry_delay
                    return {"ms": d.seconds * 1000 + d.nanos // 1_000_000,
                            "code": status.code, "message": status.message}
    return None


def one_call(channel, spec):
    path = f"/{SERVICE}/{spec['method']}"
    md = [(k, v) for k, v in spec.get("metadata", {}).items()]
    timeout = spec.get("timeout", 10)
    data = spec.get("data", "").encode()
    result = {}
    try:
        kind = spec.get("kind", "unary")
        if kind == "unary":
            rpc = channel.unary_unary(path)
            response, call = rpc.with_call(data, metadata=md, timeout=timeout)
            messages = [response]
        elif kind == "server_stream":
            call = channel.unary_stream(path)(data, metadata=md, timeout=timeout)
            messages = list(call)
        else:
            rpc = channel.stream_unary(path)
            parts = [p.encode() for p in spec.get("messages", [])]
            response, call = rpc.with_call(iter(parts), metadata=md, timeout=timeout)
            messages = [response]
        result.update(code=call.code().value[0], details=call.details() or "",
                      messages=[m.hex() for m in messages],
                      initial=metadata(call.initial_metadata()),
                      trailing=metadata(call.trailing_metadata()))
    except grpc.RpcError as e:
        result.update(code=e.code().value[0], details=e.details() or "", messages=[],
                      initial=metadata(e.initial_metadata()),
                      trailing=metadata(e.trailing_metadata()),
                      retry=retry_ms(e.trailing_metadata()))
    return result


def call(target, specs, parallel):
    with grpc.insecure_channel(target) as channel:
        if parallel:
            # One channel each, so the calls are separate HTTP/2 streams
            # sent at the same moment (a barrier, not sleeps).
            barrier = threading.Barrier(len(specs))

            def run(spec):
                with grpc.insecure_channel(spec.get("target", target)) as own:
                    grpc.channel_ready_future(own).result(timeout=10)
                    barrier.wait(timeout=10)
                    return one_call(own, spec)
            with futures.ThreadPoolExecutor(max_workers=len(specs)) as pool:
                results = list(pool.map(run, specs))
        else:
            results = []
            for spec in specs:
                if "target" in spec:
                    with grpc.insecure_channel(spec["target"]) as own:
                        results.append(one_call(own, spec))
                else:
                    results.append(one_call(channel, spec))
    json.dump(results, sys.stdout)
    print()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--port", type=int, required=True)
    c = sub.add_parser("call")
    c.add_argument("--target", required=True, help="host:port")
    c.add_argument("--parallel", action="store_true")
    c.add_argument("specs", help="JSON list of calls")
    args = p.parse_args()
    if args.cmd == "serve":
        serve(args.port)
    else:
        call(args.target, json.loads(args.specs), args.parallel)


if __name__ == "__main__":
    main()
