"""The address Webdis reaches Redis at, moved by a failover: a TCP
forwarder to whichever Redis is the primary (as a Sentinel-managed virtual
IP or a DNS name would be). A line "PORT" on the control port points it at
another Redis and closes every connection made so far, so Webdis reconnects
to the new primary.

  python -m soak.fwd --listen PORT --control PORT --target PORT"""

import argparse
import asyncio


class Forwarder:
    def __init__(self, target):
        self.target = target
        self.live = set()

    async def pipe(self, reader, writer):
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def client(self, reader, writer):
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return
        pair = (writer, uw)
        self.live.add(pair)
        try:
            await asyncio.gather(self.pipe(reader, uw), self.pipe(ur, writer))
        finally:
            self.live.discard(pair)

    async def control(self, reader, writer):
        line = await reader.readline()
        try:
            self.target = int(line.strip())
            for pair in list(self.live):
                for w in pair:
                    w.transport.abort()
            self.live.clear()
            writer.write(b"ok\n")
        except ValueError:
            writer.write(b"bad port\n")
        await writer.drain()
        writer.close()


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("--listen", type=int, required=True)
    p.add_argument("--control", type=int, required=True)
    p.add_argument("--target", type=int, required=True)
    a = p.parse_args()
    f = Forwarder(a.target)
    s1 = await asyncio.start_server(f.client, "127.0.0.1", a.listen, backlog=1024)
    s2 = await asyncio.start_server(f.control, "127.0.0.1", a.control)
    async with s1, s2:
        await asyncio.gather(s1.serve_forever(), s2.serve_forever())


if __name__ == "__main__":
    asyncio.run(main())
