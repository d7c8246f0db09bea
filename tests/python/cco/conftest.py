import pytest


def pytest_collection_modifyitems(config, items):
    # Unmarked tests are host-only: pure Python, no GPU, no DSL, no processes.
    tier = {"host", "compile", "multirank", "gfx950", "cuda"}
    for item in items:
        if not tier & {m.name for m in item.iter_markers()}:
            item.add_marker(pytest.mark.host)
