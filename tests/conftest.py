from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"
TINY_HF = FIXTURES / "models" / "ernie45_tiny_hf"
TINY_PADDLE = FIXTURES / "models" / "ernie45_tiny_paddle"
REFERENCE = FIXTURES / "reference"


@pytest.fixture(scope="session")
def tiny_hf() -> str:
    return str(TINY_HF)


@pytest.fixture(scope="session")
def tiny_paddle() -> str:
    return str(TINY_PADDLE)
