from __future__ import annotations

from pathlib import Path

import pytest

from agentnb import Workspace


@pytest.fixture
def ws(tmp_path: Path) -> Workspace:
    return Workspace(tmp_path / "ws")
