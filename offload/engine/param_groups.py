"""Parameter groups: which optimizer hyper-parameters each parameter trains with, and
how a rank's partition of a group splits into the optimizer's segments.

Groups come from `optim.param_groups` (names or shell-style patterns) or from
`initialize(..., param_groups=[{"params": [...], "lr": ...}, ...])`, as
torch.optim takes them (parameters, or their names or patterns). Optimizer
group 0 holds the optim section's values and every parameter no group names;
group k + 1 is the k-th given group. A parameter named by two groups is
refused, as torch refuses it.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Mapping, Sequence

from torch import nn

from ..config import HYPER_NAMES, ConfigError, OptimConfig, ParamGroupConfig
from .units import Group

__all__ = ["assign_param_groups", "segments_of"]

_HYPER = (*HYPER_NAMES, "lr_lambda")


def _entries(cfg: OptimConfig, given: Sequence[Mapping[str, Any]] | None
             ) -> list[tuple[str, list, dict[str, Any]]]:
    """(where, params, overrides) of each group, from `given` if any, else the config."""
    if given is None:
        return [(f"optim.param_groups[{k}]", list(g.params), g.overrides())
                for k, g in enumerate(cfg.param_groups)]
    if isinstance(given, Mapping) or isinstance(given, (str, bytes)):  # one group, unlisted
        raise ConfigError("param_groups: expected a list of dicts (one per group), got a "
                          f"{type(given).__name__}; give [{{'params': ...}}, ...], as "
                          "torch.optim takes")
    out = []
    for k, g in enumerate(given):
        where = f"param_groups[{k}]"
        if not isinstance(g, Mapping) or "params" not in g:
            raise ConfigError(f"{where}: expected a dict with 'params' (parameters or names) "
                              "and hyper-parameters, as torch.optim takes")
        unknown = set(g) - {"params", *_HYPER}
        if unknown:
            raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; known: params, "
                              f"{', '.join(_HYPER)}")
        params = g["params"]
        params = [params] if isinstance(params, (str, nn.Parameter)) else list(params)
        over = {key: g[key] for key in _HYPER if key in g}
        _check_hyper(where, over)
        if "betas" in over:
            over["betas"] = tuple(over["betas"])
        out.append((where, params, over))
    return out


def _check_hyper(where: str, over: Mapping[str, Any]) -> None:
    """Refuses a given group's hyper-parameters as `optim.param_groups` refuses them in a
    config (type, range, finite; naming `where`), and an `lr_lambda` not callable."""
    if "lr_lambda" in over and not callable(over["lr_lambda"]):
        raise ConfigError(f"{where}.lr_lambda: {over['lr_lambda']!r} is not callable; give a "
                          "function of the step returning the lr multiplier, as LambdaLR takes")
    values = {k: (list(v) if k == "betas" and isinstance(v, (tuple, list)) else v)
              for k, v in over.items() if k != "lr_lambda"}
    try:
        ParamGroupConfig(params=["*"], **values)
    except ConfigError as e:
        raise ConfigError(str(e).replace("optim.param_groups[]", where)) from None


def assign_param_groups(groups: list[Group], cfg: OptimConfig,
                        given: Sequence[Mapping[str, Any]] | None = None
                        ) -> tuple[list[dict[str, Any]], dict[tuple[int, int], int]]:
    """(the optimizer's param_groups overrides, {(gid, slot index): optimizer group}).

    Call before the model's parameters are dropped (slots still hold them).
    Raises ConfigError for a name or pattern that matches no parameter, a
    parameter the model does not train, or a parameter named by two groups."""
    entries = _entries(cfg, given)
    of: dict[tuple[int, int], int] = {}
    by_id = {id(s.param): (g.gid, i) for g in groups for i, s in enumerate(g.slots)}
    for k, (where, params, _over) in enumerate(entries, start=1):
        for item in params:
            if isinstance(item, nn.Parameter):
                if id(item) not in by_id:
                    raise ConfigError(f"{where}: a parameter of shape {tuple(item.shape)} is "
                                      "not one of the model's")
                hits = [by_id[id(item)]]
            elif isinstance(item, str):
                hits = [(g.gid, i) for g in groups for i, s in enumerate(g.slots)
                        if any(fnmatch.fnmatchcase(n, item) for n in s.names)]
                if not hits:
                    raise ConfigError(f"{where}: {item!r} matches no parameter name; names "
                                      f"look like {groups[0].slots[0].fqn!r}" if groups else
                                      f"{where}: the model has no parameters")
            else:
                raise ConfigError(f"{where}: params holds a {type(item).__name__}; give "
                                  "parameters or names")
            for key in hits:
                if of.get(key, k) != k:
                    g, i = key
                    raise ConfigError(f"{where}: parameter {groups[g].slots[i].fqn!r} is "
                                      f"already in {entries[of[key] - 1][0]}; name each "
                                      "parameter in one group only (as torch.optim)")
                of[key] = k
    over = [{}] + [o for _w, _p, o in entries]
    return over, of  # a frozen parameter may be named: it has no optimizer state


def segments_of(group: Group, rank: int, slot_groups: Mapping[tuple[int, int], int]
                ) -> tuple[list[tuple[int, int, int]], list[int | None]]:
    """(segments, slot of each segment or None for padding) of rank `rank`'s partition
    of `group`: its share of each parameter, in order, with the parameter's
    optimizer group ([Note: segments] in offload/optim/optimizer.py)."""
    lo, hi = rank * group.shard, (rank + 1) * group.shard
    segs: list[tuple[int, int, int]] = []
    slots: list[int | None] = []
    at = lo
    for i, s in enumerate(group.slots):
        a, b = max(s.offset, lo), min(s.offset + s.numel, hi)
        if a >= b:
            continue
        if a > at:  # cannot happen (slots are packed), but keep the cover exact
            segs.append((at - lo, a - at, 0))
            slots.append(None)
        segs.append((a - lo, b - a, slot_groups.get((group.gid, i), 0)))
        slots.append(i)
        at = b
    if at < hi:
        segs.append((at - lo, hi - at, 0))
        slots.append(None)
    return segs, slots
