"""A real ``vllm serve`` (the OpenAI-compatible server) as a child process, for benchmarks and tests.

    server = VllmServer(python, model_dir, port, backend="sparrowd").start()
    server.wait_ready()
    server.post("pause?mode=keep")
    out = server.generate([11, 250, 37], max_tokens=8)    # tokens, logprobs, weight-version spans
    server.stop()

It runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console
script does not start with the CPU build's package name) with vLLM's RL routes
(``VLLM_SERVER_DEV_MODE=1``), the token-in/token-out API that reports
weight-version spans (``--enable-scale-out``), no tokenizer (prompts are token
ids) and a small KV cache. Its log goes to ``log_path``.

The server's topology is vLLM's own for its platform (on CPU, a process per
worker beside the engine core). With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` in
``env``, a single-worker server runs its worker inside the engine core
instead (vLLM's ``uni`` executor, its default for one GPU): the suite's
servers do, one vLLM import fewer each (about 15 CPU-seconds here).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..errors import SparrowError

__all__ = ["VllmServer", "call", "generate"]


class VllmServer:
    def __init__(self, python: str | os.PathLike, model: str | os.PathLike, port: int, *, host: str = "127.0.0.1",
                 backend: str | None = "sparrowd",
                 tensor_parallel: int = 1, log_path: str | os.PathLike | None = None, env: dict | None = None,
                 max_model_len: int = 256, extra: tuple[str, ...] = ()):
        self.url = f"http://{host}:{port}"
        self.args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                     "--host", host, "--port", str(port), "--skip-tokenizer-init", "--enforce-eager",
                     "--max-model-len", str(max_model_len), "--dtype", "bfloat16", "--enable-scale-out",
                     "--seed", "0", *extra]
        if backend:
            self.args += ["--weight-transfer-config", json.dumps({"backend": backend})]
        if tensor_parallel > 1:
            self.args += ["--tensor-parallel-size", str(tensor_parallel), "--distributed-executor-backend", "mp"]
        self.env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1",
                    "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
        if tensor_parallel > 1:
            self.env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tensor_parallel)))
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen | None = None

    def start(self) -> "VllmServer":
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        assert self.proc is not None, "wait_ready before start"
        while True:
            if self.proc.poll() is not None:
                raise SparrowError(f"vllm serve exited ({self.proc.returncode}): {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise SparrowError(f"vllm serve did not answer within {timeout:g} s: {self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path and self.log_path.exists() else ""

    def call(self, method: str, path: str, body: dict | None = None, timeout: float = 300) -> tuple[int, dict]:
        return call(self.url, method, path, body, timeout)

    def post(self, path: str, body: dict | None = None, timeout: float = 300) -> dict:
        code, reply = self.call("POST", path, body, timeout)
        if code != 200:
            raise SparrowError(f"POST /{path}: HTTP {code}: {reply}")
        return reply

    def weight_version(self) -> str:
        return self.call("GET", "weight_info")[1]["weight_version"]

    def generate(self, prompt: list[int], **kw) -> dict:
        return generate(self.url, prompt, **kw)

    # ------------------------------------------------------------ stop

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM to the server's process group (its engine core and workers), SIGKILL if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def call(url: str, method: str, path: str, body: dict | None = None, timeout: float = 300) -> tuple[int, dict]:
    """One JSON call to a vLLM server: ``(HTTP status, reply)``."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"{url}/{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read() or b"{}")
        except ValueError:
            return e.code, {}


def generate(url: str, prompt: list[int], *, max_tokens: int = 8, logprobs: int | None = 2, timeout: float = 300,
             temperature: float = 0.0, seed: int = 0) -> dict:
    """Tokens of one prompt from a server's ``/inference/v1/generate`` (greedy by default; with
    a temperature, sampled with ``seed``, exactly ``max_tokens`` of them): ``{"tokens",
    "logprobs" (one {token id: logprob} per token), "versions" (vLLM's weight-version spans)}``."""
    sampling = {"temperature": temperature, "max_tokens": max_tokens, "seed": seed, "ignore_eos": True}
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    body = {"token_ids": list(prompt), "output_mode": "tokens", "sampling_params": sampling}
    code, reply = call(url, "POST", "inference/v1/generate", body, timeout)
    if code != 200:
        raise SparrowError(f"generate: HTTP {code}: {reply}")
    choice = reply["choices"][0]
    lps = []
    for c in (choice.get("logprobs") or {}).get("content") or []:
        d = {str(t["token_id"]): t["logprob"] for t in c["top_logprobs"]}
        d[str(c["token_id"])] = c["logprob"]
        lps.append(d)
    return {"tokens": choice["token_ids"], "logprobs": lps, "versions": choice["weight_versions"]}
