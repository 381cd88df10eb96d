"""Repository-wide pytest set-up (loaded for tests/ and notebooks/ alike).

The notebooks, executed by nbmake in a kernel subprocess, belong to the slow tier: they run with
`-m "slow or not slow"` (the README's test command, CI) and `-m slow`, not in the default run.
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)  # before the -m deselection reads the marks
def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)
