"""offload: train models whose training state is far larger than accelerator
memory, by keeping every ZeRO-3 partition in GPU memory, host memory or NVMe
and moving it there before it is needed.

    engine = offload.initialize(model, config)
    loss = engine(batch); engine.backward(loss); engine.step()
"""

from .config import ConfigError, OffloadConfig, load_config

__version__ = "0.1.0"

_ENGINE = ("CheckpointCorruptError", "CheckpointError", "OffloadEngine", "StepFailedError",
           "initialize")


def __getattr__(name: str):
    """The engine's names, imported on first use: `offload` itself, and the CLI with
    it, start without importing torch (`offload --help`, `offload view` and every
    refusal of a bad flag answer in a fraction of a second)."""
    if name in _ENGINE:
        from . import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'offload' has no attribute {name!r}")

__all__ = ["CheckpointCorruptError", "CheckpointError", "ConfigError", "OffloadConfig",
           "OffloadEngine", "StepFailedError", "initialize", "load_config", "__version__"]
