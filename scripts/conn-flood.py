#!/usr/bin/env python3
"""Open many idle (or slowloris) TCP connections to one leasecore node and report how many the
node keeps open: a manual check of the connection cap and the header timeout.

    scripts/conn-flood.py 127.0.0.1:7001 --count 10000 --hold 20 [--slowloris]

Loopback only (the address must be 127.x or localhost); the count and the hold time are bounded.
Each process can hold at most its open-file limit (`ulimit -n`) of sockets: run several
processes for more. Prints one JSON line: opened, refused at connect, and still open at the end.
"""
import argparse
import asyncio
import json
import time


async def one(host, port, slowloris, held, stats):
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
    except (OSError, asyncio.TimeoutError):
        stats["connect_failed"] += 1
        return
    stats["opened"] += 1
    if slowloris:
        try:
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            await writer.drain()
        except OSError:
            pass
    held.append((reader, writer))


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("addr")
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--hold", type=float, default=20.0)
    ap.add_argument("--slowloris", action="store_true")
    args = ap.parse_args()
    host, port = args.addr.rsplit(":", 1)
    if not (host.startswith("127.") or host == "localhost"):
        raise SystemExit("loopback addresses only")
    count = min(args.count, 50_000)
    hold = min(args.hold, 600.0)
    stats = {"opened": 0, "connect_failed": 0}
    held = []
    started = time.monotonic()
    # Connect in bounded waves so the listen backlog is not the thing being measured.
    for i in range(0, count, 500):
        await asyncio.gather(
            *(one(host, int(port), args.slowloris, held, stats) for _ in range(min(500, count - i)))
        )
    stats["connect_secs"] = round(time.monotonic() - started, 2)
    await asyncio.sleep(hold)
    still_open = 0
    for reader, writer in held:
        # The event loop ran during the hold, so a close by the server has been seen: EOF (or
        # a reset, which closes the transport).
        if not (reader.at_eof() or writer.is_closing() or reader.exception() is not None):
            still_open += 1
        writer.close()
    stats["still_open_after_hold"] = still_open
    print(json.dumps(stats))


if __name__ == "__main__":
    asyncio.run(main())
