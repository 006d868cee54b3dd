"""Full weights on request: one group's full tensor read from, or written to, every rank's
partitions (as FSDP's `summon_full_params`).

[Note: full weights]
A group's full weights are read from the fp32 master where the optimizer keeps
one (trainable groups in bf16/fp16), else from the parameter partition (fp32
training, where that partition is the master; frozen groups), all-gathered
over the ranks (every rank calls, in the same order) into one padded fp32
flat buffer. Each parameter is a view of it (a copy in its original dtype
where that is not fp32). Written back, the rank's slice goes to the master
and the parameter partition, of every group written or of none ([Note: new
weights all or nothing] below). Only between steps: a step in progress reads
and writes the same state.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterable, Iterator, NamedTuple

import torch
from torch import nn

from ..store import Tier
from .rank_order import tensors_crc32
from .step import StagedParams
from .units import Group

if TYPE_CHECKING:
    from .engine import OffloadEngine

__all__ = ["NewWeights", "groups_of", "new_weights", "read_group", "refuse_apart", "slot_tensors",
           "summoned"]


def read_group(engine: "OffloadEngine", g: Group) -> torch.Tensor:
    """The group's full padded fp32 flat buffer, on the CPU ([Note: full weights]).
    Collective: every rank calls it for the same groups in the same order."""
    engine._rank_order.check_read(g.gid)  # [Note: ranks run the same units] in rank_order.py
    shard = torch.empty(g.shard, dtype=torch.float32)
    # [Note: a read that fails on one rank] (a world of 1 raises its error as it is)
    with engine.comm.together(f"reading group {g.gid}'s full weights"):
        _read_shard(engine, g, shard)
    if engine.comm.world == 1:
        return shard
    # NCCL gathers device tensors; gloo host ones
    where = engine.device if engine.comm.backend == "nccl" else torch.device("cpu")
    full = torch.empty(g.padded, dtype=torch.float32, device=where)
    engine.comm.all_gather(full, shard.to(where))
    return full.cpu()


def _read_shard(engine: "OffloadEngine", g: Group, shard: torch.Tensor) -> torch.Tensor:
    """This rank's fp32 shard of group `g`, read into `shard` ([Note: full weights])."""
    opt = engine.optimizer
    if g.requires_grad and opt.has_master(g.gid):
        return opt.read_master(g.gid, shard)
    return shard.copy_(engine.store.fetch(("p", g.gid), to=Tier.HOST).wait())


def slot_tensors(engine: "OffloadEngine", g: Group, full: torch.Tensor) -> list[torch.Tensor]:
    """Each parameter of the group from its full buffer, in its original dtype: a view
    of `full` for fp32 parameters, a copy otherwise."""
    out = []
    for slot, dtype in zip(g.slots, engine.registered.dtypes[g.gid]):
        view = full[slot.offset:slot.offset + slot.numel].view(slot.shape)
        out.append(view if dtype == torch.float32 else view.to(dtype))
    return out


class NewWeights:
    """New full weights for several groups, written all or nothing.

    [Note: new weights all or nothing]
    `load_state_dict` and a writable `full_weights` block write new weights into
    many groups. Where any of it goes through the disk (parameters homed on
    NVMe, or optimizer state there), a failure half way (an I/O error, a
    corrupted chunk read for a later group) left the groups before it with the
    new weights and those after it with the old. There each group's new
    parameter partition is staged as a record of its own (`StagedParams`, as a
    step stages its updates: the budgets that hold a step hold it), its new fp32
    master on NVMe written to fresh extents (`stage_master`), and a master in
    host memory written in place with a copy of the old one kept; `commit`
    switches the staged ones in, with no I/O, once every group is written, and
    a failure before that frees them and puts the host masters back: every
    group is as it was. Where everything is in memory, nothing after the
    callers' checks can fail, and each group is written in place at once.

    [Note: a read that fails on one rank]
    With several ranks each writes its own shards, between collectives (each
    group's read is an all-gather). A rank whose read failed (a corrupted chunk,
    a dead disk) raised there, leaving the others in that group's all-gather
    until the process group's timeout; one whose write of the last group, or whose
    wait for its staged writes, failed after the last collective raised alone while
    the others committed: the ranks held shards of two models, with no error on
    the others. So `read_group` agrees on each read's outcome before its
    all-gather (every rank raises there: the failing one its own error, the
    others RankFailedError), a failure in `add` is kept and the rank goes on to
    the next group's collectives writing nothing more, and `commit` agrees on
    every rank's outcome before anything switches: every rank discards, or every
    rank commits."""

    def __init__(self, engine: "OffloadEngine", what: str) -> None:
        self.engine = engine
        self.what = what
        self.failure: Exception | None = None  # kept for `commit` (several ranks)
        opt = engine.optimizer
        self.staging = engine._param_tier is Tier.NVME or any(
            opt.partition(g.gid).tier is Tier.NVME for g in engine.groups
            if g.requires_grad and opt.has_master(g.gid))
        self._staged = StagedParams(engine.store, engine._param_tier)
        self._masters: list = []  # stage_master tokens
        self._host_backups: list[tuple[Group, torch.Tensor]] = []  # masters before

    def add(self, g: Group, full: torch.Tensor) -> None:
        """Writes this rank's slice of the group's full padded fp32 buffer to its master
        and parameter partition ([Note: full weights]); staged until `commit` where
        `staging`."""
        if full.numel() != g.padded:
            raise ValueError(f"group {g.gid}: full buffer has {full.numel()} elements, "
                             f"expected {g.padded}")
        if self.failure is None:  # [Note: a read that fails on one rank]
            try:
                self._add(g, full)
            except Exception as e:
                if self.engine.comm.world == 1:
                    raise
                self.failure = e

    def _add(self, g: Group, full: torch.Tensor) -> None:
        eng, opt = self.engine, self.engine.optimizer
        shard = full[eng.comm.rank * g.shard:(eng.comm.rank + 1) * g.shard]
        if not self.staging:
            _write_param(eng, g, shard, master=True)
            return
        if g.requires_grad and opt.has_master(g.gid):
            if opt.partition(g.gid).tier is Tier.NVME:
                self._masters.append(opt.stage_master(g.gid, shard.contiguous()))
            else:
                old = opt.read_master(g.gid, torch.empty(g.shard, dtype=torch.float32))
                _write_master(eng, g, shard)
                self._host_backups.append((g, old))
        with self._staged.new(g.gid, g.shard, eng.dtype) as t:
            t.copy_(shard.to(t.dtype))

    def commit(self) -> None:
        """Switches every staged group in; on a failure first, on this rank or another
        ([Note: a read that fails on one rank]), `discard`s them and raises."""
        try:
            with self.engine.comm.together(self.what):  # every rank's outcome, first
                if self.failure is not None:
                    raise self.failure
                self._staged.ready()
        except BaseException:
            self.discard()
            raise
        opt = self.engine.optimizer
        for token in self._masters:  # from here on no I/O: nothing can fail
            opt.install_master(token)
        self._masters, self._host_backups = [], []
        # [Note: a graph of older weights] in engine.py
        self.engine.weights_changed(self._staged.switch())

    def discard(self) -> None:
        """Leaves every group as it was before `add`."""
        self._staged.discard()
        for token in self._masters:
            self.engine.optimizer.drop_master(token)
        for g, old in self._host_backups:
            _write_master(self.engine, g, old)
        self._masters, self._host_backups = [], []


@contextlib.contextmanager
def new_weights(engine: "OffloadEngine", what: str) -> Iterator[NewWeights]:
    """`with new_weights(engine, what) as w: w.add(g, full) ...`: the groups added are
    written all or nothing, on every rank ([Note: new weights all or nothing]); a
    block that raises leaves every group as it was."""
    w = NewWeights(engine, what)
    try:
        yield w
    except BaseException:
        w.discard()
        raise
    w.commit()


def _write_master(engine: "OffloadEngine", g: Group, shard: torch.Tensor) -> None:
    """This rank's fp32 `shard` of group `g` as its optimizer's master (an NVMe one to
    fresh extents, then switched), its moments as they are."""
    engine.optimizer.set_master(g.gid, shard.contiguous())


def _write_param(engine: "OffloadEngine", g: Group, shard: torch.Tensor, master: bool) -> None:
    """This rank's fp32 `shard` of group `g` into its compute-dtype parameter partition
    (in every tier: its only copy is the new one, written to NVMe where that is its
    home), and into its master (`master`) where the optimizer keeps one apart."""
    key = ("p", g.gid)
    where = engine._memory_tier(key)
    engine.store.fetch(key, to=where, pin=True).wait()  # what can fail (room) comes first
    try:
        opt = engine.optimizer
        if master and g.requires_grad and opt.has_master(g.gid):
            _write_master(engine, g, shard)
        with engine.store.modify(key, where) as p:
            p.copy_(shard.to(p.dtype))
        engine.weights_changed([g.gid])  # [Note: a graph of older weights] in engine.py
    finally:
        engine.store.unpin(key)
    if engine._param_tier is Tier.NVME:
        engine.store.evict(key).wait()


def params_from_masters(engine: "OffloadEngine", gids: Iterable[int]) -> None:
    """After `engine.optimizer.load_state_dict`: each loaded group that keeps its own
    fp32 master (bf16/fp16 compute) takes its compute-dtype parameters from it, so
    the forward runs the weights `state_dict()` reports (DeepSpeed's load of fp32
    partitions does the same). Groups whose master is the parameter are untouched."""
    opt = engine.optimizer
    for gid in gids:
        g = engine.groups[gid]
        if g.requires_grad and opt.has_master(gid):
            shard = opt.read_master(gid, torch.empty(g.shard, dtype=torch.float32))
            _write_param(engine, g, shard, master=False)


def groups_of(engine: "OffloadEngine", modules: Iterable[nn.Module | str] | None) -> list[Group]:
    """The groups holding the parameters of `modules` (modules or their names; None:
    all), in group order."""
    if modules is None:
        return list(engine.groups)
    if isinstance(modules, (nn.Module, str)):
        modules = [modules]
    by_name = dict(engine.module.named_modules(remove_duplicate=False))
    chosen: set[int] = set()
    for m in modules:
        if isinstance(m, str):
            if m not in by_name:
                raise KeyError(f"full_weights: the model has no module {m!r}; give a module "
                               f"or a name of model.named_modules(), e.g. "
                               f"{[n for n in by_name if n][:4]}")
            m = by_name[m]
        chosen.update(id(sub) for sub in m.modules())
    picked = []
    for g in engine.groups:
        if any(id(mod) in chosen for slot in g.slots for mod, _ in slot.uses):
            picked.append(g)
    return picked


# [Note: calls inside a full_weights block]
# A block registers full weights in the modules where the stand-ins were, so code
# that finds a parameter's group by its stand-in (`RegisteredParams.locate`) would
# take them for parameters assigned since initialize. The block puts them there
# with `RegisteredParams.summon`, which records them until `register` puts the
# stand-ins back, and what reads the model's names
# (`_slot_names`: state_dict, named_weights, save_pretrained) maps a full weight
# back to its group as it does a stand-in: those calls work inside a read-only
# block. A second block inside the first is refused (its end would put the
# stand-ins back under the outer block), naming the fix; inside a writable block
# every other engine call is refused ([Note: one thread at a time] in
# one_thread.py).
@contextlib.contextmanager
def summoned(engine: "OffloadEngine", groups: list[Group], writable: bool
             ) -> Iterator[dict[str, torch.Tensor]]:
    """Registers full-weight parameters in the modules for the block, then puts the
    stand-ins back; with `writable`, what the modules' parameters hold at the end of
    the block (in place edits, or a new `nn.Parameter` of the same shape) is
    written back, group by group. Yields {name: tensor} for every name of every
    parameter of `groups`. A block that raises writes nothing; with several ranks, none
    writes unless every rank's block ended with the same weights."""
    names = engine._slot_names()  # while the stand-ins are registered
    fulls, values = {}, {}
    for g in groups:
        fulls[g.gid] = read_group(engine, g)
        values[g.gid] = [nn.Parameter(t, requires_grad=g.requires_grad)
                         for t in slot_tensors(engine, g, fulls[g.gid])]
    named = {}
    for g in groups:
        engine.registered.summon(g.gid, values[g.gid])
        for i, value in enumerate(values[g.gid]):
            for name in names[(g.gid, i)]:
                named[name] = value
    engine.registered.writable = writable
    failure: BaseException | None = None
    edited = None
    if engine.__dict__.get("_named_modules") is None:  # the structure cannot change
        engine.__dict__["_named_modules"] = list(engine.module.named_modules())
    layout = _snapshot(engine.module, engine.__dict__["_named_modules"], names, groups)
    try:
        yield named
    except BaseException as e:  # raised below, once every rank has agreed
        failure = e
    try:
        _same_layout(layout)
        if failure is None and writable:
            edited = _collect(groups, names)
    except ValueError as e:
        failure = failure or e
    finally:
        engine.registered.writable = False
        for g in groups:
            engine.registered.register(g.gid)
    if writable and engine.comm.world > 1:
        _agree_on_edits(engine, edited, failure)
    if failure is not None:
        raise failure
    with new_weights(engine, "full_weights(writable=True)'s write-back") as w:
        for gid, tensors in (edited or {}).items():
            g = engine.groups[gid]
            full = fulls[gid]
            for slot, t in zip(g.slots, tensors):
                full[slot.offset:slot.offset + slot.numel].copy_(t.detach().reshape(-1))
            w.add(g, full)


def _agree_on_edits(engine: "OffloadEngine", edited: dict | None,
                    failure: BaseException | None) -> None:
    """Every rank writes its own shards from its own block's edits: where one rank's
    block raised, or its edits differ from rank 0's (an edit under `if rank == 0`, a
    re-initialisation without a seed), the model would hold parts of both. Every
    rank compares a crc32 of its edits first, and raises, nothing written."""
    prints = engine.comm.every_rank(-1.0 if failure is not None
                                    else tensors_crc32(edited, None))
    if failure is not None:
        return  # this rank raises its own error
    if -1.0 in prints:
        raise RuntimeError(f"full_weights: rank {prints.index(-1.0)}'s block raised, so "
                           "no rank writes its edits (nothing was written)")
    refuse_apart(prints, "full_weights: rank {}'s block left other weights than rank 0's",
                 "written", "edits", "Make the same edit on every rank (seed what it draws), "
                 "or load rank 0's with engine.load_state_dict on every rank")


def refuse_apart(prints: list[float], what: str, done: str, source: str, fix: str) -> None:
    """Raises on every rank where the ranks' crc32s (`prints`, by rank) of the values
    each writes its own shards from differ; `what` names the first rank apart ({})."""
    if len(set(prints)) > 1:
        other = next(r for r, x in enumerate(prints) if x != prints[0])
        raise RuntimeError(f"{what.format(other)} (nothing was {done}): each rank writes its "
                           f"own shards from its own {source}, so the model would hold parts "
                           f"of both. {fix}")


class _Layout(NamedTuple):
    children: list[tuple[str, nn.Module, dict]]  # every module's children, by name
    attributes: list[tuple[nn.Module, dict]]  # the block's modules' attributes


def _snapshot(model: nn.Module, modules: list[tuple[str, nn.Module]],
              names: dict[tuple[int, int], list[str]], groups: list[Group]) -> _Layout:
    """Every module's children, and the attributes of the modules that hold the
    block's weights and of those above them, {name: (value, a copy of its items where
    it is a list, dict or set)}, for `_same_layout` to put back (the whole model's
    attributes cost each of `full_weights_by_group`'s groups 16 times the block).
    `modules`: the model's, named, as at `initialize` (no block may change them)."""
    def items(v: Any) -> Any:
        return (list(v) if type(v) is list else dict(v) if isinstance(v, dict)
                else set(v) if type(v) is set else None)
    paths = {""}
    for g in groups:
        for i in range(len(g.slots)):
            for name in names[(g.gid, i)]:
                parts = name.split(".")[:-1]
                paths.update(".".join(parts[:k]) for k in range(1, len(parts) + 1))
    held = [model.get_submodule(path) for path in sorted(paths)]
    return _Layout([(n, m, dict(m._modules)) for n, m in modules],
                   [(m, {k: (v, items(v)) for k, v in m.__dict__.items()}) for m in held])


def _same_layout(layout: _Layout) -> None:
    """A block that replaced, removed or added a module (peft's `merge_and_unload`)
    passed, and left modules the engine's hooks are not on: every later forward,
    state_dict and export raised, naming the wrong cause. Every module's children
    are put back as they were, and the attributes of the block's modules (peft's
    layers mark themselves merged), and the block refused, nothing written."""
    moved = [(name, k) for name, m, children in layout.children
             for k in [*children, *(k for k in m._modules if k not in children)]
             if m._modules.get(k) is not children.get(k)]
    if not moved:
        return
    for _, m, children in layout.children:
        m._modules.clear()
        m._modules.update(children)
    for m, before in layout.attributes:
        for k in [k for k in m.__dict__ if k not in before]:
            del m.__dict__[k]
        for k, (v, items) in before.items():
            m.__dict__[k] = v
            if type(v) is list:
                v[:] = items
            elif items is not None:
                v.clear()
                v.update(items)
    where = ".".join(filter(None, moved[0]))
    raise ValueError(f"full_weights: the block changed the model's modules ({where!r} was "
                     "replaced, removed or added); a block changes weights' values, not the "
                     "model's structure, so the modules were put back as they were and "
                     "nothing was written. Change the structure in a model of its own: "
                     "load engine.state_dict() into a plain copy and change that")


def _collect(groups: list[Group], names: dict[tuple[int, int], list[str]]
             ) -> dict[int, list[torch.Tensor]]:
    """What each parameter's attributes hold at the end of a writable block, checked."""
    out = {}
    for g in groups:
        row = []
        for i, slot in enumerate(g.slots):
            held = [module._parameters.get(attr) for module, attr in slot.uses]
            t = held[0]
            name = names[(g.gid, i)][0]
            if t is None or any(h is not t for h in held[1:]):
                raise ValueError(f"full_weights: parameter {name!r} is tied under "
                                 f"{names[(g.gid, i)]}, and they no longer hold one tensor; "
                                 "assign the same nn.Parameter to every name (nothing was "
                                 "written)")
            if tuple(t.shape) != tuple(slot.shape):
                raise ValueError(f"full_weights: parameter {name!r} now has shape "
                                 f"{tuple(t.shape)}, the engine holds {tuple(slot.shape)}; "
                                 "the shape of a parameter cannot change (nothing was "
                                 "written)")
            row.append(t)
        out[g.gid] = row
    return out
