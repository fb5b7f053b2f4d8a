"""Where the tests find the repository and ../shared (the public datasets, next to the repository)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
PUBLIC = SHARED / "data" / "public"
