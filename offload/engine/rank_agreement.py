"""What every rank must agree on at `initialize`, settled before any state is placed.

[Note: ranks agree at initialize]
Data-parallel ranks run the same collectives over partitions of the same layout. A
rank given another config or model (a per-host config file, a model built from a
per-rank setting) would otherwise abort inside gloo ("Received data size doesn't
match expected size") with its swap files left behind, or train on silently with
layouts or hyper-parameters that do not match. And a check that refuses on one
rank only (its budgets, its disk) would leave the others waiting in their first
collective. So `initialize` settles four times before any state is placed, each
time one `all_gather_object` over the whole job:

  1. the config, before the tensor-parallel mesh is built from it (every key
     except `PER_RANK_KEYS`), once each rank has loaded it and its model, the
     checkpoint each resumes from (`resume_section`), and the model's buffers
     (`buffer_section`): their names, shapes, dtypes and sharing, not their
     values (rank 0's are broadcast: a buffer on some ranks only left one rank
     waiting in its broadcast and the other in its first forward; one of another
     dtype took rank 0's bytes as its own dtype, one of another shape kept its
     own values);
  2. the model: each parameter's name, shape, trainability and optimizer
     settings, the groups (numel, padding, shard) and units, between the ranks
     of each data-parallel group (tensor-parallel ranks hold different slices),
     together with what each rank places on which disk;
  3. the free space of each rank's swap directories against what every rank
     places on the same file system ([Note: ranks sharing a disk] in
     working_set.py);
  4. the swap files: each rank's directories checked and its files opened and
     locked (another job's lock, a path one rank may not use); a rank that made
     its files removes them when another refused.

A rank that fails while the partitions are placed stops every rank at the same
group, and the job settles once more ([Note: a rank that fails while placing] in
__init__.py).

Each stage first runs this rank's own checks under `refusals()`. Where one
refuses, that rank raises its own error and every other rank a `ConfigError`
(a `RuntimeError` for an error that is not about the config) naming it; where
the values differ, every rank raises the same `ConfigError` naming the first
key, parameter or group that differs and the ranks' values. Values travel as a
digest first; only where digests differ are the descriptions gathered. Once per
`initialize`, so the pickling of `all_gather_object` costs nothing that matters
(with NCCL on this rank's GPU: [Note: a GPU per rank] in offload/store/copy.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import hashlib
import json
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import torch.distributed as dist
from torch import nn

from ..config import ConfigError, OffloadConfig
from ..store.copy import resolve_device
from .units import Group, Unit

__all__ = ["PER_RANK_KEYS", "RankAgreement", "Section", "buffer_section", "config_section",
           "model_sections", "resume_section"]

# Keys that may differ between ranks: where a rank keeps its own state and how it
# moves it (directories, budgets, I/O and NVMe-pipeline tuning, its update kernel),
# never what a collective carries, how a number is computed or what a checkpoint
# holds. store.device may name another device index, not another type. The placement
# (engine.params, grads, optimizer) is not per rank: on a GPU it decides whether an
# fp32 master is kept apart, which a checkpoint's tensor table records for every rank.
PER_RANK_KEYS = ("io.*", "store.*", "optim.kernel", "optim.chunk_elems", "optim.buffers",
                 "optim.buffer_share", "optim.block_elems", "engine.prefetch_depth")

# One comparable thing: (key, ((attribute, compared value, shown value), ...)).
Item = tuple[str, tuple[tuple[str, str, str], ...]]


class Section(NamedTuple):
    """Items compared in order; `subject` and `fix` frame the error that names one."""

    subject: str  # "" for config keys: "<key> differs between ranks"
    items: list[Item]
    fix: str


def attr(name: str, value: Any, shown: str | None = None) -> tuple[str, str, str]:
    """(attribute, the value as compared, as an error shows it)."""
    compared = repr(value)
    return name, compared, compared if shown is None else shown


def config_section(cfg: OffloadConfig) -> Section:
    """Every config key that must be equal on every rank, and store.device's type."""
    items: list[Item] = []
    for section in dataclasses.fields(cfg):
        for name, value in dataclasses.asdict(getattr(cfg, section.name)).items():
            key = f"{section.name}.{name}"
            if not any(fnmatch.fnmatchcase(key, pat) for pat in PER_RANK_KEYS):
                items.append((key, (attr("", value),)))
    try:
        kind = resolve_device(cfg.store.device).type
    except ConfigError:
        kind = cfg.store.device  # refused later, where the store is built
    items.append(("store.device", (attr("", kind, f"{cfg.store.device!r} (a {kind} device)"),)))
    return Section("", items, "give every rank the same config; only "
                   f"{', '.join(PER_RANK_KEYS)} may differ (store.device in its index only)")


def resume_section(record: Mapping[str, Any] | None) -> Section:
    """What this rank resumes from: nothing, or the checkpoint its commit record names
    (by the record's digest: nodes may mount one checkpoint at different paths). A
    rank that resumed another checkpoint, or none, trained its shard from another
    state, silently, or waited in another collective than the others'."""
    if record is None:
        value, shown = None, "no resume"
    else:
        value = hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()
                               ).hexdigest()
        shown = (f"the checkpoint of step {record.get('global_step')} of run "
                 f"{record.get('run')!r} (its commit record {value[:12]})")
    return Section("", [("resume", (attr("", value, shown),))],
                   "give every rank the same checkpoint to resume from (resume=; its path "
                   "may differ between nodes), or none")


def _settings(over: Mapping[str, Any]) -> dict[str, Any]:
    """A parameter's optimizer overrides (its learning-rate schedule is not compared)."""
    return {k: v for k, v in sorted(over.items()) if k != "lr_lambda"}


def model_sections(groups: list[Group], units: list[Unit], hyper: list[dict[str, Any]],
                   slot_groups: Mapping[tuple[int, int], int]) -> list[Section]:
    """The model's parameters, then its partition (groups, units), as compared."""
    params: list[Item] = []
    for g in groups:
        for i, s in enumerate(g.slots):
            over = _settings(hyper[slot_groups.get((g.gid, i), 0)])
            params.append((f"parameter {s.fqn!r}", (
                attr("shape", tuple(s.shape)), attr("requires_grad", g.requires_grad),
                attr("the names", list(s.names)),
                attr("optimizer settings", over, ", ".join(
                    f"{k}={v!r}" for k, v in over.items()) or "the optim section's"))))
    parts: list[Item] = [(f"group {g.gid}", (
        attr("parameters", [s.fqn for s in g.slots]), attr("numel", g.numel),
        attr("padded numel", g.padded), attr("shard", g.shard),
        attr("requires_grad", g.requires_grad))) for g in groups]
    parts += [(f"unit {i}", (attr("module", u.name), attr("groups", list(u.needs))))
              for i, u in enumerate(units)]
    fix = "build the same model on every rank"
    return [Section("the model differs between ranks", params, fix),
            Section("the model's partition differs between ranks", parts, fix)]


def buffer_section(model: nn.Module) -> Section:
    """The model's buffers as every rank must have them where rank 0's values are
    broadcast (`buffers_from_first_rank`), in its order: each name, shape, dtype and
    persistence, and which tensor a buffer several modules hold is. Values may differ."""
    items: list[Item] = []
    first: dict[int, str] = {}  # a buffer several modules hold: its first name
    for prefix, m in model.named_modules():
        for name, b in m._buffers.items():
            if b is None:
                continue
            fqn = f"{prefix}.{name}".lstrip(".")
            held = first.setdefault(id(b), fqn)
            items.append((f"buffer {fqn!r}", (
                attr("shape", tuple(b.shape)), attr("dtype", b.dtype),
                attr("persistent", name not in m._non_persistent_buffers_set),
                attr("a tensor", held, "of its own" if held == fqn else
                      f"shared with {held!r}"))))
    return Section("the model's buffers differ between ranks", items,
                   "build the same model on every rank (a buffer's values may differ: "
                   "every rank takes rank 0's)")


def _digest(sections: Sequence[Section]) -> str:
    h = hashlib.sha256()
    for sec in sections:
        for key, attrs in sec.items:
            h.update(repr((key, [(a, c) for a, c, _ in attrs])).encode())
    return h.hexdigest()


def _difference(sec: Section, a: int, mine: list[Item], b: int, theirs: list[Item]
                ) -> str | None:
    """The first item of `sec` in which rank `a` and rank `b` differ, said as an error."""
    ours, other = dict(mine), dict(theirs)
    keys = [k for k, _ in mine] + [k for k, _ in theirs if k not in ours]
    for key in keys:
        if key not in ours or key not in other:
            has, lacks = (b, a) if key not in ours else (a, b)
            return f"{sec.subject}: {key} is on rank {has} and not on rank {lacks}; {sec.fix}"
        for (attr, ca, sa), (_, cb, sb) in zip(ours[key], other[key]):
            if ca == cb:
                continue
            if not sec.subject:
                return (f"{key} differs between ranks: rank {a} has {sa}, rank {b} has {sb}; "
                        f"{sec.fix}")
            return (f"{sec.subject}: {key} has {attr} {sa} on rank {a} and {sb} on rank {b}; "
                    f"{sec.fix}")
    return None


def first_difference(sec: Section, every: list[list[Item]]) -> str:
    """The first item of `sec` in which a rank differs from rank 0 (`every`: each
    rank's items), said as an error."""
    for b in range(1, len(every)):
        why = _difference(sec, 0, every[0], b, every[b])
        if why is not None:
            return why
    return f"{sec.subject or 'the values'}: the ranks' digests differ; {sec.fix}"


class RankAgreement:
    """Settles what the ranks of the job must agree on at `initialize` ([Note: ranks
    agree at initialize]); with one rank (or no process group) it compares nothing
    and lets every error through where it is raised."""

    def __init__(self) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size() if distributed else 1
        self._refusal: BaseException | None = None

    @contextlib.contextmanager
    def refusals(self) -> Iterator[None]:
        """This rank's own checks: an `Exception` raised inside is kept for the next
        `settle`, which raises it here and names it on every other rank."""
        if self.world == 1:
            yield
            return
        try:
            yield
        except Exception as e:  # every rank hears of it at the next settle
            self._refusal = e

    def settle(self, describe: Callable[[], Sequence[Section]] = tuple, *,
               within: Sequence[Sequence[int]] | None = None, extra: Any = None) -> list[Any]:
        """Every rank calls it at the same point. Raises on every rank where one refused
        (see `refusals`), or where the sections `describe()` returns on two ranks of one
        of the `within` groups (world ranks; default: all) differ; else returns every
        rank's `extra`, by world rank. `describe` is not called on a rank that refused
        (what it describes may not exist there)."""
        if self.world == 1:
            return [extra]
        refused = self._refusal
        sections = list(describe()) if refused is None else []
        mine = None if refused is not None else _digest(sections)
        why = None if refused is None else (isinstance(refused, ConfigError), str(refused))
        reports: list[Any] = [None] * self.world
        dist.all_gather_object(reports, (mine, why, extra))
        groups = [list(range(self.world))] if within is None else [list(g) for g in within]
        if any(len({reports[r][0] for r in g if reports[r][0] is not None}) > 1 for g in groups):
            self._raise_difference(sections, groups, reports)
        if refused is not None:
            raise refused
        for r, (_, why_r, _) in enumerate(reports):
            if why_r is not None:
                config, message = why_r
                raise (ConfigError if config else RuntimeError)(
                    f"initialize: rank {r} refused, so every rank stops (what each made is "
                    f"removed): {message}")
        return [x for _, _, x in reports]

    def _raise_difference(self, sections: list[Section], groups: list[list[int]],
                          reports: list[Any]) -> None:
        """Gathers every rank's sections (every rank is here: they all saw the same
        digests; one that refused sends none) and raises the first difference."""
        full: list[Any] = [None] * self.world
        dist.all_gather_object(full, None if self._refusal is not None else sections)
        for g in groups:
            ranks = [r for r in g if full[r] is not None]
            for b in ranks[1:]:
                a = ranks[0]
                if reports[b][0] == reports[a][0]:
                    continue
                for sec, theirs in zip(full[a], full[b]):
                    why = _difference(sec, a, sec.items, b, theirs.items)
                    if why is not None:
                        raise ConfigError(why)
        raise ConfigError("initialize: the ranks' configs or models differ (their digests "
                          "do not match) where no key could be named; give every rank the "
                          "same config and model")
