"""Inference engines behind one small interface (see `rlboost.workers.engines.base`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlboost.workers.engines.base import Engine, EngineError, Generated, Sequence

if TYPE_CHECKING:
    from rlboost.config import WorkerSettings


def make_engine(name: str, **options: object) -> Engine:
    """Engines are imported lazily: the emulated one must not pay for importing torch."""
    if name == "emulated":
        from rlboost.workers.engines.emulated import EmulatedEngine

        return EmulatedEngine(**options)  # type: ignore[arg-type]
    if name == "torch":
        from rlboost.workers.engines.torch_engine import TorchEngine

        return TorchEngine(**options)  # type: ignore[arg-type]
    if name == "vllm":
        try:
            from rlboost.workers.engines.vllm_engine import VLLMEngine
        except ModuleNotFoundError as e:
            raise EngineError(f"the vllm engine is not available in this build ({e.name} missing); "
                              "use --engine torch") from None
        return VLLMEngine(**options)  # type: ignore[arg-type]
    raise EngineError(f"unknown engine {name!r}: choose emulated, torch or vllm")


def engine_from_settings(w: WorkerSettings, sleep: bool = False) -> Engine:
    """The one engine factory: a worker process's engine and the reserved side's seeding engine
    are both built here from `[worker]` settings (engine, model_dir and the engine options).
    `sleep`: vLLM sleep mode (checked by the caller, `rlboost.workers.seeding.make_seeding_engine`)."""
    if w.engine == "emulated":
        from rlboost.workers.engines.emulated import LengthModel, TimingModel

        return make_engine("emulated", speed=w.speed, timing=TimingModel().on_gpus(w.gpus).per_emulated_token(
            w.token_scale), lengths=LengthModel().per_emulated_token(w.token_scale))
    if not w.model_dir:
        raise EngineError(f"the {w.engine} engine needs a model directory (--model-dir, worker.model_dir)")
    if w.engine == "torch":
        return make_engine("torch", model_dir=w.model_dir, device=w.device, dtype=w.dtype or "float64",
                           max_model_len=w.max_model_len, prefix_cache_mb=w.prefix_cache_mb)
    options: dict[str, object] = dict(model_dir=w.model_dir, dtype=w.dtype or None, max_model_len=w.max_model_len,
                                      tensor_parallel_size=w.tensor_parallel_size,
                                      gpu_memory_utilization=w.gpu_memory_utilization, enforce_eager=w.enforce_eager)
    if sleep:
        options["enable_sleep_mode"] = True
    return make_engine(w.engine, **options)


__all__ = ["Engine", "EngineError", "Generated", "Sequence", "engine_from_settings", "make_engine"]
