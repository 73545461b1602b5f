"""Prefix sharing driven the way an engine with a block pool and a prefix cache drives it.

A model engine (vLLM's automatic prefix caching, in miniature) owns as many blocks as the cache
has page-sets besides the padding slot's. A request is admitted with a hit on a cached prefix
(any prefix of another request's blocks whose blocks are all still cached) plus fresh blocks;
fresh blocks come from the engine's free list, never-used ones first, else the least recently
freed cached block (its content is evicted); a running request grows by fresh blocks; a finished
request's blocks stay cached (SGLang's allocator names a new block only after the step that writes
it: the position is claimed first, the key bound at the start of the next rule, before any hit,
free, eviction or release); the engine may also evict cached blocks outright, forgetting their
keys (SGLang's radix cache: the page-sets stay mapped where they were, dead content, and their
ids go back to the free list). Every fresh page-set is written with a value of its own through
the slot's virtual addresses (host backend: one memfd page mapped at several addresses).

Invariants after every rule: the core's audit (references = mappings + keys), every running
request reads, at each of its page-sets, the value its block was written with (shared ones
included), bind() never runs short (the engine counts exactly what vattn holds), and a hit reads
back the block's value through the new request's own addresses.
"""

import mmap
from collections import OrderedDict

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from tests.core._util import make_cache

SLOTS, PAGE, SETS = 4, mmap.PAGESIZE, 12      # 12 page-sets in the pool: padding + 11 blocks
T = 128                                        # tokens per page-set


class SharingMachine(RuleBasedStateMachine):
    totals: dict = {}
    stream_ordered = False             # reclaim waits on fences (True: retires, see the lag machine)
    pack_pages = 0                     # > 0: shared runs of 2 page-sets packed (see PackedMachine)
    pack_sets: int | tuple = 2         # (2, 4): runs of 4 packed whole, the rest in runs of 2

    def __init__(self):
        super().__init__()
        self.cache = make_cache(num_layers=1, group_size=1, split_kv=True, num_kv_heads=1,
                                head_dim=PAGE // 256, page_bytes=PAGE, page_budget=2 * SETS * PAGE,
                                max_context=6 * T, max_slots=SLOTS, map_ahead_tokens=T,
                                stream_ordered=self.stream_ordered, driver=self.make_driver(),
                                pack_pages=self.pack_pages, pack_sets=self.pack_sets)
        self.cache.prewarm(T)          # as the engines do: loose page-sets mapped in idle slots
        k, v = self.cache.k(0).view(torch.int16), self.cache.v(0).view(torch.int16)
        self.kv = k.as_strided((2, *k.shape), (v.storage_offset() - k.storage_offset(), *k.stride())).numpy()
        self.blocks = SETS - 1
        self.never_used = list(range(self.blocks))
        self.cached: OrderedDict[int, int] = OrderedDict()   # free but cached: block -> value, LRU first
        self.value: dict[int, int] = {}                      # block -> value written into it
        self.running: dict[int, list[int]] = {}              # slot -> its blocks, in order
        self.chains: list[list[int]] = []                     # block lists of earlier requests
        self.pending: list[tuple[int, int, int]] = []          # (slot, index, block) claimed, unnamed
        self.serial = 0

    def make_driver(self):
        return None                    # the host backend

    def teardown(self):
        m = self.cache.metrics()
        for name in ("prefix_hits", "pages_aliased", "keys_bound", "fence_waits", "page_sets_moved",
                     "pages_retired", "page_sets_staged", "packs_built", "pages_packed", "pack_unpacks"):
            SharingMachine.totals[name] = SharingMachine.totals.get(name, 0) + m[name]
        SharingMachine.totals["evicting"] = SharingMachine.totals.get("evicting", 0) + (not self.never_used)
        self.kv = None
        self.cache.close()

    # -- the model engine ---------------------------------------------------------------------
    def _in_use(self) -> set[int]:
        return {b for blocks in self.running.values() for b in blocks}

    def _free_count(self) -> int:
        return len(self.never_used) + len(self.cached)

    def _fresh(self, n: int, forget: bool = False) -> list[int]:
        """``n`` blocks off the free list; ``forget``: an evicted block's key is dropped now (SGLang
        frees it when it evicts), else the bind that reuses it drops it (vLLM)."""
        out = []
        for _ in range(n):
            if self.never_used:
                out.append(self.never_used.pop(0))
            else:
                block, _ = self.cached.popitem(last=False)   # evicted: its content is dead
                self.value.pop(block, None)
                if forget:
                    self.cache.forget([block])
                out.append(block)
        return out

    def _hit(self, choice: int, length: int) -> list[int]:
        """A cached prefix of an earlier chain: every block still holds the chain's content."""
        if not self.chains:
            return []
        chain = self.chains[choice % len(self.chains)]
        prefix = []
        for block in chain[:length]:
            if block not in self.value or (block not in self.cached and block not in self._in_use()):
                break
            prefix.append(block)
        return prefix

    def _resolve(self) -> None:
        """Name the claimed page-sets (SGLang: the page ids copied to the host one step late)."""
        for slot, index, block in self.pending:
            assert self.cache.bind(slot, index, [block]), "bind after claim ran short"
        self.pending = []

    def _write(self, slot: int, index: int, block: int) -> None:
        self.serial = self.serial % 30000 + 1
        self.value[block] = self.serial
        self.kv[:, slot, index * T:(index + 1) * T] = self.serial

    # -- rules ----------------------------------------------------------------------------------
    @precondition(lambda self: len(self.running) < SLOTS)
    @rule(choice=st.integers(0, 50), hit_len=st.integers(0, 4), fresh=st.integers(1, 3))
    def admit(self, choice, hit_len, fresh):
        got = self._admission(choice, hit_len, fresh)
        if got is not None:
            slot, blocks, hit = got
            assert self.cache.bind(slot, 0, blocks, hits=len(hit)), "bind ran short"
            self._admitted(slot, blocks, hit)

    @precondition(lambda self: len(self.running) < SLOTS)
    @rule(choice=st.integers(0, 50), hit_len=st.integers(1, 4), fresh=st.integers(0, 2))
    def admit_copy_on_write(self, choice, hit_len, fresh):
        """A hit that ends inside its last block (vLLM's partial hit): the whole blocks before it
        are shared, and a fresh block takes a copy of the last one, which stays as it was."""
        got = self._admission(choice, hit_len, fresh + 1)
        if got is None:
            return
        slot, blocks, hit = got
        if not hit:                    # nothing cached to copy from: an ordinary admission
            assert self.cache.bind(slot, 0, blocks), "bind ran short"
            self._admitted(slot, blocks, hit)
            return
        src, hit = hit[-1], hit[:-1]
        blocks = hit + blocks[len(hit) + 1:]
        index = len(hit)
        assert self.cache.bind(slot, 0, blocks, hits=len(hit)), "bind ran short"
        copied = self.cache.copy_block(src, blocks[index])
        SharingMachine.totals["copied" if copied else "not_copied"] = \
            SharingMachine.totals.get("copied" if copied else "not_copied", 0) + 1
        if copied:
            got = self.kv[:, slot, index * T:(index + 1) * T]
            assert (got == self.value[src]).all(), f"the copy of {src} reads other data"
        if src not in self._in_use():  # retained until copied (vLLM), then cached again
            self.cached[src] = self.value[src]
        self._admitted(slot, blocks, hit)   # the copy is overwritten: src must not change

    @precondition(lambda self: self.chains)
    @rule(choice=st.integers(0, 50), hit_len=st.integers(1, 4), copies=st.integers(1, 3))
    def stage(self, choice, hit_len, copies):
        """The engine saw a burst of requests hit a cached prefix: it is mapped into idle slots
        ahead of the next ones (on the map-ahead worker); a later admission with that hit is
        handed one and finds it in place."""
        self._resolve()
        hit = self._hit(choice, hit_len)
        if hit:
            queued = self.cache.stage_prefix(hit, copies)
            self.cache.wait()
            SharingMachine.totals["staged"] = SharingMachine.totals.get("staged", 0) + queued

    def _admission(self, choice, hit_len, fresh):
        """A new request's ``(slot, blocks, hit)``, acquired and not bound yet (``None``: the
        engine has too few free blocks)."""
        self._resolve()
        hit = self._hit(choice, hit_len)
        fresh = min(fresh, 6 - len(hit))
        if fresh > self._free_count() - sum(b in self.cached for b in hit):
            return None
        for b in hit:                  # a hit takes the block off the free list (vLLM's touch)
            self.cached.pop(b, None)
        blocks = hit + self._fresh(fresh)
        slot = self.cache.acquire(expected_len=len(blocks) * T, prefix=hit)
        return slot, blocks, hit

    def _admitted(self, slot, blocks, hit):
        """A bound new request: its hits read their blocks' values, its fresh blocks are written."""
        for i, b in enumerate(hit):
            assert (self.kv[:, slot, i * T:(i + 1) * T] == self.value[b]).all(), f"hit on {b} reads other data"
        for i in range(len(hit), len(blocks)):
            self._write(slot, i, blocks[i])
        self.running[slot] = blocks
        self._step(slot)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, SLOTS - 1), n=st.integers(1, 2), late=st.booleans())
    def grow(self, pick, n, late):
        slot, blocks, n = self._growth(pick, n)
        if n <= 0:
            return
        new = self._fresh(n, forget=late)
        if late:
            for j, b in enumerate(new):
                assert self.cache.claim(slot, len(blocks) + j), "claim ran short"
                self.pending.append((slot, len(blocks) + j, b))
            SharingMachine.totals["claimed"] = SharingMachine.totals.get("claimed", 0) + n
        else:
            assert self.cache.bind(slot, len(blocks), new), "bind ran short"
        self._grown(slot, blocks, new)

    def _growth(self, pick, n):
        """The running request ``pick`` names, its blocks, and how many it can get (<= ``n``)."""
        self._resolve()
        slot = sorted(self.running)[pick % len(self.running)]
        blocks = self.running[slot]
        return slot, blocks, min(n, 6 - len(blocks), self._free_count())

    def _grown(self, slot, blocks, new):
        for j, b in enumerate(new):
            self._write(slot, len(blocks) + j, b)
        blocks += new
        self._step(slot)

    def _step(self, slot):
        """The engine's per-step ensure with map-ahead (one page-set further, in the background)."""
        assert self.cache.step({slot: len(self.running[slot]) * T}) == []
        self.cache.wait()

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, SLOTS - 1))
    def finish(self, pick):
        self._resolve()
        slot = sorted(self.running)[pick % len(self.running)]
        blocks = self.running.pop(slot)
        self.cache.release(slot)
        self.chains = (self.chains + [blocks])[-6:]
        in_use = self._in_use()
        for b in reversed(blocks):     # freed tail first (vLLM's eviction order), still cached
            if b not in in_use:
                self.cached[b] = self.value[b]

    @precondition(lambda self: self.cached)
    @rule(n=st.integers(1, 3))
    def evict(self, n):
        self._resolve()
        for _ in range(min(n, len(self.cached))):
            block, _ = self.cached.popitem(last=False)
            self.value.pop(block)
            self.cache.forget([block])
            self.never_used.append(block)
            SharingMachine.totals["forgotten"] = SharingMachine.totals.get("forgotten", 0) + 1

    @rule(pages=st.integers(0, 8))
    def reclaim(self, pages):
        self._resolve()
        self.cache.reclaim(pages)

    @invariant()
    def shared_content_and_accounting(self):
        c = self.cache
        assert not c._inflight and (c._worker is None or c._worker.idle())
        c.audit()
        for slot, blocks in self.running.items():
            got = self.kv[:, slot, :len(blocks) * T].reshape(2, len(blocks), T, -1)
            want = np.array([self.value[b] for b in blocks], dtype=np.int16)[None, :, None, None]
            assert (got == want).all(), f"slot {slot} reads other data than its blocks {blocks}"
        held = sum(1 for b in self.value if b in self.cached or b in self._in_use()) - len(self.pending)
        assert c.metrics()["keys_held"] >= held


def run_machine(machine, *, steps: int) -> dict:
    """Run ``machine`` (150 seeded examples of ``steps`` rules); the totals it counted."""
    SharingMachine.totals = {}
    run_state_machine_as_test(machine, settings=settings(
        max_examples=150, stateful_step_count=steps, deadline=None, derandomize=True,
        suppress_health_check=list(HealthCheck)))
    return SharingMachine.totals


def test_sharing_state_machine():
    t = run_machine(SharingMachine, steps=120)
    # the run exercised what it is about: hits mapped from other slots, and block reuse
    assert t["prefix_hits"] > 100 and t["pages_aliased"] > 100 and t["evicting"] > 10, t
    assert t["page_sets_moved"] > 10 and t["forgotten"] > 10 and t["claimed"] > 50, t
    assert t["copied"] > 50, t         # copy-on-write of a hit ending inside a block
    assert t["staged"] > 20 and t["page_sets_staged"] > 20, t   # prefixes staged into idle slots


class PackedMachine(SharingMachine):
    """The same engine with packs on: a run hit twice is copied into one allocation per range and
    mapped from it; every rule (eviction, moves, copy-on-write, staging, forget, reuse) crosses
    pack runs, and every running request reads its own blocks after each."""
    pack_pages = 8


def test_sharing_state_machine_with_packs():
    t = run_machine(PackedMachine, steps=120)
    assert t["packs_built"] > 10 and t["pages_packed"] > 10 and t["pack_unpacks"] > 5, t
    assert t["prefix_hits"] > 100 and t["page_sets_moved"] > 10 and t["copied"] > 50, t


class TwoPackSizes:
    """A machine mixin: packs of two sizes (4 and 2 page-sets; a hit run is tiled with a pack of
    4 where one starts and fits, else packs of 2), with hits of 4 page-sets made common."""
    pack_pages, pack_sets = 16, (2, 4)

    def __init__(self):
        super().__init__()
        packs = self.cache._pages.packs
        create = packs.create

        def counted(start, per_range):       # packs of 4 created, into the run's totals
            pack = create(start, per_range)
            if pack is not None and pack.size > 2:
                SharingMachine.totals["big_packs"] = SharingMachine.totals.get("big_packs", 0) + 1
            return pack
        packs.create = counted

    def _hit(self, choice: int, length: int) -> list[int]:
        return super()._hit(choice, min(2 * length, 4))


class MultiPackedMachine(TwoPackSizes, SharingMachine):
    """Runs of both pack sizes cross every rule."""


def test_sharing_state_machine_with_packs_of_two_sizes():
    t = run_machine(MultiPackedMachine, steps=120)
    assert t["packs_built"] > 10 and t.get("big_packs", 0) > 0 and t["pack_unpacks"] > 5, t   # packs of 4 made
    assert t["prefix_hits"] > 100 and t["page_sets_moved"] > 10 and t["copied"] > 50, t


def test_a_pack_of_pages_rewritten_in_place_is_not_mapped():
    """Found by 200-rule runs (2026-12-06): a cached block moved out of a new request's way
    leaves its pages where they are for the new block; a pack copied from them still matched
    their pool generations, and a later hit mapped the pack: the old block's content under the
    new block's key. A fresh block bound to kept pages now moves their generation on."""
    m = PackedMachine()
    try:
        admit = [(0, 3, 0), (0, 1, 0), (0, 1, 0), (0, 1, 2), (0, 1, 1), (0, 1, 0), (0, 1, 0), (33, 1, 2),
                 (1, 1, 1), (41, 1, 2)]                 # (choice, fresh, hit_len)
        order = "AFAFAFAFAFAAFFAFAFRA"                    # admit, finish, reclaim
        for step in order:
            if step == "A":
                choice, fresh, hit_len = admit.pop(0)
                m.admit(choice=choice, fresh=fresh, hit_len=hit_len)   # its hits read their blocks
            elif step == "F":
                m.finish(pick=0)
            else:
                m.reclaim(pages=1)
            m.shared_content_and_accounting()
        assert m.cache.metrics()["page_sets_moved"] >= 1      # blocks were moved out of the way
    finally:
        m.teardown()
