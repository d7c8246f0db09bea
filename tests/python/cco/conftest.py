import os

import pytest

# Without a GPU, Triton kernels run in Triton's interpreter; it must be chosen before triton is
# imported, so it is set here rather than in the test module that happens to import triton first.
if not os.environ.get("CCO_TEST_GPU"):
    try:
        import torch

        _gpu = torch.cuda.is_available()
    except ImportError:
        _gpu = False
    if not _gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    # Unmarked tests are host-only: pure Python, no GPU, no DSL, no processes.
    tier = {"host", "compile", "multirank", "gfx950", "cuda"}
    for item in items:
        if not tier & {m.name for m in item.iter_markers()}:
            item.add_marker(pytest.mark.host)


def pytest_sessionstart(session):
    # In CI the compile tier must run: a missing FlyDSL or ld.lld would otherwise turn every gfx950
    # compile and ISA-conformance test into a skip and the run would pass without checking them.
    if os.environ.get("CI"):
        from kernels_fused.gfx950.toolchain import flydsl_available

        why = flydsl_available()
        if why is not None:
            raise pytest.UsageError(f"CI needs the gfx950 compile toolchain: {why} (run scripts/setup.sh)")


@pytest.fixture(scope="module")
def gfx950_sweep(request):
    """Compiles the gfx950 variants (``quant, tile, K, fuse``) of this module's selected tests that
    take this fixture, on every CPU at once, before the first of them runs
    (``kernels_fused.gfx950.isa.precompile``): a compile is one core's work for 1-25 s, and a sweep
    of 70-odd compiled one by one was most of the compile tier's time."""
    from kernels_fused.gfx950 import isa
    from kernels_fused.gfx950.toolchain import flydsl_available

    if flydsl_available() is None:
        isa.precompile([tuple(item.callspec.params[a] for a in ("quant", "tile", "K", "fuse"))
                        for item in request.session.items
                        if item.module is request.module and "gfx950_sweep" in item.fixturenames])
