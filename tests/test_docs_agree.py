"""The docs say what the service does: its defaults, the model it names, and to users.

A user reads the defaults in the README's endpoint table and in docs/service.md, copies the model
name from docs/clients.md and reads the measurement pages as written to them; each check here
compares a page with the value in the code, or looks for a phrase that only made sense to the
people who wrote the page.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specrag.controller.config import ControllerConfig
from specrag.pipeline.models.catalog import SERVED_NAME

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


@pytest.mark.parametrize("page", [ROOT / "README.md", DOCS / "service.md"], ids=lambda p: p.name)
def test_the_endpoint_table_gives_the_defaults(page: Path) -> None:
    row = next(
        line
        for line in page.read_text(encoding="utf-8").splitlines()
        if line.startswith("| `POST /v1/rag` |")
    )
    config = ControllerConfig()
    assert f'"k"? (default {config.k_default})' in row
    assert f'"max_tokens"? (default {config.max_tokens_default})' in row


def test_the_client_examples_use_the_model_the_service_names() -> None:
    text = (DOCS / "clients.md").read_text(encoding="utf-8")
    named = set(re.findall(r'model(?:=|": )"([^"]+)"', text))
    assert named == {SERVED_NAME}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_pages_speak_to_users(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    assert not re.search(r"\bthe issue\b|\bissue's\b|\bissue \d+", text, re.IGNORECASE)
