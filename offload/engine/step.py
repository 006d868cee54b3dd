"""The optimizer step's commit: new parameter partitions wait beside the old ones and
switch in together with the optimizer's round.

[Note: all or nothing]
A step changes, for every group it updates, the compute-dtype parameter
partition (a store record), the fp32 master and Adam moments and the step
count (the optimizer's). Until the whole step succeeded, none of it may be
visible, so a failure anywhere (a full or failing disk, a corrupted read, an
exception in forward, backward or a hook, a budget that cannot be met)
leaves every one of them as it was:
  * the optimizer keeps each partition's previous version for the open round
    ([Note: rounds] in offload/optim/optimizer.py): NVMe state in its old
    extents (the update is written to fresh ones), host state in a copy;
  * a group's new parameters are stored as a record of their own (`staged_key`)
    beside the old one, which forwards and backwards in the meantime go on
    reading, as torch would show them before `step()`;
  * `commit` waits until every staged record is stored, commits the
    optimizer's round (which waits for its writes and fails as a whole), and
    only then switches the staged records in (`TieredStore.replace`, no I/O,
    cannot fail half way); a failure before that discards every staged record
    and rolls the round back.
Past the point where no previous version is kept (the first update in place,
the optimizer's commit) the step runs to its end `uninterrupted`.
An update that runs when nothing after it can fail (`step()` with host
optimizer state whose inputs and outputs are all pinned in memory first:
`update_in_place` in in_place.py) keeps no previous version and costs nothing.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import threading
from typing import Hashable, Iterator

import torch

from ..store import MoveHandle, Tier, TieredStore
from .interrupts import DEFERRED_SIGNALS, run_each

log = logging.getLogger(__name__)

__all__ = ["StagedParams", "StepFailedError", "staged_key", "uninterrupted"]


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """[Note: no interrupt mid-commit] Ctrl-C (SIGINT) raises KeyboardInterrupt at
    whatever line the main thread runs: between two groups' updates in place, or
    between the optimizer's commit and the parameters' switch, it would leave a
    step half applied with no previous version to go back to. So would a handler
    of the program's that raises (a SIGALRM timeout, a SIGTERM handler calling
    sys.exit). Inside this block SIGINT, and each of `DEFERRED_SIGNALS` a Python
    handler is installed for, is only noted; at its end the handler that was installed
    gets it (by default, KeyboardInterrupt raised after the step completed). Off
    the main thread, where Python delivers no signals, it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    old = {sig: signal.getsignal(sig) for sig in DEFERRED_SIGNALS}
    held = [sig for sig, h in old.items()  # (None: a handler set outside Python, kept)
            if callable(h) or (sig == signal.SIGINT and h is not None)]
    for sig in held:
        signal.signal(sig, lambda signum, frame: caught.append(signum))
    failed = True
    try:
        yield
        failed = False
    finally:
        for sig in held:
            signal.signal(sig, old[sig])
        # each once, in the order they came, every one; where the block raised, its
        # error is on its way already: a Ctrl-C noted then is dropped, the program's
        # other handlers still run (as SafeInterrupts does)
        run_each(functools.partial(signal.raise_signal, sig) for sig in dict.fromkeys(caught)
                 if not (failed and old[sig] is signal.default_int_handler))


def staged_key(gid: int) -> Hashable:
    """The store key of group `gid`'s new parameter partition until the step commits."""
    return ("p", gid, "staged")


class StepFailedError(RuntimeError):
    """A training step failed; every partition is as it was before the step.

    `groups`: the groups whose update was undone. The cause is `__cause__`.
    Remove the cause and run the step's micro-batches again: the result is the
    one a run that never failed would have had.
    """

    def __init__(self, message: str, groups: list[int]) -> None:
        super().__init__(message)
        self.groups = groups


class StagedParams:
    """New parameter partitions of the open step, by group; see [Note: all or nothing]."""

    def __init__(self, store: TieredStore, home: Tier) -> None:
        self._store = store
        self._home = home
        self._puts: dict[int, MoveHandle | None] = {}  # None: stored, nothing in flight

    def __len__(self) -> int:
        return len(self._puts)

    def __contains__(self, gid: object) -> bool:
        """True when group `gid`'s new partition is staged in the open step."""
        return gid in self._puts

    @contextlib.contextmanager
    def new(self, gid: int, numel: int, dtype: torch.dtype) -> Iterator[torch.Tensor]:
        """`with staged.new(gid, numel, dtype) as t:` group `gid`'s parameters-to-be,
        a CPU tensor the caller fills; stored as the group's staged record when the
        block ends (nothing is, if it raises). Written in place in the store's
        memory where that is CPU memory, else copied in at the end. On NVMe they
        stay in HOST (dirty) while it has room: the next forward finds them there,
        and they are written only if the store evicts them."""
        if gid in self._puts:
            raise RuntimeError(f"group {gid} already has new parameters in this step")
        key = staged_key(gid)
        if self._home is Tier.DEVICE and self._store.device.type != "cpu":
            values = torch.empty(numel, dtype=dtype)  # the optimizer writes CPU memory
            yield values
            self._puts[gid] = self._store.put(key, values, kind="param", tier=self._home)
            return
        with self._store.create(key, numel, dtype, kind="param", tier=self._home,
                                write=False) as values:
            yield values
        self._puts[gid] = None  # stored on return: nothing to wait for

    def take(self, gid: int, tier: Tier) -> bool:
        """Makes the copy in `tier` of group `gid`'s current partition (fp32, its master)
        the staged record, holding the current values, for the update to overwrite
        in place (then `with staged.in_place(gid, tier) as t:`); False, changing
        nothing, unless the partition is homed on NVMe, that copy is CPU memory and
        clean, and no other thread pins it.

        [Note: the update in the old copy's memory]
        The commit keeps a group's current partition until the step succeeds
        ([Note: all or nothing]). Where that partition is a clean copy in memory
        beside its NVMe one (read from NVMe this step), the NVMe copy already is
        the previous version: the memory copy becomes the staged record
        (`TieredStore.split`, no copy) and the update overwrites it in place, so
        an update holds one partition of memory instead of the current one and the
        new one (the commit frees the old extent; a failed step frees the staged
        record and reads the NVMe copy again). A dirty copy (the group's only one,
        updated and kept in memory by the previous step) is still read and staged
        beside, and so is a partition homed in memory, whose old copy would have
        to stay there."""
        if gid in self._puts:
            raise RuntimeError(f"group {gid} already has new parameters in this step")
        if self._home is not Tier.NVME or (tier is not Tier.HOST
                                           and self._store.device.type != "cpu"):
            return False
        return self._store.split(("p", gid), staged_key(gid), tier, pin=True)

    @contextlib.contextmanager
    def in_place(self, gid: int, tier: Tier) -> Iterator[torch.Tensor]:
        """`with staged.in_place(gid, tier) as t:` after `take`: `t` is the staged
        record's memory, to be updated in place. If the block raises, the staged
        record is freed: the group's partition is as it was, its other copy
        holding the current values. `take` pinned the record, so that nothing (a
        prefetch making room) moves it out of `tier` in between; the pin is given
        back here."""
        key = staged_key(gid)
        try:
            with self._store.modify(key, tier) as values:
                yield values
        except BaseException:
            self._store.unpin(key)
            self._store.free(key)
            raise
        self._store.unpin(key)
        self._puts[gid] = None

    def ready(self) -> None:
        """Waits until every staged record is stored; raises the first failure, or
        RuntimeError where a switch would be refused (a group's partition still
        pinned), before anything commits."""
        for handle in self._puts.values():
            if handle is not None:
                handle.wait()
        for gid in self._puts:
            pins = self._store.info(("p", gid)).pins
            if pins:
                raise RuntimeError(f"group {gid}'s parameter partition is pinned {pins} "
                                   "time(s) at the step's commit (a forward still running "
                                   "on another thread?): the step cannot switch it")

    def switch(self) -> list[int]:
        """Makes each staged record (`ready` first) its group's parameter partition;
        returns the groups."""
        gids, self._puts = list(self._puts), {}
        for gid in gids:  # no I/O from here on
            self._store.replace(("p", gid), staged_key(gid))
        return gids

    def discard(self) -> list[int]:
        """Forgets every staged record (the old parameters stay); returns the groups."""
        gids, puts = list(self._puts), self._puts
        self._puts = {}
        for gid in gids:
            try:
                if puts[gid] is not None:
                    puts[gid].wait()
            except Exception:  # the failure being handled, or one of its kind
                pass
            if staged_key(gid) in self._store:
                self._store.free(staged_key(gid))
        return gids
