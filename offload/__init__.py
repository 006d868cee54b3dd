"""offload: train models whose training state is far larger than accelerator
memory, by keeping every ZeRO-3 partition in GPU memory, host memory or NVMe
and moving it there before it is needed.

    engine = offload.initialize(model, config)
    loss = engine(batch); engine.backward(loss); engine.step()
"""

from .config import ConfigError, OffloadConfig, load_config
from .engine import (CheckpointCorruptError, CheckpointError, OffloadEngine, StepFailedError,
                     initialize)

__version__ = "0.1.0"

__all__ = ["CheckpointCorruptError", "CheckpointError", "ConfigError", "OffloadConfig",
           "OffloadEngine", "StepFailedError", "initialize", "load_config", "__version__"]
