"""Reading and loading `CpuAdam`'s committed state: `read_master`, `read_state_chunks`
(engine checkpoints), `partition_state` / `state_dict` and their loads.

Every read sees the committed version ([Note: rounds] in optimizer.py). The
state dict carries the moments in the optimizer's stored form ([Note: compressed
moments] in codec.py): fp32 or bf16 tensors, or int8/uint8 codes with their
scales under `exp_avg_scale` / `exp_avg_sq_scale`; a load takes that form as is
(bit for bit) or fp32 moments of any source (encoded on the way in).
`read_state_chunks` decodes to fp32, so an engine checkpoint holds fp32 moments
whatever the form, and a load encodes them again: a decoded int8 block encodes
to the same codes, so the round trip loses nothing.
"""

from __future__ import annotations

import numbers
import weakref
from typing import Any, Callable, Hashable, Iterator, Mapping

import torch

from ..config import HYPER_NAMES
from .adam import hyper_error
from .codec import Moment, copy_moment, decode, encode, moment_from_dict, moment_to_dict, \
    new_moment
from .state import PartitionState, Tier
from .torch_view import unsupported_option

__all__ = ["StateAccess", "StateView"]

_NOT_SAVED = ("params", "lr_lambda")  # a group's keys a state dict does not carry
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def flat_tensor(t: torch.Tensor, what: str, numel: int,
                dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """`t` as a 1-D view, checked: a contiguous CPU tensor of `dtypes`, `numel` elements,
    each at a multiple of its size."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or t.dtype not in dtypes or not t.is_contiguous():
        raise ValueError(f"{what}: a contiguous CPU tensor of {'/'.join(map(str, dtypes))} is "
                         f"needed, got {t.dtype} on {t.device} (contiguous={t.is_contiguous()})")
    if t.numel() != numel:
        raise ValueError(f"{what}: {t.numel()} elements, the partition has {numel}")
    if t.data_ptr() % t.element_size():  # native.py's kernel cannot take it ([Note: native kernel])
        raise ValueError(f"{what}: its address {t.data_ptr():#x} is not aligned to its "
                         f"{t.element_size()}-byte elements; pass a copy (t.clone())")
    return t.view(-1)


def _checked_steps(value: Any) -> int:
    """A state dict's "steps" (the optimizer's committed rounds): a whole number, at least 0."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = int(value)  # a numpy integer too
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"state_dict['steps']: {value!r} is not a count of steps (a whole "
                         "number, at least 0): load what state_dict() returned")
    return value


# an engine's step updates partitions during backward, in a round its step() commits
_OPEN_ROUND_FIX = ("load state between steps: under an engine, after engine.step() (or "
                   "drop the step with engine.zero_grad()); on its own, after commit() or "
                   "rollback()")

class StateView(Mapping):
    """`CpuAdam.state`: torch's `optimizer.state`, read-only, keyed as `param_groups`'
    "params" are (partition ids). `state[pid]` is `partition_state(pid)`: the committed
    version's "step", "exp_avg", "exp_avg_sq" and "master" (host state: the live
    tensors; NVMe state: read from the disk on each access, the partition's 12-16
    bytes an element). Changing state goes through `load_state_dict`."""

    def __init__(self, opt: "StateAccess") -> None:
        self._opt = weakref.ref(opt)

    def _owner(self) -> "StateAccess":
        opt = self._opt()
        if opt is None:
            raise RuntimeError("the optimizer of this state view is gone")
        return opt

    def __getitem__(self, pid: Hashable) -> dict[str, torch.Tensor]:
        opt = self._owner()
        if isinstance(pid, torch.Tensor):
            raise KeyError(
                "engine.optimizer.state is keyed by partition ids, as its param_groups' "
                "'params' are (each partition holds a slice of a group of parameters, "
                "flattened); a model parameter is not a key. Iterate over "
                "engine.optimizer.param_groups[k]['params'] for the keys")
        if pid not in opt._parts:
            raise KeyError(f"unknown partition {pid!r}; known: {list(opt._parts)[:8]}")
        return opt.partition_state(pid)

    def __contains__(self, pid: object) -> bool:
        return not isinstance(pid, torch.Tensor) and pid in self._owner()._parts

    def __iter__(self) -> Iterator[Hashable]:
        return iter(list(self._owner()._parts))

    def __len__(self) -> int:
        return len(self._owner()._parts)

    def __setitem__(self, pid: Hashable, value: Any) -> None:
        raise TypeError("engine.optimizer.state is read-only: load state with "
                        "engine.optimizer.load_state_dict (or load_partition_state)")

    __delitem__ = __setitem__

    def __repr__(self) -> str:
        return f"<optimizer state of {len(self)} partitions>"


class StateAccess:
    """The reading and loading half of `CpuAdam` (a mixin: it uses the optimizer's
    lock, partitions, pipeline and round)."""

    _load_hook: weakref.WeakMethod | None = None
    _step_open: weakref.WeakMethod | None = None
    _before_load: weakref.WeakMethod | None = None

    @property
    def state(self) -> StateView:
        """torch's `optimizer.state`, read-only, keyed by partition id ([`StateView`])."""
        return StateView(self)

    def set_load_hook(self, method: Callable[[list[Hashable]], Any]) -> None:
        """`load_state_dict` calls the bound `method(pids)` with the partitions it loaded,
        after loading them (held weakly): the engine rebuilds the compute-dtype
        parameters of those that keep their own master."""
        self._load_hook = weakref.WeakMethod(method)

    def set_before_load(self, method: Callable[[], Any]) -> None:
        """`load_state_dict` calls the bound `method()` first, outside the lock (held
        weakly): the engine waits there for a checkpoint save in the background, which
        reads this state as of its call ([Note: saving in the background])."""
        self._before_load = weakref.WeakMethod(method)

    def set_step_open(self, method: Callable[[], bool]) -> None:
        """`load_state_dict` refuses while the bound `method()` is true (held weakly): an
        engine's step whose updates are queued for its update thread, where they would
        run over the loaded state (and its parameters be read back from masters they
        are updating), or be refused, as the thread happened to reach them or not."""
        self._step_open = weakref.WeakMethod(method)

    def _committed_host(self, part: PartitionState) -> tuple[int, tuple]:
        """(step, (master, exp_avg, exp_avg_sq)) of a host partition's committed version."""
        return self._backups.get(part.pid, (part.step, part.host))

    def read_master(self, pid: Hashable, out: torch.Tensor) -> torch.Tensor:
        """Copies partition `pid`'s committed fp32 master into `out` (any float dtype,
        same numel, rounded to nearest even); e.g. to rebuild a compute-dtype copy.
        Returns `out`."""
        with self._lock:
            part = self.partition(pid)
            if part.master_is_param:
                raise ValueError(f"partition {pid!r} keeps no master: it is the caller's "
                                 "parameter partition (master_is_param)")
            flat = flat_tensor(out, f"read_master out of {pid!r}", part.numel, _OUT_DTYPES)
            if part.tier is Tier.HOST:
                flat.copy_(self._committed_host(part)[1][0])
            else:
                self._pipeline.read_state(part, lambda _p, _i, lo, n, m, _a, _s:
                                          flat[lo:lo + n].copy_(m))
            return out

    # -- checkpoint reader (engine checkpoints) -- begin
    def read_state_chunks(self, pid: Hashable,
                          consume: Callable[[int, int, dict[str, torch.Tensor]], None]) -> int:
        """Streams partition `pid`'s committed state ([Note: rounds]: an update in the
        open round is not seen); returns its committed step count. `consume(lo, n,
        tensors)` gets elements [lo, lo + n) as 1-D fp32 views {"master", "exp_avg",
        "exp_avg_sq"} ("master" absent where it is the parameter partition; compressed
        moments decoded), valid only during the call. Host state: one call for fp32
        moments (the live tensors, or the copy an update in the round kept), one per
        `chunk_elems` elements for compressed ones; NVMe state: one call per chunk read
        into a pipeline buffer, so the state is never held whole. Refused for a
        partition updated with final=True in the open round (its committed version
        is gone)."""
        with self._lock:
            part = self.partition(pid)
            if pid in self._final:
                raise RuntimeError(f"partition {pid!r} was updated in place (final=True) in "
                                   "the open round: its committed state is gone")
            scratch = None if self.state_dtype == "fp32" else torch.empty(
                2 * min(part.numel, self.chunk_elems), dtype=torch.float32)

            def named(lo: int, n: int, m, a: Moment, s: Moment) -> None:
                if scratch is None:
                    d = {"exp_avg": a.data, "exp_avg_sq": s.data}
                else:
                    d = {"exp_avg": decode(a, scratch[:n]), "exp_avg_sq": decode(s, scratch[n:2 * n])}
                if m is not None:
                    d["master"] = m
                consume(lo, n, d)
            if part.tier is Tier.HOST:
                step, (m, a, s) = self._committed_host(part)
                span = part.numel if scratch is None else self.chunk_elems
                for lo in range(0, part.numel, span):
                    hi = min(part.numel, lo + span)
                    named(lo, hi - lo, None if m is None else m[lo:hi], a[lo:hi], s[lo:hi])
                return step
            self._pipeline.read_state(part, lambda _p, _i, lo, n, m, a, s: named(lo, n, m, a, s))
            return part.step  # an NVMe partition's step advances at its commit
    # -- checkpoint reader -- end

    def partition_state(self, pid: Hashable) -> dict[str, torch.Tensor]:
        """{"step", "segment_steps", "exp_avg", "exp_avg_sq", "master"} of one
        partition's committed version (step: a 0-d fp32 tensor, as torch;
        segment_steps: int64, one per segment ([Note: segments]); no "master" where it
        is the parameter partition). The moments in the stored form (fp32, bf16, or
        int8/uint8 codes plus "exp_avg_scale" / "exp_avg_sq_scale"). Host state: the
        live tensors (no copy); NVMe state: fresh tensors read chunk by chunk."""
        with self._lock:
            part = self.partition(pid)
            step = torch.tensor(float(part.step))
            if part.tier is Tier.HOST:
                k, (m, a, s) = self._committed_host(part)
                step = torch.tensor(float(k))
            else:
                m = None if part.master_is_param else torch.empty(part.numel)
                a, s = (new_moment(self.state_dtype, k, part.numel)
                        for k in ("exp_avg", "exp_avg_sq"))

                def consume(_p, _i, lo, n, mb, ab, sb) -> None:
                    if mb is not None:
                        m[lo:lo + n].copy_(mb)
                    copy_moment(a[lo:lo + n], ab)
                    copy_moment(s[lo:lo + n], sb)
                self._pipeline.read_state(part, consume)
            seg_steps = torch.tensor(self._seg_backups.get(pid, part.seg_steps),
                                     dtype=torch.int64)
            state = {"step": step, "segment_steps": seg_steps, **moment_to_dict(a),
                     **moment_to_dict(s)}
            if m is not None:
                state["master"] = m
            return state

    def load_partition_state(self, pid: Hashable, state: Mapping[str, Any]) -> None:
        """Loads one partition's state (keys as `partition_state`, moments in this
        optimizer's stored form or fp32; "master" optional: absent keeps the current
        master; ignored where the master is the parameter partition; "segment_steps"
        optional: absent gives every segment `step`). NVMe: written to fresh extents,
        then switched, so a failure leaves the previous state whole."""
        with self._lock:
            part = self.partition(pid)
            step, tensors = self._checked_state(part, state)
            seg_steps = self._checked_seg_steps(part, state, step)
            if pid in self._round:
                raise ValueError(f"partition {pid!r} was updated in the open round; "
                                 f"{_OPEN_ROUND_FIX}")
            if part.tier is Tier.HOST:
                m, a, s = part.host
                if tensors["master"] is not None and m is not None:
                    m.copy_(tensors["master"])
                tmp = torch.empty(part.numel, dtype=torch.float32)
                for k, dst in (("exp_avg", a), ("exp_avg_sq", s)):
                    src = tensors[k]
                    if isinstance(src, Moment):
                        copy_moment(dst, src)
                    else:
                        encode(src, dst, tmp)
                part.step = step
                part.seg_steps = seg_steps
                return
            self._pipeline.discard(pid)
            new = self._write_new(part, tensors["master"], tensors["exp_avg"],
                                  tensors["exp_avg_sq"])
            part.commit(self._pipeline.swap, new, step)
            part.seg_steps = seg_steps

    def stage_master(self, pid: Hashable, master: torch.Tensor) -> Any:
        """[Note: new weights all or nothing] in offload/engine/full_weights.py: an NVMe
        partition's new fp32 `master` written to fresh extents, its moments and step
        kept; the partition is unchanged until `install_master` of the returned token
        (`drop_master` frees it). The partition must be on NVMe."""
        with self._lock:
            part = self._master_to_replace(pid)
            part.check_tier(Tier.NVME)
            flat = flat_tensor(master, f"stage_master of {pid!r}", part.numel,
                               (torch.float32,))
            return pid, self._write_new(part, flat, None, None)

    def set_master(self, pid: Hashable, master: torch.Tensor) -> None:
        """Replaces partition `pid`'s fp32 master, its moments and step kept: an NVMe
        one through `stage_master` (fresh extents, then switched), a host one in place."""
        if self.partition(pid).tier is Tier.NVME:
            self.install_master(self.stage_master(pid, master))
            return
        with self._lock:
            part = self._master_to_replace(pid)
            part.host[0].copy_(flat_tensor(master, f"set_master of {pid!r}", part.numel,
                                           (torch.float32,)))

    def _master_to_replace(self, pid: Hashable) -> Any:
        """Partition `pid`, refused where it keeps no master or its update of the open
        round has run (the lock held)."""
        part = self.partition(pid)
        if part.master_is_param:
            raise ValueError(f"partition {pid!r} keeps no master (master_is_param)")
        if pid in self._round:
            raise ValueError(f"partition {pid!r} was updated in the open round; "
                             f"{_OPEN_ROUND_FIX}")
        return part

    def install_master(self, token: Any) -> None:
        """Makes a `stage_master` the partition's master: no I/O, cannot fail."""
        pid, new = token
        with self._lock:
            part = self.partition(pid)
            self._pipeline.discard(pid)  # chunks read ahead hold the old master
            part.commit(self._pipeline.swap, new, part.step)

    def drop_master(self, token: Any) -> None:
        """Frees a `stage_master` not installed; the partition keeps its master."""
        _, new = token
        with self._lock:
            for ext in new:
                self._pipeline.swap.free(ext)

    @staticmethod
    def _checked_seg_steps(part: PartitionState, state: Mapping[str, Any], step: int) -> list[int]:
        got = state.get("segment_steps")
        if got is None:
            return [step] * len(part.segments)
        got = [int(x) for x in (got.tolist() if isinstance(got, torch.Tensor) else got)]
        if len(got) != len(part.segments) or any(x < 0 or x > step for x in got):
            raise ValueError(f"state of partition {part.pid!r}: segment_steps {got[:8]} do not "
                             f"fit its {len(part.segments)} segments at step {step}")
        return got

    def _checked_state(self, part: PartitionState, state: Mapping[str, Any]) -> tuple[int, dict]:
        """(step, {"master": fp32 or None, "exp_avg"/"exp_avg_sq": a `Moment` of this
        optimizer's form, or fp32})."""
        missing = {"step", "exp_avg", "exp_avg_sq"} - set(state)
        if missing:
            raise ValueError(f"state of partition {part.pid!r} lacks {sorted(missing)}")
        step = int(state["step"].item() if isinstance(state["step"], torch.Tensor)
                   else state["step"])
        if step < 0:
            raise ValueError(f"state of partition {part.pid!r}: step {step} is negative")
        what = f"state[{part.pid!r}]"
        t = state.get("master")
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}['master']: expected a torch.Tensor, got {type(t).__name__}")
        tensors = {"master": None if t is None else flat_tensor(
            t.detach().to(torch.float32).contiguous(), f"{what}['master']", part.numel,
            (torch.float32,))}
        for k in ("exp_avg", "exp_avg_sq"):
            tensors[k] = moment_from_dict(state, k, self.state_dtype, part.numel, what)
            if isinstance(tensors[k], torch.Tensor):
                tensors[k] = flat_tensor(tensors[k], f"{what}[{k!r}]", part.numel,
                                         (torch.float32,))
        return step, tensors

    def state_dict(self) -> dict[str, Any]:
        """torch-style: {"state": {pid: partition_state(pid)}, "param_groups": [{"lr",
        "betas", "eps", "weight_decay", "params": [pids]}], "steps": committed rounds}.
        A group's other keys (those a scheduler wrote: "initial_lr", OneCycleLR's
        "max_lr", ...) are saved as torch saves them, so a scheduler made with
        `last_epoch` after a load finds them. `lr_lambda` is not saved (as LambdaLR
        does not save its lambdas)."""
        with self._lock:
            groups = [{**{k: v for k, v in g.items() if k not in _NOT_SAVED},
                       "params": list(g["params"])} for g in self.param_groups]
            return {"state": {pid: self.partition_state(pid) for pid in self._parts},
                    "param_groups": groups, "steps": self.steps}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Loads `state_dict()` output: hyper-parameters per group, then each
        partition's state. Everything is checked before anything changes."""
        before = self._before_load() if self._before_load is not None else None
        if before is not None:
            before()
        with self._lock:
            groups = state_dict.get("param_groups")
            states = state_dict.get("state", {})
            if groups is None or len(groups) != len(self.param_groups):
                raise ValueError(f"state_dict has {0 if groups is None else len(groups)} "
                                 f"param groups, the optimizer {len(self.param_groups)}")
            for k, (mine, theirs) in enumerate(zip(self.param_groups, groups)):
                if set(theirs.get("params", ())) != set(mine["params"]):
                    raise ValueError(f"param_groups[{k}] holds partitions "
                                     f"{list(theirs.get('params', ()))[:8]}, this optimizer "
                                     f"{mine['params'][:8]}: load what this optimizer's "
                                     "state_dict() returned (a torch optimizer's names the "
                                     "model's parameters, not the engine's partitions; "
                                     "save_checkpoint / resume carry the whole state)")
                bad = unsupported_option(theirs, self.decoupled) or hyper_error(
                    *(theirs.get(key, mine[key]) for key in HYPER_NAMES))
                if bad:
                    raise ValueError(f"state_dict param_groups[{k}]: {bad}")
            for pid, st in states.items():
                part = self.partition(pid)
                self._checked_seg_steps(part, st, self._checked_state(part, st)[0])
            steps = _checked_steps(state_dict.get("steps", self.steps))
            step_open = self._step_open() if self._step_open is not None else None
            if self._round or (step_open is not None and step_open()):
                raise ValueError(f"the open round's updates have run or are queued "
                                 f"(partitions {self.round[:8]} so far); {_OPEN_ROUND_FIX}")
            for mine, theirs in zip(self.param_groups, groups):
                # every saved key, as torch's load_state_dict (a scheduler's too)
                mine.update({k: v for k, v in theirs.items() if k not in _NOT_SAVED})
                mine["betas"] = tuple(mine["betas"])
            for pid, st in states.items():
                self.load_partition_state(pid, st)
            self.steps = steps
            self._round.clear()
        hook = self._load_hook() if self._load_hook is not None else None
        if hook is not None:  # outside the lock: it reads the masters back
            hook(list(states))
