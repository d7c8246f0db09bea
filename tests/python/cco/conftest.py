import os

import pytest


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
        from kernels_fused.flydsl_toolchain import flydsl_available

        why = flydsl_available()
        if why is not None:
            raise pytest.UsageError(f"CI needs the gfx950 compile toolchain: {why} (run scripts/setup.sh)")
