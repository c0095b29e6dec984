"""Fixtures: generated text files, a tiny random Llama, a private cache directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import build_tiny_llama, make_text

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three text files (~60 KB in all) of generated English-like prose."""
    d = tmp_path_factory.mktemp("texts")
    for i in range(3):
        (d / f"doc{i}.txt").write_text(make_text(i, 120))
    return d


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, text_dir: Path) -> Path:
    texts = [p.read_text() for p in sorted(text_dir.glob("*.txt"))]
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama", texts)


@pytest.fixture()
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private compress cache for tests that must not touch the real one."""
    d = tmp_path / "cache"
    monkeypatch.setenv("COMPRESS_CACHE", str(d))
    return d
