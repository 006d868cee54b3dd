"""[Note: engine.cfg changed between calls] `engine.cfg` is the configuration the engine
was built for: its working set, whether a group's update runs beside backward (no
clipping, no accumulation), its files and budgets all follow from its keys. One key is
read at each call, documented so: `engine.keep_checkpoints`, at each save. Any other
key changed on `engine.cfg` after `initialize` was ignored in part: an
`optim.max_grad_norm` turned on was reported in `engine.grad_norm` but clipped
nothing, turned off it failed every later step with an internal message; a
`grad_accum_steps` raised after the window's updates had run failed the next backward.
`FixedConfig.check` runs where the engine reads its configuration (backward, step,
save): it checks every key again (a keep_checkpoints of -1 deleted every older
checkpoint; a max_grad_norm of NaN was taken) and refuses a changed one, naming it,
before anything is changed."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Iterator

from ..config import HYPER_NAMES, ConfigError, OffloadConfig

LIVE = frozenset({"engine.keep_checkpoints"})  # read at each save, documented so

_RESUME = ("set it back, or pass the new value to offload.initialize (save a checkpoint "
           "and resume from it to carry the training on)")
_VALUES = ("set it back, and change the value in engine.optimizer.param_groups, as in torch "
           "(a resume restores the checkpoint's values, whatever the config says)")
_FIXES = {  # keys a resume does not take from the config
    **{f"optim.{k}": _VALUES for k in HYPER_NAMES},
    "optim.param_groups": "set it back, and change the groups' values in "
                          "engine.optimizer.param_groups[k] (a resume keeps the groups of "
                          "the save)",
    "engine.dtype": "set it back: a checkpoint resumes only in the dtype it was saved in; "
                    "for another, load engine.state_dict() into a fresh model and "
                    "initialize that",
}


def _keys(cfg: OffloadConfig) -> Iterator[tuple[str, Any]]:
    for s in dataclasses.fields(cfg):
        section = getattr(cfg, s.name)
        for k in dataclasses.fields(section):
            if f"{s.name}.{k.name}" not in LIVE:
                yield f"{s.name}.{k.name}", getattr(section, k.name)


class FixedConfig:
    """The keys `cfg` held when the engine was built; `check()` refuses a change."""

    def __init__(self, cfg: OffloadConfig) -> None:
        self._cfg, self._given = cfg, {k: copy.deepcopy(v) for k, v in _keys(cfg)}

    def check(self) -> None:
        self._cfg.validate()
        for key, now in _keys(self._cfg):
            given = self._given[key]
            if now != given:
                raise ConfigError(
                    f"engine.cfg: {key} was changed from {given!r} to {now!r} after "
                    f"initialize; the engine was set up for the value it was given and does "
                    f"not follow a change: {_FIXES.get(key, _RESUME)}")
