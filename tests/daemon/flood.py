"""A hostile member's flood, in a process of its own (as on its own box: it does not share the
test's interpreter lock with the Publisher): for ``seconds``, ``per_target`` long polls (each held
``hold`` seconds) at once to each target, each sent again 20 ms after it ends. Prints the HTTP
status counts as JSON.

    python -m tests.daemon.flood CONFIG.json
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys
import time
from pathlib import Path

import aiohttp
import msgpack
from cryptography.hazmat.primitives import serialization

from sparrowd.swarm.identity import NodeKey, peer_headers


async def main(cfg: dict) -> dict:
    key = NodeKey(serialization.load_pem_private_key(cfg["key_pem"].encode(), password=None))
    codes: collections.Counter = collections.Counter()
    deadline = time.monotonic() + cfg["seconds"]
    body = msgpack.packb({"node_id": cfg["node"], "region": "us", "after": 1 << 40, "wait": cfg["hold"],
                          "versions": []})

    async def one(session, url, method, to):
        while time.monotonic() < deadline:
            lease = json.loads(Path(cfg["ticket_file"]).read_text())  # the member's latest ticket
            headers = {"Content-Type": "application/msgpack",
                       **peer_headers(key, cfg["node"], to, lease["ticket"], lease["epoch"], time.time())}
            try:
                async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                    async with session.request(method, url, data=body if method == "POST" else None,
                                               headers=headers) as r:
                        await r.read()
                        codes[r.status] += 1
            except (TimeoutError, aiohttp.ClientError, OSError):
                codes["held"] += 1
            await asyncio.sleep(0.02)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(one(session, t["url"], t["method"], t["to"]) for t in cfg["targets"]
                               for _ in range(cfg["per_target"])))
    return dict(codes)


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(json.loads(open(sys.argv[1]).read())))))
