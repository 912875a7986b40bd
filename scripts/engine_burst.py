#!/usr/bin/env python3
"""Bursts of concurrent streaming requests against a running `kvtier engine` (stdlib only).

Each request is its own HTTP/1.1 connection to SGLang's `/generate` with `input_ids` (so the
prompt length is exact whatever the tokenizer), streamed, read until the server ends the body.
First `--fill` waves of distinct prompts fill the device prefix cache; then `--burst` requests
at once, sharing prefixes with the fill (so they hit) or not. Every request must end: tokens
and `[DONE]`, or 503 with Retry-After. A request that sees nothing for `--stall-s` seconds is
reported with the engine's `/health` at that moment, and the script exits 1.

    scripts/engine_burst.py --port 8000 --fill 4 --wave 16 --burst 128 --prompt-tokens 1024
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import urllib.request
from dataclasses import dataclass, field


@dataclass
class Outcome:
    status: int = 0
    events: int = 0
    done: bool = False
    first_event_s: float | None = None
    end_s: float | None = None
    error: str = ""
    stalled: bool = False
    retry_after: str | None = None
    timeline: list[str] = field(default_factory=list)


def health(port: int) -> dict[str, object]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:
        return json.loads(r.read())


async def stream(port: int, ids: list[int], max_new: int, stall_s: float) -> Outcome:
    out = Outcome()
    start = time.monotonic()
    body = json.dumps(
        {
            "input_ids": ids,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True},
            "stream": True,
        }
    ).encode()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as e:
        out.error = f"connect: {e}"
        return out
    try:
        writer.write(
            b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), stall_s)
        out.status = int(head.split(b" ")[1])
        for line in head.decode().split("\r\n"):
            if line.lower().startswith("retry-after:"):
                out.retry_after = line.split(":", 1)[1].strip()
        while True:
            line = await asyncio.wait_for(reader.readline(), stall_s)
            if not line:
                break
            if line.startswith(b"data: "):
                now = time.monotonic() - start
                out.events += 1
                if out.first_event_s is None:
                    out.first_event_s = now
                if line.strip() == b"data: [DONE]":
                    out.done = True
        out.end_s = time.monotonic() - start
    except asyncio.TimeoutError:
        out.stalled = True
        out.error = f"nothing for {stall_s:.0f} s after {out.events} events"
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        writer.close()
    return out


async def wave(
    port: int, prompts: list[list[int]], max_new: int, stall_s: float, connections: int
) -> list[Outcome]:
    # A client-side connection pool of `connections` (aiohttp's shared-session default is 100,
    # httpx's max_connections too): past it a request waits in the client, unseen by the
    # engine, and its timeout runs while it waits, as those clients' timeouts do.
    pool = asyncio.Semaphore(connections)

    async def one(p: list[int]) -> Outcome:
        start = time.monotonic()
        try:
            await asyncio.wait_for(pool.acquire(), stall_s)
        except asyncio.TimeoutError:
            return Outcome(stalled=True, error=f"no client connection free for {stall_s:.0f} s (never sent)")
        try:
            left = max(stall_s - (time.monotonic() - start), 1.0)
            return await stream(port, p, max_new, left)
        finally:
            pool.release()

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def summary(name: str, outs: list[Outcome]) -> tuple[int, int, int]:
    served = sum(1 for o in outs if o.status == 200 and o.done)
    refused = sum(1 for o in outs if o.status == 503 and o.retry_after)
    bad = len(outs) - served - refused
    ends = [o.end_s for o in outs if o.end_s is not None]
    firsts = sorted(o.first_event_s for o in outs if o.first_event_s is not None)
    p50 = firsts[len(firsts) // 2] if firsts else float("nan")
    print(
        f"{name}: {len(outs)} requests, {served} served, {refused} refused (503), {bad} failed or hung; "
        f"first event p50 {p50:.2f} s, last end {max(ends, default=float('nan')):.2f} s",
        flush=True,
    )
    for i, o in enumerate(outs):
        if not (o.status == 200 and o.done) and not (o.status == 503 and o.retry_after):
            print(f"  request {i}: status {o.status} events {o.events} error {o.error!r}", flush=True)
    return served, refused, bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--fill", type=int, default=4, help="waves before the burst")
    ap.add_argument("--wave", type=int, default=16, help="requests per fill wave")
    ap.add_argument("--burst", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--shared", type=float, default=0.9, help="prefix fraction a burst prompt shares with a fill prompt")
    ap.add_argument("--max-new", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=256, help="token ids drawn below this")
    ap.add_argument("--stall-s", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--client-connections", type=int, default=1 << 30, help="client-side connection pool (default: unlimited)"
    )
    a = ap.parse_args()
    rng = random.Random(a.seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(a.vocab) for _ in range(n)]

    fills = [prompt(a.prompt_tokens) for _ in range(a.fill * a.wave)]
    shared = int(a.prompt_tokens * a.shared)
    burst = [fills[i % len(fills)][:shared] + prompt(a.prompt_tokens - shared) for i in range(a.burst)] if fills else [
        prompt(a.prompt_tokens) for _ in range(a.burst)
    ]
    bad_total = 0
    for w in range(a.fill):
        outs = asyncio.run(
            wave(a.port, fills[w * a.wave : (w + 1) * a.wave], a.max_new, a.stall_s, a.client_connections)
        )
        bad_total += summary(f"fill wave {w}", outs)[2]
        print(f"  health: {health(a.port)}", flush=True)
    outs = asyncio.run(wave(a.port, burst, a.max_new, a.stall_s, a.client_connections))
    bad_total += summary("burst", outs)[2]
    print(f"  health: {health(a.port)}", flush=True)
    return 1 if bad_total else 0


if __name__ == "__main__":
    sys.exit(main())
