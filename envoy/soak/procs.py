"""The processes the soak starts: each is stopped on exit, whatever happens,
and a killed one can be started again with the same command line."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HOST = "127.0.0.1"
PROCS = []


def log(msg):
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Proc:
    """One process: its name, command, log file and environment."""

    def __init__(self, name, args, logfile, env=None, cwd=None, port=None):
        self.name, self.args, self.logfile = name, [str(a) for a in args], Path(logfile)
        self.env, self.cwd, self.port = env, cwd, port
        self.p = None
        self.starts = 0

    def start(self, wait=30.0):
        f = open(self.logfile, "ab")
        env = dict(os.environ)
        env.update(self.env or {})
        self.p = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=f,
                                  stderr=subprocess.STDOUT, env=env, cwd=self.cwd,
                                  start_new_session=True)
        f.close()
        self.starts += 1
        if self not in PROCS:
            PROCS.append(self)
        if self.port and not wait_port(self.p, self.port, wait):
            raise SoakError(f"{self.name} did not start on :{self.port}:\n{tail(self.logfile)}")
        return self

    def alive(self):
        return self.p is not None and self.p.poll() is None

    def signal(self, sig):
        if self.alive():
            os.kill(self.p.pid, sig)

    def kill(self):
        """SIGKILL, and waits for the process to be gone."""
        if self.alive():
            os.kill(self.p.pid, signal.SIGKILL)
        if self.p is not None:
            self.p.wait(timeout=10)

    def stop(self):
        if self.p is None:
            return
        if self.p.poll() is None:
            try:
                os.kill(self.p.pid, signal.SIGCONT)  # a stopped one cannot end
                self.p.terminate()
                self.p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(timeout=5)
            except ProcessLookupError:
                pass


class SoakError(Exception):
    pass


def stop_all():
    for p in reversed(PROCS):
        try:
            p.stop()
        except Exception as e:  # keep stopping the others
            print(f"soak: could not stop {p.name}: {e}", file=sys.stderr)


def free_ports(n):
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind((HOST, 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def port_open(port):
    try:
        with socket.create_connection((HOST, port), timeout=0.2):
            return True
    except OSError:
        return False


def wait_port(p, port, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if p.poll() is not None:
            return False
        if port_open(port):
            return True
        time.sleep(0.05)
    return False


def wait_for(what, pred, timeout, step=0.05):
    """Polls `pred` until it is true; SoakError naming `what` past `timeout`."""
    end = time.monotonic() + timeout
    while True:
        try:
            if pred():
                return
        except (OSError, SoakError):
            pass
        if time.monotonic() > end:
            raise SoakError(f"timed out waiting for {what}")
        time.sleep(step)


def tail(path, n=15):
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join("    " + line for line in lines[-n:])


class Redis:
    """A minimal RESP client (admin commands: AUTH, INFO, SCAN, TTL, ...)."""

    def __init__(self, port, user=None, password=None, timeout=5):
        self.sock = socket.create_connection((HOST, port), timeout=timeout)
        self.buf = b""
        if user:
            self.cmd("AUTH", user, password)

    def _fill(self):
        chunk = self.sock.recv(65536)
        if not chunk:
            raise SoakError("redis closed the connection")
        self.buf += chunk

    def _line(self):
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _reply(self, raw=False):
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode()
        if kind == b"-":
            raise SoakError(f"redis: {rest.decode()}")
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            while len(self.buf) < n + 2:
                self._fill()
            data, self.buf = self.buf[:n], self.buf[n + 2:]
            return data if raw else data.decode(errors="replace")
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._reply(raw) for _ in range(n)]
        raise SoakError(f"redis: unexpected reply {line!r}")

    def cmd(self, *args, raw=False):
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            a = a if isinstance(a, bytes) else str(a).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(a), a))
        self.sock.sendall(b"".join(out))
        return self._reply(raw)

    def pipeline(self, cmds):
        """Every command sent at once, the replies read in order."""
        out = []
        for args in cmds:
            out.append(b"*%d\r\n" % len(args))
            for a in args:
                a = a if isinstance(a, bytes) else str(a).encode()
                out.append(b"$%d\r\n%s\r\n" % (len(a), a))
        self.sock.sendall(b"".join(out))
        return [self._reply() for _ in cmds]

    def info(self, section):
        d = {}
        for line in self.cmd("INFO", section).splitlines():
            if ":" in line and not line.startswith("#"):
                k, v = line.split(":", 1)
                d[k] = v
        return d

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass
