"""vLLM's way into sparrowd: the ``vllm.general_plugins`` entry point that registers the
``sparrowd`` weight-transfer backend.

    vllm serve MODEL --weight-transfer-config '{"backend": "sparrowd"}'

vLLM calls ``register`` in every process it starts (the API server, the engine
core, each worker), whether or not the backend is used. So it imports no part
of sparrowd that needs torch and changes nothing for a vLLM that does not
select the backend: the engines are registered by module path (vLLM imports
them only when the backend is created), and on the CPU backend the one change
the backend needs, keeping linear layers on plain ``F.linear`` over their
parameters instead of a private packed copy (so that in-place writes take
effect), is made at model load only when the model being loaded is configured
with ``backend: sparrowd``.

A model loaded from a sparrowd model folder (``DATA/current``, or one
``sparrowd checkout`` wrote) is read under the folder's shared lock, so the
daemon's in-place update of that folder waits until the weights are in; the
version the folder held then is what the backend's workers start from.
"""

from __future__ import annotations

__all__ = ["BACKEND", "register", "register_engines", "keep_plain_cpu_weights", "hold_folder_while_loading",
           "loaded_version"]

BACKEND = "sparrowd"
_MODULE = "sparrowd.integrations.vllm_backend"


def register() -> None:
    """The entry point: the engines, and the CPU dispatch for models that select the backend."""
    register_engines()
    keep_plain_cpu_weights(when=selected)
    hold_folder_while_loading()


_LOADED: dict[str, int] = {}  # model folder -> the sparrowd version its weights were loaded at (this process)


def loaded_version(folder) -> int | None:
    """The version of the sparrowd model folder this process loaded ``folder``'s weights at."""
    import os

    return _LOADED.get(os.path.realpath(folder)) if folder else None


def hold_folder_while_loading() -> None:
    """Wrap vLLM's default loader: weights of a sparrowd model folder are read under its shared
    lock (``sparrowd.current.reading``), and the folder's version is recorded. Installed once."""
    try:
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    except ImportError:  # pragma: no cover - not inside vLLM, or a vLLM without this loader
        return
    original = DefaultModelLoader.load_weights
    if getattr(original, "sparrowd_wrapped", False):
        return

    def load_weights(self, model, model_config):
        import os

        from sparrowd.current import reading

        folder = getattr(model_config, "model", None)
        if not folder or not os.path.isdir(folder):
            return original(self, model, model_config)
        with reading(folder) as version:
            out = original(self, model, model_config)
            if version is not None:
                _LOADED[os.path.realpath(folder)] = version
            return out

    setattr(load_weights, "sparrowd_wrapped", True)  # a mark on the function object, which mypy does not model
    DefaultModelLoader.load_weights = load_weights


def register_engines() -> None:
    """Register the worker-side and trainer-side engines (safe to call more than once). vLLM's
    trainer process loads no plugins: importing ``sparrowd.integrations.vllm_backend`` (for
    ``SparrowTrainerInitInfo``) calls this too."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, cls in ((WeightTransferEngineFactory, "SparrowWeightTransferEngine"),
                         (WeightTransferTrainerFactory, "SparrowTrainerWeightTransferEngine")):
        try:
            factory.register_engine(BACKEND, _MODULE, cls)
        except ValueError:  # already registered in this process
            pass


def selected() -> bool:
    """Whether the vLLM config being built or loaded selects the sparrowd backend."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    transfer = getattr(config, "weight_transfer_config", None)
    return transfer is not None and transfer.backend == BACKEND


def keep_plain_cpu_weights(when=None) -> None:
    """On vLLM's CPU backend, keep linear layers on ``F.linear`` over their own parameters for
    models loaded while ``when()`` holds (always when None); other models keep vLLM's packed
    kernels. A no-op off the CPU backend and outside vLLM. Installed once per process."""
    try:
        from vllm.platforms import current_platform
    except ImportError:  # pragma: no cover - not inside vLLM
        return
    if not current_platform.is_cpu():
        return
    import torch
    import vllm.model_executor.layers.utils as utils

    current = utils.dispatch_cpu_unquantized_gemm
    original = getattr(current, "sparrowd_original", current)
    conditions = list(getattr(current, "sparrowd_when", ()))
    if when not in conditions:
        conditions.append(when)

    def dispatch(layer, remove_weight: bool) -> None:
        plain = any(c is None or c() for c in conditions)
        if not plain or layer.weight.is_meta or layer.weight.ndim != 2:
            return original(layer, remove_weight)
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    # Marks on the function object (read back above, by getattr), which mypy does not model.
    setattr(dispatch, "sparrowd_original", original)
    setattr(dispatch, "sparrowd_when", tuple(conditions))
    utils.dispatch_cpu_unquantized_gemm = dispatch
