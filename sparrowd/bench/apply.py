"""``sparrowd bench apply``: the pause of an engine's update against reloading the model.

Two engines:

* ``engine="vllm"`` (the default) runs where vLLM is installed (the engine
  environment) and measures vLLM itself, on the CPU;
* ``engine="torch"`` needs only torch: a Qwen3-shaped state dict on
  ``device`` (``cuda`` on a GPU box) takes the updates through the engine
  socket with a ``PatchApplier``, the path the vLLM extension and backend run
  on each worker, against reloading every tensor (``copy_`` from the host
  tensors of a safetensors file, as vLLM's default weight loader does, and
  a bare ``copy_`` from host memory: any reload's floor).

With vLLM: a Qwen3 of about
``size_mib`` MiB of bf16 (random init, ``save_pretrained``) is checkpoint 0;
each step moves ``density`` of its elements by one ulp and is published
through a trainer daemon on loopback, whose engine socket the engine attaches
to. For each step it times ``update(llm)`` (fetch the decoded patch over the
socket, scatter it into the runtime parameters, reset the prefix cache)
beside vLLM's own ``load_weights`` of the whole checkpoint of that step, in
the same engine, and checks that both leave the very same parameters.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

from ..errors import InputError
from . import needs_vllm, sync_device, torch_device, write_json

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _config(size_mib: int):
    from transformers import Qwen3Config

    hidden = 1024 if size_mib >= 256 else 512
    layers = max(2, int(size_mib * (1 << 20) / 2 / (12.6 * hidden * hidden)))
    return Qwen3Config(vocab_size=32000, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                       num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, head_dim=64,
                       max_position_embeddings=512, tie_word_embeddings=False)


def _params(worker):
    return {n: p.detach().clone() for n, p in worker.model_runner.model.named_parameters()}


def _load_weights(worker, folder: str, cold: bool = False) -> float:
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    files = sorted(str(p) for p in Path(folder).glob("*.safetensors"))
    if cold:  # out of the page cache: the reload reads the disk, as a restarted engine would
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    t0 = time.perf_counter()
    worker.model_runner.model.load_weights(safetensors_weights_iterator(files, use_tqdm_on_load=False))
    return time.perf_counter() - t0


def _generation_seconds(llm) -> float:
    """Greedy generation of 8 x 32 tokens: what keeping plain linear weights costs on the CPU."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": [(7 * i + j) % 1000 + 1 for j in range(16)]} for i in range(8)]
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm.generate(prompts[:1], sp, use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    return time.perf_counter() - t0


def _plain_engine_generation(checkpoint: str) -> float:
    """The same generation on an engine without the extension (vLLM's packed CPU kernels)."""
    from vllm import LLM

    llm = LLM(checkpoint, skip_tokenizer_init=True, enforce_eager=True, kv_cache_memory_bytes=64 << 20,
              dtype="bfloat16", max_model_len=512)
    return _generation_seconds(llm)


def _step(torch, state: dict, density: float, g) -> int:
    """An RL step's worth of change: about ``density`` of each bf16 tensor's elements moved up one
    ulp, in place; returns how many were drawn (a few twice)."""
    changed = 0
    for t in state.values():
        bits = t.view(torch.int16).view(-1)
        idx = torch.randint(0, bits.numel(), (max(1, int(bits.numel() * density)),), generator=g)
        bits[idx] += 1
        changed += idx.numel()
    return changed


def _wait_ready(worker, version: int) -> None:
    deadline = time.monotonic() + 60
    while version not in worker._sparrow.client.ready(5)[1]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"version {version} never became ready")
    worker._sparrow.client.fetch(version)  # waits for the decode the daemon runs ahead: the pause is the engine's


def run(*, size_mib: int = 512, steps: int = 3, density: float = 0.01, json_path: str | None = None,
        engine: str = "vllm", device: str = "cpu") -> int:
    if engine == "torch":
        return _run_torch(size_mib=size_mib, steps=steps, density=density, device=device, json_path=json_path)
    if device != "cpu":
        raise InputError("--device is for --engine torch; the vLLM engine here is vLLM's CPU build")
    try:
        import torch
        from transformers import Qwen3ForCausalLM
        from vllm import LLM
    except ImportError as e:
        return needs_vllm("apply", e.name, "; or --engine torch, which needs torch alone")

    from ..integrations.vllm import update
    from ..publisher import Publisher
    from .trainer import trainer_daemon

    rows = []
    with trainer_daemon("sparrowd-bench-apply-") as trainer:
        root, token, port_url = trainer.root, trainer.token_file, trainer.url
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(_config(size_mib)).to(torch.bfloat16)
        model.save_pretrained(root / "ckpt0")
        state = model.state_dict()
        total = sum(t.numel() for t in state.values())
        pub = Publisher(daemon=port_url, token_file=token, anchor_every=0)
        pub.start(state, version=0, anchor=False)
        llm = LLM(str(root / "ckpt0"), skip_tokenizer_init=True, enforce_eager=True, kv_cache_memory_bytes=64 << 20,
                  dtype="bfloat16", max_model_len=512,
                  worker_extension_cls="sparrowd.integrations.vllm.SparrowWorkerExtension")
        t0 = time.perf_counter()
        [learned] = llm.collective_rpc("sparrow_connect", args=(str(trainer.data_dir / "engine.sock"),),
                                       kwargs={"token_file": str(token), "version": 0, "engine": "bench"})
        connect = time.perf_counter() - t0
        print(f"sparrowd bench apply: Qwen3 of {total * 2 / (1 << 20):.0f} MiB bf16 ({total / 1e6:.0f}M parameters, "
              f"{len(state)} tensors), {100 * density:.1f}% of elements moved per step, vLLM CPU, "
              f"{os.cpu_count()} CPUs", flush=True)
        print(f"   connect (placements learned from vLLM's loaders): {connect:.2f} s, {learned['runs']} runs "
              f"for {learned['tensors']} checkpoint tensors", flush=True)
        g = torch.Generator().manual_seed(1)
        for step in range(1, steps + 1):
            changed = _step(torch, state, density, g)
            model.save_pretrained(root / f"ckpt{step}")
            pub.publish(state, version=step)
            llm.collective_rpc(_wait_ready, args=(step,))
            t0 = time.perf_counter()
            got = update(llm, step)
            pause = time.perf_counter() - t0
            assert got == step, got
            [applied] = llm.collective_rpc("sparrow_stats")
            [after_update] = llm.collective_rpc(_params)
            [cold] = llm.collective_rpc(_load_weights, args=(str(root / f"ckpt{step}"), True))
            [reload] = llm.collective_rpc(_load_weights, args=(str(root / f"ckpt{step}"),))
            [after_reload] = llm.collective_rpc(_params)
            same = all(torch.equal(after_update[k].view(torch.int16), after_reload[k].view(torch.int16))
                       for k in after_update)
            if not same:
                raise RuntimeError(f"step {step}: the update and vLLM's reload left different parameters")
            rows.append({"step": step, "elements_changed": changed, "update_seconds": pause,
                         "scatter_seconds": applied["scatter_seconds"], "load_weights_seconds": reload,
                         "load_weights_cold_seconds": cold})
            print(f"   step {step}: update pause {pause:.3f} s (scatter {applied['scatter_seconds']:.3f} s of "
                  f"{applied['elements']} elements); vLLM's load_weights of the whole checkpoint {cold:.3f} s from "
                  f"disk ({cold / pause:.1f}x the pause), {reload:.3f} s from the page cache "
                  f"({reload / pause:.2f}x); parameters identical", flush=True)
        pub.close()
        ours = _generation_seconds(llm)
        r = subprocess.run([sys.executable, "-c", "import sys; from sparrowd.bench.apply import "
                            "_plain_engine_generation as g; print(g(sys.argv[1]))", str(root / "ckpt0")],
                           capture_output=True, text=True)
        if r.returncode == 0:
            packed = float(r.stdout.strip().splitlines()[-1])
            print(f"   generation of 8 x 32 tokens: {ours:.2f} s with plain weights (the extension) vs "
                  f"{packed:.2f} s with vLLM's packed CPU kernels ({ours / packed:.2f}x)", flush=True)
        else:
            print(f"   (the engine without the extension did not run: {r.stderr.strip().splitlines()[-1:]})")
    if json_path:
        write_json(json_path, rows)
    return 0


# ----------------------------------------------------------------- engine="torch"

QWEN3_8B = {"hidden": 4096, "intermediate": 12288, "layers": 36, "heads": 32, "kv_heads": 8, "head_dim": 128,
            "vocab": 151936}


def qwen3_shapes(size_mib: int) -> dict[str, tuple[int, ...]]:
    """A Qwen3 checkpoint's tensor names and shapes, of about ``size_mib`` MiB of bf16: Qwen3-8B's
    widths (a 151936-token vocabulary, untied head) with as many layers as fit, at least one;
    smaller models get narrower widths and vocabularies so that several layers fit."""
    c = dict(QWEN3_8B)
    if size_mib < 256:
        c.update(hidden=512, intermediate=1536, heads=8, kv_heads=4, head_dim=64, vocab=8000)
    elif size_mib < 4096:
        c.update(hidden=1024, intermediate=3072, heads=16, kv_heads=8, head_dim=64, vocab=32000)
    h, i, hd = c["hidden"], c["intermediate"], c["head_dim"]
    q, kv = c["heads"] * hd, c["kv_heads"] * hd
    layer: dict[str, tuple[int, ...]] = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
             "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
             "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
             "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i),
             "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    per_layer = sum(math.prod(s) for s in layer.values())
    outer = 2 * c["vocab"] * h + h
    layers = max(1, round((size_mib * (1 << 20) / 2 - outer) / per_layer))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab"], h)}
    for n in range(layers):
        shapes.update({f"model.layers.{n}.{k}": v for k, v in layer.items()})
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (c["vocab"], h)})
    return shapes


def _run_torch(*, size_mib: int, steps: int, density: float, device: str, json_path: str | None) -> int:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ..integrations.engine import EngineClient, sync
    from ..integrations.torch import PatchApplier
    from ..publisher import Publisher
    from .trainer import trainer_daemon

    dev = torch_device(torch, device)
    rows = []
    with trainer_daemon("sparrowd-bench-apply-") as trainer:
        # The trainer's copy lives on the host (the Publisher's fused compare); the engine's on the
        # device. Random bf16 weights of a Qwen3's shapes, drawn on the device (fast on a GPU).
        g = torch.Generator(device=dev).manual_seed(0)
        engine_state = {name: (torch.randn(shape, generator=g, device=dev) * 0.02).to(torch.bfloat16)
                        for name, shape in qwen3_shapes(size_mib).items()}
        state = {name: t.to("cpu", copy=True) for name, t in engine_state.items()}
        total = sum(t.numel() for t in state.values())
        where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{os.cpu_count()} CPUs"
        print(f"sparrowd bench apply: Qwen3-shaped state dict of {total * 2 / (1 << 30):.2f} GiB bf16 "
              f"({total / 1e9:.2f}B parameters, {len(state)} tensors) on {dev} ({where}), torch "
              f"{torch.__version__}, {100 * density:.1f}% of elements moved per step, PatchApplier through the "
              f"engine socket (verify=False, as the vLLM extension runs)", flush=True)
        pub = Publisher(daemon=trainer.url, token_file=trainer.token_file, anchor_every=0)
        pub.start(state, version=0, anchor=False)
        client = EngineClient(trainer.data_dir / "engine.sock", token_file=trainer.token_file, engine="bench",
                              version=0)
        applier = PatchApplier(engine_state, version=0, verify=False)
        gen = torch.Generator().manual_seed(1)
        for step in range(1, steps + 1):
            changed = _step(torch, state, density, gen)
            t0 = time.perf_counter()
            pub.publish(state, version=step)
            t_publish = time.perf_counter() - t0
            t0 = time.perf_counter()
            if step not in client.ready(60, until=step)[1]:
                raise RuntimeError(f"version {step} never became ready at the daemon")
            client.fetch(step)  # waits for the decode the daemon runs ahead: the pause is the engine's
            t_ready = time.perf_counter() - t0
            sync_device(torch, dev)
            t0 = time.perf_counter()
            got = sync(client, applier, step, exact=True)
            sync_device(torch, dev)
            pause = time.perf_counter() - t0
            if got != step:
                raise RuntimeError(f"step {step}: the engine holds version {got}")
            same = all(torch.equal(engine_state[k].view(torch.int16).cpu(), state[k].view(torch.int16))
                       for k in state)
            if not same:
                raise RuntimeError(f"step {step}: the engine's weights differ from the trainer's")
            s = applier.last
            assert s is not None  # the engine holds this step: the applier has applied it
            rows.append({"step": step, "elements_changed": changed, "publish_seconds": t_publish,
                         "decoded_seconds": t_ready, "update_seconds": pause, "scatter_seconds": s.scatter_seconds,
                         "elements": s.elements})
            print(f"   step {step}: update pause {pause:.3f} s (scatter {s.scatter_seconds:.3f} s of {s.elements} "
                  f"elements in {s.tensors} tensors); publish {t_publish:.2f} s, then decoded for the engine "
                  f"{t_ready:.2f} s later; weights identical to the trainer's", flush=True)
        client.close()
        pub.close()
        # The reloads, in the same process: every tensor copied in from the host, bare and from the
        # checkpoint file (mapped, in the page cache), as a full broadcast's receiver must.
        floor = _reload_seconds(torch, dev, engine_state, lambda: state.items())
        ckpt = trainer.root / "model.safetensors"
        save_file(state, str(ckpt))

        def from_file():
            with safe_open(str(ckpt), "pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)

        reload = _reload_seconds(torch, dev, engine_state, from_file)
    pause = max(r["update_seconds"] for r in rows)
    print(f"\n   reload of every tensor: {reload:.3f} s from the safetensors file (page cache), {floor:.3f} s "
          f"copying from host memory (a reload's floor)")
    print(f"   update pause (worst step) {pause:.3f} s; the reload takes {reload / pause:.1f}x that, the floor "
          f"{floor / pause:.1f}x")
    if json_path:
        write_json(json_path, {"engine": "torch", "device": str(dev), "model_bytes": 2 * total, "steps": rows,
                               "reload_seconds": reload, "reload_floor_seconds": floor})
    return 0


def _reload_seconds(torch, dev, params: dict, tensors) -> float:
    """Best of two loads of every tensor into ``params`` (``copy_``, vLLM's default weight loader)."""
    best = float("inf")
    for _ in range(2):
        sync_device(torch, dev)
        t0 = time.perf_counter()
        with torch.no_grad():
            for name, t in tensors():
                params[name].copy_(t)
        sync_device(torch, dev)
        best = min(best, time.perf_counter() - t0)
    return best
