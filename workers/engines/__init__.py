"""Inference engines behind one small interface (see `workers.engines.base`)."""

from __future__ import annotations

from workers.engines.base import Engine, EngineError, Generated, Sequence


def make_engine(name: str, **options: object) -> Engine:
    """Engines are imported lazily: the emulated one must not pay for importing torch."""
    if name == "emulated":
        from workers.engines.emulated import EmulatedEngine

        return EmulatedEngine(**options)  # type: ignore[arg-type]
    if name == "torch":
        from workers.engines.torch_engine import TorchEngine

        return TorchEngine(**options)  # type: ignore[arg-type]
    if name == "vllm":
        try:
            from workers.engines.vllm_engine import VLLMEngine
        except ModuleNotFoundError as e:
            raise EngineError(f"the vllm engine is not available in this build ({e.name} missing); "
                              "use --engine torch") from None
        return VLLMEngine(**options)  # type: ignore[arg-type]
    raise EngineError(f"unknown engine {name!r}: choose emulated, torch or vllm")


__all__ = ["Engine", "EngineError", "Generated", "Sequence", "make_engine"]
