import os
from pathlib import Path

import pytest

# shared/ lies beside the checkout (CI copies it there); TITAN_SHARED overrides.
TRACES = (
    Path(os.environ.get("TITAN_SHARED") or Path(__file__).resolve().parents[2].parent / "shared")
    / "traces"
    / "hta-tests"
)


@pytest.fixture(scope="session")
def traces() -> Path:
    if not TRACES.exists():
        pytest.skip(f"shared traces not found at {TRACES}")
    return TRACES
