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
REAL_WEIGHT_FIXTURES = frozenset({"bundled_engine", "gemma_engine", "embedder"})
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
    """Where real weights live: the converted models, the shipped models' packages, the embedder."""
    from kvshift_memory.embedding import bundled_embedding_path
    from kvshift_memory.engine.loading import kvshift_home
    from kvshift_memory.shipped import SHIPPED_MODELS

    folders = [kvshift_home() / "models"]
    # a package not installed holds nothing that could be loaded either
    for model in SHIPPED_MODELS.values():
        with contextlib.suppress(Exception):
            folders.extend(part.parent for part in model.gguf_parts())
    with contextlib.suppress(Exception):
        folders.append(bundled_embedding_path().parent)
    return tuple(folder.resolve() for folder in folders)


@pytest.fixture(autouse=True)
def _real_weights_only_when_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("model") is not None:
        return
    from transformers import PreTrainedModel

    from kvshift_memory.embedding import MiniLMEmbedder

    def refuse() -> None:
        raise RuntimeError(
            f"{request.node.nodeid} loads real weights but is not marked `model`: use the "
            "bundled_engine / gemma_engine / embedder fixtures or @pytest.mark.model (see conftest.py at the root)"
        )

    load = PreTrainedModel.from_pretrained.__func__  # type: ignore[attr-defined]
    real = _real_weight_folders()

    def from_pretrained(cls: Any, name: Any, *args: Any, **kwargs: Any) -> Any:
        if any(Path(str(name)).resolve().is_relative_to(folder) for folder in real):
            refuse()
        return load(cls, name, *args, **kwargs)

    # every model class reads its weights through here (the Auto classes hold copies of their own
    # loader, made when transformers first imports them, so patching theirs would miss or leak); the
    # embedder may already hold its weights
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(from_pretrained))
    monkeypatch.setattr(MiniLMEmbedder, "_load", lambda self: refuse())
