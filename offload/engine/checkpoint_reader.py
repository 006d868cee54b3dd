"""Reading a checkpoint written by `save_checkpoint` (offload/engine/training_checkpoint.py):
its commit record, its tensors by element range with every chunk's checksum
verified, and the placement of a rank's partitions on resume."""

from __future__ import annotations

import functools
import logging
import math
import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..files import json_loads, read_regular_text
from ..io import host_copy
from ..config import HYPER_NAMES
from ..io.buffers import mapped_empty
from ..optim.codec import bound_first_moment, moment_bound
from .checkpoint_buffers import (BUFFERS, check_buffers, check_extra_states, decode_buffers,
                                 decode_extra_states, restore_buffers, restore_extra_states)
from .checkpoint_chunks import MISSING, CRC_BYTES, ChunkFileError, ChunkFiles, chunk_key, read_index
from .checkpoint_publish import PARTIAL, RECORD, is_committed
from .checkpoint_record import check_record
from .checkpoint_files import (CheckpointCorruptError, CheckpointError, CheckpointLimitError,
                               _read_json, decode_rng_state, limit_reached, not_permitted,
                               set_rng_state)
from .checkpoint_layout import (_DTYPE_NAMES, CHECKED, FORMAT, TORCH_DTYPES, _context,
                                _max_chunk_bytes, _rank_range, _spec, _stored_shape, _ts,
                                check_utf8)
from .units import Group, Slot

log = logging.getLogger(__name__)

__all__ = ["CheckpointReader"]


def _hyper_value(key: str, v: Any) -> Any:
    """A hyper-parameter as restored and compared (JSON gives betas as a list)."""
    return tuple(float(b) for b in v) if key == "betas" else float(v)


def _describe(groups: list[dict[str, Any]]) -> str:
    return "; ".join(f"group {k}: " + ", ".join(f"{key}={_hyper_value(key, g[key])}"
                                                for key in ("lr", "weight_decay") if key in g)
                     for k, g in enumerate(groups))


def _unreadable(path: Any, e: BaseException | None) -> CheckpointLimitError | None:
    """The error for checkpoint file `path` that `e` kept from being opened or read,
    where `e` is a limit of this process or machine (open files, memory); else None."""
    return limit_reached(f"checkpoint file {path} cannot be read", e, path)


def _chunk_in(out: torch.Tensor | None, dtype: torch.dtype, a: int, b: int, ce: int,
              k: int) -> torch.Tensor | None:
    """The bytes of `out` (elements [a, b) of an array) that chunk `k` of `ce`
    elements fills, where the whole chunk lands in `out` and `out` is a contiguous
    CPU tensor of the array's dtype; else None (the chunk is read and copied)."""
    if (out is None or out.dtype != dtype or out.device.type != "cpu"
            or not out.is_contiguous() or k * ce < a or (k + 1) * ce > b):
        return None
    return out[k * ce - a:(k + 1) * ce - a].view(torch.uint8)


def _check_layout(meta: dict[str, Any], sharding: dict[str, Any], dtype: str) -> None:
    """ValueError where an array's zarr.json says its bytes are laid out otherwise than
    the save wrote them (`_spec`): offload reads the chunks by their known layout,
    but another reader (tensorstore, zarr) follows the metadata, and would read a
    changed dtype, byte order or key encoding as other values."""
    keys = meta.get("chunk_key_encoding", {})
    fill = meta.get("fill_value")
    differ = [what for what, got, want in (
        ("zarr_format", meta.get("zarr_format"), 3),
        ("node_type", meta.get("node_type"), "array"),
        ("chunk grid", meta.get("chunk_grid", {}).get("name"), "regular"),
        ("fill_value", type(fill) in (int, float) and fill == 0, True),
        ("storage transformers", meta.get("storage_transformers") or [], []),
        ("data_type", meta.get("data_type"), dtype),
        ("codecs", meta.get("codecs") and len(meta["codecs"]), 1),
        ("chunk codecs", sharding.get("codecs"), CHECKED),
        ("index codecs", sharding.get("index_codecs"), CHECKED),
        ("index location", sharding.get("index_location", "end"), "end"),
        ("chunk key encoding", (keys.get("name"), keys.get("configuration", {})
                                .get("separator", "/")), ("default", "/")),
    ) if got != want]
    if differ:
        raise ValueError(f"its {', '.join(differ)} differ from what the save "
                         f"wrote (a zarr 3 array of {dtype} on a regular grid, fill value 0, "
                         "one sharding codec of little-endian chunks and index, each with "
                         "its crc32c, the index at the end, default keys)")


class CheckpointReader:
    """A committed checkpoint opened for reading: its commit record (`record`) and its
    tensors, read by element range with every chunk's checksum verified."""

    def __init__(self, path: str | os.PathLike) -> None:
        """`path`: the checkpoint directory (or its commit record, `checkpoint.json`)."""
        if not os.fspath(path):  # Path("") is the working directory: never what was meant
            raise CheckpointError("the checkpoint path is empty; pass the directory "
                                  f"save_checkpoint wrote (it holds {RECORD})")
        p = Path(path).absolute()
        if p.name == RECORD and p.is_file():  # the record inside: its directory is meant
            p = p.parent
        if not p.exists():
            raise CheckpointError(f"checkpoint {p} does not exist")
        if not p.is_dir():
            raise CheckpointError(f"checkpoint {p} is a file, not a checkpoint directory: pass "
                                  f"the directory save_checkpoint wrote (it holds {RECORD})")
        if not is_committed(p):
            try:  # shorter names first: step-20 before step-100
                inside = sorted((d.name for d in p.iterdir() if d.is_dir() and is_committed(d)),
                                key=lambda n: (len(n), n))
            except OSError:
                inside = []
            if inside and not (p / RECORD).exists():  # the parent save_checkpoint was given
                raise CheckpointError(f"{p} is not a checkpoint but holds {len(inside)}: "
                                      f"{', '.join(inside[-4:])}; pass one of them (e.g. "
                                      f"{p / inside[-1]})")
            raise CheckpointError(f"{p} is not a committed checkpoint: it has no {RECORD} or "
                                  f"its name ends in {PARTIAL} (a save that did not finish, "
                                  "or not a checkpoint)")
        try:
            rec = _read_json(p / RECORD)
        except OSError as e:  # a limit of the process is no damage
            raise (_unreadable(p / RECORD, e) or CheckpointCorruptError(
                f"checkpoint file {p / RECORD} cannot be read ({e.strerror})")) from e
        if rec.get("format") != FORMAT:
            raise CheckpointError(f"checkpoint {p}: format {rec.get('format')!r}, this "
                                  f"version reads {FORMAT!r}; save it again with the "
                                  "version of offload that wrote it, or export its weights "
                                  "(offload checkpoint export) with that version")
        check_record(rec, p / RECORD)
        self.path = p
        self.record = rec
        self.tensors: dict[str, dict[str, Any]] = rec["tensors"]
        self._alias = {a: name for name, t in self.tensors.items()
                       for a in [name] + list(t["aliases"])}
        # what `restore` applies, checked before the first group is read (`_prepare`):
        # the saved hyper-parameters per engine group and this rank's RNG states
        self._restoring: tuple | None = None  # (hyper, rng, buffers, extra states)
        self._arrays: dict = {}
        self._files: ChunkFiles | None = None
        self._chunks: dict[tuple[str, str], tuple[int, int]] = {}  # (kind, name) ->
        # (elements per chunk, chunks per shard)
        self._indices: dict[str, list[tuple[int, int]]] = {}  # shard file -> its index
        self.damaged = False  # the last verify() found damage (not only unreadable files)
        self._steps: dict[int, int] = {}  # saved group -> its step count (rank 0's)
        self._param_steps: dict[str, int] = {}  # parameter -> its own update count
        for r in reversed(rec["ranks"]):
            self._steps.update({int(k): v for k, v in r["steps"].items()})
            self._param_steps.update(r.get("param_steps", {}))

    def name_of(self, slot: Slot) -> str:
        """The checkpoint's name of the model parameter `slot` (any of its aliases)."""
        for a in [slot.fqn] + list(slot.names):
            if a in self._alias:
                return self._alias[a]
        raise CheckpointError(f"checkpoint {self.path} has no tensor {slot.fqn!r} (of shape "
                              f"{tuple(slot.shape)}); it holds e.g. {sorted(self.tensors)[:5]}")

    def check(self, groups: list[Group], dtype: torch.dtype) -> None:
        """Refuses a model whose tensors (names, shapes), compute dtype or trainable
        set differ from the checkpoint's, naming the first tensor that differs, and a
        checkpoint whose ranks' ranges do not cover every group."""
        seen: dict[str, str] = {}  # checkpoint name -> the model parameter read from it
        for g in groups:
            for s in g.slots:
                name = self.name_of(s)
                t = self.tensors[name]
                if name in seen:  # weights tied in the save, separate parameters here
                    raise CheckpointError(
                        f"checkpoint {self.path}: tensor {name!r} holds weights that were "
                        f"tied in the save ({', '.join(t['aliases'])}), the model has "
                        f"{seen[name]!r} and {s.fqn!r} as separate parameters; tie them as "
                        "the saved model did (one Parameter under every name)")
                if tuple(t["shape"]) != tuple(s.shape):
                    raise CheckpointError(f"checkpoint {self.path}: tensor {name!r} has shape "
                                          f"{tuple(t['shape'])}, the model's {s.fqn!r} "
                                          f"{tuple(s.shape)}")
                have = t["kinds"]["param"]
                if have != _DTYPE_NAMES[dtype]:
                    saved = {v: k for k, v in {"fp32": "float32", "bf16": "bfloat16",
                                               "fp16": "float16"}.items()}.get(have, have)
                    raise CheckpointError(f"checkpoint {self.path}: tensor {name!r} was saved "
                                          f"in {have}, this engine computes in "
                                          f"{_DTYPE_NAMES[dtype]}; resume with "
                                          f"engine.dtype={saved!r}")
                if g.requires_grad != bool(t["requires_grad"]):
                    raise CheckpointError(f"checkpoint {self.path}: tensor {name!r} was saved "
                                          f"{'trainable' if t['requires_grad'] else 'frozen'}"
                                          f", the model's {s.fqn!r} is "
                                          f"{'trainable' if g.requires_grad else 'frozen'}"
                                          "; resume with the parameters frozen as saved (to "
                                          "change what trains, load that engine's "
                                          "state_dict() into a fresh model with the new "
                                          "requires_grad and initialize it: Adam's state "
                                          "starts afresh)")
                seen[name] = s.fqn
        unused = sorted(set(self.tensors) - set(seen))
        tied = {a: s.fqn for g in groups for s in g.slots for a in s.names if a in unused}
        if tied:  # separate in the save, one parameter here
            a, fqn = next(iter(sorted(tied.items())))
            raise CheckpointError(f"checkpoint {self.path}: tensor {a!r} was saved as a "
                                  f"parameter of its own, the model ties it to {fqn!r}; "
                                  "resume with the weights untied, as the saved model had "
                                  "them")
        if unused:
            raise CheckpointError(f"checkpoint {self.path}: tensors {unused[:8]} are not in "
                                  "the model")
        for g in self.record["groups"]:
            spans = sorted(tuple(r["writes"][str(g["gid"])]) for r in self.record["ranks"])
            covered = 0
            for lo, hi in spans:
                if lo != covered:
                    break
                covered = hi
            if covered < g["numel"]:
                raise CheckpointError(f"checkpoint {self.path}: group {g['gid']} is covered "
                                      f"only up to element {covered} of {g['numel']} by the "
                                      f"ranks' ranges {spans}")
        # the rank files: their RNG states are restored last, so a loss is found first
        for r in range(self.record["world"]):
            if not self._rank_path(r).is_file():
                raise self._rank_damaged(r, "is missing")

    def _array(self, kind: str, name: str):
        """The array through tensorstore (for tests and tools that want its view)."""
        key = (kind, name)
        if key not in self._arrays:
            check_utf8(self.path, "CheckpointReader._array", "move the checkpoint to a UTF-8 "
                       "path to open its arrays with tensorstore (offload itself reads it "
                       "where it is: initialize(resume=...), verify())")
            try:
                spec = {**_spec(self.path, kind, name), "fill_missing_data_reads": False}
                self._arrays[key] = _ts().open(spec, open=True, context=_context()).result()
            except Exception as e:
                what = f"checkpoint {self.path}: array {kind}/{name} cannot be opened"
                raise (limit_reached(what, e) or self._corrupt(
                    f"checkpoint {self.path}: cannot open array {kind}/{name}: {e}")) from e
        return self._arrays[key]

    def _grid(self, kind: str, name: str) -> tuple[int, int]:
        """(elements per chunk, chunks per shard) of array `kind/name`, as its metadata
        says (the save's, which need not be this version's: [Note: shard files])."""
        key = (kind, name)
        if key not in self._chunks:
            meta = self.path / kind / name / "zarr.json"
            stored = _stored_shape(tuple(self.tensors[name]["shape"]))
            try:
                m = json_loads(read_regular_text(meta))
                if m["shape"] != stored:
                    raise ValueError(f"its shape {m['shape']} is not the commit record's "
                                     f"{stored}")
                shard = m["chunk_grid"]["configuration"]["chunk_shape"]
                codec = m["codecs"][0]
                if codec["name"] != "sharding_indexed":
                    raise ValueError(f"its codec is {codec['name']!r}, not sharding_indexed")
                chunk = codec["configuration"]["chunk_shape"]
                _check_layout(m, codec["configuration"],
                              self.tensors[name]["kinds"].get(kind, "float32"))
                for what, s in (("shard", shard), ("chunk", chunk)):
                    if (not isinstance(s, list) or len(s) != len(stored)
                            or any(type(d) is not int or d < 1 for d in s)):
                        raise ValueError(f"its {what} shape {s} is not {len(stored)} positive "
                                         "integers")
                if (shard[0] % chunk[0] or list(shard[1:]) != list(chunk[1:])
                        or list(chunk[1:]) != stored[1:]):
                    raise ValueError(f"shards of {shard} are not whole rows of chunks of "
                                     f"{chunk}, whole rows of the array's {stored}")
            except PermissionError as e:
                raise not_permitted(meta, e) from e
            except (OSError, ValueError, KeyError, TypeError, IndexError, ArithmeticError) as e:
                limited = _unreadable(meta, e) if isinstance(e, OSError) else None
                if limited is not None:  # a limit of the process is no damage
                    raise limited from e
                why = e.strerror if isinstance(e, OSError) and e.strerror else e  # named: meta
                raise self._corrupt(f"checkpoint {self.path}: array {kind}/{name}: no "
                                    f"readable shard and chunk shape in {meta} ({why})") from e
            self._chunks[key] = (math.prod(chunk), shard[0] // chunk[0])
        return self._chunks[key]

    def _locate(self, kind: str, name: str, ndim: int, k: int, nbytes: int
                ) -> tuple[str, int, int]:
        """(shard file, offset, nbytes) of chunk `k` of array `kind/name`, its chunks of
        `nbytes`, from its shard's index; CheckpointCorruptError naming the chunk
        where the file or its index is missing or damaged."""
        _ce, per = self._grid(kind, name)
        path = str(self.path / kind / name / chunk_key(ndim, k // per))
        try:
            if path not in self._indices:
                self._indices[path] = read_index(path, per)
            off, length = self._indices[path][k % per]
            if (off, length) == (MISSING, MISSING):
                raise ChunkFileError(path, f"has no chunk in slot {k % per} of its index")
            if length != nbytes + CRC_BYTES:
                raise ChunkFileError(path, f"holds {length} bytes in slot {k % per}, a chunk "
                                     f"of this array has {nbytes + CRC_BYTES} ({nbytes} + a "
                                     f"{CRC_BYTES}-byte checksum)")
        except ChunkFileError as e:
            raise self._damaged(kind, name, ndim, k, e) from e
        return path, off, nbytes

    def _damaged(self, kind: str, name: str, ndim: int, k: int, e: ChunkFileError
                 ) -> CheckpointError:
        if e.denied is not None:
            return not_permitted(e.path, e.denied)
        limited = _unreadable(e.path, e.__cause__)  # a limit of the process is no damage
        if limited is not None:
            return limited
        return self._corrupt(
            f"checkpoint {self.path}: array {kind}/{name}, chunk "
            f"({', '.join([str(k)] + ['0'] * (ndim - 1))}): cannot be read back intact "
            f"({e.why}; file {e.path}); the checkpoint is damaged: resume from another")

    def _chunk_files(self, chunk_bytes: int) -> ChunkFiles:
        """The reader's chunk I/O, with buffers for chunks of `chunk_bytes`."""
        if self._files is not None and self._files.capacity < chunk_bytes + CRC_BYTES:
            self.close()  # a checkpoint saved with larger chunks than this version's
        if self._files is None:
            try:
                self._files = ChunkFiles(self.path, max(chunk_bytes,
                                                        _max_chunk_bytes(self.tensors)),
                                         existing=self.path / RECORD)
            except OSError as e:  # its probe of the record, its buffers' memory
                limited = (_unreadable(e.filename, e) if e.filename else limit_reached(
                    f"checkpoint {self.path}: its reads' buffers cannot be set up", e))
                if limited is None:
                    raise
                raise limited from e
        return self._files

    def close(self) -> None:
        """Frees the reader's I/O engine and buffers (it reopens them if used again)."""
        if self._files is not None:
            self._files.close()
            self._files = None

    def read_into(self, items: list[tuple[str, str, int, int, torch.Tensor | None]]) -> None:
        """For each (kind, name, a, b, out): out[:] = elements [a, b) (C order) of array
        `kind/name` (`out` None: read and checked only), every chunk's checksum
        verified; the chunks are read several at a time and copied on the chunk
        threads ([Note: shard files])."""
        todo = []  # (kind, name, dtype, ce, ndim, a, b, out, k) per chunk
        for kind, name, a, b, out in items:
            t = self.tensors[name]
            if kind not in t["kinds"]:
                raise CheckpointError(f"checkpoint {self.path}: tensor {name!r} has no "
                                      f"{kind!r} array (it has {sorted(t['kinds'])})")
            dtype = TORCH_DTYPES[t["kinds"][kind]]
            ce, _per = self._grid(kind, name)
            ndim = len(_stored_shape(tuple(t["shape"])))
            todo += [(kind, name, dtype, ce, ndim, a, b, out, k)
                     for k in range(a // ce, (b - 1) // ce + 1) if a < b]
        if not todo:
            return

        def consume(i: int, raw: torch.Tensor) -> None:
            _kind, _name, dtype, ce, _ndim, a, b, out, k = todo[i]
            if out is not None:
                x, y = max(a, k * ce), min(b, (k + 1) * ce)
                host_copy(out[x - a:y - a], raw.view(dtype)[x - k * ce:y - k * ce])
        chunks = [self._locate(kind, name, ndim, k, ce * dtype.itemsize)
                  for kind, name, dtype, ce, ndim, _a, _b, _out, k in todo]
        files = self._chunk_files(max(n for _p, _o, n in chunks))
        try:
            files.read(chunks, consume, [_chunk_in(out, dtype, a, b, ce, k)
                                         for _k, _n, dtype, ce, _d, a, b, out, k in todo])
        except ChunkFileError as e:
            kind, name, _dt, _ce, ndim, _a, _b, _out, k = todo[e.index]
            raise self._damaged(kind, name, ndim, k, e) from e
        except OSError as e:  # the reads' buffers (memory), not a file: no damage either
            limited = limit_reached(f"checkpoint {self.path}: its chunks cannot be read", e)
            if limited is None or isinstance(e, CheckpointError):
                raise
            raise limited from e

    def read_range(self, kind: str, name: str, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) (C order) of array `kind/name`, 1-D, in the array's dtype;
        checksums verified."""
        out = torch.empty(max(0, b - a), dtype=TORCH_DTYPES[self.tensors[name]["kinds"].get(
            kind, "float32")])
        self.read_into([(kind, name, a, b, out)])
        return out

    def _shard_items(self, kind: str, g: Group, rank: int,
                     out: torch.Tensor) -> list[tuple[str, str, int, int, torch.Tensor]]:
        """`read_into`'s items that fill `out` (1-D, `g.shard` elements) with `rank`'s
        partition of group `g` (of this model's layout) of `kind`, and zeroes its
        padding. `master` falls back to `param` where the master was the parameter."""
        items = []
        filled = 0  # out[:filled] is spoken for; the gaps between slots are padding: zeros
        for s in g.slots:
            a, b = _rank_range(g, s, rank)
            if a >= b:
                continue
            name = self.name_of(s)
            k = kind if kind in self.tensors[name]["kinds"] else "param"
            base = s.offset - rank * g.shard
            out[filled:base + a].zero_()
            items.append((k, name, a, b, out[base + a:base + b]))
            filled = base + b
        out[filled:].zero_()
        return items

    def step_of(self, g: Group) -> int:
        """The step count of the saved group that held `g`'s first parameter."""
        return self._steps.get(self.tensors[self.name_of(g.slots[0])]["group"], 0)

    def place_group(self, engine: Any, g: Group, segments: list | None = None,
                    slots: list | None = None) -> None:
        """Puts this rank's partition of `g` (parameters, master, moments, step counts)
        where the engine keeps it, as `initialize` places a fresh one. `segments` and
        `slots`: the partition's parameter ranges and the parameter of each (None:
        padding), as `param_groups.segments_of` gives them; each range resumes at its
        parameter's own update count (padding's is 0: it never has a gradient).

        Every rank calls this for every group, in the same order, and the ranks agree
        on each group's outcome ([Note: ranks agree] in offload/comm/collectives.py):
        each reads chunks of its own, so damage one rank finds (a chunk, its rank
        file) fails the resume on every rank, never leaving the others to train from
        this checkpoint while it resumes from another or stops."""
        with engine.comm.together(f"initialize(resume={self.path}), group {g.gid}"):
            self._place_group(engine, g, segments, slots)

    def _place_group(self, engine: Any, g: Group, segments: list | None,
                     slots: list | None) -> None:
        self._prepare(engine)  # a mismatch is found before any state is read
        rank = engine.comm.rank
        with engine.store.create(("p", g.gid), g.shard, engine.dtype, kind="param",
                                 tier=engine._param_tier) as param:  # read in place: no copy
            if not g.requires_grad:
                self.read_into(self._shard_items("param", g, rank, param))
                return
            shared = engine.master_is_param  # fp32: the parameter partition is the master
            # the resumed state in mappings of small pages: under a hypervisor the first
            # touch of a huge page (torch's large allocations, [Note: huge pages]) ran at
            # 0.3-0.5 GB/s against 1-2 GB/s for small ones ([Note: populating ahead])
            state = {k: mapped_empty(g.shard, torch.float32)
                     for k in ("exp_avg", "exp_avg_sq") + (() if shared else ("master",))}
            # one read for the whole partition: its chunks queue together and the
            # pages they land in are faulted in ahead ([Note: populating ahead])
            self.read_into([item for k, out in [("param", param), *state.items()]
                            for item in self._shard_items(k, g, rank, out)])
            self._bound_int8_moments(engine, state, segments, g.shard)
            step = self.step_of(g)
            engine.optimizer.add_partition(  # master_is_param: `param` only gives the size
                g.gid, param if shared else state["master"], tier=engine.cfg.engine.optimizer,
                master_is_param=shared, exp_avg=state["exp_avg"],
                exp_avg_sq=state["exp_avg_sq"], step=step, segments=segments,
                origin=g.origin(rank),
                segment_steps=None if slots is None else [
                    0 if s is None else self._param_steps.get(self.name_of(g.slots[s]), step)
                    for s in slots])  # padding never has a gradient: its count stays 0

    def _bound_int8_moments(self, engine: Any, state: dict[str, torch.Tensor],
                            segments: list | None, n: int) -> None:
        """Moments saved from int8 codes and resumed in another form are clamped as the
        int8 update clamps them ([Note: the first moment's bound] in
        offload/optim/codec.py): |exp_avg| <= C sqrt(exp_avg_sq), C of each segment's
        betas as the resume restores them. A sqrt(v) whose code was 0 beside an
        exp_avg whose code was not made the next fp32 or bf16 step m / eps (150 lr in
        one case), where the int8 update never moves an element that way."""
        saved = self.record.get("config", {}).get("optim", {}).get("state_dtype", "fp32")
        if saved != "int8" or engine.cfg.optim.state_dtype == "int8":
            return  # int8 again: the codes encode back as they were, bit for bit
        hyper = self._restoring[0]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        for lo, size, k in segments or [(0, n, 0)]:
            b1, b2 = hyper[k].get("betas", engine.optimizer.param_groups[k]["betas"])
            bound_first_moment(m[lo:lo + size], v[lo:lo + size].sqrt(), moment_bound(b1, b2))

    def _prepare(self, engine: Any) -> None:
        """Checks, once, what `restore` will apply, before anything of the engine
        changes: the saved hyper-parameters matched to the engine's optimizer groups
        (`_matched_hyper`) and this rank's rank file (rank 0's where the checkpoint
        had fewer ranks)."""
        if self._restoring is None:
            rank = engine.comm.rank
            hyper = (self._hyper_by_members(engine) if all(
                "params" in g for g in self.record["param_groups"])
                else self._matched_hyper(engine.optimizer.param_groups))
            own = self._rank_file(rank if rank < self.record["world"] else 0)
            self.check_buffers(engine.module)
            self._restoring = (hyper, own["rng"], self._saved_buffers,
                               self._saved_extra_states)

    def check_buffers(self, module: nn.Module) -> None:
        """CheckpointError where `module`'s buffers (names, shapes, dtypes; meta ones
        too) are not those the checkpoint holds."""
        buffers, states = self._saved_buffers, self._saved_extra_states
        problem = None if buffers is None else check_buffers(module, buffers)
        if problem is None and states is not None:
            problem = check_extra_states(module, states)
        if problem is not None:
            raise CheckpointError(f"checkpoint {self.path}: {problem}; resume with the "
                                  "model the checkpoint was saved from")

    def buffer_names(self) -> set[str]:
        """The names of the module buffers the checkpoint holds."""
        return set(self._saved_buffers or {})

    def buffers(self) -> dict[str, torch.Tensor]:
        """The module buffers the checkpoint holds, by their first `state_dict` name, in
        the model's order (empty for a save that kept none); CheckpointCorruptError
        where `buffers.json` is damaged."""
        return dict(self._saved_buffers or {})

    @functools.cached_property
    def _saved_buffers(self) -> dict[str, torch.Tensor] | None:
        """The module buffers the save kept (checkpoint_buffers.py); None where it kept
        none (a checkpoint written before they were saved)."""
        return None if self._buffers_file is None else self._buffers_file[0]

    @functools.cached_property
    def _saved_extra_states(self) -> dict[str, Any] | None:
        """The modules' extra states the save kept ([Note: extra states in a
        checkpoint] in checkpoint_buffers.py); None where it kept none."""
        return None if self._buffers_file is None else self._buffers_file[1]

    @functools.cached_property
    def _buffers_file(self) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None] | None:
        """`buffers.json`, checked against the commit record and decoded: (buffers,
        extra states); None where the save wrote none."""
        p = self.path / BUFFERS
        want = self.record.get("buffers_sha256")  # None: a save that did not record it
        if want is None and not p.exists():
            return None
        try:
            obj = _read_json(p)
            if want is not None and obj["sha256"] != want:
                raise CheckpointCorruptError(f"checkpoint {self.path}: {p} is not the one "
                                             "its commit record lists (another save's); "
                                             "resume from another")
            return decode_buffers(obj, str(p)), decode_extra_states(obj, str(p))
        except FileNotFoundError:
            raise self._corrupt(f"checkpoint {self.path}: {p} is missing (the model's "
                                "buffers: BatchNorm statistics and the like); the "
                                "checkpoint is damaged: resume from another") from None
        except OSError as e:
            limited = _unreadable(p, e)  # a limit of the process is no damage
            if limited is not None:
                raise limited from e
            raise CheckpointCorruptError(f"checkpoint {self.path}: {p} cannot be read "
                                         f"({e.strerror}); resume from another") from e
        except ValueError as e:
            raise CheckpointCorruptError(f"checkpoint {self.path}: {e}; resume from "
                                         "another") from e

    def _hyper_by_members(self, engine: Any) -> list[dict[str, Any]]:
        """The saved hyper-parameters for each of the engine's optimizer groups, the
        saved group with the same parameters (by the checkpoint's names, whatever the
        order the groups are listed in); CheckpointError naming the first group that
        has no such saved group."""
        mine: list[set[str]] = [set() for _ in engine.optimizer.param_groups]
        for g in engine.groups:
            if g.requires_grad:
                for i, s in enumerate(g.slots):
                    mine[engine.param_group_of.get((g.gid, i), 0)].add(self.name_of(s))
        saved = self.record["param_groups"]
        by_members = {frozenset(g["params"]): g for g in saved}
        out = []
        for k, names in enumerate(mine):
            theirs = by_members.get(frozenset(names))
            if theirs is None:
                near = max(saved, key=lambda g: len(names & set(g["params"])))
                extra = sorted(names - set(near["params"]))[:3]
                lacking = sorted(set(near["params"]) - names)[:3]
                raise CheckpointError(
                    f"checkpoint {self.path}: optimizer group {k} of this engine ("
                    f"{'the default group' if k == 0 else f'param_groups[{k - 1}]'}, "
                    f"{len(names)} parameters) holds other parameters than every group of "
                    f"the save (the nearest adds {extra}, lacks {lacking}); resume with the "
                    "param_groups of the save (any order), then change them through "
                    "engine.optimizer.param_groups[k]")
            out.append({key: _hyper_value(key, theirs[key])
                        for key in HYPER_NAMES if key in theirs})
        return out

    def _matched_hyper(self, mine: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The saved hyper-parameters for each of the engine's optimizer groups `mine`,
        for a checkpoint whose commit record does not list each group's parameters.

        Such a record keeps each group's values, not which parameters it held,
        so only group 0 (the optim section's values and every parameter no group
        names) is known to be the same group in both; it gets the saved values, as
        torch's `load_state_dict` gives them. A given group (1, 2, ...) matched by
        its place could be another group listed in another order, so its saved
        values must equal the engine's (restoring them then changes nothing); where
        they differ, or the number of groups does, CheckpointError says what differs
        rather than give one group's values to another."""
        saved = self.record["param_groups"]
        fix = ("resume with the param_groups of the save (initialize(param_groups=...) or "
               "optim.param_groups), in its order and with its values; change a value "
               "after initialize through engine.optimizer.param_groups[k]")
        if len(saved) != len(mine):
            raise CheckpointError(
                f"checkpoint {self.path} was saved with {len(saved)} optimizer param groups "
                f"({_describe(saved)}), this engine has {len(mine)} ({_describe(mine)}); the "
                f"saved hyper-parameters cannot be matched to these groups: {fix}")
        differ = []
        for k in range(1, len(saved)):
            keys = [key for key in HYPER_NAMES if key in saved[k] and _hyper_value(
                key, saved[k][key]) != _hyper_value(key, mine[k][key])]
            if keys:
                differ.append(f"param_groups[{k - 1}] (optimizer group {k}): " + ", ".join(
                    f"{key} saved {_hyper_value(key, saved[k][key])}, given "
                    f"{_hyper_value(key, mine[k][key])}" for key in keys))
        if differ:
            raise CheckpointError(
                f"checkpoint {self.path}: {'; '.join(differ)}. The checkpoint does not record "
                "which parameters each group held, so groups are matched by their place and "
                f"a changed value cannot be told from groups listed in another order: {fix}")
        return [{key: _hyper_value(key, g[key]) for key in HYPER_NAMES if key in g} for g in saved]

    def _corrupt(self, message: str) -> CheckpointError:
        """CheckpointCorruptError(`message`); where the checkpoint is gone since it was
        opened (pruned by a save's engine.keep_checkpoints, or removed), the error
        that says so instead of calling it damaged."""
        if is_committed(self.path):
            return CheckpointCorruptError(message)
        return CheckpointError(
            f"checkpoint {self.path} was removed while it was read (a save into "
            f"{self.path.parent} with engine.keep_checkpoints prunes older checkpoints "
            "there, whichever training saved them): resume from a checkpoint that stays, "
            "and give each training a parent directory of its own")

    def _rank_path(self, r: int) -> Path:
        return self.path / "ranks" / f"{r}.json"

    def _rank_damaged(self, r: int, why: str) -> CheckpointError:
        return self._corrupt(
            f"checkpoint {self.path}: rank file {self._rank_path(r)} {why} (rank {r} of "
            f"{self.record['world']} wrote it); the checkpoint is damaged: resume from another")

    def _rank_file(self, r: int) -> dict[str, Any]:
        """ranks/<r>.json, its sha256 checked and its content compared with the commit
        record's copy; CheckpointCorruptError naming the file where it is missing,
        unreadable, changed or another save's."""
        p = self._rank_path(r)
        try:
            obj = _read_json(p)
        except FileNotFoundError:
            raise self._rank_damaged(r, "is missing") from None
        except OSError as e:  # a limit of the process is no damage
            raise (_unreadable(p, e) or self._rank_damaged(r, f"cannot be read "
                                                           f"({e.strerror})")) from e
        entry = next((x for x in self.record["ranks"] if x.get("rank") == r), None)
        if entry is None:
            raise self._rank_damaged(r, "has no entry in the commit record")
        differ = [k for k, v in entry.items() if obj.get(k) != v]
        if differ:
            raise self._rank_damaged(r, f"does not match the commit record ({', '.join(differ)}"
                                     " differ): it is another save's")
        try:  # the one entry the commit record has no copy of
            obj["rng"] = decode_rng_state(obj.get("rng"))
        except ValueError as e:
            raise self._rank_damaged(r, str(e)) from None
        return obj

    def restore(self, engine: Any) -> None:
        """The engine's counters, loss scale, hyper-parameters and this rank's RNG states
        (rank 0's where the checkpoint had fewer ranks); CheckpointError, before any of
        them changes, where the saved param groups do not match the engine's
        (`_matched_hyper`) or the rank file is damaged."""
        self._prepare(engine)
        hyper, rng, buffers, states = self._restoring
        rec = self.record
        engine.global_step = int(rec["global_step"])
        engine.micro_step = int(rec["micro_step"])
        if isinstance(rec.get("run"), str):  # [Note: a training's checkpoints]
            engine.run_id = rec["run"]
        e = engine.cfg.engine
        if not e.loss_scale:  # a fixed engine.loss_scale is the config's; a dynamic one
            saved = float(rec["loss_scale"])  # keeps to this run's floor
            engine.loss_scale = max(e.min_loss_scale, saved) if e.dtype == "fp16" else saved
        engine._good_steps = int(rec["good_steps"])
        engine.optimizer.steps = engine.global_step  # committed rounds: one per step
        for mine, theirs in zip(engine.optimizer.param_groups, hyper):
            mine.update(theirs)
        set_rng_state(rng)
        if buffers is not None:
            restore_buffers(engine.module, buffers)
        if states is not None:
            restore_extra_states(engine.module, states)

    def warn_other_optimizer(self, name: str) -> None:
        """Warns where the checkpoint trained with another `optim.name` than this resume's
        `name` (AdamW's decoupled weight decay against Adam's added to the gradient):
        the hyper-parameters come from the checkpoint, the update's rule from the
        config, which changed the training with no word."""
        saved = self.record.get("config", {}).get("optim", {}).get("name")
        if isinstance(saved, str) and saved != name:
            log.warning("checkpoint %s trained with optim.name %r; this resume's config says "
                        "%r, which it trains on with (the weight decay %s); set optim.name = "
                        "%r to continue as saved", self.path, saved, name,
                        "decoupled, as torch's AdamW" if name == "adamw"
                        else "added to the gradient, as torch's Adam", saved)

    def verify(self, progress: Callable[[str], None] | None = None) -> list[str]:
        """Checks every rank file (`ranks/<r>.json`: present, its sha256, as the commit
        record lists it), then reads every chunk of every array (one chunk in memory
        at a time) and checks its checksum; returns the problems found, each naming
        the file, or the array and chunk (empty: intact). `progress(array)` is called
        before each array. `damaged` is then whether a problem is damage
        (CheckpointCorruptError), not a file this process may not read. A limit of the
        process or machine met while reading (open files, memory) is raised
        (CheckpointLimitError): what it kept from being read is neither intact nor
        damaged."""
        found: list[CheckpointError] = []
        for r in range(self.record["world"]):
            try:
                self._rank_file(r)
            except CheckpointLimitError:
                raise
            except CheckpointError as e:
                found.append(e)
        try:
            self._saved_buffers
        except CheckpointLimitError:
            raise
        except CheckpointError as e:
            found.append(e)
        for name, t in self.tensors.items():
            n = math.prod(t["shape"])
            for kind in t["kinds"]:
                if progress is not None:
                    progress(f"{kind}/{name}")
                try:
                    self.read_into([(kind, name, 0, n, None)])
                except CheckpointLimitError:
                    raise
                except CheckpointError as e:
                    found.append(e)
        self.damaged = any(isinstance(e, CheckpointCorruptError) for e in found)
        return [str(e) for e in found]

    @property
    def extra(self) -> dict[str, Any]:
        """The `extra` dict given to the save (e.g. the data position)."""
        return self.record.get("extra", {})
