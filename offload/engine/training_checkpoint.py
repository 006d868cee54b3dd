"""Checkpoints of the whole training state: one zarr v3 store (tensorstore) per checkpoint.
This module writes them; checkpoint_reader.py reads them back.

[Note: checkpoint layout]
A checkpoint is one directory that any zarr v3 reader opens:
  checkpoint.json          the commit record (see below); written last
  ranks/<r>.json           what rank r wrote: its element ranges, step counts, RNG
  param/<name>             the parameter in its full logical shape, compute dtype
  master/<name>            its fp32 master weights, where distinct from `param`
  exp_avg/<name>           Adam's first moment, fp32
  exp_avg_sq/<name>        Adam's second moment, fp32
`<name>` is the parameter's name in the model (the first use of tied weights;
the record lists the other names). A partition is a slice of a group's flat
buffer; the group's slots map flat ranges to parameters (units.py), so each
rank writes, for every array, the element ranges its partitions cover, as
boxes of the array (`flat_boxes`; the layout's code is checkpoint_layout.py).
Chunks are whole rows of dimension 0, about `CHUNK_ELEMS` elements, each
followed by its crc32c (zarr's `crc32c` codec), which every read verifies;
consecutive chunks share a shard file (zarr's `sharding_indexed` codec,
[Note: shard files]): up to `SHARD_CHUNKS` of them when one rank saves, one
when several do. A shard that two ranks' ranges share
is written in rank order, one rank after the other (barriers), every other
shard by its one writer without coordination. Shards of one chunk with several
ranks keep what two ranks share, held in memory until the rank's turn, at one
chunk's size.

The commit record holds what is not a tensor: the format, the package
version, the config, the world size, the engine's step counters and loss
scale, the optimizer's hyper-parameters, every tensor's names, shape, dtypes
and group, the groups' step counts (Adam's bias correction; `lr_lambda` is
evaluated at the global step, also saved), and the user's `extra`.

[Note: publishing a checkpoint]
A save writes into `.<name>.partial` beside the target, makes every file and
directory durable (fsync), writes the commit record, fsyncs it and renames
the directory to its name in one `rename`, then fsyncs the parent. A reader
opens only a directory holding a commit record, so it sees the previous
checkpoint or the new one, never a mix; a save killed at any point leaves a
`.partial` directory, which the next save into the same parent removes. The
target must not exist: a checkpoint is never overwritten in place (save each
under its own name, e.g. by step). `engine.keep_checkpoints` > 0 keeps that
many committed checkpoints (highest steps) in the parent, removing older ones
after a publish.

Saving happens between steps only: while a step's updates are open (the
optimizer's round, staged parameters, gradients of a step not taken) the
state is not one version, and the save is refused ([Note: all or nothing] in
step.py).

[Note: saving in the background]
`save_checkpoint(..., blocking=False)` captures at the call what is not a
tensor (step counters, loss scale, hyper-parameters, RNG states, the tensor
table) and leaves the tensors to a thread, which must still see them as they
were at the call while training goes on. It does, because nothing the next
step does before its commit changes a committed version: a forward only reads
the parameter partitions; a backward writes gradients (not saved) and, with
NVMe optimizer state, may run early updates, which write new optimizer state
to fresh extents and new parameters to staged records, keeping the previous
versions readable ([Note: all or nothing] in step.py), and the thread reads
exactly those (`CpuAdam.read_state_chunks` reads the committed version). The
first thing that changes a committed version is `step()` (in-place updates of
host state, the optimizer's commit, the switch of staged parameters),
`load_state_dict` or `full_weights(writable=True)`. So each begins by waiting
for the save (`OffloadEngine.wait_for_checkpoint`); that wait is the save's
stall, zero when the save finishes within the next forward and backward.
With several ranks the thread's barriers use a process group of their own
(gloo), created at the call, so they never interleave with the training's
collectives.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
import threading
import time
import zlib
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..comm import RankFailedError
from ..config import HYPER_NAMES
from ..files import check_directory, existing_ancestor
from ..io import host_copy
from ..io.errors import limit_hint
from ..store import Tier
from .checkpoint_buffers import (BUFFERS, EXTRA_STATES, capture_buffers,
                                 capture_extra_states, encode_buffers)
from .checkpoint_chunks import ChunkFiles, InPlace, Shard, chunk_key
from .checkpoint_files import (CheckpointCorruptError, CheckpointError, CheckpointPathError,
                               _digest, _fsync_path, _fsync_tree, _read_json, _write_json,
                               rng_state)
from .checkpoint_layout import (_DTYPE_NAMES, FORMAT, KINDS, TORCH_DTYPES, Grid, _box_shape,
                                _context, _grid, _max_chunk_bytes, _segments, _spec,
                                _stored_shape, _to_numpy, _ts, flat_boxes)
from .checkpoint_publish import (LOCK, PARTIAL, RECORD, PartialLock, check_save_path,
                                 partial_of, prune, remove_partials)
from .lr_scheduler import scheduler_state, to_json_scalar
from .units import Group, Slot
from .working_set import this_host

log = logging.getLogger(__name__)

__all__ = ["CheckpointError", "CheckpointCorruptError", "CheckpointSave", "save_checkpoint",
           "RECORD", "FORMAT"]


# -- saving ------------------------------------------------------------------------------
def check_between_steps(engine: Any) -> None:
    """Refuses a save while a step's updates are open ([Note: all or nothing])."""
    opt = engine.optimizer
    why = []
    if opt.round:
        why.append(f"the optimizer's round holds updates of groups {opt.round[:8]}")
    if len(engine.staged):
        why.append("new parameters of the step are staged")
    if engine._backwards or engine._early:
        why.append(f"{engine._backwards} backward call(s) ran since the last step")
    if why:
        raise CheckpointError("save_checkpoint: a step is open (" + "; ".join(why) + "); save "
                              "between steps: after engine.step() (or engine.zero_grad())")
    if len(engine._awaiting):  # [Note: a forward awaiting its backward] in hooks.py
        raise CheckpointError(
            "save_checkpoint: a forward in training mode awaits its backward (its outputs "
            "are still held): the checkpoint would hold the RNG states and BatchNorm "
            "statistics after that forward but not its activations, so a resumed run would "
            "not redo that micro-batch as this one goes on. Save after its engine.backward() "
            "and engine.step(), or drop its outputs (del loss, out) first; evaluate under "
            "torch.no_grad() or in model.eval()")


def _tensor_table(engine: Any) -> dict[str, dict[str, Any]]:
    """name -> shape, aliases, group, offset, dtype of each kind the checkpoint holds."""
    opt = engine.optimizer
    table = {}
    for g in engine.groups:
        kinds = {"param": _DTYPE_NAMES[engine.dtype]}
        if g.requires_grad:
            if opt.has_master(g.gid):
                kinds["master"] = "float32"
            kinds["exp_avg"] = kinds["exp_avg_sq"] = "float32"
        for s in g.slots:
            table[s.fqn] = {"shape": list(s.shape), "aliases": list(s.names), "group": g.gid,
                            "offset": s.offset, "requires_grad": g.requires_grad,
                            "kinds": dict(kinds)}
    return table


class _OpenChunk:
    """A chunk being assembled in an aligned buffer: chunk `k` of its array, `numel`
    elements of data (fewer than the chunk's at the array's end), `filled` so far
    (scheduled), `pending` copies into it not yet done, and `shard`, set once its
    last piece is scheduled: the copy that finishes last writes it there."""

    __slots__ = ("k", "buf", "numel", "nbytes", "filled", "pending", "shard")

    def __init__(self, k: int, buf: Any, numel: int, nbytes: int) -> None:
        self.k, self.buf, self.numel, self.nbytes = k, buf, numel, nbytes
        self.filled = self.pending = 0
        self.shard: Shard | None = None


class _GroupWriter:
    """Writes one rank's partition of one group into the arrays, range by range
    ([Note: shard files]): a chunk of a shard only this rank writes goes to its
    shard file straight from the partition's memory where one aligned range holds
    all of it, else assembled in an aligned buffer (the copies on the chunk
    threads); a shard another rank writes too is written through tensorstore in
    rank turns (`finish`)."""

    def __init__(self, root: Path, g: Group, rank: int, arrays: dict, context,
                 files: ChunkFiles, table: dict) -> None:
        self.root, self.g, self.rank, self.arrays = root, g, rank, arrays
        self.context, self.files, self.table = context, files, table
        self.open: dict[tuple[str, str], _OpenChunk] = {}
        self.shared: list[tuple[str, Slot, int, np.ndarray]] = []  # written in rank turns
        self.copies: list = []  # futures of the copies of the current `write`
        self.in_place: list[InPlace] = []  # chunks of the current `write` from its memory
        self.lock = threading.Lock()
        self.bytes = 0
        # each slot's range on this rank, cut at shared chunks: the same for every write
        self.segments = [(s, _segments(g, s, rank)) for s in g.slots]

    def write(self, lo: int, values: dict[str, torch.Tensor]) -> None:
        """`values`: kind -> the rank's partition-local elements [lo, lo + len) of it;
        copied or written before this returns (the tensors may be reused buffers)."""
        try:
            for kind, v in values.items():
                self._write(kind, lo, v)
        finally:
            copies, self.copies = self.copies, []
            in_place, self.in_place = self.in_place, []
            for t in in_place:
                t.wait()
            for f in copies:
                f.result()

    def _write(self, kind: str, lo: int, values: torch.Tensor) -> None:
        base = self.rank * self.g.shard + lo
        end = base + values.numel()
        for s, segments in self.segments:
            for a, b, shared in segments:
                x, y = max(a, base - s.offset), min(b, end - s.offset)
                if x >= y:
                    continue
                piece = values[s.offset + x - base:s.offset + y - base]
                if shared:  # held until this rank's turn
                    self.shared.append((kind, s, x, _to_numpy(piece.clone())))
                else:
                    self._fill(kind, s, x, piece)

    def _fill(self, kind: str, s: Slot, x: int, piece: torch.Tensor) -> None:
        """Starts writing the slot-local elements [x, x + len): a chunk they hold whole,
        in aligned memory, straight from it (`write` waits for it before the memory
        may change), the others by copies into their chunks' buffers. This rank's
        own chunks arrive in order from their first element (`_segments` cuts
        ranges at shared shards)."""
        key = (kind, s.fqn)
        shape = tuple(s.shape)
        grid = _grid(shape, self.g.world)
        ce = grid.chunk
        total = math.prod(_stored_shape(shape))
        dtype = TORCH_DTYPES[self.table[s.fqn]["kinds"][kind]]
        while piece.numel():
            k, off = divmod(x, ce)
            cur = self.open.get(key)
            if (cur is None and off == 0 and piece.numel() >= ce and (k + 1) * ce <= total
                    and self.files.in_place(piece[:ce])):  # all of it here: no copy
                self.in_place.append(self.files.write_in_place(
                    self._shard(kind, s, grid, k, dtype), k % grid.per_shard, piece[:ce]))
                self.bytes += ce * dtype.itemsize
                x += ce
                piece = piece[ce:]
                continue
            if cur is None and off == 0:
                cur = self.open[key] = _OpenChunk(k, self.files.buffer(),
                                                  min(ce, total - k * ce), ce * dtype.itemsize)
            if cur is None or cur.k != k or cur.filled != off:
                raise RuntimeError(f"checkpoint of {kind}/{s.fqn}: element {x} arrived out of "
                                   f"order (chunk {k} at {off}; open: "
                                   f"{None if cur is None else (cur.k, cur.filled)})")
            n = min(piece.numel(), cur.numel - off)
            dst = cur.buf.as_tensor(dtype, ce)[off:off + n]
            cur.filled += n
            with self.lock:
                cur.pending += 1
                if cur.filled == cur.numel:
                    del self.open[key]
                    cur.shard = self._shard(kind, s, grid, k, dtype)
            self.copies.append(self.files.submit(self._copy, cur, dst, piece[:n], dtype, ce))
            self.bytes += n * dtype.itemsize
            x += n
            piece = piece[n:]

    def _shard(self, kind: str, s: Slot, grid: Grid, k: int, dtype: torch.dtype) -> Shard:
        """The shard file that holds chunk `k` of array `kind/<s.fqn>`."""
        first = k // grid.per_shard * grid.per_shard
        return Shard(str(self.root / kind / s.fqn / chunk_key(len(_stored_shape(tuple(s.shape))),
                                                                k // grid.per_shard)),
                     grid.per_shard, min(grid.per_shard, grid.chunks - first),
                     grid.chunk * dtype.itemsize)

    def _copy(self, cur: _OpenChunk, dst: torch.Tensor, src: torch.Tensor, dtype: torch.dtype,
              ce: int) -> None:
        """On a chunk thread: one piece into its chunk; the last copy writes the chunk."""
        host_copy(dst, src)
        with self.lock:
            cur.pending -= 1
            ready = cur.pending == 0 and cur.shard is not None
        if ready:
            if cur.numel < ce:  # the array's last chunk: zeros (the fill value) after it
                cur.buf.as_tensor(dtype, ce)[cur.numel:].zero_()
            self.files.write(cur.shard, cur.k % cur.shard.slots, cur.buf, cur.nbytes)

    def _put(self, kind: str, s: Slot, x: int, data: np.ndarray) -> None:
        """Writes a shared chunk's part through tensorstore (read, change, write)."""
        key = (kind, s.fqn)
        if key not in self.arrays:
            self.arrays[key] = _ts().open(_spec(self.root, kind, s.fqn), open=True,
                                          context=self.context).result()
        arr = self.arrays[key]
        shape = tuple(_stored_shape(tuple(s.shape)))
        futs = [arr[idx].write(data[a - x:b - x].reshape(_box_shape(idx)))
                for idx, a, b in flat_boxes(shape, x, x + data.size)]
        for f in futs:
            f.result()
        self.bytes += data.nbytes

    def check(self) -> None:
        """Checks this rank's chunks are all written (started)."""
        if self.open:
            raise RuntimeError(f"checkpoint of group {self.g.gid}: chunks left incomplete: "
                               f"{ {k: (c.k, c.filled, c.numel) for k, c in self.open.items()} }")

    def finish(self, comm: Any) -> None:
        """Writes the chunks ranks share, one rank at a time, every rank agreeing after
        each turn."""
        world = comm.world
        if world == 1:
            return
        for turn in range(world):
            with comm.together("save_checkpoint"):
                if turn == self.rank:
                    for kind, s, x, data in self.shared:
                        self._put(kind, s, x, data)
        self.shared.clear()


class CheckpointSave:
    """A save in progress ([Note: saving in the background]); `wait()` returns the
    published path or raises the save's error. `seconds`: how long the save took
    (once done); `stalled`: seconds training waited for it (its next step's start)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: float | None = None
        self.stalled = 0.0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.reported = False  # its error was raised to a caller of wait()
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> Path:
        self._done.wait()
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            self.reported = True
            raise self._error
        return self.path

    def _run(self, job: "_SaveJob") -> None:
        t0 = time.perf_counter()
        try:
            job.run()
        except BaseException as e:  # handed to wait()
            self._error = e
        finally:
            self.seconds = time.perf_counter() - t0
            self._done.set()


class _SaveJob:
    """One rank's part of one save: what is not a tensor is captured when the save is
    called; the tensors are read when `run` reaches them (their state as of the call:
    [Note: saving in the background])."""

    def __init__(self, engine: Any, path: Path, extra: dict[str, Any],
                 scheduler: dict | None, comm: Any, states: dict[str, str]) -> None:
        self.engine, self.path, self.comm = engine, path, comm
        self.states = states  # the modules' extra states, as `_check_save` captured them
        self.tmp = partial_of(path)
        self.table = _tensor_table(engine)
        self.rng = rng_state()
        self.param_steps = _param_steps(engine)
        self.record = _record(engine, self.table, extra, scheduler)
        self.buffers = capture_buffers(engine.module) if comm.rank == 0 else {}

    def run(self) -> None:
        """Writes and publishes the checkpoint; a failure on any rank fails the save on
        every rank ([Note: ranks agree] in offload/comm/collectives.py), removes its
        partial directory (on rank 0, which made it) and raises CheckpointError naming
        the path, the cause and the fix."""
        self.lock: PartialLock | None = None
        try:
            self._run()
        except Exception as e:
            if self.lock is not None:
                shutil.rmtree(self.tmp, ignore_errors=True)
            if isinstance(e, CheckpointError):
                raise
            code = _errno_of(e)
            fix = ("free disk space or save elsewhere; " if code in (errno.ENOSPC, errno.EDQUOT)
                   else "save to a directory this process may write; "
                   if code in (errno.EROFS, errno.EACCES, errno.EPERM)
                   else f"{limit_hint(code)}; " if limit_hint(code) else "")
            raise CheckpointError(
                f"save_checkpoint: writing {self.path} failed ({type(e).__name__}: {e}); "
                f"{fix}nothing was published and the checkpoints already in "
                f"{self.path.parent} are untouched") from e
        finally:
            if self.lock is not None:
                self.lock.release()

    def _start(self) -> dict:
        """Rank 0: the partial directory, locked, and its arrays ([Note: partial
        directories] in checkpoint_publish.py)."""
        parent, tmp = self.path.parent, self.tmp
        parent.mkdir(parents=True, exist_ok=True)
        try:
            self.lock = PartialLock(tmp, wait=False)
        except BlockingIOError:
            raise CheckpointError(f"save_checkpoint: another save of {self.path} is in "
                                  "progress; save each under its own name") from None
        remove_partials(parent)  # those no save is writing
        shutil.rmtree(tmp, ignore_errors=True)  # a killed save of this name (locked now)
        tmp.mkdir()
        (tmp / "ranks").mkdir()
        context, futs = _context(), []
        for name, t in self.table.items():
            for kind, dtype in t["kinds"].items():
                futs.append(((kind, name), _ts().open(
                    _spec(tmp, kind, name, tuple(t["shape"]), dtype, self.comm.world),
                    create=True, context=context)))
        # every open ends before the first error is raised: one still creating its
        # array's files after the failed save removed the partial directory would
        # leave it behind
        errors = [f.exception() for _key, f in futs]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return {key: f.result() for key, f in futs}

    def _run(self) -> None:
        engine, comm, tmp, path = self.engine, self.comm, self.tmp, self.path
        rank = comm.rank
        t0 = time.perf_counter()
        with engine.recorder.span("checkpoint save", cat="checkpoint", track="checkpoint",
                                  path=str(path)) as span:
            arrays: dict = {}
            with comm.together("save_checkpoint"):
                if rank == 0:
                    arrays = self._start()
            _agree_on_directory(comm, path, tmp)  # before any rank writes into it
            written, steps = _write_partitions(engine, comm, tmp, arrays, _context(),
                                               self.table)
            with comm.together("save_checkpoint"):
                _write_json(tmp / "ranks" / f"{rank}.json", {
                    "rank": rank, "steps": {str(k): v for k, v in steps.items()},
                    "param_steps": self.param_steps, "rng": self.rng,
                    "writes": {str(g.gid): [rank * g.shard, (rank + 1) * g.shard]
                               for g in engine.groups},
                    "bytes": written})
            with comm.together("save_checkpoint"):
                if rank == 0:
                    self._publish()
            span.set(bytes=written)
        log.info("checkpoint %s: step %d, %d bytes from rank %d in %.2f s", path,
                 self.record["global_step"], written, rank, time.perf_counter() - t0)

    def _publish(self) -> None:
        """Rank 0: the commit record, durable, then the rename ([Note: publishing a
        checkpoint]) and the pruning of older checkpoints."""
        tmp, path, parent = self.tmp, self.path, self.path.parent
        # [Note: extra states in a checkpoint] in checkpoint_buffers.py: none is {}
        buffers = {**encode_buffers(self.buffers), EXTRA_STATES: self.states}
        _write_json(tmp / BUFFERS, buffers)
        ranks = []
        for r in range(self.comm.world):
            mine = _read_json(tmp / "ranks" / f"{r}.json")
            ranks.append({k: mine[k] for k in ("rank", "steps", "param_steps", "writes",
                                               "bytes")})
        # the record names the buffers file it goes with: one missing or another
        # save's is damage, not a checkpoint without buffers
        _write_json(tmp / RECORD, {**self.record, "ranks": ranks,
                                   "buffers_sha256": _digest(buffers)})
        _fsync_tree(tmp)
        os.rename(tmp, path)  # published: what fails from here on says so
        try:
            _fsync_path(parent)
        except OSError as e:
            raise CheckpointError(
                f"save_checkpoint: {path} is published, complete and readable, but making "
                f"its name durable failed ({e}): it may be lost if the machine loses power "
                "before the file system writes it back") from e
        engine = self.engine
        engine._saved_here.add(os.path.realpath(path))
        keep = engine.cfg.engine.keep_checkpoints
        if keep:
            try:
                ahead = prune(parent, keep, path, FORMAT, self.record["run"],
                              engine._resumed_step, frozenset(engine._saved_here))
                if ahead and not engine._said_ahead:  # [Note: checkpoints of a rolled-back
                    engine._said_ahead = True  # training] in checkpoint_publish.py
                    log.info("keep_checkpoints: %d checkpoint(s) of this training from after "
                             "step %d, which it resumed at, are kept and not counted (e.g. "
                             "%s); remove them when they are not wanted", len(ahead),
                             engine._resumed_step, ahead[0])
            except OSError as e:  # the save stands: only the clean-up of older ones failed
                log.warning("checkpoint %s was saved, but removing older checkpoints of %s "
                            "(engine.keep_checkpoints=%d) failed: %s", path, parent, keep, e)


def _errno_of(e: BaseException) -> int | None:
    """The errno of a save's failure: an OSError's own, or the one tensorstore names in
    its message (`[os_error_code='28']`: a full disk met while it creates an array)."""
    code = getattr(e, "errno", None)
    if code is None:
        found = re.search(r"os_error_code='(\d+)'", str(e))
        code = int(found.group(1)) if found else None
    if code is None and os.strerror(errno.EMFILE) in str(e):  # tensorstore may name no code
        code = errno.EMFILE
    return code


def _keys_not_strings(value: Any) -> list[Any]:
    """The dict keys in `value` (nested in dicts, lists, tuples) that are not str."""
    if isinstance(value, dict):
        return [k for k in value if not isinstance(k, str)] + [
            k for v in value.values() for k in _keys_not_strings(v)]
    if isinstance(value, (list, tuple)):
        return [k for v in value for k in _keys_not_strings(v)]
    return []


def _check_save(engine: Any, path: Path, extra: dict[str, Any]
                ) -> tuple[dict | None, dict, dict[str, str]]:
    """Refuses a save that cannot be written as asked, before anything is; returns the
    engine's LR scheduler's state, `extra` and the modules' extra states, as the
    checkpoint will hold them (copies: a background save writes them as they were at
    the call, not as the loop has changed them since)."""
    check_between_steps(engine)
    engine.fixed_cfg.check()  # [Note: engine.cfg changed between calls] in fixed_config.py
    check_save_path(path)  # here, so that every rank refuses it together
    if getattr(engine, "tp", None) is not None:  # its files would hold one TP slice per DP rank
        raise CheckpointError("save_checkpoint: not supported with tp.size > 1 yet; save the "
                              "full weights with offload.engine.full_state_dict(engine)")
    try:
        kept = json.loads(json.dumps(extra, sort_keys=True))  # as the commit record holds it
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"save_checkpoint: extra must be JSON-serialisable, with keys "
                              f"of one type (strings): {e}") from e
    keys = _keys_not_strings(extra)
    if keys:  # JSON would write 1 as "1": resumed_extra would differ from extra
        raise CheckpointError(f"save_checkpoint: extra has the key {keys[0]!r} "
                              f"({type(keys[0]).__name__}); its keys (nested ones too) must "
                              "be strings, as resumed_extra gives them back")
    try:
        scheduler = scheduler_state(getattr(engine, "lr_scheduler", None))
    except ValueError as e:
        raise CheckpointError(f"save_checkpoint: {e}") from e
    for g in engine.groups:  # each array is a directory named after its parameter
        for slot in g.slots:
            if any(c in slot.fqn for c in "/\\\0"):
                raise CheckpointError(
                    f"save_checkpoint: parameter {slot.fqn!r} has a '/' or '\\' in its "
                    "name, which names its arrays' directory in the checkpoint and would "
                    "put them elsewhere (nothing was written): register the module under "
                    "a name without them, or save the weights with save_pretrained")
    if path.name.endswith(PARTIAL) or path.name.endswith(PARTIAL + LOCK):
        raise CheckpointError(f"save_checkpoint: {path} ends in {PARTIAL!r}, the name of a "
                              "save in progress (removed by the next save); choose another "
                              "name")
    if os.path.lexists(path):  # a link to nothing too: the publish's rename would fail
        link = " (a symbolic link to a missing target)" if not path.exists() else ""
        raise CheckpointError(f"save_checkpoint: {path} exists{link}; a checkpoint is never "
                              "overwritten: save each under its own name (e.g. step-<n>)")
    try:
        states = capture_extra_states(engine.module)
    except ValueError as e:
        raise CheckpointError(f"save_checkpoint: {e} (nothing was written)") from e.__cause__
    try:
        check_directory(path.parent, "save_checkpoint")
    except FileExistsError as e:  # one error type for every refused save
        raise CheckpointPathError(str(e)) from None
    return scheduler, kept, states


def _agree_to_save(comm: Any, path: Path, refused: BaseException | None) -> None:
    """Every rank calls `save_checkpoint`; a refusal on one (its own `extra`, a step
    open there) is raised on every rank ([Note: ranks agree] in
    offload/comm/collectives.py), where the others would wait for it at the save's
    first barrier; so is a checkpoint name that differs between the ranks, or ranks
    of one machine whose paths name different directories ([Note: one directory for
    every rank])."""
    if comm.world == 1:
        if refused is not None:
            raise refused
        return
    mine = float(zlib.crc32(os.fsencode(path.name)))
    where = [0.0] * (2 * comm.world)  # each rank's machine and directory, at its place
    where[comm.rank] = _key(this_host())
    where[comm.world + comm.rank] = _key(_directory_of(path))
    failed, total, *where = comm.sum_scalars([0.0 if refused is None else 1.0, mine, *where])
    if refused is not None:
        raise refused
    if failed:
        raise RankFailedError(f"save_checkpoint: other ranks of {comm.world} refused the save "
                              "or were not saving at this point (every rank calls "
                              "save_checkpoint at the same point of the loop, not under `if "
                              "rank == 0`; their error says why); nothing was written")
    if total != mine * comm.world:
        raise CheckpointError(f"save_checkpoint: the ranks gave different names (this rank: "
                              f"{path}); every rank saves its part of one checkpoint: give "
                              "them the same name (e.g. step-<engine.global_step>)")
    hosts, dirs = where[:comm.world], where[comm.world:]
    first = {}  # machine -> the first rank on it
    apart = [(first[h], r) for r, h in enumerate(hosts)
             if dirs[first.setdefault(h, r)] != dirs[r]]
    if apart:
        a, b = apart[0]
        paths = comm.every_rank_object(str(path))
        raise CheckpointError(
            f"save_checkpoint: ranks {a} and {b}, on one machine, gave paths of different "
            f"directories (rank {a}: {paths[a]}, rank {b}: {paths[b]}); {_ONE_DIRECTORY}; "
            "nothing was written")


# what the refusals of [Note: one directory for every rank] say to do
_ONE_DIRECTORY = ("every rank writes its part into one checkpoint directory: give every "
                  "rank the path of the same directory, on a file system every machine of "
                  "the job mounts (its mount point may differ between machines)")


def _directory_of(path: Path) -> str:
    """Where `path` is, as this machine's kernel knows it: the (device, inode) of its
    nearest existing ancestor and the names below that, the same through any mount
    point or link of that directory (the realpath where it cannot be read)."""
    real = os.path.realpath(path)
    try:
        found = existing_ancestor(os.path.dirname(real))
        st = os.stat(found)
    except OSError:
        return real
    return f"{st.st_dev}:{st.st_ino}:{os.path.relpath(real, found)}"


def _key(text: str) -> float:
    """A 52-bit digest of `text`, exact as a float64 in a sum of zeros."""
    return float(int(hashlib.sha256(os.fsencode(text)).hexdigest()[:13], 16))


def _agree_on_directory(comm: Any, path: Path, tmp: Path) -> None:
    """[Note: one directory for every rank]
    Every rank writes its partitions into the one checkpoint directory rank 0 makes
    (`.<name>.partial`, published by rank 0's rename). A rank given a directory of its
    own (a per-node local directory: the same name under another parent, or the same
    path on another machine's own disk) wrote its chunks into a `.partial` directory
    nobody publishes or removes, and failed at its rank file there. Paths are not
    compared across machines, since nodes may mount a shared file system at
    different places: `_agree_to_save` refuses, before anything is written, ranks of
    one machine (one boot id) whose paths name different directories; and once rank
    0 has made the partial directory, every rank checks that it sees that directory
    (its inode numbers, and those of its `ranks/`, as rank 0 sees them), before it
    writes anything there. A rank that does not fails the save on every rank, and
    rank 0 removes its partial directory."""
    if comm.world == 1:
        return
    try:
        seen = _key(f"{os.stat(tmp).st_ino}:{os.stat(tmp / 'ranks').st_ino}")
    except OSError:
        seen = 0.0
    every = comm.every_rank(seen)
    blind = [r for r, v in enumerate(every) if not v or v != every[0]]
    if blind:
        paths = comm.every_rank_object(str(path))
        raise CheckpointError(
            f"save_checkpoint: rank {blind[0]} does not see the directory rank 0 is writing "
            f"the checkpoint into (rank 0: {paths[0]}, rank {blind[0]}: {paths[blind[0]]}): "
            f"each machine saved to a directory of its own; {_ONE_DIRECTORY}; nothing was "
            "published, and rank 0 removed what it had made")


def save_checkpoint(engine: Any, path: str | os.PathLike, extra: dict[str, Any] | None = None,
                    *, blocking: bool = True) -> CheckpointSave:
    """Writes the engine's whole training state to the checkpoint directory `path`
    ([Note: checkpoint layout], [Note: publishing a checkpoint]); every rank calls
    it, between steps. With `blocking=False` the tensors are written by a thread
    while training goes on ([Note: saving in the background]). Returns the save's
    handle (done when blocking)."""
    given = os.fspath(path)
    path = Path(given).absolute()
    extra = {} if extra is None else extra
    refused = scheduler = None
    states: dict[str, str] = {}
    try:
        if not given:  # Path("") is the working directory: never what was meant
            raise CheckpointError("save_checkpoint: the path is empty; give the directory "
                                  "to write the checkpoint to (e.g. 'checkpoints/step-100')")
        scheduler, extra, states = _check_save(engine, path, extra)
    except Exception as e:
        refused = e
    engine._rank_order.check_save()  # [Note: ranks run the same units] in rank_order.py
    _agree_to_save(engine.comm, path, refused)
    handle = CheckpointSave(path)
    if blocking:
        t0 = time.perf_counter()
        _SaveJob(engine, path, extra, scheduler, engine.comm, states).run()
        handle.seconds = handle.stalled = time.perf_counter() - t0
        handle._done.set()
        return handle
    comm = engine.comm
    if comm.world > 1:  # its barriers must not interleave with training's collectives
        if engine._save_comm is None:  # one group for every background save, freed at close
            import torch.distributed as dist
            from ..comm import Collectives, user_timeout
            engine._save_comm = Collectives(dist.new_group(
                backend="gloo", timeout=user_timeout()))
        comm = engine._save_comm
    job = _SaveJob(engine, path, extra, scheduler, comm, states)
    handle._thread = threading.Thread(target=handle._run, args=(job,),
                                      name="offload-checkpoint", daemon=True)
    handle._thread.start()
    return handle


def _param_steps(engine: Any) -> dict[str, int]:
    """Each trainable parameter's own update count on this rank (a parameter without a
    gradient in a step does not count it: Adam's bias correction), read when the save
    is called: the next step's early updates count theirs before it commits."""
    out: dict[str, int] = {}
    for g in engine.groups:
        if not g.requires_grad:
            continue
        seg_steps = engine.optimizer.partition(g.gid).seg_steps
        for slot, n in zip(engine.grad_slots.segment_slots.get(g.gid, ()), seg_steps):
            if slot is not None:
                out[g.slots[slot].fqn] = n
    return out


def _write_partitions(engine: Any, comm: Any, root: Path, arrays: dict, context, table: dict
                      ) -> tuple[int, dict[int, int]]:
    """Each group's partition of this rank: the parameters through the store (fetch,
    pin, read, unpin), the optimizer state streamed chunk by chunk in its committed
    version, into shard files written with O_DIRECT ([Note: shard files]). Returns
    (bytes written, each group's step count) once every write is done."""
    written = 0
    steps = {}
    rank = comm.rank
    # a chunk per kind may be open while its group's ranges arrive, one more per slot edge
    with ChunkFiles(root, _max_chunk_bytes(table), held=len(KINDS) + 1) as files:
        for g in engine.groups:
            w = _GroupWriter(root, g, rank, arrays, context, files, table)
            with comm.together("save_checkpoint"):  # [Note: ranks agree]
                key = ("p", g.gid)
                p = engine.store.fetch(key, to=Tier.HOST, pin=True).wait()
                try:
                    w.write(0, {"param": p.cpu()})
                finally:
                    engine.store.unpin(key)
                if g.requires_grad:
                    steps[g.gid] = engine.optimizer.read_state_chunks(
                        g.gid, lambda lo, _n, ts: w.write(lo, ts))
                w.check()
            w.finish(comm)
            written += w.bytes
        with comm.together("save_checkpoint"):
            files.finish()
    return written, steps


def _number(v: Any) -> Any:
    """A group's value as the record holds it: a tensor (torch.optim takes an lr as a
    0-d tensor, which a scheduler fills in place) as its value now; a numpy scalar
    (np.float32 from a schedule's arithmetic) as a Python number."""
    return float(v) if isinstance(v, torch.Tensor) else to_json_scalar(v, v)


def _record(engine: Any, table: dict, extra: dict, scheduler: dict | None) -> dict[str, Any]:
    from .. import __version__
    members: list[list[str]] = [[] for _ in engine.optimizer.param_groups]
    for g in engine.groups:  # each optimizer group's parameters, by their table names
        if g.requires_grad:
            for i, s in enumerate(g.slots):
                members[engine.param_group_of.get((g.gid, i), 0)].append(s.fqn)
    return {"format": FORMAT, "version": __version__, "created": time.time(),
            "run": engine.run_id,  # [Note: a training's checkpoints] in checkpoint_publish.py
            "world": engine.comm.world, "dtype": engine.cfg.engine.dtype,
            "global_step": engine.global_step, "micro_step": engine.micro_step,
            "loss_scale": engine.loss_scale, "good_steps": engine._good_steps,
            "config": asdict(engine.cfg),
            "param_groups": [{**{k: ([_number(x) for x in v] if isinstance(v, (tuple, list))
                                     else _number(v))
                                 for k, v in grp.items()
                                 if k in HYPER_NAMES},
                              "lr_lambda": grp.get("lr_lambda") is not None,  # scheduled
                              "params": members[k]}
                             for k, grp in enumerate(engine.optimizer.param_groups)],
            "groups": [{"gid": g.gid, "numel": g.numel, "shard": g.shard,
                        "requires_grad": g.requires_grad} for g in engine.groups],
            "tensors": table, "extra": extra,
            # [Note: the engine's scheduler] in lr_scheduler.py
            "lr_scheduler": scheduler}
