"""Weights written in place inside a unit's forward, refused.

[Note: weights written in a forward]
torch keeps a change a forward makes to its own weights: `nn.Embedding(max_norm=...)`
and `F.embedding(..., max_norm=...)` renormalise the rows they read in place, and a
model may `clamp_` a parameter under `torch.no_grad()`. The engine's weights in a
forward are views of the group's gathered buffer. With one rank that buffer is the
stored partition itself, and the change stayed; with several it is an all-gathered
copy, freed after the forward, and the change was lost with no word: the same model
trained on other weights with another world size. With autograd on, torch itself
refused the write (the views come from one `split`) with a message naming neither
the weight nor a fix. `initialize` refuses an embedding with `max_norm`
(model_checks.py); one set afterwards is refused before the unit's weights are
gathered, and any other write is found after the forward by the gathered buffer's
version counter (an in-place change of any view bumps it; the engine fills the
buffer through `.data`, which does not) and refused naming the unit and its weights.
A write found after the forward has already happened: where the gathered buffer
borrows the stored partition (one rank, weights in fp32) the stored weights hold
the change, as torch's would, and their other copies (a clean one on NVMe) are
dropped, so a later read does not bring the old weights back (`_keep_written` in
gathering.py).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .units import Unit

__all__ = ["EMBEDDING_FIX", "WeightWrites"]

EMBEDDING_FIX = ("set max_norm=None (clip the rows' norms after each step inside `with "
                 "engine.full_weights(writable=True)` if you need them bounded)")
_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


class WeightWrites:
    """The engine's check of [Note: weights written in a forward]."""

    def __init__(self) -> None:
        self._embeddings: dict[int, list[tuple[str, nn.Module]]] = {}  # unit -> its own
        self.failed: RuntimeError | None = None  # the error of a forward torch failed

    def before(self, unit: Unit, states: Any) -> None:
        """Refuses the unit's forward where one of its embeddings was given a max_norm
        after `initialize` (before anything is gathered or written)."""
        own = self._embeddings.get(id(unit))
        if own is None:
            own = self._embeddings[id(unit)] = list({
                id(m): (slot.fqn.rpartition(".")[0] or type(m).__name__, m)
                for gid in unit.needs for slot in states[gid].group.slots
                for m, _ in slot.uses if isinstance(m, _EMBEDDINGS)}.values())
        for where, m in own:
            if m.max_norm is not None:
                raise RuntimeError(
                    f"{where} is an {type(m).__name__} whose max_norm was set to "
                    f"{m.max_norm} after offload.initialize: it would rewrite its weight "
                    f"in place inside forward, which the engine does not support; "
                    f"{EMBEDDING_FIX}")

    @staticmethod
    def written(unit: Unit, states: Any) -> list[Any]:
        """The unit's gathered groups (their states) whose weights its forward changed
        in place: their buffer's version moved since they were bound."""
        return [st for gid in unit.needs if (st := states[gid]).gathered
                and st.flat._version != st.bound]

    def refuse(self, unit: Unit, written: list[Any], failed: bool) -> None:
        """Raises (or keeps for `take`, where the forward raised already: torch drops an
        error of this hook then) where the unit's forward changed the groups `written`."""
        if not written:
            return
        names = [s.fqn for st in written for s in st.group.slots]
        e = RuntimeError(
            f"the forward of {unit.name} changed a weight in place (one of "
            + ", ".join(repr(n) for n in names[:4]) + (", ..." if len(names) > 4 else "")
            + "): a weight rewritten inside forward (an embedding's max_norm, F.embedding("
            "..., max_norm=...), an in-place op on a parameter under torch.no_grad()) is not "
            "supported: the weights a forward reads are gathered copies on several ranks, "
            "where the change would be lost, so it is refused on every rank count. Change "
            "weights between steps, inside `with engine.full_weights(writable=True)`; for "
            f"an embedding, {EMBEDDING_FIX}")
        if not failed:
            raise e
        self.failed = e

    def take(self) -> RuntimeError | None:
        """The error `after` kept for a forward that raised (once)."""
        e, self.failed = self.failed, None
        return e
