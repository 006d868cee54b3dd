"""offload: train models whose training state is far larger than accelerator
memory, by keeping every ZeRO-3 partition in GPU memory, host memory or NVMe
and moving it there before it is needed."""

from .config import ConfigError, IoConfig, OffloadConfig, load_config

__version__ = "0.1.0"

__all__ = ["ConfigError", "IoConfig", "OffloadConfig", "load_config", "__version__"]
