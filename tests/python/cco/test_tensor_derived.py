"""The backends' store of values derived from weights (the CUDA backend's unshuffled and vendor
weights): a new tensor at a freed one's address is not taken for it. The fault scenario that found
it: a rank rejected a call and ran it on a zero weight of its own making; its next good call got a
weight at the same address, version 0, and used the zero weight's unshuffled copy."""

import torch

from cco.backends.base import WeightDerived


def test_a_new_tensor_where_a_freed_one_was_is_not_taken_for_it():
    """A weight that dies takes its value along, so a new tensor the allocator places at its
    address (version 0 again, perhaps the same ``id``) derives its own."""
    cache = WeightDerived()
    for i in range(64):
        src = torch.full((4096,), float(i))
        got = cache.get((src,), lambda: src * 2)
        assert torch.equal(got, src * 2), f"round {i}: derived from another tensor"
        del src, got
        assert len(cache) == 0


def test_weight_derived_keeps_one_value_per_weight():
    """The per-weight store (the CUDA backend's vendor weights: the layers of one shape share one op
    and a model calls them in turn): each weight's value is kept while it is unchanged, an in-place
    write or other tensor objects derive anew, a weight that dies takes its entry with it, and past
    ``kept`` weights the oldest goes."""
    cache, calls = WeightDerived(kept=3), []

    def derived(w):
        first, second = w

        def derive():
            calls.append(1)
            return float(first.sum() + second.sum())
        return derive

    ws = [(torch.full((8,), float(i)), torch.ones(2)) for i in range(3)]
    for _ in range(3):  # called in turn, as a decode step calls its layers
        for w in ws:
            assert cache.get(w, derived(w)) == float(w[0].sum() + 2)
    assert len(calls) == 3 and len(cache) == 3
    ws[1][0].add_(1)  # an in-place write: that weight alone derives again
    assert cache.get(ws[1], derived(ws[1])) == 18.0 and len(calls) == 4
    del ws[0], w  # a weight that dies takes its entry along
    assert len(cache) == 2
    view = (ws[1][0].view(2, 4), ws[1][1])  # other tensor objects (a view of the same bytes): another entry
    cache.get(view, derived(view))
    assert len(calls) == 5 and len(cache) == 3
    extra = (torch.zeros(8), torch.ones(2))
    cache.get(extra, derived(extra))
    assert len(calls) == 6 and len(cache) == 3  # past kept: the oldest entry (ws[1]'s) went
    cache.get(ws[0], derived(ws[0]))  # (written since, re-kept: not the oldest)
    assert len(calls) == 6
    cache.get(ws[1], derived(ws[1]))
    assert len(calls) == 7


def test_weight_derived_is_not_fooled_by_swapped_data():
    """``w.data = other`` moves the bytes under the same object and bumps no counter: the address
    in the stamp misses, and the kept alias keeps the old bytes taken meanwhile."""
    cache = WeightDerived()
    w = torch.full((4096,), 1.0)
    ptr = w.data_ptr()
    cache.get((w,), lambda: w * 2)
    w.data = torch.full((4096,), 2.0)
    assert all(torch.full((4096,), 3.0).data_ptr() != ptr for _ in range(8))
    assert torch.equal(cache.get((w,), lambda: w * 2), torch.full((4096,), 4.0))


def test_weight_derived_last_entry_is_checked_like_any_and_holds_nothing_let_go():
    """The entry the last call returned is tried first (a decode layer asks for its own weight on
    every call): it is returned only for the same tensor objects at the same stamp (a write in place,
    the scales given new bytes alone, or another tensor misses it), and it holds nothing the store
    has let go: the value of a weight that died, or of one pushed out past ``kept``, is freed."""
    import gc
    import weakref

    store, made = WeightDerived(kept=2), []

    def derive():
        made.append(1)
        return torch.zeros(1024)

    w = (torch.ones(4), torch.ones(2))
    first = store.get(w, derive)
    assert store.get(w, derive) is first and store.get(w, derive) is first and len(made) == 1
    w[1].data = w[1].data.clone()  # the scales' new bytes alone, no version moved
    second = store.get(w, derive)
    assert second is not first and len(made) == 2
    w[0].add_(1)
    assert store.get(w, derive) is not second and len(made) == 3
    assert store.get((w[0].view(4), w[1]), derive) is not None and len(made) == 4  # other objects, the same stamp
    value = weakref.ref(store.get(w, derive))  # (the last call's entry again: w's)
    assert len(made) == 4
    del w, first, second
    gc.collect()
    assert value() is None  # the weight died: its value went, the last entry too
    a, b, c = ((torch.full((4,), float(i)), torch.ones(2)) for i in range(3))
    value = weakref.ref(store.get(a, derive))
    store.get(b, derive)
    store.get(a, derive)  # a is the last entry again ...
    store.get(c, derive)  # ... and c pushes one out past kept=2
    gc.collect()
    kept = {id(x) for x in (store.get(b, derive), store.get(c, derive))}
    assert len(kept) == 2 and value() is None  # a, the oldest, went: its value is freed


def test_weight_derived_refreshes_its_value_in_place_where_asked():
    """With ``refresh``, a kept weight's value is brought up to date in place when the weight is
    written in place or given new bytes (the same value object: a CUDA graph captured over it keeps
    reading live memory), derived afresh for another tensor or where ``keep()`` says no (a capture);
    without it the value is replaced (a new object)."""
    store = WeightDerived()
    w, s = torch.ones(4), torch.ones(2)
    made, refreshed = [], []

    def derive():
        made.append(w.clone())
        return [w.clone()]

    def refresh(value):
        refreshed.append(1)
        value[0].copy_(w)
        return value

    first = store.get((w, s), derive, refresh=refresh)
    w.add_(1)  # written in place: its version moves
    again = store.get((w, s), derive, refresh=refresh)
    assert again is first and torch.equal(again[0], w) and (len(made), len(refreshed)) == (1, 1)
    assert store.get((w, s), derive, refresh=refresh) is first and len(refreshed) == 1  # unchanged: a hit
    w.data = torch.full((4,), 7.0)  # new bytes, no version moved
    assert store.get((w, s), derive, refresh=refresh) is first and torch.equal(first[0], w) and len(refreshed) == 2
    w.add_(1)
    fresh = store.get((w, s), derive, keep=lambda: False, refresh=refresh)  # (a capture): derived, not kept
    assert fresh is not first and len(made) == 2 and len(refreshed) == 2
    other = torch.ones(4)
    assert store.get((other, s), derive, refresh=refresh) is not first and len(made) == 3
    plain = WeightDerived()
    kept = plain.get((w, s), derive)
    w.add_(1)
    assert plain.get((w, s), derive) is not kept  # without refresh: replaced


def test_mxfp8_copy_is_refreshed_into_the_same_tensor():
    """``vendor.prepare_weight(..., into=)``: mxfp8's bf16 copy of a changed weight is written into
    the kept copy's tensor, bit for bit a fresh copy; the other quants' views are made anew."""
    from cco import quant as Q
    from kernels_fused.hopper import vendor

    g = torch.Generator().manual_seed(2)
    wq, ws = Q.quantize_b(torch.randn(64, 128, generator=g), "mxfp8")
    kept = vendor.prepare_weight(wq, ws, "mxfp8")
    wq2, ws2 = Q.quantize_b(torch.randn(64, 128, generator=g), "mxfp8")
    wq.copy_(wq2)
    ws.copy_(ws2)
    again = vendor.prepare_weight(wq, ws, "mxfp8", into=kept)
    assert again is kept and torch.equal(kept.dense.view(torch.int16),
                                         vendor.prepare_weight(wq, ws, "mxfp8").dense.view(torch.int16))
    pq, ps = Q.quantize_b(torch.randn(64, 128, generator=g), "ptpc")
    old = vendor.prepare_weight(pq, ps, "ptpc")
    assert vendor.prepare_weight(pq, ps, "ptpc", into=old).b_t.data_ptr() == pq.data_ptr()


def test_unshuffled_copy_is_refreshed_into_the_same_tensor(monkeypatch):
    """An op with ``weight_layout="bpreshuffle"`` on NVIDIA reads a row-major copy of the weight
    (``CudaBackend._unshuffled``): a weight written in place is unshuffled into that same copy (a
    CUDA graph captured over it reads live bytes, which the next eager call brought up to date),
    bit for bit a fresh copy, and a call with another weight leaves the first weight's copy alive;
    the vendor GEMM's views (ptpc, blockscale) then stay on the same bytes too."""
    from types import SimpleNamespace

    from cco import quant as Q
    from cco.backends import cuda
    from cco.backends.cuda import CudaBackend
    from cco.preshuffle import preshuffle_b, unshuffle_b

    monkeypatch.setattr(cuda, "_not_capturing", lambda: True)  # (a CPU build of torch has no capture to ask)
    g = torch.Generator().manual_seed(3)
    fake = SimpleNamespace(config=SimpleNamespace(weight_layout="bpreshuffle", quant="ptpc"),
                           _weight=WeightDerived(), _vendor_weight=WeightDerived())
    fake._unshuffled = lambda b: CudaBackend._unshuffled(fake, b)
    wq, ws = Q.quantize_b(torch.randn(64, 128, generator=g), "ptpc")
    b_pre = preshuffle_b(wq)
    kept = CudaBackend._unshuffled(fake, b_pre)
    view = CudaBackend._vendor(fake, b_pre, ws)
    other = preshuffle_b(Q.quantize_b(torch.randn(64, 128, generator=g), "ptpc")[0])
    CudaBackend._unshuffled(fake, other)
    w2, _ = Q.quantize_b(torch.randn(64, 128, generator=g), "ptpc")
    b_pre.copy_(preshuffle_b(w2))
    again = CudaBackend._unshuffled(fake, b_pre)
    assert again is kept and torch.equal(kept.view(torch.uint8), w2.view(torch.uint8))
    assert torch.equal(again.view(torch.uint8), unshuffle_b(b_pre).view(torch.uint8))
    assert CudaBackend._vendor(fake, b_pre, ws).b_t.data_ptr() == view.b_t.data_ptr() == kept.data_ptr()
