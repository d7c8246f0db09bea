"""The gemm-ar benchmark's arm selection (host only): mori's names, the lsa arms, refusals, how
the alternative arms switch backend knobs, and the refusal of ranks that share a GPU."""

import pytest

from scripts.bench_gemm_ar import ARMS, select_arms


def test_all_and_mori_names():
    assert select_arms("all", "ptpc") == list(ARMS)
    assert select_arms("fused-sdma,fused-lsa,gemm-only", "ptpc") == ["fused", "fused-lsa", "gemm-only"]
    assert "scaled_mm" not in select_arms("all", "blockscale")  # cuBLAS has no blockscale arm


@pytest.mark.parametrize("mode", ["split-lsa", "fused-xyz"])
def test_unknown_or_unimplemented_arms_are_refused_with_the_reason(mode):
    with pytest.raises(SystemExit, match="split-sdma" if mode == "split-lsa" else "not an arm"):
        select_arms(mode, "ptpc")


def test_override_sets_dotted_paths_and_refuses_unknown_knobs():
    """The alternative arms switch backend knobs by dotted path; a misspelt knob must not leave the
    arm silently running the default."""
    import types

    from cco.benchmark import override

    backend = types.SimpleNamespace(dma_reduce_in_gemm=False, schedule=types.SimpleNamespace(flag_by_copy=True))
    override(backend, {"dma_reduce_in_gemm": True, "schedule.flag_by_copy": False})
    assert backend.dma_reduce_in_gemm is True and backend.schedule.flag_by_copy is False
    for bad in ("dma_reduce_in_gem", "schedule.flag_by_cpy"):
        with pytest.raises(AttributeError, match=bad):
            override(backend, {bad: True}, what="arm")


def test_every_alternative_arm_is_selectable_and_its_chunks_build():
    """An alternative arm named in a comma list runs; a "chunks" override is a valid op chunking."""
    from cco import layout
    from scripts.bench_gemm_ar import ALTERNATIVES, OP_ARMS

    assert select_arms(",".join(ALTERNATIVES), "ptpc") == list(ALTERNATIVES)
    assert {"fused-two-lanes", "fused-taper", "fused-8-chunks"} <= set(ALTERNATIVES)
    for name in ALTERNATIVES:
        overrides = OP_ARMS[name][3]
        assert overrides, f"{name} overrides nothing: it would time the default"
        if "chunks" in overrides:
            cfg = layout.build_config(n=7168, k=2048, m_max=16384, world=2, chunks=overrides["chunks"],
                                      block_m=128, block_n=128)
            assert layout.call_chunks(cfg, 16384) == len(layout.chunk_weights(cfg))


class _Comm:
    """A stand-in communicator whose ranks report ``keys`` (host, GPU uuid)."""

    def __init__(self, keys):
        import torch

        self.keys, self.world, self.device = keys, len(keys), torch.device("cuda", 0)

    def all_gather_object(self, _):
        return list(self.keys)


@pytest.mark.parametrize("keys, shared", [
    ([("h0", "gpu-a"), ("h0", "gpu-b")], False),
    ([("h0", "gpu-a"), ("h1", "gpu-a")], False),  # same uuid string on two hosts: distinct GPUs
    ([("h0", "gpu-a"), ("h0", "gpu-a")], True),
    ([("h0", "gpu-a"), ("h0", "gpu-b"), ("h0", "gpu-a")], True),
])
def test_ranks_sharing_a_gpu_are_found_and_refused_by_the_benchmarks(monkeypatch, keys, shared):
    """Ranks on one GPU get the IPC window (torch symmetric memory refuses them) and the benchmarks
    refuse to time them: their bytes never cross a link."""
    import types

    import torch

    from cco import window
    from cco.benchmark import require_a_gpu_per_rank

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(uuid="unused"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    comm = _Comm(keys)
    assert window.ranks_share_a_device(comm) is shared
    if shared:
        with pytest.raises(SystemExit, match="ranks share a GPU"):
            require_a_gpu_per_rank(comm, "bench")
    else:
        require_a_gpu_per_rank(comm, "bench")
