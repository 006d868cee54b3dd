"""Property tests: random put / fetch / evict / modify / split / free / pin sequences under tiny
budgets over all three tiers, checked after every step against a reference copy; and the
same driven by two threads at once."""

from __future__ import annotations

import contextlib
import os
import random
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, \
    run_state_machine_as_test

from offload.store import BudgetExceededError, Residency, Tier, TieredStore

from .conftest import ENGINES, PAGE, page_tensor, store_config

D, H, N = Tier.DEVICE, Tier.HOST, Tier.NVME
KEYS = st.sampled_from(range(6))
UP = st.sampled_from([D, H])
ANY = st.sampled_from([D, H, N])
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
RESTING = {Residency.DEVICE, Residency.HOST, Residency.NVME}


def check_store(s: TieredStore, ref: dict, budgets: dict[str, int]) -> None:
    """Budgets never exceeded, accounting equals the records, resting states consistent,
    and every valid DEVICE/HOST copy equals the reference."""
    s.audit()
    stats = s.stats()
    for name, budget in budgets.items():
        assert stats.tiers[name].used <= budget, (name, stats.tiers[name], budget)
    assert set(s.keys()) == set(ref)
    for key, value in ref.items():
        info = s.info(key)
        if info.state in RESTING:
            assert info.state.value == min(info.valid).name, info
            assert info.dirty == (len(info.valid) == 1 and N not in info.valid), info
        for tier in (D, H):
            if tier in info.valid:
                assert torch.equal(s.get(key, tier), value), (key, tier, info)


class StoreMachine(RuleBasedStateMachine):
    """One store with budgets of a few pages; `swap_root` and `engine` are set by the test."""

    swap_root: Path
    engine: str
    budgets = {"DEVICE": 2 * PAGE, "HOST": 3 * PAGE}

    def __init__(self) -> None:
        super().__init__()
        self.dir = self.swap_root / f"swap{random.getrandbits(40)}"
        self.store = TieredStore(store_config(self.dir, device_pages=2, host_pages=3,
                                              engine=self.engine))
        self.ref: dict[int, torch.Tensor] = {}
        self.pins: dict[int, int] = {}

    @rule(key=KEYS, tier=ANY, pages=st.sampled_from([0.25, 1, 2]), dtype=DTYPES,
          seed=st.integers(0, 99))
    def put(self, key, tier, pages, dtype, seed):
        if key in self.ref:
            return
        value = page_tensor(seed, pages, dtype)
        try:
            self.store.put(key, value, tier=tier).wait()
        except BudgetExceededError:
            assert key not in self.store
            return
        self.ref[key] = value

    @precondition(lambda self: self.ref)
    @rule(data=st.data(), to=UP, pin=st.booleans())
    def fetch(self, data, to, pin):
        key = data.draw(st.sampled_from(sorted(self.ref)))
        before = self.store.info(key)
        try:
            view = self.store.fetch(key, to, pin=pin).wait()
        except BudgetExceededError:
            after = self.store.info(key)
            assert (after.state, after.valid) == (before.state, before.valid)
            return
        assert torch.equal(view, self.ref[key])
        self.pins[key] = self.pins.get(key, 0) + pin

    @precondition(lambda self: self.ref)
    @rule(data=st.data(), to=ANY)
    def evict(self, data, to):
        key = data.draw(st.sampled_from(sorted(self.ref)))
        if self.pins.get(key):
            return
        try:
            self.store.evict(key, to).wait()
        except BudgetExceededError:
            return
        assert not any(t < to for t in self.store.info(key).valid)

    @precondition(lambda self: self.ref)
    @rule(data=st.data(), tier=UP)
    def modify(self, data, tier):
        key = data.draw(st.sampled_from(sorted(self.ref)))
        if tier not in self.store.info(key).valid:
            return
        with self.store.modify(key, tier) as t:
            t.add_(1)
        self.ref[key] = self.ref[key] + 1
        assert self.store.info(key).valid == {tier}

    @precondition(lambda self: self.ref and len(self.ref) < 6)
    @rule(data=st.data(), tier=UP)
    def split(self, data, tier):
        key = data.draw(st.sampled_from(sorted(self.ref)))
        into = data.draw(st.sampled_from(sorted(set(range(6)) - set(self.ref))))
        before = self.store.info(key)
        done = self.store.split(key, into, tier)
        assert done == (tier in before.valid and len(before.valid) > 1), before
        after = self.store.info(key)
        if not done:
            assert into not in self.store and after.valid == before.valid
            return
        assert after.valid == before.valid - {tier} and after.pins == before.pins
        assert self.store.info(into).valid == {tier}
        self.ref[into] = self.ref[key].clone()

    @precondition(lambda self: self.ref)
    @rule(data=st.data())
    def free(self, data):
        key = data.draw(st.sampled_from(sorted(self.ref)))
        for _ in range(self.pins.pop(key, 0)):
            self.store.unpin(key)
        self.store.free(key)
        del self.ref[key]

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def unpin(self, data):
        key = data.draw(st.sampled_from(sorted(k for k, n in self.pins.items() if n)))
        self.store.unpin(key)
        self.pins[key] -= 1

    @invariant()
    def consistent(self):
        check_store(self.store, self.ref, self.budgets)

    def teardown(self):
        for key, n in self.pins.items():
            for _ in range(n):
                self.store.unpin(key)
        for key, value in self.ref.items():
            assert torch.equal(self.store.fetch(key, H).wait(), value), key
        self.store.close()
        assert not os.listdir(self.dir)


@pytest.mark.parametrize("engine", ENGINES)
def test_random_moves_match_reference(tmp_path, engine):
    machine = type("StoreMachine", (StoreMachine,), {"swap_root": tmp_path, "engine": engine})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=25, stateful_step_count=40, deadline=None))


def _drive(s: TieredStore, keys: list, shared: list, lock: threading.Lock, ref: dict,
           rng: random.Random, steps: int, errors: list) -> None:
    """One thread's random moves over its own keys, and over shared keys under `lock`."""
    try:
        for _ in range(steps):
            key = rng.choice(keys + shared)
            guard = lock if key in shared else contextlib.nullcontext()
            with guard:
                _one_op(s, key, ref, rng)
    except BaseException as e:  # reported by the main thread
        errors.append(e)


def _one_op(s: TieredStore, key, ref: dict, rng: random.Random) -> None:
    op = rng.choice(["fetch", "fetch", "evict", "modify", "free"])
    try:
        if key not in ref:
            ref[key] = page_tensor(rng.randrange(100), rng.choice([0.5, 1]))
            s.put(key, ref[key], tier=rng.choice([D, H, N])).wait()
        elif op == "fetch":
            view = s.fetch(key, rng.choice([D, H]), pin=True).wait()
            try:
                assert torch.equal(view, ref[key]), key
            finally:
                s.unpin(key)
        elif op == "evict":
            s.evict(key, rng.choice([H, N])).wait()
        elif op == "modify":
            s.fetch(key, H, pin=True).wait()  # pinned: the other thread cannot evict it now
            try:
                with s.modify(key, H) as t:
                    assert torch.equal(t, ref[key])
                    t.add_(2)
                ref[key] = ref[key] + 2
            finally:
                s.unpin(key)
        else:
            s.free(key)
            del ref[key]
    except BudgetExceededError:
        # The other thread held everything (pinned or busy) for a moment: a refusal, not a
        # loss. A put that failed is simply absent.
        if key in ref and key not in s:
            del ref[key]


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_two_threads_moving_at_once(tmp_path_factory, seed):
    swap = tmp_path_factory.mktemp("swap")
    budgets = {"DEVICE": 3 * PAGE, "HOST": 4 * PAGE}
    s = TieredStore(store_config(swap, device_pages=3, host_pages=4))
    ref: dict = {}
    lock, errors = threading.Lock(), []
    threads = [threading.Thread(target=_drive, args=(
        s, [f"t{i}.{k}" for k in range(3)], ["shared0", "shared1"], lock, ref,
        random.Random(seed + i), 40, errors)) for i in range(2)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):  # in between: accounting and budgets hold
        s.audit()
        stats = s.stats()
        for name, budget in budgets.items():
            assert stats.tiers[name].used <= budget, stats.tiers[name]
        threading.Event().wait(0.002)
    for t in threads:
        t.join()
    assert not errors, errors
    s.wait_all()
    check_store(s, ref, budgets)
    for key, value in ref.items():
        assert torch.equal(s.fetch(key, H).wait(), value), key
    s.close()
    assert not os.listdir(swap)
