#!/usr/bin/env python3
"""Demo upstream for redis-guard: answers every request with a small JSON
document and counts what it executed, so the demo and the tests can see what
reached the upstream.

  GET /__stats            -> {"requests": N, "byPath": {...}, "inFlight":
                             {...}, "peakInFlight": {...}} (not counted):
                             requests executed, being executed now (a
                             request leaves the count before its response's
                             last bytes are sent), and the most executed at
                             once, per path
  header x-upstream-status -> answer with that status
  header x-upstream-delay-ms -> wait that long first (bounded to 10 s)
  header x-upstream-pad-bytes -> add that many spaces to the body (<= 1 MiB)
  header x-upstream-body-pause-ms -> send half the body, pause, send the rest
  header x-upstream-binary-bytes -> answer with that many bytes (<= 16 MiB) of
         application/octet-stream instead, pseudo-random and seeded by the
         execution number: a second execution never sends the same bytes
  header x-upstream-headers -> a JSON list of [name, value] pairs added to
         the response in that order (a name may repeat); each character of a
         value below U+0100 is sent as that one byte, so "\u00ff" sends 0xFF
         (a header value that is not UTF-8)
  header x-upstream-llm -> answer as an LLM API with the token counts of
         x-upstream-tokens ("<prompt>,<completion>", default "10,20"):
         openai-json (a chat completion with its usage), openai-sse (chunks,
         then a final chunk with the usage, then [DONE]) or anthropic-sse
         (message_start with the input tokens, deltas, message_delta with the
         output tokens as a running total, message_stop); with
         x-upstream-body-pause-ms, a stream pauses that long before its
         usage, so a client can leave before it
  header x-upstream-trailers -> a JSON list of [name, value] pairs sent as
         trailers after a chunked body (as gRPC sends its status and
         metadata)
"""
import argparse
import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()
STATS = {"requests": 0, "byPath": {}, "inFlight": {}, "peakInFlight": {}}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _serve(self):
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        if self.path == "/__stats":
            with LOCK:
                out = json.dumps(STATS).encode()
            return self._reply(200, out)
        with LOCK:
            STATS["requests"] += 1
            STATS["byPath"][self.path] = STATS["byPath"].get(self.path, 0) + 1
            n = STATS["requests"]
            now = STATS["inFlight"].get(self.path, 0) + 1
            STATS["inFlight"][self.path] = now
            peak = STATS["peakInFlight"]
            peak[self.path] = max(peak.get(self.path, 0), now)
        self._running = True
        try:
            self._execute(n, body)
        finally:
            self._finish()

    def _finish(self):
        """Ends this execution's count before the response's last bytes are
        written: a client that has read its whole response never sees the
        request still in flight (a test reading the count right after it was
        answered once saw its previous request there)."""
        if getattr(self, "_running", False):
            self._running = False
            with LOCK:
                STATS["inFlight"][self.path] -= 1

    def _llm(self, kind, status):
        prompt, completion = (int(x) for x in
                              (self.headers.get("x-upstream-tokens") or "10,20").split(","))
        pause = min(int(self.headers.get("x-upstream-body-pause-ms") or 0), 10_000)
        if kind == "openai-json":
            out = json.dumps({
                "id": "chatcmpl-demo", "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"}}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion},
            }).encode()
            return self._reply(status, out)
        if kind == "openai-sse":
            head = [{"choices": [{"delta": {"content": w}}], "usage": None} for w in ("Hel", "lo")]
            tail = [{"choices": [], "usage": {"prompt_tokens": prompt,
                                              "completion_tokens": completion,
                                              "total_tokens": prompt + completion}}]
            events = ([b"data: " + json.dumps(e).encode() for e in head],
                      [b"data: " + json.dumps(e).encode() for e in tail] + [b"data: [DONE]"])
        elif kind == "anthropic-sse":
            def ev(name, data):
                return f"event: {name}\ndata: {json.dumps(data)}".encode()
            head = [ev("message_start", {"type": "message_start", "message": {
                        "usage": {"input_tokens": prompt, "output_tokens": 1}}}),
                    ev("content_block_delta", {"type": "content_block_delta",
                                               "delta": {"text": "Hello"}})]
            tail = [ev("message_delta", {"type": "message_delta",
                                         "usage": {"output_tokens": max(1, completion // 2)}}),
                    ev("message_delta", {"type": "message_delta",
                                         "usage": {"output_tokens": completion}}),
                    ev("message_stop", {"type": "message_stop"})]
            events = (head, tail)
        else:
            return self._reply(400, b'{"error":"unknown x-upstream-llm"}')
        first = b"".join(e + b"\n\n" for e in events[0])
        rest = b"".join(e + b"\n\n" for e in events[1])
        self.send_response(status)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(first) + len(rest)))
        self.end_headers()
        self.wfile.write(first)
        self.wfile.flush()
        if pause:
            time.sleep(pause / 1000)
        self._finish()
        self.wfile.write(rest)

    def _execute(self, n, body):
        delay = min(int(self.headers.get("x-upstream-delay-ms") or 0), 10_000)
        if delay:
            time.sleep(delay / 1000)
        status = int(self.headers.get("x-upstream-status") or 200)
        llm = self.headers.get("x-upstream-llm")
        if llm:
            return self._llm(llm, status)
        binary = min(int(self.headers.get("x-upstream-binary-bytes") or 0), 16 << 20)
        extra = json.loads(self.headers.get("x-upstream-headers") or "[]")
        if binary:
            return self._reply(status, random.Random(n).randbytes(binary),
                               content_type="application/octet-stream", extra=extra)
        out = json.dumps({
            "method": self.command,
            "path": self.path,
            "execution": n,
            "bodyBytes": len(body),
        }).encode()
        # Pads the body and sends it in two halves with a pause between them,
        # so a client can leave after the upstream has started answering.
        pad = min(int(self.headers.get("x-upstream-pad-bytes") or 0), 1 << 20)
        out += b" " * pad
        pause = min(int(self.headers.get("x-upstream-body-pause-ms") or 0), 10_000)
        self._reply(status, out, pause, extra=extra)

    def _reply(self, status, out, pause_ms=0, content_type="application/json", extra=()):
        trailers = json.loads(self.headers.get("x-upstream-trailers") or "[]")
        if trailers:
            return self._chunked(status, out, content_type, trailers)
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(out)))
        # http.server encodes header lines as Latin-1: one byte per character.
        for name, value in extra:
            self.send_header(name, value)
        self.end_headers()
        if pause_ms:
            half = len(out) // 2
            self.wfile.write(out[:half])
            self.wfile.flush()
            time.sleep(pause_ms / 1000)
            out = out[half:]
        self._finish()
        self.wfile.write(out)

    def _chunked(self, status, out, content_type, trailers):
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("transfer-encoding", "chunked")
        self.send_header("trailer", ", ".join(name for name, _ in trailers))
        self.end_headers()
        tail = b"".join(f"{name}: {value}\r\n".encode("latin-1") for name, value in trailers)
        self._finish()
        self.wfile.write(b"%x\r\n%s\r\n0\r\n%s\r\n" % (len(out), out, tail))

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _serve


class Server(ThreadingHTTPServer):
    daemon_threads = True
    # The default listen backlog (5) drops connections under a burst, which
    # Envoy reports as 503s that have nothing to do with the filter.
    request_queue_size = 1024


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    args = p.parse_args()
    server = Server((args.host, args.port), Handler)
    print(f"upstream listening on {args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
