"""Every test that loads real weights is marked ``model``, so ``pytest -m "not model"`` is quick.

Marked automatically: tests that use a fixture holding the bundled model or embedder (directly or
through another fixture), and the framework packages' integration tests. Any other test that
reads the bundled weights in this process fails, naming this file: it must use those fixtures or
carry ``@pytest.mark.model`` itself (as tests that load them in a subprocess do). Tiny
random-weight models, built from a config or saved to a temporary folder, are not real weights.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any

import pytest

#: fixtures that hold real weights (a fixture built on one of them is in a test's closure too)
REAL_WEIGHT_FIXTURES = frozenset({"bundled_engine", "embedder"})
#: folders whose tests all drive the bundled model
REAL_WEIGHT_FOLDERS = ("integration_tests",)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        uses_weights = REAL_WEIGHT_FIXTURES & set(getattr(item, "fixturenames", ()))
        in_folder = any(part in REAL_WEIGHT_FOLDERS for part in Path(str(item.fspath)).parts)
        if uses_weights or in_folder:
            item.add_marker(pytest.mark.model)


@functools.cache
def _real_weight_folders() -> tuple[Path, ...]:
    """Where the bundled weights live: the converted model, its GGUF package, the embedder."""
    from kvshift_memory.embedding import bundled_embedding_path
    from kvshift_memory.engine.loading import bundled_gguf_path, kvshift_home

    folders = [kvshift_home() / "models"]
    for locate in (bundled_gguf_path, bundled_embedding_path):
        with contextlib.suppress(Exception):  # not installed: nothing of it can be loaded either
            folders.append(locate().parent)
    return tuple(folder.resolve() for folder in folders)


@pytest.fixture(autouse=True)
def _real_weights_only_when_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("model") is not None:
        return
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    from kvshift_memory.embedding import MiniLMEmbedder

    def refuse() -> None:
        raise RuntimeError(
            f"{request.node.nodeid} loads real weights but is not marked `model`: use the "
            "bundled_engine / embedder fixtures or @pytest.mark.model (see conftest.py at the root)"
        )

    load = _BaseAutoModelClass.from_pretrained.__func__  # type: ignore[attr-defined]
    real = _real_weight_folders()

    def from_pretrained(cls: Any, name: Any, *args: Any, **kwargs: Any) -> Any:
        if any(Path(str(name)).resolve().is_relative_to(folder) for folder in real):
            refuse()
        return load(cls, name, *args, **kwargs)

    # every model in this project is read through here; the embedder may already hold its weights
    monkeypatch.setattr(_BaseAutoModelClass, "from_pretrained", classmethod(from_pretrained))
    monkeypatch.setattr(MiniLMEmbedder, "_load", lambda self: refuse())
