"""An LR scheduler the engine steps and checkpoints (`initialize(..., lr_scheduler=)`).

[Note: the engine's scheduler]
A torch or transformers scheduler takes `engine.optimizer` ([Note: what torch
sees] in optim/optimizer.py), and a loop may step it itself. Resuming one by
hand has a trap: `initialize(resume=...)` restores each group's lr before the
loop can make its scheduler, and making one writes its first rate (e.g. 0 at
the start of a warm-up) over it; `scheduler.load_state_dict` then restores
the scheduler but writes no rate, so the first step after a resume trains at
the wrong one. (torch's loops avoid it by loading the optimizer's state after
making the scheduler.) So `initialize` takes a factory, as DeepSpeed does:

- it makes the scheduler once the optimizer's values are final (after a
  resume restored them); `engine.lr_scheduler` is it;
- `engine.step()` steps it after each step that commits (not after a skipped
  one: fp16 overflow, a non-finite norm);
- `save_checkpoint` saves its `state_dict()` in the commit record (it must be
  JSON-serialisable, as `extra`), and a resume loads it, then puts back the
  values the checkpoint saved (lr, and betas: OneCycleLR's and CyclicLR's
  momentum writes them too). JSON turns int keys into strings and tuples into
  lists: the load gives them back their types as a freshly made scheduler's
  state has them (MultiStepLR's milestones are a Counter of ints, and with
  string keys it would never decay again).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from typing import Any, Callable

import torch

from ..config import HYPER_NAMES, ConfigError

log = logging.getLogger(__name__)

__all__ = ["make_scheduler", "scheduler_state", "step_scheduler", "warn_schedule_dropped"]


def make_scheduler(factory: Callable[[torch.optim.Optimizer], Any],
                   optimizer: torch.optim.Optimizer, saved: dict | None,
                   resumed: bool) -> Any:
    """`factory(optimizer)`, checked, with `saved` (its state in the checkpoint resumed
    from) loaded. Raises ConfigError for something the engine cannot step."""
    if not callable(factory):
        raise ConfigError(f"initialize: lr_scheduler must be a function of the optimizer "
                          f"(e.g. lambda opt: get_cosine_schedule_with_warmup(opt, 100, "
                          f"1000)), not {type(factory).__name__}")
    # as resumed: making the scheduler writes its first values over them
    resumed_values = _group_values(optimizer.param_groups)
    try:
        scheduler = factory(optimizer)
    except ValueError as e:  # torch's "Expected 3 lr_lambdas, but got 2", max_lr's length
        if len(optimizer.param_groups) > 1 and ("lr_lambdas" in str(e)
                                                or "param_groups" in str(e)):
            e.add_note(f"offload: engine.optimizer has {len(optimizer.param_groups)} "
                       "param_groups: param_groups[0] is the default group (the parameters "
                       "no given group names, with the optim section's values) and the "
                       "k-th group given is param_groups[k + 1]; a per-group list of the "
                       "scheduler needs a value for each (docs/engine.md)")
        raise
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ConfigError("initialize: lr_scheduler ReduceLROnPlateau needs a metric at each "
                          "step, which engine.step() does not have; make it yourself from "
                          "engine.optimizer and call its step(metric)")
    missing = [m for m in ("step", "state_dict", "load_state_dict")
               if not callable(getattr(scheduler, m, None))]
    if missing or getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ConfigError(f"initialize: lr_scheduler(optimizer) returned "
                          f"{type(scheduler).__name__}, "
                          + (f"which lacks {', '.join(missing)}" if missing else
                             "a scheduler of another optimizer")
                          + "; return a torch.optim.lr_scheduler scheduler of the optimizer "
                          "it is given")
    if saved is not None:
        scheduler.load_state_dict(_as_saved(saved, scheduler.state_dict()))
        _put_back(optimizer.param_groups, resumed_values)
    elif resumed:
        log.warning("the checkpoint resumed from holds no lr_scheduler state (it was saved "
                    "without one): the scheduler starts from its beginning")
    return scheduler


def warn_schedule_dropped(record: dict[str, Any], optimizer: torch.optim.Optimizer,
                          factory_given: bool, path: Any) -> None:
    """Warns where the checkpoint at `path` (commit record `record`) was saved under a
    schedule this resume was not given: the learning rate would stay at its resumed
    value with no word (the opposite case, a factory and no saved state, warns in
    `make_scheduler`)."""
    if record.get("lr_scheduler") is not None and not factory_given:
        log.warning("checkpoint %s was saved with an lr_scheduler, and this initialize was "
                    "given none: the learning rate stays at its resumed value, "
                    "unscheduled; pass lr_scheduler= as when saving to continue the "
                    "schedule", path)
    if (any(g.get("lr_lambda") for g in record.get("param_groups", []))
            and all(g.get("lr_lambda") is None for g in optimizer.param_groups)):
        log.warning("checkpoint %s was saved with an lr_lambda schedule, and this initialize "
                    "was given none: the learning rate stays at its resumed value, "
                    "unscheduled; pass lr_lambda= (or the param_groups' lr_lambda) as when "
                    "saving to continue the schedule", path)


def _as_saved(value: Any, like: Any) -> Any:
    """`value` (a scheduler's state read back from JSON) with the types JSON lost put
    back as `like` (a fresh scheduler's state) has them: non-string dict keys, a
    Counter, tuples, 0-d tensors (the rates of a group whose lr is a tensor:
    `_state_number`). A key `like` lacks (the factory of the resume made other
    milestones) is an int again where `like`'s keys are ints."""
    if isinstance(like, torch.Tensor) and like.dim() == 0 and isinstance(value, (int, float)):
        return torch.tensor(value, dtype=like.dtype, device=like.device)
    if isinstance(value, dict) and isinstance(like, dict):
        keys = {str(k): k for k in like}
        ints = isinstance(like, Counter) or (bool(like) and all(
            isinstance(k, int) for k in like))

        def key(k: Any) -> Any:
            if k in keys:
                return keys[k]
            if ints and isinstance(k, str) and k.lstrip("-").isdigit():
                return int(k)
            return k
        out = {key(k): _as_saved(v, like.get(key(k))) for k, v in value.items()}
        return Counter(out) if isinstance(like, Counter) else out
    if isinstance(value, list) and isinstance(like, (list, tuple)):
        out = [_as_saved(v, like[i] if i < len(like) else None) for i, v in enumerate(value)]
        return tuple(out) if isinstance(like, tuple) else out
    return value


_NOT_A_SCALAR = object()


def to_json_scalar(v: Any, otherwise: Any = _NOT_A_SCALAR) -> Any:
    """`v` as a Python number where it is a numpy scalar (what a schedule's arithmetic on
    np.float32 gives, which torch takes as an lr and JSON does not), else `otherwise`
    (json.dumps' `default`: TypeError). A tensor is not one: an object holding one
    would resume holding a number."""
    import numbers
    if isinstance(v, numbers.Number) and not isinstance(v, (bool, int, float, complex)):
        return int(v) if isinstance(v, numbers.Integral) else float(v)
    if otherwise is _NOT_A_SCALAR:
        raise TypeError(f"Object of type {type(v).__name__} is not JSON serializable")
    return otherwise


def step_scheduler(scheduler: Any, number: int) -> None:
    """Steps the engine's scheduler after step `number` committed. One that raises (a
    lambda's error) left the step applied, the scheduler half stepped (LambdaLR counts
    the step before it computes the rate) and the error as raw as if the step had
    failed, whose fix, running the step's micro-batches again, would apply them twice.
    The scheduler and its optimizer's values are put back as before its step, and
    the error says what was applied and what to do."""
    groups = scheduler.optimizer.param_groups
    # as torch's schedulers keep it: a step rebinds their attributes (last_epoch, the
    # last rates), so a shallow copy is enough and costs nothing per step (a lambda
    # object holding a table, or a lock, copied deep at every step cost or failed)
    state = {k: list(v) if type(v) is list else v for k, v in scheduler.state_dict().items()}
    values = _group_values(groups)
    try:
        scheduler.step()
    except Exception as e:
        scheduler.load_state_dict(state)
        _put_back(groups, values)
        raise RuntimeError(
            f"step {number} was applied (the weights were updated; engine.global_step is "
            f"{number}), then the lr_scheduler's step() raised {type(e).__name__}: {e}. "
            "The scheduler is as it was before: fix the cause, call "
            "engine.lr_scheduler.step() once, and go on with the next batch (running "
            "this step's micro-batches again would apply them twice)") from e


def _group_values(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each group's values a scheduler may write (a tensor lr copied: it writes it in
    place)."""
    return [{k: g[k].clone() if isinstance(g[k], torch.Tensor) else g[k]
             for k in HYPER_NAMES if k in g} for g in groups]


def _put_back(groups: list[dict[str, Any]], values: list[dict[str, Any]]) -> None:
    """`_group_values`' values into `groups` again, a tensor lr in place."""
    for g, saved in zip(groups, values):
        for k, v in saved.items():
            if isinstance(v, torch.Tensor) and isinstance(g[k], torch.Tensor):
                g[k].copy_(v)
            else:
                g[k] = v


def scheduler_state(scheduler: Any) -> dict | None:
    """The scheduler's state as the commit record holds it; CheckpointError-worthy
    ValueError where it is not JSON-serialisable."""
    if scheduler is None:
        return None
    state = scheduler.state_dict()
    try:
        return json.loads(json.dumps(state, default=_state_number))
    except (TypeError, ValueError) as e:
        raise ValueError(f"the lr_scheduler's state_dict() must be JSON-serialisable to be "
                         f"saved in the checkpoint ({type(scheduler).__name__}: {e}); a "
                         "LambdaLR's lambdas should be functions, not objects holding "
                         "tensors") from e


def _state_number(v: Any) -> Any:
    """A scheduler's rate as JSON holds it: a 0-d tensor (torch copies a group's tensor
    lr into `base_lrs` and `_last_lr`) as its value at the save, made a tensor again at
    the resume (`_as_saved`); a numpy scalar as a Python number."""
    if isinstance(v, torch.Tensor) and v.dim() == 0 and not v.is_complex():
        return v.item()
    return to_json_scalar(v)
