"""``bench rl``'s generation: each server takes its requests one at a time, the servers side by side.

vLLM's sampling on CPU is not batch-invariant, so requests sent to a server together land in
batches that depend on their timing, and runs (and strategies) differ now and then. Two
stand-in servers (plain HTTP, the reply shape of vLLM's ``/inference/v1/generate``) record how
many requests each holds at once; the real servers are in ``tests/engine/test_bench_rl.py``.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sparrowd.bench import rl


class _Server:
    """A generate endpoint that answers after ``delay`` seconds with tokens derived from the prompt
    and seed, and counts the requests it holds at once."""

    def __init__(self, delay: float = 0.1, version: str = "3"):
        self.now = self.most = self.served = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.now += 1
                    outer.most = max(outer.most, outer.now)
                time.sleep(delay)
                seed = body["sampling_params"]["seed"]
                tokens = [(seed + t + sum(body["token_ids"])) % rl.VOCAB
                          for t in range(body["sampling_params"]["max_tokens"])]
                reply = json.dumps({"choices": [{"token_ids": tokens, "weight_versions": [{"version": version}]}]})
                with outer.lock:
                    outer.now -= 1
                    outer.served += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply.encode())

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


class _World:
    def __init__(self, servers):
        self.servers = servers


@pytest.fixture
def servers():
    made = [_Server(), _Server()]
    yield made
    for s in made:
        s.close()


def test_each_server_takes_one_request_at_a_time_and_the_servers_run_side_by_side(servers):
    cfg = rl.RLConfig(prompts=4, samples=3, max_tokens=5)
    t0 = time.monotonic()
    batch = rl._generate(_World(servers), cfg, step=2, version=3)
    took = time.monotonic() - t0
    assert [s.most for s in servers] == [1, 1]  # never two requests at once on a server
    assert [s.served for s in servers] == [6, 6]  # prompts 0 and 2 on the first, 1 and 3 on the second
    assert took < 9 * 0.1  # side by side: about 6 requests' time, not 12
    # In the order of (prompt, sample), whatever order the servers finished in.
    prompts = rl._prompts(cfg, 2)
    assert [p for p, _, _ in batch] == [prompts[k] for k in range(4) for _ in range(3)]
    seeds = [(cfg.seed * 1_000_003 + 2 * 10_007 + k * 101 + g) % (1 << 31) for k in range(4) for g in range(3)]
    assert [c[0] for _, c, _ in batch] == [(s + sum(p)) % rl.VOCAB for s, (p, _, _) in zip(seeds, batch, strict=True)]
    assert all(r == rl._reward(c) for _, c, r in batch)


def test_a_sample_on_another_version_fails_the_step(servers):
    with pytest.raises(RuntimeError, match="generated on versions \\['3'\\], not 4"):
        rl._generate(_World(servers), rl.RLConfig(prompts=2, samples=1, max_tokens=2), step=1, version=4)
