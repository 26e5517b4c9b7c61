"""Helpers every benchmark shares: where results go, and how they are written."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

OUT_DIR = Path(__file__).resolve().parent / "out"


def machine() -> dict[str, Any]:
    """What the numbers were measured on, recorded next to them."""
    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()}


def write_json(name: str, data: dict[str, Any]) -> Path:
    """Write ``bench/out/<name>.json`` (pretty, stable key order) and return its path."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def plot_path(name: str) -> Path:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    return OUT_DIR / f"{name}.png"
