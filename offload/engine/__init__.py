"""`offload.initialize`: wraps a model for ZeRO-3 training with tiered partitions."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib
import logging
import os
import re
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..comm import Collectives, GatherIssuer
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
from .engine import _DTYPES, OffloadEngine
from .interrupts import SafeInterrupts
from .eviction import next_use_of
from .lr_scheduler import make_scheduler, warn_schedule_dropped
from .meta import meta_device
from .model_checks import refuse_unsupported
from .materialise import Lineage
from .model_buffers import (buffers_from_first_rank, buffers_to, load_buffers,
                            materialise_buffers, persistent_buffers, saved_buffers)
from .model_weights import (guard_casts, guard_resize, guard_save_pretrained, guard_tie,
                            guard_tp_generate)
from .one_thread import EngineBusyError
from .param_groups import assign_param_groups
from .params_view import point_weight_list
from .rank_order import RankOrderError
from .step import StepFailedError
from .tensor_parallel import TensorParallel, full_state_dict
from .training_checkpoint import CheckpointCorruptError, CheckpointError
from .placing import drop_params, place_groups
from .units import WRAPPED, EngineMark, Group, Unit, build_units, mark_wrapped
from .rank_agreement import (RankAgreement, buffer_section, config_section, model_sections,
                              resume_section)
from .working_set import check_budgets, check_disk, check_memory, disk_share

log = logging.getLogger(__name__)

__all__ = ["CheckpointCorruptError", "CheckpointError", "CheckpointReader", "EngineBusyError",
           "OffloadEngine", "RankOrderError", "StepFailedError", "full_state_dict",
           "initialize"]


def _refuse_wrapped(model: nn.Module) -> None:
    """Raises `ConfigError` if `model` is an engine or was wrapped by one before."""
    if isinstance(model, OffloadEngine):
        raise ConfigError("initialize(model): got an OffloadEngine, which is already "
                          "initialized; train with it as it is, or pass a fresh model")
    for name, m in model.named_modules():
        if m.__dict__.get(WRAPPED):
            where = f"its module {name!r}" if name else "it"
            owner = m.__dict__[WRAPPED]()
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
    job: _Job | None = None  # None where this rank refused: the settle raises then
    with agreement.refusals():
        job = _read_job(model, config, checkpoint, resume, lr_lambda)
    agreement.settle(lambda: [config_section(job.cfg), resume_section(  # the whole job,
        job.resumed.record if job.resumed is not None else None),  # before its mesh
        buffer_section(job.model)])
    cfg, model = job.cfg, job.model
    # [Note: ZeRO-3 over DP, tensor parallelism over TP] in tensor_parallel.py
    tp = TensorParallel.setup(model, cfg, restored=job.restored, recorder=recorder,
                              keep_undo=True, cuda=job.cuda)
    with _cut_undone_on_failure(tp):  # [Note: undoing parallelize] in offload/comm/domino.py
        comm = (tp.mesh.dp if tp is not None
                else Collectives(recorder=recorder, cuda=job.cuda))
        layout = _layout(job, tp, comm, param_groups, agreement)
        gathers = None  # [Note: gather thread] in offload/comm/gather_thread.py
        if cfg.comm.gather_thread and comm.world > 1:
            dp_groups = tp.mesh.dp_groups if tp is not None else [list(range(comm.world))]
            gathers = GatherIssuer(comm, gather_group(comm, dp_groups))
        return _build(job, tp, comm, gathers, layout, agreement, lr_lambda=lr_lambda,
                      lr_scheduler=lr_scheduler, recorder=recorder, progress=progress)


@dataclasses.dataclass
class _Job:
    """What `initialize` was given, read and checked on this rank."""

    cfg: OffloadConfig  # the engine's own copy
    cuda: bool
    model: nn.Module
    checkpoint: str | os.PathLike | None  # initial weights: its path,
    ckpt: SafetensorsCheckpoint | None  # the checkpoint
    gen_config: Any  # and its generation config
    resume: str | os.PathLike | None  # a whole training state: its path,
    resumed: CheckpointReader | None  # its reader

    @property
    def restored(self) -> bool:
        return self.ckpt is not None or self.resumed is not None


def _read_job(model: nn.Module | Callable[[], nn.Module], config: OffloadConfig | dict | str | None,
              checkpoint: str | os.PathLike | None, resume: str | os.PathLike | None,
              lr_lambda: Callable[[int], float] | None) -> _Job:
    """Reads and checks `initialize`'s arguments; makes the model's buffers (meta ones,
    from the checkpoint where it holds them)."""
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
    job = _Job(cfg, cuda, model, checkpoint, ckpt, gen_config, resume, resumed)
    TensorParallel.check(model, cfg, restored=job.restored)
    return job


class _Layout(NamedTuple):
    units: list[Unit]
    groups: list[Group]
    hyper: list[dict[str, Any]]  # the optimizer's param_groups overrides
    slot_groups: dict[tuple[int, int], int]  # (gid, slot) -> its optimizer group


def _layout(job: _Job, tp: TensorParallel | None, comm: Collectives,
            param_groups: Sequence[Mapping[str, Any]] | None, agreement: RankAgreement
            ) -> _Layout:
    """The model's units, groups and optimizer groups, once every rank checked the
    budgets, the memory and the disk for them and agreed on the layout."""
    cfg, model, dtype, share = job.cfg, job.model, _DTYPES[job.cfg.engine.dtype], None
    with agreement.refusals():
        units, groups = build_units(model, cfg.engine.group_size, comm.world,
                                    whole=_whole_modules(model, cfg.engine.whole_modules)
                                    + (tp.blocks if tp is not None else []))
        hyper, slot_groups = assign_param_groups(groups, cfg.optim, param_groups)
        if job.ckpt is not None:
            _check_checkpoint_covers(job.ckpt, model, groups, job.checkpoint)
        check_budgets(cfg, groups, dtype)  # before any file is made
        check_memory(cfg, groups, dtype)  # before anything is placed
        if job.resumed is not None:
            job.resumed.check(groups, dtype)
        share = disk_share(cfg, groups, dtype)
    # data-parallel ranks hold the same layout; tensor-parallel ranks differ in slices
    shares = agreement.settle(lambda: model_sections(groups, units, hyper, slot_groups),
                              within=tp.mesh.dp_groups if tp is not None else None,
                              extra=share)
    with agreement.refusals():
        check_disk(cfg, groups, dtype, shares if agreement.world > 1 else None)
    agreement.settle()
    return _Layout(units, groups, hyper, slot_groups)


def _build(job: _Job, tp: TensorParallel | None, comm: Collectives,
           gathers: GatherIssuer | None, layout: _Layout, agreement: RankAgreement, *,
           lr_lambda: Callable[[int], float] | None, lr_scheduler: Callable[..., Any] | None,
           recorder: TraceRecorder, progress: Callable[[int, int], None] | None
           ) -> OffloadEngine:
    """Makes the store and the engine and places every group's partitions; where
    anything fails, closes what was made and puts the model back as it was."""
    cfg, model, resumed = job.cfg, job.model, job.resumed
    units, groups, hyper, slot_groups = layout
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
            deferred = place_groups(engine, groups, slot_groups, job.ckpt, resumed, lineage,
                                    progress, agreement)
            _restore_counters(engine, job, lr_scheduler)
            for g in deferred:
                drop_params(g, engine)
            _finish_model(engine, job, tp)
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


def _restore_counters(engine: OffloadEngine, job: _Job,
                      lr_scheduler: Callable[..., Any] | None) -> None:
    """A resumed job's counters, loss scale, hyper-parameters and RNG; the engine's
    scheduler, made (and resumed) from `lr_scheduler`."""
    resumed = job.resumed
    if resumed is not None:
        resumed.restore(engine)
        engine.resumed_extra = dict(resumed.extra)
        engine._resumed_step = engine.global_step
        warn_schedule_dropped(resumed.record, engine.optimizer, lr_scheduler is not None,
                              job.resume)
        resumed.warn_other_optimizer(engine.cfg.optim.name)
    if lr_scheduler is not None:  # [Note: the engine's scheduler] in lr_scheduler.py
        engine.lr_scheduler = make_scheduler(
            lr_scheduler, engine.optimizer,
            resumed.record.get("lr_scheduler") if resumed is not None else None,
            resumed is not None)


def _finish_model(engine: OffloadEngine, job: _Job, tp: TensorParallel | None) -> None:
    """Moves the model's buffers to the device (rank 0's on every rank, as DDP), marks
    the model and guards the methods that would act on its stand-ins."""
    model, comm = job.model, engine.comm
    buffers_to(model, engine.store.device)
    # [Note: rank 0's weights] in placing.py; buffers are never cut: every rank of the job, TP too
    everyone = tp.mesh.world if tp is not None else comm
    if everyone.world > 1 and not job.restored:
        buffers_from_first_rank(everyone, model)
    mark_wrapped(model, engine)  # [Note: wrapped modules] in units.py
    guard_casts(model, engine.dtype, engine.device)
    guard_resize(model)
    guard_tie(model)
    guard_save_pretrained(model)
    if tp is not None:
        guard_tp_generate(model)
    if job.gen_config is not None:  # as from_pretrained sets it
        model.generation_config = job.gen_config
    if comm.world > 1:  # [Note: generation on several ranks] in model_weights.py
        for m in model.modules():
            m.__dict__["_is_fsdp_managed_module"] = EngineMark(True, m)
    if job.resumed is not None:
        job.resumed.close()


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
    once, a real one's at the end: `drop_params`), moves its buffers, and marks and
    guards its modules. Where it fails, or a Ctrl-C noted in its last lines is raised
    at their end (after every group was handed over), the model is put back as it
    was: its parameters (the user's tensors, which the engine only read), buffers
    and marks, so it trains as before or is given to `initialize` again. Before, only
    meta parameters were put back: a Ctrl-C in those last lines left a model on the
    CPU with a closed engine's stand-ins, its weights gone with the engine."""

    def __init__(self, model: nn.Module) -> None:
        # each module's attributes (the engine's marks and guards are added there, and
        # views of gathered weights while a group is bound), parameters and buffers
        self._modules = [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers))
                         for m in model.modules()]

    def restore(self) -> None:
        for m, attrs, params, buffers in self._modules:
            for k in [k for k in m.__dict__ if k not in attrs]:
                del m.__dict__[k]
            m.__dict__.update(attrs)
            m._parameters.clear()
            m._parameters.update(params)
            m._buffers.clear()
            m._buffers.update(buffers)
            for name in params:
                point_weight_list(m, name)


