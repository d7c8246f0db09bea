"""The ping-pong GEMM's barrier protocol (``kernels_fused.hopper.gluon_pingpong``), replayed on the host
under random interleavings: its loader and two consumers as the kernel writes them (the same step
numbers, slots and phase parities), mbarriers with hardware's parity wait, TMA loads that land and
MMAs that retire at random later points. Every interleaving must end (no deadlock), every MMA must
read the fill of its own step, and no load may land in a slot an unretired MMA still reads. The
kernel cannot run here; this is what shows its indices and waits are right, and that the order
barrier is needed (without it a consumer passes a wait a ring lap early: shown failing)."""

from __future__ import annotations

import random

import pytest


class Barrier:
    """An mbarrier of arrival count 1: ``done`` phases completed. ``try_wait.parity P`` passes while
    the current phase's parity is not ``P`` (so a fresh barrier passes a wait for parity 1)."""

    def __init__(self):
        self.done = 0

    def passes(self, parity: int) -> bool:
        return (self.done & 1) != parity

    def arrive(self):
        self.done += 1


class Kernel:
    """One program's partitions over ``tiles`` tiles of ``steps`` K steps, a ring of ``stages`` slots."""

    def __init__(self, tiles: int, steps: int, stages: int, ordered: bool = True):
        self.tiles, self.steps, self.stages, self.ordered = tiles, steps, stages, ordered
        self.ready = [Barrier() for _ in range(stages)]
        self.empty = [Barrier() for _ in range(stages)]
        self.order = [Barrier(), Barrier()]
        self.content = [None] * stages  # the step whose operands a slot holds
        self.loads = []  # (step, slot) issued, not landed
        self.reading = {0: [], 1: []}  # a consumer's MMAs in flight: the slots they read
        self.errors = []
        self.mmas = 0

    def loader(self):
        g = 0
        for _tile in range(self.tiles):
            for _kk in range(self.steps):
                slot = g % self.stages
                yield lambda slot=slot, g=g: self.empty[slot].passes(((g // self.stages) & 1) ^ 1)
                self.loads.append((g, slot))
                g += 1

    def land(self, rng):
        """A load issued earlier lands: its slot holds its step, its ready barrier completes a phase."""
        g, slot = self.loads.pop(rng.randrange(len(self.loads)) if rng.random() < 0.3 else 0)
        if any(slot in r for r in self.reading.values()):
            self.errors.append(f"step {g}'s load landed in slot {slot} while an MMA still reads it")
        self.content[slot] = g
        self.ready[slot].arrive()

    def consumer(self, parity: int):
        for j in range(parity, self.tiles, 2):
            if j > 0 and self.ordered:
                yield lambda j=j: self.order[parity].passes(((j - 1) // 2) & 1)
            g = j * self.steps
            for kk in range(self.steps):
                g2 = g + kk
                slot = g2 % self.stages
                yield lambda slot=slot, g2=g2: self.ready[slot].passes((g2 // self.stages) & 1)
                if self.content[slot] != g2:
                    self.errors.append(f"consumer {parity}: step {g2}'s MMA read slot {slot} holding step "
                                       f"{self.content[slot]}")
                self.reading[parity].append(slot)
                self.mmas += 1
                yield lambda: True  # the MMA runs a while
                del self.reading[parity][:-1]  # wgmma.wait_group 1: all but the last retired
                if kk > 0:
                    self.empty[(g2 + self.stages - 1) % self.stages].arrive()
            self.reading[parity].clear()  # wait_group 0
            self.empty[(g + self.steps - 1) % self.stages].arrive()
            self.order[1 - parity].arrive()
            for _ in range(3):  # the epilogue
                yield lambda: True


def replay(tiles: int, steps: int, stages: int, seed: int, ordered: bool = True) -> Kernel:
    """Run the partitions to the end under one random interleaving; a state where nothing can move
    before the end is recorded as a deadlock."""
    rng = random.Random(seed)
    k = Kernel(tiles, steps, stages, ordered)
    actors = {"loader": k.loader(), "c0": k.consumer(0), "c1": k.consumer(1)}
    waiting = {name: next(gen, None) for name, gen in actors.items()}
    while any(w is not None for w in waiting.values()) or k.loads:
        runnable = [name for name, w in waiting.items() if w is not None and w()]
        if k.loads and (not runnable or rng.random() < 0.4):
            k.land(rng)
            continue
        if not runnable:
            k.errors.append(f"deadlock: {sorted(n for n, w in waiting.items() if w is not None)} wait")
            break
        name = rng.choice(runnable)
        waiting[name] = next(actors[name], None)
    return k


@pytest.mark.parametrize("tiles, steps, stages", [(1, 3, 4), (2, 2, 4), (5, 18, 4), (6, 28, 3), (7, 5, 2),
                                                  (4, 1, 3), (9, 7, 4)])
def test_every_interleaving_ends_with_each_mma_on_its_own_step(tiles, steps, stages):
    for seed in range(150):
        k = replay(tiles, steps, stages, seed)
        assert k.errors == [], (seed, k.errors[:3])
        assert k.mmas == tiles * steps


def test_without_the_order_barrier_a_consumer_reads_a_slot_a_lap_early():
    """The second consumer's first wait, on step ``steps``'s slot, passes on a phase of an earlier
    fill of that slot when the loader has not yet reached its step: its MMA reads other operands."""
    wrong = [replay(4, 5, 2, seed, ordered=False).errors for seed in range(100)]
    assert any(any("MMA read slot" in e for e in errors) for errors in wrong)
