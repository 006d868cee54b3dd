"""Placing each group's partitions at `initialize`: made (from a checkpoint, else
by the modules' initialisers, rank 0's where ranks differ) or resumed, each rank
its own partition, with a failure on one rank stopping every rank."""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Sequence

import torch

from ..comm import Collectives, RankFailedError
from .checkpoint import SafetensorsCheckpoint
from .checkpoint_reader import CheckpointReader
from .engine import _TIERS, OffloadEngine
from .materialise import Lineage, _materialise
from .param_groups import segments_of
from .rank_agreement import RankAgreement
from .units import Group, mark_wrapped

log = logging.getLogger(__name__)

__all__ = ["Placing", "drop_params", "place_groups", "place_new_group"]


def place_groups(engine: OffloadEngine, groups: Sequence[Group],
                 slot_groups: Mapping[tuple[int, int], int],
                 ckpt: SafetensorsCheckpoint | None, resumed: CheckpointReader | None,
                 lineage: Lineage, progress: Callable[[int, int], None] | None,
                 agreement: RankAgreement) -> list[Group]:
    """Places each group's partitions (read from `resumed`, else made:
    `place_new_group`), a Ctrl-C coming between groups; a materialised meta group's
    parameters are handed over at once. Raises on every rank where one failed
    ([Note: a rank that fails while placing]). Returns the groups of real parameters,
    which the model keeps until nothing can fail ([Note: a failed initialize leaves
    the model as it was] in __init__.py)."""
    comm = engine.comm
    deferred = []  # the user's real tensors stay in the model until nothing can fail
    differs = None  # [Note: rank 0's weights]: a parameter this rank had otherwise
    placing = Placing(comm)  # [Note: a rank that fails while placing]
    for g in groups:
        engine._interrupts.safe_point()
        was_meta = any(sl.param.is_meta for sl in g.slots)
        segments, slots = segments_of(g, comm.rank, slot_groups)
        if g.requires_grad:
            engine.grad_slots.segment_slots[g.gid] = slots
        if resumed is not None:  # the whole state of the group, read by name
            if progress is not None and placing.agree() is None:
                break  # a `progress` that raised on a rank
            # its ranks agree on its outcome (the others raise RankFailedError)
            resumed.place_group(engine, g, segments, slots)
        else:
            found = place_new_group(engine, g, segments, ckpt, lineage, placing)
            if placing.stopped:
                break
            differs = differs or found
        # a materialised meta group is freed at once: no process holds all
        if was_meta and placing.error is None:
            drop_params(g, engine)
        elif not was_meta:
            deferred.append(g)
        if progress is not None:
            placing.run(progress, g.gid + 1, len(groups))
    else:
        placing.run(engine.store.wait_all)
        placing.agree()  # the last group's outcome, and the writes'
    placing.settle(agreement)
    if differs is not None:
        log.warning("initialize: rank %d's initial weights differ from rank 0's "
                    "(first: %r); every rank trains from rank 0's, as under DDP",
                    comm.rank, differs)
    return deferred


class Placing:
    """[Note: a rank that fails while placing]
    Each rank places its own partitions, group by group, on its own disks: one rank's
    disk may fill there (its free space was checked, but another process may take it
    meanwhile), or its initialiser or `progress` raise, where the others' do not. A
    rank that raised at once left the others waiting in the next group's collective
    (the all-reduce of rank 0's weights) for the process group's timeout, 30 minutes.
    So a rank keeps its error (`run`) and goes on to the next `agree`, one all-reduce
    the ranks of the data-parallel group reach at the same point of every group (it
    also counts the ranks `_from_first_rank` needs), where all of them stop. Then the
    whole job settles (`RankAgreement`; tensor-parallel ranks of other groups too,
    once they placed theirs): the rank that failed raises its own error, every other
    rank a `RuntimeError` (a `ConfigError` for a config error) naming it, and
    `initialize` closes what each made, its swap files removed. A resumed group's
    ranks agree on its outcome themselves (`CheckpointReader.place_group`)."""

    def __init__(self, comm: Collectives) -> None:
        self.comm = comm
        self.error: Exception | None = None  # this rank's, raised at `settle`
        self.stopped = False  # a rank of the group failed: no rank places more

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), unless this rank failed already (then None); an error is kept."""
        if self.error is not None:
            return None
        try:
            return fn(*args)
        except Exception as e:  # raised at `settle`, once every rank has stopped
            self.error = e
            return None

    def agree(self, flag: bool = False) -> int | None:
        """Every rank of the group, at the same point: None where a rank has failed so
        far (every rank stops placing), else how many ranks passed `flag`."""
        failed, flagged = self.comm.sum_scalars([float(self.error is not None), float(flag)])
        self.stopped = failed > 0
        return None if self.stopped else int(flagged)

    def settle(self, agreement: RankAgreement) -> None:
        """Raises this rank's error, or one naming the rank that failed, on every rank of
        the job; returns where none did."""
        if not self.stopped and self.comm.world == agreement.world:
            return  # the group is the job, and its last `agree` found no failure
        with agreement.refusals():
            if self.error is not None:
                raise self.error
        agreement.settle()
        if self.stopped:  # not reached: the rank that failed refused at the settle
            raise RankFailedError(f"initialize: another rank of {self.comm.world} failed "
                                  "while placing its partitions (its error says why)")


def place_new_group(engine: OffloadEngine, g: Group, segments: list[tuple[int, int, int]],
                    ckpt: SafetensorsCheckpoint | None, lineage: Lineage, placing: Placing
                    ) -> str | None:
    """Makes group `g`'s weights (from `ckpt`, else by the modules' initialisers, rank
    0's where ranks differ) and places this rank's partition and its optimizer state;
    places nothing once a rank has failed ([Note: a rank that fails while placing]).
    Returns the first parameter whose weights differed from rank 0's, if any."""
    cfg, comm = engine.cfg, engine.comm
    full = placing.run(_materialise, engine.module, g, cfg.engine.seed, ckpt, lineage)
    real = ckpt is None and not all(sl.param.is_meta for sl in g.slots)
    anyone_real = placing.agree(real)  # [Note: rank 0's weights]
    if anyone_real is None:
        return None
    differs = _from_first_rank(comm, g, full) if anyone_real else None
    placing.run(_place_shard, engine, g, segments, full)
    return differs


def _place_shard(engine: OffloadEngine, g: Group, segments: list[tuple[int, int, int]],
                 full: torch.Tensor) -> None:
    """This rank's partition of the group's weights `full`, and its optimizer state."""
    cfg, comm = engine.cfg, engine.comm
    shard = full[comm.rank * g.shard:(comm.rank + 1) * g.shard]
    engine.store.put(("p", g.gid), shard.to(engine.dtype), kind="param",
                     tier=_TIERS[cfg.engine.params])
    # NVMe state is written now: never all masters at once
    if g.requires_grad:
        shared = engine.master_is_param  # fp32: the stored shard is it
        engine.optimizer.add_partition(
            g.gid, shard if shared else shard.clone(), tier=cfg.engine.optimizer,
            master_is_param=shared, segments=segments, origin=g.origin(comm.rank))


def _from_first_rank(comm: Collectives, g: Group, full: torch.Tensor) -> str | None:
    """[Note: rank 0's weights] The user's weights are the (data-parallel) group's first
    rank's, as DDP broadcasts rank 0's parameters when it wraps a model: ranks that
    built the model after seeding each its own way (`manual_seed(seed + rank)`) would
    otherwise each keep its own slice of its own weights, and train a model that no
    rank built. A group whose parameters are meta on every rank (made from
    `engine.seed`) is the same everywhere already, and so is a checkpoint's; one
    real on some rank (all of a rank's are not meta; FSDP's `sync_module_states`
    habit of building the model on rank 0 only) is sent from rank 0. The ranks count
    those in the all-reduce of each group where they agree that none has failed
    ([Note: a rank that fails while placing]), and every rank calls this where one
    is. Returns the first parameter of `g` whose values on this rank were not rank
    0's, or None."""
    mine = full.clone() if comm.rank != 0 else None
    comm.broadcast_first(full)
    if mine is None or torch.equal(mine, full):
        return None
    return next((sl.fqn for sl in g.slots if not torch.equal(
        mine[sl.offset:sl.offset + sl.numel], full[sl.offset:sl.offset + sl.numel])), "?")


def drop_params(g: Group, engine: OffloadEngine) -> None:
    """Replaces the group's parameters in their modules by the engine's registered
    stand-ins (shape, dtype, device and requires_grad queries work; a use raises
    naming it: [Note: registered parameters] in params_view.py)."""
    engine.registered.register(g.gid)
    for s in g.slots:
        for mod, _ in s.uses:
            mark_wrapped(mod, engine)
        s.param = None
    engine.unbind(g.gid)
