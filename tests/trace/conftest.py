from pathlib import Path

import pytest

TRACES = Path("/work/shared/traces/hta-tests")


@pytest.fixture(scope="session")
def traces() -> Path:
    if not TRACES.exists():
        pytest.skip(f"shared traces not found at {TRACES}")
    return TRACES
