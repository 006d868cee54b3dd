"""The commit record's own check (checkpoint.json, its sha256 verified by the reader):
every field the reader, `initialize(resume=...)` and `offload checkpoint` use has the
type and range a save writes (`_record` in training_checkpoint.py), or the record is
damage, named by its field."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ..config import HYPER_NAMES
from ..trace.analysis import short_repr
from .checkpoint_files import CheckpointCorruptError
from .checkpoint_layout import KINDS, TORCH_DTYPES

_KINDS = frozenset(KINDS)

__all__ = ["check_record"]


_ABSENT = object()  # a field the commit record lacks
_INT_MAX = 2**63 - 1  # counts, steps and element numbers beyond this come from no save


def _count(v: Any, lo: int = 0) -> bool:
    """Whether `v` is an integer (not a bool) in [lo, 2**63)."""
    return type(v) is int and lo <= v <= _INT_MAX


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _dict_of(v: Any, ok: Callable[[Any], bool]) -> bool:
    return isinstance(v, dict) and all(ok(x) for x in v.values())


def _list_of(v: Any, ok: Callable[[Any], bool]) -> bool:
    return isinstance(v, list) and all(ok(x) for x in v)


def _tensor_entry(t: Any) -> bool:
    """Whether `t` is a commit record's entry of one tensor, as `_record` writes it."""
    return (isinstance(t, dict) and _list_of(t.get("shape"), _count)
            and _dict_of(t.get("kinds"), lambda d: isinstance(d, str) and d in TORCH_DTYPES)
            and "param" in t["kinds"] and set(t["kinds"]) <= _KINDS
            and _list_of(t.get("aliases"), lambda a: isinstance(a, str))
            and isinstance(t.get("requires_grad"), bool) and _count(t.get("group")))


def _hyper_ok(g: Any) -> bool:
    return isinstance(g, dict) and all(
        (_list_of(g[k], _number) and len(g[k]) == 2) if k == "betas" else _number(g[k])
        for k in HYPER_NAMES if k in g) and (
        "params" not in g or _list_of(g["params"], lambda n: isinstance(n, str)))


def _rank_entry(r: Any, gids: list[str]) -> bool:
    """Whether `r` is a commit record's entry of one rank, with a range per group."""
    return (isinstance(r, dict) and _count(r.get("rank"))
            and _dict_of(r.get("steps"), _count)
            and all(k.isdecimal() for k in r["steps"])
            and _dict_of(r.get("param_steps", {}), _count)
            and _dict_of(r.get("writes"), lambda w: _list_of(w, _count) and len(w) == 2)
            and all(g in r["writes"] for g in gids))


def check_record(rec: dict[str, Any], where: Path) -> None:
    """CheckpointCorruptError naming `where` and the first field of the commit record
    (its sha256 verified) whose type or range is not what a save writes (`_record` in
    training_checkpoint.py): the reader, `initialize(resume=...)` and `offload
    checkpoint` use these fields as they are, and would fail on them with a raw
    TypeError or KeyError, or loop over a world of 10**12 ranks."""
    def damaged(what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"checkpoint file {where}: damaged record: {what}; the "
                                      "checkpoint is damaged: resume from another")

    def need(field: str, ok: Callable[[Any], bool], expected: str, each: str = "",
             default: Any = _ABSENT, empty: bool = True) -> None:
        """`rec[field]` passes `ok`; `each` ("list", "JSON object"): `rec[field]` is one (not
        empty unless `empty`) and its every entry passes `ok`."""
        value = rec.get(field, default)
        whole = expected if not each else (
            f"{'a' if empty else 'a non-empty'} {each}, each entry {expected}")
        if value is _ABSENT:
            raise damaged(f"{field} is missing, expected {whole}")
        if not each:
            if not ok(value):
                raise damaged(f"{field} is {short_repr(value, 60)}, expected {expected}")
            return
        if not isinstance(value, list if each == "list" else dict) or not (value or empty):
            raise damaged(f"{field} is {short_repr(value, 60)}, expected {whole}")
        keyed = value.items() if isinstance(value, dict) else enumerate(value)
        bad = next(((k, v) for k, v in keyed if not ok(v)), None)
        if bad is not None:
            raise damaged(f"{field}[{bad[0]!r}] is {short_repr(bad[1], 60)}, expected {expected}")
    for key in ("global_step", "micro_step", "good_steps"):
        need(key, _count, "an integer >= 0")
    need("world", lambda v: _count(v, 1), "a positive integer")
    need("dtype", lambda v: v in ("fp32", "bf16", "fp16"), "'fp32', 'bf16' or 'fp16'")
    need("loss_scale", _number, "a number")
    need("config", lambda v: isinstance(v, dict) and isinstance(v.get("engine"), dict) and all(
        k in v["engine"] for k in ("params", "grads", "optimizer")),
        "the engine's configuration (engine.params, grads, optimizer)")
    need("param_groups", _hyper_ok, "an optimizer group (numbers lr, betas, eps, "
         "weight_decay; params a list of names)", each="list", empty=False)
    need("groups", lambda g: isinstance(g, dict) and _count(g.get("gid"))
         and _count(g.get("numel")), "a group with integers gid and numel", each="list")
    need("tensors", _tensor_entry, "a tensor with shape, kinds (param and others: float32, "
         "bfloat16 or float16), aliases, requires_grad and group", each="JSON object")
    gids = [str(g["gid"]) for g in rec["groups"]]
    need("ranks", lambda r: _rank_entry(r, gids), "a rank with rank, steps and a range per "
         "group (writes)", each="list")
    ranks = sorted(r["rank"] for r in rec["ranks"])
    if len(ranks) != rec["world"] or ranks != list(range(len(ranks))):
        raise damaged(f"written by {rec['world']} ranks but holds the records of ranks "
                      f"{short_repr(ranks, 60)}")
    need("version", lambda v: isinstance(v, str), "the writer's version")
    need("extra", lambda v: isinstance(v, dict), "an object")
    need("lr_scheduler", lambda v: v is None or isinstance(v, dict), "null or an object",
         default=None)
    need("buffers_sha256", lambda v: v is None or isinstance(v, str), "null or a sha256",
         default=None)
