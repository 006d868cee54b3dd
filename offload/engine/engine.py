"""`OffloadEngine`: ZeRO-3 training with partitions tiered over DEVICE, HOST and NVME.

[Note: gathered weights and autograd]
Each group has one persistent flat leaf tensor (`flat`, compute dtype,
requires_grad) whose storage is allocated only while the group is gathered:
`_gather` resizes the storage and all-gathers the shards into it, and the
module attributes are bound to fresh views of it before each use, so autograd
routes every use's gradient into `flat.grad` through one AccumulateGrad. After
a unit's forward its groups' storage is resized to 0 (autograd's saved views
keep the tensor, not the bytes); a hook on the unit's outputs re-gathers
before the unit's backward runs; `flat`'s post-accumulate-grad hook fires once
per backward, after the last use, and reduce-scatters the gradient into the
rank's fp32 grad partition and frees the storage again. During backward
(activation-checkpoint recomputation) a unit's forward does not free: the
post-accumulate hook does.

[Note: one split per use]
The parameter views of a group come from one `flat.split(...)`, not a slice
per parameter: autograd then sums them with one SplitBackward (a single
flat-sized gradient) where slices would each zero-fill a flat-sized gradient
and AccumulateGrad would add them up.

[Note: warm gather memory] and [Note: gathered weights borrow the record] are in
warm.py.

[Note: what lives where]
The compute-dtype parameter partition (`("p", gid)`) and the fp32 gradient
partition (`("g", gid)`) are records in the `TieredStore`, homed by
`engine.params` / `engine.grads`. fp32 master weights and Adam moments belong
to `CpuAdam`, on the host or streamed from NVMe (`engine.optimizer`): the
optimizer's pipeline owns their chunked layout. In fp32 training the
parameter partition is itself the master (`master_is_param`): the optimizer
keeps only the moments, reads the current partition and writes the new one
(into the staged record during a step, [Note: all or nothing] in step.py, or
in place where nothing can fail any more), so no second fp32 copy is stored,
read or written.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
import uuid
import weakref
from concurrent.futures import BrokenExecutor, Future, ThreadPoolExecutor
from typing import Any, Callable

import torch
from torch import nn

from ..comm import Collectives, GatherIssuer, Pending
from ..config import OffloadConfig
from ..io import hold_switch_interval
from ..optim import CpuAdam, OptimStepError
from ..planner import AccessTrace
from ..planner.sizes import keeps_master
from ..store import Tier, TieredStore, footprint
from ..store.copy import bind_thread, start_cpu_threads
from ..trace import NULL_RECORDER, TraceRecorder, UnitSpans
from .eviction import PendingUpdates
from .fixed_config import FixedConfig
from .forward_prefetch import ForwardOnlyPrefetch
from .full_weights import params_from_masters
from .gathering import GatheredWeights, GroupState, in_backward
from .grad_slots import GradSlots
from .grads import _DTYPES, GradPartitions, refuse_backward_args
from .hyper_watch import HyperWatch
from .hooks import IN_BACKWARD, ForwardPass, ModuleHooks
from .saved_weights import FUNCTORCH_REFUSED, close_all, refused_by_functorch
from .weight_writes import WeightWrites
from .in_place import pin_in_place, unpin_all, update_in_place
from .interrupts import SafeInterrupts
from .lr_scheduler import step_scheduler
from .nested_grads import NestedGrads
from .model_weights import ModelWeights
from .one_thread import EngineBusyError, OneThread, one_call
from .owned import Owned
from .params_view import RegisteredParams, all_dropped
from .rank_order import RankOrder, RankOrderError
from .step import StagedParams, StepFailedError, uninterrupted
from .tensor_parallel import TensorParallel
from .training_checkpoint import CheckpointSave
from .training_checkpoint import save_checkpoint as _save_checkpoint
from .units import NOT_PICKLABLE, EngineHook, Group, Unit, eager, static_order, weak_hook
from .updates import GroupUpdates
from .warm import Borrowing, WarmMemory
from .working_set import working_set

log = logging.getLogger(__name__)

__all__ = ["OffloadEngine"]

_TIERS = {"device": Tier.DEVICE, "host": Tier.HOST, "nvme": Tier.NVME}


class OffloadEngine(ModelWeights, ModuleHooks, GradPartitions, GroupUpdates, GatheredWeights,
                    nn.Module):
    """The wrapped model; built by `offload.initialize`. Call it like the model."""

    def __init__(self, model: nn.Module, cfg: OffloadConfig, units: list[Unit],
                 groups: list[Group], store: TieredStore, comm: Collectives,
                 recorder: TraceRecorder = NULL_RECORDER, tp: TensorParallel | None = None,
                 gathers: GatherIssuer | None = None) -> None:
        super().__init__()
        self.module, self.cfg = model, cfg
        self.fixed_cfg = FixedConfig(cfg)
        self.units, self.groups = units, groups
        # comm: the data-parallel ranks ([Note: ZeRO-3 over DP, tensor parallelism over TP])
        self.store, self.comm, self.tp = store, comm, tp
        # every rank of the job: what all must agree on (the ranks' order, a step's outcome)
        self._whole = comm if tp is None else tp.mesh.world
        self.recorder = recorder
        self._gathers = gathers or GatherIssuer(comm)  # [Note: gather thread]
        self._spans = UnitSpans(recorder)  # per-unit spans and use waits (docs/trace.md)
        self.dtype = _DTYPES[cfg.engine.dtype]
        self.device = store.device
        self.trace = AccessTrace(static_order(units))  # step 1 follows the modules' order
        self.micro_step = 0   # backward calls, all steps
        self.global_step = 0  # optimizer steps taken
        # [Note: a training's checkpoints] in checkpoint_publish.py: kept over resumes
        self.run_id = uuid.uuid4().hex
        # [Note: a graph of older weights] A forward's graph is for the weights it
        # gathered: a backward through it after they changed (a step, a load) would
        # gather the new ones, so each group counts the changes of its weights
        # (GroupState.version) and the backward of a unit whose groups changed since
        # its forward raises, as torch's version counters do. A step that updated
        # other groups only (a GAN's discriminator) leaves the graph usable, as torch.
        # the last committed step's global gradient 2-norm before clipping, over every
        # rank (what torch's clip_grad_norm_ returns), where the step computed it
        # (optim.max_grad_norm > 0, or fp16); else None
        self.grad_norm: float | None = None
        self._backwards = 0   # backward calls since the last step (or zero_grad)
        self._in_backward = False  # engine.backward() is running: [Note: backward runs here]
        self._backward_units: set[int] = set()  # units whose backward hook checked (hooks.py)
        self._saved_scopes: list = []  # [Note: weights saved for a backward]
        self._saved_hooks_on: dict[int, bool] = {}  # unit -> False: its forward runs torch.func
        self._weight_writes = WeightWrites()  # [Note: weights written in a forward]
        e = cfg.engine  # fp16: a fixed loss scale, or dynamic scaling's first one
        self.loss_scale = (e.loss_scale or e.initial_loss_scale) if e.dtype == "fp16" else 1.0
        self._good_steps = 0
        self._grad_tier, self._param_tier = _TIERS[cfg.engine.grads], _TIERS[cfg.engine.params]
        # fp32 partitions the CPU optimizer can update where they are: see [Note: what
        # lives where]; on a GPU, DEVICE-homed ones keep a master on the CPU side
        self.master_is_param = not keeps_master(cfg.engine.dtype, cfg.engine.params,
                                                self.device.type)
        self._states = [GroupState(g, self.dtype, self.device) for g in groups]
        # an early update's gradient is a HOST record where HOST has room for it beside
        # the minimum working set ([Note: the gradient's fp32 copy is a record])
        grads = [footprint(g.shard * 4) for g in groups if g.requires_grad]
        need = working_set(cfg, groups, self.dtype)
        self._early_grads_stored = bool(grads) and cfg.store.host_budget >= (
            need.host + max(grads))
        # what is gathered at once: two units' groups, and one gathered ahead across ranks
        size = [sum(groups[g].padded for g in u.needs) * self.dtype.itemsize for u in units]
        ahead = max((g.padded for g in groups), default=0) * self.dtype.itemsize
        unit = max((sum(footprint(groups[g].shard * self.dtype.itemsize) for g in u.needs)
                    for u in units), default=0)
        self._borrowing = Borrowing(self.device, comm.world == 1 and tp is None,
                                    cfg.store.device_budget - need.device, unit)
        self._warm = WarmMemory(self.device, 2 * max(size, default=0)
                                + (ahead if comm.world > 1 else 0), ahead)
        self._kept_warned: set[int] = set()  # [Note: kept weights] in warm.py
        self._warned_zero_fill = False  # zero_grad(set_to_none=False) said what it does
        # [Note: zero_grad in the window] A loop written for Accelerate or a torch
        # optimizer (step(); zero_grad() after every micro-batch) drops each micro-batch's
        # gradient under grad_accum_steps > 1: step() waits for more, zero_grad() starts
        # the step over, and nothing ever updates. Dropping is torch's meaning (and a
        # micro-batch may be discarded on purpose), so it stays; a zero_grad() right
        # after a step() that waited says so, once.
        self._step_awaits_more = False  # the last step() waited for more micro-batches
        self._zeroed = False  # [Note: engine.zero_grad on some ranks] in params_view.py
        self._warned_window_drop = False
        self._closed = False
        self._pid = os.getpid()  # [Note: an engine in a forked child] in model_weights.py
        self._reductions: list[Pending] = []
        self._has_grad: set[int] = set()
        self._nested = NestedGrads()  # [Note: reentrant checkpoints inside a unit]
        # [Note: a forward awaiting its backward] in hooks.py: this pass's mark, and the
        # marks of training passes whose graph is alive and no backward has ended since
        self._pass: ForwardPass | None = None
        self._awaiting: weakref.WeakSet = weakref.WeakSet()
        self._gradless_gathered: set[int] = set()  # [Note: weights without a gradient in
        # backward] in gathering.py
        self._one_thread = OneThread()  # [Note: one thread at a time] in one_thread.py
        # [Note: Ctrl-C at a safe point] in interrupts.py
        self._interrupts = SafeInterrupts(self._interrupted_twice)
        self._broken: str | None = None
        self._input_pass: int | None = None  # [Note: gradients of the inputs] in gathering.py
        self.param_group_of: dict[tuple[int, int], int] = {}  # (gid, slot) -> optimizer group
        self.grad_slots = GradSlots(comm)  # [Note: parameters without a gradient]
        self._hooks: list[Any] = []
        self._opt: CpuAdam | None = None
        # one thread: early updates run in the order backward produced the gradients
        self._updater = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-update",
                                           initializer=bind_thread, initargs=(store.device,))
        self._early: list[Future] = []
        self._start_updater()
        # [Note: values written between backward and step], [Note: every rank steps with
        # the same values] in hyper_watch.py
        self._hyper_watch = HyperWatch(self._whole)
        self.lr_scheduler: Any = None  # [Note: the engine's scheduler] in lr_scheduler.py
        self.resumed_extra: dict[str, Any] = {}  # the `extra` of the checkpoint resumed from
        # [Note: checkpoints of a rolled-back training] in checkpoint_publish.py
        self._resumed_step: int | None = None  # the global step a resume started at
        self._saved_here: set[str] = set()  # real paths of the checkpoints this engine saved
        self._said_ahead = False
        self.pending_updates = PendingUpdates()  # [Note: the updates' order] in eviction.py
        # the open step's new partitions ([Note: all or nothing] in step.py)
        self.staged = StagedParams(store, self._param_tier)
        self._update_order: list[int] = []  # groups in the order this step updated them
        self._next_update: dict[int, int] = {}  # group -> the one updated after it, last step
        self._io_lock = threading.Lock()
        # I/O completions and early updates are Python threads: [Note: switch interval]
        self._switch = hold_switch_interval(cfg.io.switch_interval)
        # released by close(), or when collected unclosed: [Note: an engine dropped
        # without close()] in owned.py
        self._owned = Owned(self, self._updater, self._warm, store, self._switch,
                            self._one_thread)
        self._opt_bytes = [0, 0]  # optimizer-state bytes read, written (all steps)
        self._save_comm: Collectives | None = None  # background saves' own group (ranks > 1)
        for st in self._states:
            if st.group.requires_grad:
                self._hooks.append(st.flat.register_post_accumulate_grad_hook(
                    weak_hook(self, OffloadEngine._on_grad, st.group.gid)))
        self._rank_order = RankOrder(self._whole, units, cfg.engine.check_rank_order,
                                     None if tp is None else tp.mesh)
        self._rank_order.on_missed_step = weak_hook(self, OffloadEngine._drop_missed_step)
        # [Note: registered parameters] in params_view.py
        self.registered = RegisteredParams(model, groups, units, self.dtype, self.device)
        self._ahead = ForwardOnlyPrefetch(units, store, cfg.engine.prefetch_depth)
        # [Note: our forward hooks run last], [Note: torch.compile] in units.py
        self._last_hooks: dict[int, list[int]] = {}  # id(module) -> its post hooks' ids
        for unit in units:
            module = unit.module
            self._hooks.append(module.register_forward_pre_hook(  # before the user's: they
                EngineHook(self._make_pre(unit)), prepend=True))  # may read the weights
            self._hooks.append(module.register_forward_hook(EngineHook(self._make_post(unit)),
                                                            always_call=True))
            self._last_hooks.setdefault(id(module), []).append(self._hooks[-1].id)
        for module in model.modules():
            self._hooks.append(module.register_load_state_dict_pre_hook(
                EngineHook(weak_hook(self, OffloadEngine._refuse_module_load))))
        # [Note: one thread at a time] in one_thread.py: around the root module's unit hooks
        self._hooks.append(model.register_forward_pre_hook(EngineHook(self._root_pre),
                                                           prepend=True, with_kwargs=True))
        self._hooks.append(model.register_forward_hook(EngineHook(self._root_post),
                                                       always_call=True))
        self._last_hooks.setdefault(id(model), []).append(self._hooks[-1].id)

    # -- the optimizer ----------------------------------------------------------------
    def _attach_optimizer(self, lr_lambda: Callable[[int], float] | None = None,
                          param_groups: list[dict[str, Any]] | None = None) -> None:
        self._opt = CpuAdam.open(self.cfg, rank=self.store.rank,  # its files: the store's
                                 nvme=self.cfg.engine.optimizer == "nvme", lr_lambda=lr_lambda,
                                 param_groups=param_groups, recorder=self.recorder,
                                 store=self.store,  # the store's swap file and I/O engine
                                 masters=not self.master_is_param)  # chunk buffers' layout
        self._owned.opt = self._opt
        self._opt.set_zero_grad_hook(self.zero_grad)  # optimizer.zero_grad(), as torch's
        self._opt.set_load_hook(self._params_from_masters)  # optimizer.load_state_dict()
        self._opt.set_step_open(self._early_updates_queued)  # ... refused while True
        self._opt.set_before_load(self._wait_for_save)  # ... after a save has read it

    def _start_updater(self) -> None:
        """Starts the update thread now. The executor starts it at its first `submit`,
        after queueing the work: where the start fails (a thread limit, RLIMIT_NPROC),
        backward raised, but the queued update stayed behind and ran in the next
        step's thread, on that step's state. Started here, a limit fails initialize."""
        try:
            self._updater.submit(start_cpu_threads).result()
        except RuntimeError as e:
            self._updater.shutdown(wait=False, cancel_futures=True)
            if isinstance(e, BrokenExecutor):  # its initializer failed, not the start
                raise
            raise RuntimeError(f"initialize: the optimizer's update thread cannot start ({e}): "
                               "the process is at its limit of threads (ulimit -u, "
                               "RLIMIT_NPROC, or the container's pids limit); raise it") from e

    @property
    def optimizer(self) -> CpuAdam:
        if self._opt is None:
            raise RuntimeError("the engine has no optimizer yet")
        return self._opt

    def _interrupted_twice(self, where: str) -> None:
        self._broken = (
            f"a second Ctrl-C interrupted this engine inside its own code ({where}): its "
            "state in memory may be inconsistent; do not save from it: close it "
            "(engine.close()) and resume a new engine from the last checkpoint "
            "(offload.initialize(model, config, resume=path))")

    def _after_failed_pass(self, e: BaseException, alone: str | None,
                           raises: bool = True) -> None:
        """A forward or backward raised `e` (its pass undone): tells the other ranks
        where they can learn it ([Note: a rank whose model raised]). `alone`: why they
        cannot go on together (`RankOrder.alone`, asked before the undo): the engine
        refuses every call from now on, and this raises why, from `e` (a Ctrl-C or an
        exit goes on as itself, and so does `e` where not `raises`: why is logged)."""
        if alone is None:
            self._rank_order.failed(e)
            return
        self._broken = alone
        if not isinstance(e, Exception) or not raises:
            log.error("%s", alone)
            return
        raise RuntimeError(alone) from e

    def _early_updates_queued(self) -> bool:
        """Whether the open step handed updates to the update thread, run or not yet."""
        return bool(self._early)

    def _undo_forward(self, e: BaseException) -> str | None:
        """A forward outside any backward raised `e`: gives its gathered weights back and,
        under autograd, abandons the accumulation window; returns `RankOrder.alone(e)`,
        asked first, for `_after_failed_pass`."""
        alone = self._rank_order.alone(e)
        close_all(self._saved_scopes)  # [Note: weights saved for a backward]
        self._release_gathered(orphan=True)
        if torch.is_grad_enabled():
            self._abandon_window("a forward raised")
        return alone

    # -- the user's loop ----------------------------------------------------------------
    @property
    def grad_accum_steps(self) -> int:
        """Backward calls per optimizer step: the configuration's `engine.grad_accum_steps`,
        fixed at initialize (assigning it raises, where it would be ignored)."""
        return self.cfg.engine.grad_accum_steps

    @grad_accum_steps.setter
    def grad_accum_steps(self, value: Any) -> None:
        raise AttributeError("grad_accum_steps is read from the configuration given to "
                             "offload.initialize ({'engine': {'grad_accum_steps': N}}, or "
                             "[engine] grad_accum_steps = N in a file), not set on the engine")

    @functools.partial(eager, recursive=False)  # [Note: torch.compile] in units.py
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._check_open()
        # [Note: one thread at a time], [Note: Ctrl-C at a safe point]; inside a backward it
        # is a checkpoint's recomputation, part of engine.backward()'s call
        guard = (contextlib.nullcontext() if in_backward()
                 else self._one_thread.held("engine(...)"))
        with guard, self._interrupts.held():
            if torch.is_grad_enabled():
                self._spans.step_begin()
            try:
                with self.recorder.span("forward", cat="compute", track="compute"):
                    out = self.module(*args, **kwargs)
                self._interrupts.safe_point()  # [Note: a call that a Ctrl-C fails]
                return out
            except BaseException as e:  # a forward changes no state of the step
                if in_backward():
                    self._release_gathered(orphan=True)
                else:
                    self._after_failed_pass(e, self._undo_forward(e))
                # [Note: weights saved for a backward], [Note: weights written in a forward]
                told = (RuntimeError(FUNCTORCH_REFUSED) if refused_by_functorch(e)
                        else self._weight_writes.take())
                if told is not None:
                    raise told from e
                raise

    def _drop_missed_step(self) -> None:
        """[Note: ranks run the same units] in rank_order.py: this rank met another's
        step() at another call (it skipped its own), and that step failed, dropping its
        gradients: this rank drops its own, so the ranks go on from the same state."""
        if self._backwards:
            self._drop_step()
            log.warning("another rank ran step() while this one did not: the step's "
                        "gradients are dropped on every rank; call engine.step() on every "
                        "rank after the same backward calls")

    def _abandon_window(self, what: str) -> None:
        """[Note: a forward that raises between micro-batches] With gradient
        accumulation, a forward that raises after some of the step's micro-batches
        ran their backward leaves their gradients summed in the grad partitions; the
        user's way back, running the step's micro-batches again, would count them
        twice (and shift every later step's window by one). So such a forward
        drops the step's gradients, as a backward that raises does: the step starts
        over. Evaluation forwards (autograd off) and a forward after the window's
        last backward (its gradients are whole: `step()` applies them) leave them.
        A backward that another rank's failure stopped drops them too ([Note: a rank
        whose model raised]): every rank drops the same window, and their steps pair."""
        done, n = self._backwards, self.cfg.engine.grad_accum_steps
        if not 0 < done < n:
            return
        self._abort_step()
        log.warning("%s after %d of the step's %d micro-batches: their gradients are "
                    "dropped; run the step's micro-batches again from the first", what,
                    done, n)

    def backward(self, loss: torch.Tensor, **torch_args: Any) -> None:
        """Backward of `loss` (scaled for fp16); gradients land in the grad partitions.

        The gradients of `engine.grad_accum_steps` backward calls are summed and
        divided by `grad_accum_steps` (the mean over micro-batches, as DeepSpeed and
        Accelerate do): pass each micro-batch's own loss, not divided. A backward
        that raises leaves every partition as it was before the step, and drops
        the step's gradients (run its micro-batches again).
        """
        self._check_open()
        self.fixed_cfg.check()  # [Note: engine.cfg changed between calls] in fixed_config.py
        refuse_backward_args(torch_args)  # retain_graph=, inputs=, ...: named, not a TypeError
        # [Note: one thread at a time], [Note: Ctrl-C at a safe point]
        with self._one_thread.held("engine.backward()", outer=True, sealed=True), \
                self._interrupts.held():
            self._backward(loss)

    def _agree_on_backward(self) -> bool:
        """The checks before a backward's first collective, agreed by every rank (one
        refusing makes every rank raise, nothing changed): what trains is what
        initialize saw, the ranks are at the same point, and what the program did to
        the shown `.grad`s; returns whether it dropped all of them on every rank
        ([Note: a .grad the program dropped] in params_view.py)."""
        try:  # what trains is fixed at initialize
            self.registered.check_trainable(self.module)
            refused = None
        except RuntimeError as e:
            refused = e
        dropped, error = self.registered.dropped_grads()
        self._zeroed = False  # a new window: [Note: engine.zero_grad on some ranks]
        refused = refused or error
        try:
            self._rank_order.check_backward()  # [Note: ranks run the same units]
            # [Note: freezing after initialize]; every rank learns whether one refused
            dropped = self.registered.check_frozen_agree(self.comm, refused is not None,
                                                         dropped)
            if refused is not None:
                raise refused
        except BaseException as e:
            # the forward's look-ahead gathers for this backward are dropped: a rank
            # that kept them would skip their all-gathers in its next forward, and
            # the ranks' collectives would no longer pair
            self._release_gathered()
            if isinstance(e, RankOrderError):  # another rank's pass failed: this rank's
                self._abandon_window("another rank's failure stopped a backward")  # too
            raise
        return dropped

    def _backward(self, loss: torch.Tensor) -> None:
        self._spans.step_begin()  # the model may have been called without the engine
        awaited, self._step_awaits_more = self._step_awaits_more, False
        if self._agree_on_backward():  # the micro-batches before this one are dropped:
            self._warn_window_drop("model.zero_grad()", awaited)  # it starts the step
            self._drop_step()
            self._spans.step_begin()
        if self._backwards >= self.cfg.engine.grad_accum_steps:
            raise RuntimeError(f"backward: {self._backwards} backward call(s) since the last "
                               "step(), and engine.grad_accum_steps is "
                               f"{self.cfg.engine.grad_accum_steps}; call engine.step() (or "
                               "engine.zero_grad()) first, or raise engine.grad_accum_steps "
                               "to accumulate more micro-batches")
        if self.loss_scale != 1.0:
            loss = loss * self.loss_scale
        if self._last_micro_step() and self._early_allowed():  # else nothing runs early
            self._hyper_watch.backward_begins(self.optimizer)
        try:
            with self.recorder.span("backward", cat="compute", track="compute"):
                self._in_backward = True
                IN_BACKWARD.add(self)
                self._backward_units.clear()  # [Note: a rank whose model raised]
                try:
                    loss.backward()
                    self._reduce_nested_grads()  # [Note: reentrant checkpoints inside a unit]
                finally:
                    self._in_backward = False
                    IN_BACKWARD.discard(self)
                    self._awaiting.clear()  # [Note: a forward awaiting its backward]
                self._spans.backward_end()
            for p in self._reductions:
                p.wait()
            self._interrupts.safe_point()  # [Note: a call that a Ctrl-C fails] in interrupts.py
        except BaseException as e:
            alone = self._rank_order.alone(e)  # [Note: a pass that raised under tensor ...]
            for p in self._reductions:  # let reductions in flight land, then undo them
                try:
                    p.wait()
                except Exception as e2:
                    log.debug("reduction failed while undoing a failed backward: %s", e2)
            self._abort_step()
            self._release_gathered(orphan=True)
            self._after_failed_pass(e, alone)
            raise
        finally:
            self._drop_nested_grads()  # what a failed pass left
            self._reductions.clear()
            self._release_gathered()
        self._backwards += 1
        self.micro_step += 1
        self.registered.show_grads(self.grad_slots.had)  # [Note: absent gradients]

    def _release_gathered(self, orphan: bool = False) -> None:
        """No forward runs now: frees what is still gathered (frozen groups; groups of a
        checkpoint recomputation that torch stopped early, skipping its post-hooks; a
        forward or backward that raised), after letting all-gathers in flight end.
        `orphan` (after an error): [Note: orphaned gathers]."""
        for st in self._states:
            if st.pending is not None:
                try:
                    self._gather(st)
                except Exception as e:  # the error that stopped the pass is reported
                    log.debug("gather of group %d failed while releasing: %s",
                              st.group.gid, e)
            st.active = 0
            if orphan and st.gathered:
                self._orphan(st)
            self._free(st)

    def _orphan(self, st: GroupState) -> None:
        """[Note: orphaned gathers] The frames of an error's traceback hold views of the
        weights gathered when it was raised (a layer's `weight` argument): freed in
        place, they would point at freed memory, and printing the traceback would
        crash the interpreter. After an error, the group's flat tensor takes a fresh,
        empty storage instead; the old one goes with its last view."""
        self._fresh_storage(st)
        if st.borrowed:  # the old storage keeps the pool's mapping; the record moves on
            self._return(st)
        st.gathered = False
        st.views.clear()
        self.unbind(st.group.gid)

    @one_call("engine.step()", outer=True, sealed=True)  # [Note: one thread at a time]
    def step(self) -> bool:
        """The optimizer step over every partition, then `lr_scheduler.step()` where
        initialize was given one; returns False if it was skipped
        (fp16 overflow; with clipping on, a gradient norm that is not finite, in every
        dtype, with a warning), if no backward ran since the last step, or if this is
        not the last micro-step of `grad_accum_steps`.

        All or nothing ([Note: all or nothing] in step.py): on a failure every
        parameter, master, moment and step count is as before the step, the
        step's gradients are dropped, and `StepFailedError` names the groups and
        the cause; remove the cause and run the step's micro-batches again.
        """
        self._check_open()
        self.fixed_cfg.check()  # [Note: engine.cfg changed between calls] in fixed_config.py
        # a dropped window meets the others' step: [Note: engine.zero_grad on some ranks]
        if self._backwards == 0 and not self._zeroed or \
                self._backwards % self.cfg.engine.grad_accum_steps:
            self._step_awaits_more = self._backwards > 0  # [Note: zero_grad in the window]
            return False
        number, error = self.global_step + 1, None
        # the step, its schedule and its report, one engine call: [Note: Ctrl-C at a safe
        # point] in interrupts.py (a Ctrl-C in torch's scheduler left it half stepped)
        with self._interrupts.held():
            try:
                with self.recorder.span("optimizer step", cat="compute", track="compute"):
                    try:
                        done = self._step()
                        self._backwards = 0  # before a Ctrl-C noted in the step is raised
                    except BaseException as e:
                        if self.global_step == number:  # after the commit: the step is
                            self._backwards = 0         # applied, nothing to undo or claim
                            raise
                        undone = self._abort_step(e)
                        if not isinstance(e, Exception):
                            raise
                        which = (f"groups {undone} rolled back" if undone else
                                 "no update had begun")
                        raise StepFailedError(
                            f"step {number} failed ({type(e).__name__}: {e}); {which}: "
                            "every group is at its state before the step (parameters, "
                            "master weights, Adam moments, step counts) and the step's "
                            "gradients were dropped: fix the cause and run the step's "
                            "micro-batches again", undone) from e
                return done
            except BaseException as e:
                error = type(e.__cause__ or e).__name__
                raise
            finally:
                try:  # after each step that commits, an error raised after its commit too
                    if self.global_step == number and self.lr_scheduler is not None:
                        with self._interrupts.everywhere():  # its lr lambda's lines too
                            step_scheduler(self.lr_scheduler, number)
                finally:
                    self._spans.step_end(number, error)  # the report's card of this step

    def _step(self) -> bool:
        self.wait_for_checkpoint(raise_error=False)  # nothing changes before it has read
        self._rank_order.check_step()  # [Note: ranks run the same units] in rank_order.py
        self.trace.finish()  # after the check: a rank that skipped step() records on too
        early, self._early = self._early, []
        # [Note: a .grad the program dropped] in params_view.py
        dropped, error = self.registered.dropped_grads()
        dropped, self._zeroed = dropped or self._zeroed, False
        changed = self._hyper_watch.step_begins(self.optimizer, bool(early))
        errors = [error, None if dropped else changed]  # undone with the step
        errors += [f.exception() for f in early]  # waits for every one of them
        # [Note: ranks agree] in collectives.py: before the step's first collective
        # (under tensor parallelism every rank's: a TP rank that committed alone would
        # leave its shards a step ahead of the others')
        dropping = self._whole.agree(next((e for e in errors if e is not None), None),
                                     "step()", flag=dropped)
        if all_dropped(dropping, self._whole.world):  # as zero_grad() before this step: it
            self._drop_step()  # changes nothing; no card: the next micro-batch starts it
            return False
        gids = [g for g in sorted(self._has_grad) if ("g", g) in self.store]
        scale = self._grad_divisor
        norm, found_inf = self._grad_norm(gids, scale)
        if found_inf:
            self._abort_step()
            self._after_overflow()
            return False
        self.pending_updates.add(*gids, reads_master=self.master_is_param)
        pinned = None
        try:  # what can fail, every rank's part of it, before any rank commits
            with self._whole.together("step()"):
                if self.cfg.engine.optimizer == "host" and not self.staged:
                    pinned = pin_in_place(self, gids)
                if pinned is not None:  # its updates cannot be undone: refuse bad values first
                    self.optimizer.check_values(self.global_step)
                else:
                    for gid in gids:
                        self._update_group(gid, None, norm)
                self.staged.ready()
                self.optimizer.durable(grad_norm=norm)
        except BaseException:
            unpin_all(self, pinned or [])
            raise
        with uninterrupted():  # [Note: no interrupt mid-commit] in step.py
            if pinned is not None:
                update_in_place(self, gids, norm, pinned)
            self.pending_updates.clear()
            self.optimizer.commit(grad_norm=norm)  # its writes are durable: cannot fail
            updated = set(gids) | set(self.staged.switch())  # early updates' too
            self._has_grad.clear()
            self.grad_slots.clear()
            self.registered.hide_grads()
            self._after_good_step()
            self.global_step += 1
            self.weights_changed(updated)
            self.grad_norm = norm
        self._prefetch_state()
        return True

    def _abort_step(self, cause: BaseException | None = None) -> list[int]:
        """Undoes the open step: waits for early updates, rolls the optimizer's round
        back, forgets staged parameters and drops the step's gradients; returns the
        groups whose update was undone (`cause`: the error that stopped the step, for
        the groups the optimizer undid itself). The next backward starts a new step."""
        errors = [cause] + [f.exception() for f in self._early]  # waits for them
        self._early = []
        self.pending_updates.clear()
        undone = set(self.staged.discard())
        try:
            undone |= set(self.optimizer.rollback())
        finally:  # a round that cannot be undone (see in_place.py) still ends the step
            for e in errors:
                if isinstance(e, OptimStepError):
                    undone.update(e.unchanged)
            self._drop_grads([g.gid for g in self.groups if ("g", g.gid) in self.store])
            for st in self._states:  # a gradient hook stopped before it took the .grad
                st.flat.grad = None  # (an error, Ctrl-C): the next backward adds to it
            self._update_order = []
            self._backwards = 0
            self.registered.hide_grads()
            self._hyper_watch.forget()
        return sorted(undone)

    def _prefetch_state(self) -> None:
        """Starts reading the optimizer state of the group this step updated first: the
        next step's first update (the last group of the forward) then finds its first
        chunks read while the forward runs."""
        order, self._update_order = self._update_order, []
        self._next_update = dict(zip(order, order[1:]))  # each update reads the next's ahead
        if order and self.cfg.engine.optimizer == "nvme":
            try:  # after the commit: a read-ahead that fails costs its time, never the step
                self.optimizer.prefetch(order[0])
            except Exception as e:
                log.warning("reading the next step's first optimizer state ahead failed "
                            "(%s: %s); the step is applied, that update reads it when it "
                            "runs", type(e).__name__, e)

    def _params_from_masters(self, gids: list[int]) -> None:
        params_from_masters(self, gids)

    def _after_overflow(self) -> None:
        e = self.cfg.engine
        if e.dtype == "fp16" and not e.loss_scale:
            self.loss_scale = max(e.min_loss_scale, self.loss_scale / 2)
            log.info("fp16 overflow: step skipped, loss scale now %g", self.loss_scale)
        elif e.dtype == "fp16":  # a fixed scale never moves: say so, or no step ever may
            log.warning("step %d skipped: fp16 gradients overflowed at the fixed "
                        "engine.loss_scale %g (lower it, or set 0 for dynamic scaling)",
                        self.global_step + 1, self.loss_scale)
        else:  # docs/engine.md: non-finite gradients
            log.warning("step %d skipped: the gradients' norm is not finite (inf or NaN "
                        "gradients, e.g. from an inf in the batch); every weight, moment and "
                        "step count is unchanged (torch's clip_grad_norm_ and AdamW would write "
                        "NaN into the weights)", self.global_step + 1)
        self._good_steps = 0

    def _after_good_step(self) -> None:
        e = self.cfg.engine
        if e.dtype == "fp16" and not e.loss_scale:
            self._good_steps += 1
            if self._good_steps % e.loss_scale_window == 0:
                self.loss_scale *= 2

    def nvme_bytes(self) -> tuple[int, int]:
        """(read, written): bytes moved between NVMe and host so far, by the store
        (parameters, gradients) and the optimizer (master weights, moments)."""
        moves = self.store.stats().moves
        with self._io_lock:
            opt_r, opt_w = self._opt_bytes
        read = moves["NVME->HOST"].bytes + moves["NVME->DEVICE"].bytes
        return read + opt_r, moves["HOST->NVME"].bytes + opt_w

    def _drop_step(self) -> None:
        """Drops the step in progress, as `zero_grad()`: its gradients, the updates
        that ran early (undone) and, where a backward ran, its span in the trace (the
        next micro-batch starts the step again)."""
        if self._backwards:
            self._spans.step_drop()
        self._abort_step()

    # -- checkpoints (docs/checkpoints.md) -- begin
    @one_call("engine.save_checkpoint()", outer=True, sealed=True)  # [Note: one thread at a time]
    def save_checkpoint(self, path: str | os.PathLike, extra: dict[str, Any] | None = None,
                        *, blocking: bool = True) -> CheckpointSave:
        """Writes the whole training state (parameters, masters, moments, step counts,
        loss scale, RNG states, config, `extra`: e.g. the data position) to the new
        checkpoint directory `path`, published atomically; every rank calls it,
        between steps. `blocking=False` returns at once: the state as of the call
        is written while training goes on, and the next `step()` waits for the save
        before it changes anything ([Note: saving in the background]).
        `offload.initialize(model, config, resume=path)` resumes."""
        self._check_open()
        self.wait_for_checkpoint()  # one save at a time
        # a blocking save is one engine call: [Note: Ctrl-C at a safe point] in interrupts.py
        with self._interrupts.held() if blocking else contextlib.nullcontext():
            # the save, known to the exit and to the next step at once (one slot, no code
            # runs in between): [Note: an engine open at interpreter exit] in owned.py
            self._owned.saving = _save_checkpoint(self, path, extra, blocking=blocking)
        return self._owned.saving

    def wait_for_checkpoint(self, *, raise_error: bool = True) -> None:
        """Waits for a save in the background to end; raises its error (with
        `raise_error=False`, as `step()` waits, logs it: the save's handle keeps it).

        A wait cut short (Ctrl-C) leaves the save the engine's: the save still
        reads the store and the optimizer, so `close()` and the calls that change
        the state wait for it again."""
        saving = self._owned.saving
        if saving is None or saving.done() and saving.reported:  # its error was had: once
            self._owned.saving = None
            return
        t0 = time.perf_counter()
        try:
            if saving.done():
                saving.wait()
                return
            with self.recorder.span("checkpoint wait", cat="wait", track="compute"):
                try:
                    saving.wait()
                finally:
                    saving.stalled += time.perf_counter() - t0
        except Exception as e:
            if raise_error:
                raise
            log.error("checkpoint %s failed (training goes on): %s", saving.path, e)
        finally:
            if saving.done():  # ended, with or without an error: the engine is done with it
                self._owned.saving = None
    # -- checkpoints -- end

    def close(self) -> None:
        """Removes the hooks, closes the optimizer and the store (and their swap files).
        The engine is unusable afterwards (its methods raise); closing again does
        nothing, or finishes a close cut short (a second Ctrl-C, a store whose moves
        did not end within store.wait_timeout). A Ctrl-C while it waits (for a save
        in the background) comes at its end ([Note: Ctrl-C at a safe point])."""
        if os.getpid() != self._pid:  # [Note: an engine in a forked child]
            self._closed = True
            return
        if self._owned.released:
            return
        # [Note: one thread at a time]: not under another thread's call, nor inside one
        with self._one_thread.held("engine.close()", outer=True, sealed=True):
            self._closed = True  # every call is refused from here, even if this one is cut short
        with self._interrupts.held():
            self.registered.close()  # the model's stand-ins say the engine is closed
            self.wait_for_checkpoint(raise_error=False)
            self._updater.shutdown(wait=True)
            self._gathers.close()
            if self._save_comm is not None:
                self._save_comm.destroy()
            if self.tp is not None:
                self.tp.mesh.close()
            for h in self._hooks:
                h.remove()
            self._hooks.clear()
            close_all(self._saved_scopes)  # [Note: weights saved for a backward]
            self._owned.release()  # the optimizer, warm memory, store, switch interval

    def __enter__(self) -> "OffloadEngine":
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:  # torch.save(engine), copy.deepcopy(engine)
        raise TypeError(NOT_PICKLABLE)

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except EngineBusyError as e:  # the block's own error is the one to see
            log.warning("the engine was not closed at the end of a `with` block that raised "
                        "(%s); call engine.close() once the other call has returned", e)
