"""`offload.initialize`: wraps a model for ZeRO-3 training with tiered partitions."""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import logging
import os
import re
import weakref
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..comm import Collectives, GatherIssuer, RankFailedError
from ..comm.collectives import backend_for, device_backend
from ..comm.gather_thread import gather_group
from ..config import ConfigError, OffloadConfig, load_config
from ..io import hugepages
from ..io.errors import limit_hint
from ..store import NextUsePolicy, TieredStore
from ..store.copy import resolve_device, start_cpu_threads
from ..trace import NULL_RECORDER, TraceRecorder
from .checkpoint import SafetensorsCheckpoint
from .checkpoint_reader import CheckpointReader
from .engine import _DTYPES, _TIERS, OffloadEngine
from .interrupts import SafeInterrupts
from .eviction import next_use_of
from .lr_scheduler import make_scheduler, warn_schedule_dropped
from .meta import meta_device
from .model_checks import refuse_unsupported
from .materialise import Lineage, _materialise
from .model_buffers import (buffers_from_first_rank, buffers_to, load_buffers,
                            materialise_buffers, persistent_buffers, saved_buffers)
from .model_weights import (guard_casts, guard_resize, guard_save_pretrained, guard_tie,
                            guard_tp_generate)
from .one_thread import EngineBusyError
from .param_groups import assign_param_groups, segments_of
from .params_view import point_weight_list
from .rank_order import RankOrderError
from .step import StepFailedError
from .tensor_parallel import TensorParallel, full_state_dict
from .training_checkpoint import CheckpointCorruptError, CheckpointError
from .units import EngineMark, Group, build_units
from .rank_agreement import (RankAgreement, buffer_section, config_section, model_sections,
                              resume_section)
from .working_set import check_budgets, check_disk, check_memory, disk_share

log = logging.getLogger(__name__)

__all__ = ["CheckpointCorruptError", "CheckpointError", "CheckpointReader", "EngineBusyError",
           "OffloadEngine", "RankOrderError", "StepFailedError", "full_state_dict",
           "initialize"]

# [Note: wrapped modules]
# `initialize` takes a model's parameters into the engine's partitions: each module
# it took parameters from (and the model itself) is marked under this key in its
# `__dict__` (as torch's composable APIs mark the modules they were applied to), so
# a second `initialize` on the model, on a part of it, or on the engine itself is
# refused instead of wrapping an empty shell. The mark outlives `close()`: the
# model's weights went into the engine and leave with its closing (its methods
# raise then), so save them first (`state_dict()`, `save_pretrained()`). The mark
# is a weak reference to the engine, so the refusal can say whether that engine
# is still there to train with.
_WRAPPED = "_offload_wrapped"


def _refuse_wrapped(model: nn.Module) -> None:
    """Raises `ConfigError` if `model` is an engine or was wrapped by one before."""
    if isinstance(model, OffloadEngine):
        raise ConfigError("initialize(model): got an OffloadEngine, which is already "
                          "initialized; train with it as it is, or pass a fresh model")
    for name, m in model.named_modules():
        if m.__dict__.get(_WRAPPED):
            where = f"its module {name!r}" if name else "it"
            owner = m.__dict__[_WRAPPED]()
            if owner is None or owner._closed:
                raise ConfigError(
                    f"initialize(model): {type(model).__name__} was already wrapped by an "
                    f"OffloadEngine that is closed now ({where} gave its parameters to that "
                    "engine, and they went with its closing): build a fresh model and load "
                    "what was saved before closing (engine.save_pretrained(dir) or "
                    "engine.state_dict()), or resume from a checkpoint "
                    "(offload.initialize(fresh_model, config, resume=path))")
            raise ConfigError(
                f"initialize(model): {type(model).__name__} was already wrapped by an "
                f"OffloadEngine ({where} gave its parameters to that engine); train with that "
                "engine, or build a fresh model (load the old engine's state_dict() into it "
                "for its weights)")


def _warn_unused_scaling(e: Any) -> None:
    """Loss-scaling keys set where engine.dtype is not fp16 (they would be ignored)."""
    scaling = [k for k in ("loss_scale", "initial_loss_scale", "loss_scale_window",
                           "min_loss_scale")
               if getattr(e, k) != type(e).__dataclass_fields__[k].default]
    if scaling and e.dtype != "fp16":
        log.warning("engine.%s: loss scaling is for engine.dtype 'fp16'; with %r it is not "
                    "used (bf16 and fp32 gradients need none)", scaling[0], e.dtype)


def _model_of(model: nn.Module | Callable[[], nn.Module],
              lr_lambda: Callable[[int], float] | None) -> nn.Module:
    """`model`, or the model the function builds (under the meta device); refuses what
    is not a model, a model wrapped before, and an `lr_lambda` that is not callable."""
    if not isinstance(model, nn.Module) and not callable(model):
        raise ConfigError(f"initialize(model): expected an nn.Module or a function that builds "
                          f"one, got {type(model).__name__}")
    if lr_lambda is not None and not callable(lr_lambda):
        raise ConfigError(f"initialize(lr_lambda): {lr_lambda!r} is not callable; give a "
                          "function of the step returning the lr multiplier, as LambdaLR takes")
    if not isinstance(model, nn.Module):
        with meta_device():
            model = model()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"initialize(model): expected an nn.Module or a function that builds "
                          f"one, got {type(model).__name__}")
    _refuse_wrapped(model)
    return model


@functools.cache
def _report_omp_wait_policy() -> None:
    """Says once per process, where updates run beside backward, that torch's OpenMP
    threads spin between parallel regions and how to stop it ([Note: OpenMP's wait
    policy] in offload/__init__.py)."""
    from .. import omp_wait_policy

    if omp_wait_policy().upper() in ("", "ACTIVE"):
        log.warning("torch's OpenMP threads spin between parallel regions (OMP_WAIT_POLICY "
                    "%s when torch was imported) and take the cores the optimizer's updates "
                    "use beside backward: on 2 cores the bench step took 0.43 s where 0.38 s "
                    "with PASSIVE. Set OMP_WAIT_POLICY=PASSIVE in the environment, or import "
                    "offload before torch (it sets it then)",
                    omp_wait_policy() or "unset")


@functools.cache
def _report_huge_pages() -> None:
    """Says once per process whether large host tensors get huge pages
    ([Note: huge pages] in offload/io/hugepages.py)."""
    ok, why = hugepages.check()
    if ok:
        log.debug(why)
    elif hugepages.kernel_mode() in ("never", "unavailable") or hugepages.opted_out():
        log.info(why)
    else:
        log.warning(why)


def _whole_modules(model: nn.Module, names: list[str]) -> list[nn.Module]:
    """The modules `engine.whole_modules` names, each kept as one unit: by the name
    model.named_modules() gives, or by class name (every module of that class, as
    FSDP's and accelerate's wrap policies take layer classes)."""
    found = dict(model.named_modules(remove_duplicate=False))
    out: dict[int, nn.Module] = {}
    for i, name in enumerate(names):
        if name in found:
            out.setdefault(id(found[name]), found[name])
            continue
        of_class = [m for m in found.values() if type(m).__name__ == name]
        if not of_class:
            near = [n for n in found if n and (n.endswith(name) or name in n)][:5]
            raise ConfigError(f"engine.whole_modules[{i}]: {type(model).__name__} has no module "
                              f"{name!r}, nor a module of a class of that name; give names as "
                              "model.named_modules() lists them, or a module class's name"
                              + (f", e.g. {', '.join(map(repr, near))}" if near else ""))
        for m in of_class:
            out.setdefault(id(m), m)
    return list(out.values())


@contextlib.contextmanager
def _cut_undone_on_failure(tp: TensorParallel | None) -> Iterator[None]:
    """A refusal after tensor parallelism cut the model's blocks puts the model back as
    the user gave it (its original layers, with their full weights); success frees
    the originals."""
    try:
        yield
    except BaseException:
        if tp is not None:
            tp.plan.undo()
            tp.mesh.close()  # its groups (the engine's close, where it got that far, did)
        raise
    if tp is not None:
        tp.plan.commit()


def _import_dtensor() -> None:
    """torch imports torch.distributed.tensor at the first nn.Parameter the engine
    registers, opening its files then: with the swap files holding descriptors, a low
    RLIMIT_NOFILE failed there with a raw EMFILE naming a torch source file. Imported
    before any swap file, and a limit met here is named."""
    if not dist.is_available():  # a torch built without distributed has none
        return
    try:
        importlib.import_module("torch.distributed.tensor")
    except OSError as e:
        hint = limit_hint(e.errno)
        if not hint:
            raise
        raise OSError(e.errno, f"initialize: cannot import torch.distributed.tensor "
                      f"({e.strerror}): {hint}") from e


def initialize(model: nn.Module | Callable[[], nn.Module],
               config: OffloadConfig | dict | str | None = None, *,
               checkpoint: str | os.PathLike | None = None,
               resume: str | os.PathLike | None = None,
               lr_lambda: Callable[[int], float] | None = None,
               param_groups: Sequence[Mapping[str, Any]] | None = None,
               lr_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
               recorder: TraceRecorder = NULL_RECORDER,
               progress: Callable[[int, int], None] | None = None) -> OffloadEngine:
    """Partitions `model` into groups, places each rank's partitions in their home
    tiers and returns the engine to train it with.

    `model` may live on the CPU, on the `meta` device, or be a function that
    builds it (called under `torch.device("meta")`); meta parameters are
    materialised one group at a time by their module's `reset_parameters` (or
    a transformers model's `_init_weights`), seeded by `engine.seed` and the
    group, so every rank makes the same weights and no process holds them all.
    With `checkpoint` (a .safetensors file or a directory of them), every
    parameter is read from it instead, one tensor at a time.
    With `resume` (a directory written by `engine.save_checkpoint`), the whole
    training state is restored from it instead (docs/checkpoints.md), on any
    number of ranks; the model gives only the structure.
    `lr_lambda(step) -> multiplier` schedules the learning rate (as LambdaLR), at the
    global step (`engine.global_step`).
    `param_groups`: as torch.optim's, a list of dicts {"params": parameters of
    `model` or names or fnmatch patterns, "lr", "betas", "eps", "weight_decay",
    "lr_lambda"}; replaces `optim.param_groups`. Parameters named by no group
    train with the `optim` section's values.
    `lr_scheduler(optimizer) -> scheduler` (a torch or transformers scheduler of the
    optimizer it is given): `engine.step()` steps it after each step that commits,
    and checkpoints save and resume it (docs/engine.md#learning-rate-schedules).
    `progress(done, total)` is called after each group is placed.
    Under torch.distributed (torchrun), each rank keeps 1/world of every group.
    """
    # [Note: ranks agree at initialize] in rank_agreement.py: each block's refusal on one
    # rank is raised on every rank at the next settle, before any swap file is made
    _import_dtensor()
    _on_this_ranks_gpu()  # before anything is refused: the agreement is a collective
    agreement = RankAgreement()
    with agreement.refusals():
        # the engine's own copy: the caller's object, changed or reused later, changes nothing
        cfg = copy.deepcopy(load_config(config))
        device = resolve_device(cfg.store.device)
        cuda = device.type == "cuda"
        if cuda:  # [Note: a GPU per rank] in offload/store/copy.py
            torch.cuda.set_device(device)
        _refuse_gather_thread_on_nccl(cfg, cuda)
        if dist.is_available() and dist.is_initialized():
            _refuse_cpu_tensors_on_nccl(str(dist.get_backend()),
                                        str(dist.get_backend_config()), cuda)
        _report_huge_pages()
        model = _model_of(model, lr_lambda)
        refuse_unsupported(model, cfg.engine.dtype)
        _warn_unused_scaling(cfg.engine)
        if checkpoint is not None and resume is not None:
            raise ConfigError("initialize: pass checkpoint (initial weights) or resume (a "
                              "whole training state), not both")
        ckpt = SafetensorsCheckpoint(checkpoint) if checkpoint is not None else None
        if ckpt is not None:
            ckpt.adopt(model)  # [Note: transformers' conversions] in checkpoint.py
        gen_config = ckpt.generation_config(model) if ckpt is not None else None
        resumed = CheckpointReader(resume) if resume is not None else None
        if resumed is not None:  # before a meta buffer it lacks is made
            resumed.check_buffers(model)
        materialise_buffers(model, cfg.engine.seed,
                             resumed.buffer_names() if resumed is not None
                             else saved_buffers(model, ckpt))
        if ckpt is not None:
            load_buffers(model, ckpt)
        TensorParallel.check(model, cfg, restored=ckpt is not None or resumed is not None)
    agreement.settle(lambda: [config_section(cfg), resume_section(  # the whole job, before
        resumed.record if resumed is not None else None), buffer_section(model)])  # its mesh
    # [Note: ZeRO-3 over DP, tensor parallelism over TP] in tensor_parallel.py
    tp = TensorParallel.setup(model, cfg, restored=ckpt is not None or resumed is not None,
                              recorder=recorder, keep_undo=True, cuda=cuda)
    with _cut_undone_on_failure(tp):  # [Note: undoing parallelize] in offload/comm/domino.py
        comm = (tp.mesh.dp if tp is not None
                else Collectives(recorder=recorder, cuda=cuda))
        dtype, share = _DTYPES[cfg.engine.dtype], None
        with agreement.refusals():
            units, groups = build_units(model, cfg.engine.group_size, comm.world,
                                        whole=_whole_modules(model, cfg.engine.whole_modules)
                                        + (tp.blocks if tp is not None else []))
            hyper, slot_groups = assign_param_groups(groups, cfg.optim, param_groups)
            if ckpt is not None:
                _check_checkpoint_covers(ckpt, model, groups, checkpoint)
            check_budgets(cfg, groups, dtype)  # before any file is made
            check_memory(cfg, groups, dtype)  # before anything is placed
            if resumed is not None:
                resumed.check(groups, dtype)
            share = disk_share(cfg, groups, dtype)
        # data-parallel ranks hold the same layout; tensor-parallel ranks differ in slices
        shares = agreement.settle(lambda: model_sections(groups, units, hyper, slot_groups),
                                  within=tp.mesh.dp_groups if tp is not None else None,
                                  extra=share)
        with agreement.refusals():
            check_disk(cfg, groups, dtype, shares if agreement.world > 1 else None)
        agreement.settle()
        gathers = None  # [Note: gather thread] in offload/comm/gather_thread.py
        if cfg.comm.gather_thread and comm.world > 1:
            dp_groups = tp.mesh.dp_groups if tp is not None else [list(range(comm.world))]
            gathers = GatherIssuer(comm, gather_group(comm, dp_groups))
        # store.policy "next-use": the copy the step needs last leaves first (eviction.py)
        policy = NextUsePolicy() if cfg.store.policy == "next-use" else None
        store, engine = None, None
        start_cpu_threads()  # before any swap file
        before = _ModelBefore(model)  # [Note: a failed initialize leaves the model as it was]
        try:
            # a Ctrl-C while the store and the engine are made (a swap file opened and
            # not yet recorded, the model's hooks half registered) comes once they are,
            # so that the `except` below closes what was made ([Note: Ctrl-C at a safe
            # point] in interrupts.py)
            with SafeInterrupts(lambda where: None).held():
                with agreement.refusals():  # a swap directory or lock refused on some ranks
                    # swap files are named by the rank in the whole job (DP ranks repeat
                    # over TP)
                    store = TieredStore(cfg, rank=tp.mesh.world.rank if tp is not None
                                        else comm.rank, recorder=recorder, policy=policy)
                agreement.settle()
                if cfg.engine.optimizer == "nvme" and store.device.type == "cpu":
                    _report_omp_wait_policy()  # updates run beside a backward on the cores
                lineage = Lineage(model)
                engine = OffloadEngine(model, cfg, units, groups, store, comm, recorder, tp,
                                       gathers)
            # [Note: Ctrl-C at a safe point] in interrupts.py: one while the partitions
            # are placed comes before the next group, and the engine is closed
            with engine._interrupts.held():
                if policy is not None:
                    policy.follow(next_use_of(engine.trace, engine.staged, engine.pending_updates))
                engine._attach_optimizer(lr_lambda, hyper)
                engine.param_group_of = slot_groups  # a checkpoint records each group's members
                deferred = []  # the user's real tensors stay in the model until nothing can fail
                differs = None  # [Note: rank 0's weights]: a parameter this rank had otherwise
                placing = _Placing(comm)  # [Note: a rank that fails while placing]
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
                        found = _place_new_group(engine, g, segments, ckpt, lineage, placing)
                        if placing.stopped:
                            break
                        differs = differs or found
                    # a materialised meta group is freed at once: no process holds all
                    if was_meta and placing.error is None:
                        _drop_params(g, engine)
                    elif not was_meta:
                        deferred.append(g)
                    if progress is not None:
                        placing.run(progress, g.gid + 1, len(groups))
                else:
                    placing.run(store.wait_all)
                    placing.agree()  # the last group's outcome, and the writes'
                placing.settle(agreement)
                if differs is not None:
                    log.warning("initialize: rank %d's initial weights differ from rank 0's "
                                "(first: %r); every rank trains from rank 0's, as under DDP",
                                comm.rank, differs)
                if resumed is not None:
                    resumed.restore(engine)  # counters, loss scale, hyper-parameters, RNG
                    engine.resumed_extra = dict(resumed.extra)
                    warn_schedule_dropped(resumed.record, engine.optimizer,
                                          lr_scheduler is not None, resume)
                if lr_scheduler is not None:  # [Note: the engine's scheduler] in lr_scheduler.py
                    engine.lr_scheduler = make_scheduler(
                        lr_scheduler, engine.optimizer,
                        resumed.record.get("lr_scheduler") if resumed is not None else None,
                        resumed is not None)
                for g in deferred:
                    _drop_params(g, engine)
                buffers_to(model, store.device)
                # [Note: rank 0's weights]; buffers are never cut: every rank of the job, TP too
                everyone = tp.mesh.world if tp is not None else comm
                if everyone.world > 1 and ckpt is None and resumed is None:
                    buffers_from_first_rank(everyone, model)
                model.__dict__[_WRAPPED] = EngineMark(weakref.ref(engine), model)  # [Note:
                # wrapped modules]
                guard_casts(model, engine.dtype, engine.device)
                guard_resize(model)
                guard_tie(model)
                guard_save_pretrained(model)
                if tp is not None:
                    guard_tp_generate(model)
                if gen_config is not None:  # as from_pretrained sets it
                    model.generation_config = gen_config
                if comm.world > 1:  # [Note: generation on several ranks] in model_weights.py
                    for m in model.modules():
                        m.__dict__["_is_fsdp_managed_module"] = EngineMark(True, m)
                if resumed is not None:
                    resumed.close()
                log.info("offload: %d parameters in %d groups over %d units, world %d, %s "
                         "compute, params on %s, grads on %s, optimizer state on %s",
                         sum(g.numel for g in groups), len(groups), len(units), comm.world,
                         cfg.engine.dtype, cfg.engine.params, cfg.engine.grads,
                         cfg.engine.optimizer)
            # nothing after this block may be interrupted: a Ctrl-C at its end (noted in
            # it) still finds the `except` below, where one after it would leave the
            # engine open and the model wrapped, with no engine returned to close
        except BaseException:  # Ctrl-C too
            try:
                if engine is not None:
                    engine.close()  # removes its hooks and closes the store
                else:
                    if store is not None:
                        store.close()  # removes the files this rank made
                    if gathers is not None:
                        gathers.close()
                before.restore()
            finally:
                if resumed is not None:
                    resumed.close()
            raise
    return engine


class _Placing:
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


def _place_new_group(engine: OffloadEngine, g: Group, segments: list[tuple[int, int, int]],
                     ckpt: SafetensorsCheckpoint | None, lineage: Lineage, placing: _Placing
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


def _refuse_gather_thread_on_nccl(cfg: OffloadConfig, cuda: bool) -> None:
    """comm.gather_thread is for gloo: NCCL's collectives are asynchronous already, and
    two NCCL communicators driven from two threads can deadlock."""
    if (cfg.comm.gather_thread and dist.is_available() and dist.is_initialized()
            and dist.get_world_size() > 1 and device_backend(cuda=cuda) == "nccl"):
        raise ConfigError("comm.gather_thread is for gloo: NCCL's collectives are "
                          "asynchronous already, and two communicators driven from two "
                          "threads can deadlock under NCCL; set comm.gather_thread = false")


def _on_this_ranks_gpu() -> None:
    """Under NCCL, makes the rank's GPU current before `initialize` can refuse
    anything ([Note: a GPU per rank] in offload/store/copy.py): the ranks agree on a
    refusal by a collective on the current device, which is GPU 0 on every rank until
    set, and a configuration refused before the device was chosen met NCCL's
    "duplicate GPU" instead of its ConfigError."""
    if (torch.cuda.is_available() and dist.is_available() and dist.is_initialized()
            and device_backend(cuda=True) == "nccl"):
        torch.cuda.set_device(resolve_device("cuda"))  # the GPU store.device "cuda" takes


def _refuse_cpu_tensors_on_nccl(backend: str, config: str, cuda: bool) -> None:
    """A process group that sends CPU tensors over NCCL (a plain "nccl" group with
    store.device "cpu") is refused: NCCL carries CUDA tensors only, and the first
    all-gather failed deep inside torch, on GPU 0 of every rank."""
    if not cuda and backend_for(backend, config, cuda=False) == "nccl":
        raise ConfigError("store.device is 'cpu' but the process group is NCCL, which "
                          "carries CUDA tensors only: set store.device = 'cuda' (or "
                          "'auto'), or make the group with gloo for CPU tensors "
                          "(init_process_group('cpu:gloo,cuda:nccl'), or 'gloo')")


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


def _check_checkpoint_covers(ckpt: SafetensorsCheckpoint, model: nn.Module,
                             groups: list[Group], where: str | os.PathLike) -> None:
    """[Note: weights a checkpoint lacks] As transformers' from_pretrained, parameters
    `checkpoint=` does not hold (a new task head, new adapters) are initialised as the
    model initialises them, and named in one warning; a checkpoint that holds none of
    the model's parameters is another model's, and is refused."""
    slots = [s for g in groups for s in g.slots]
    missing = [s.fqn for s in slots if all(ckpt.resolve(n) is None for n in s.names)]
    if slots and len(missing) == len(slots):
        raise ValueError(f"checkpoint {where} holds none of the model's parameters (e.g. "
                         f"{missing[0]!r}); it holds e.g. {sorted(ckpt.files)[:5]}: give the "
                         "checkpoint of this model")
    for s in slots:  # shapes and dtypes from the headers, before any group is read
        ckpt.check(s.fqn, s.names, tuple(s.shape))
    names = [n for s in slots for n in s.names] + [f for f, _, _ in persistent_buffers(model)]
    used = {ckpt.resolve(n) for n in names}
    ignored = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []  # as HF's
    unused = sorted(k for k in ckpt.files
                    if k not in used and not any(re.search(p, k) for p in ignored))
    if missing:
        log.warning("offload: %d of the model's %d parameters are not in checkpoint %s and "
                    "are initialised as the model does (train them, e.g. a new head): %s%s%s",
                    len(missing), len(slots), where, ", ".join(missing[:10]),
                    " ..." if len(missing) > 10 else "",
                    f"; and {len(unused)} of its tensors match no name of the model (e.g. "
                    f"{', '.join(map(repr, unused[:3]))}): a head the model replaces, or "
                    "names of another layout of this model (transformers converts some as it "
                    "loads them: experts merged, tensors renamed); for the latter, load the "
                    "model with transformers' from_pretrained and pass it to initialize "
                    "without checkpoint=" if unused else "")
    elif unused:
        log.warning("offload: %d tensors of checkpoint %s match no parameter or buffer of "
                    "the model and are not loaded: %s%s", len(unused), where,
                    ", ".join(unused[:10]), " ..." if len(unused) > 10 else "")


class _ModelBefore:
    """The model's modules as `initialize` found them.

    [Note: a failed initialize leaves the model as it was]
    `initialize` hands the model's parameters over group by group (a meta group's at
    once, a real one's at the end: `_drop_params`), moves its buffers, and marks and
    guards its modules. Where it fails, or a Ctrl-C noted in its last lines is raised
    at their end (after every group was handed over), the model is put back as it
    was: its parameters (the user's tensors, which the engine only read), buffers
    and marks, so it trains as before or is given to `initialize` again. Before, only
    meta parameters were put back: a Ctrl-C in those last lines left a model on the
    CPU with a closed engine's stand-ins, its weights gone with the engine."""

    _MARKS = (_WRAPPED, "_apply", "resize_token_embeddings", "tie_weights", "generate",
              "save_pretrained", "_is_fsdp_managed_module", "generation_config")

    def __init__(self, model: nn.Module) -> None:
        self._modules = [(m, dict(m._parameters), dict(m._buffers),
                          {k: m.__dict__[k] for k in self._MARKS if k in m.__dict__})
                         for m in model.modules()]

    def restore(self) -> None:
        for m, params, buffers, marks in self._modules:
            for name in set(m._parameters) | set(params):
                m.__dict__.pop(name, None)
            m._parameters.clear()
            m._parameters.update(params)
            m._buffers.clear()
            m._buffers.update(buffers)
            for k in self._MARKS:
                if k in marks:
                    m.__dict__[k] = marks[k]
                else:
                    m.__dict__.pop(k, None)
            for name in params:
                point_weight_list(m, name)


def _drop_params(g: Group, engine: OffloadEngine) -> None:
    """Replaces the group's parameters in their modules by the engine's registered
    stand-ins (shape, dtype, device and requires_grad queries work; a use raises
    naming it: [Note: registered parameters] in params_view.py)."""
    engine.registered.register(g.gid)
    for s in g.slots:
        for mod, _ in s.uses:
            mod.__dict__[_WRAPPED] = EngineMark(weakref.ref(engine), mod)  # [Note: wrapped
            # modules]
        s.param = None
    engine.unbind(g.gid)
