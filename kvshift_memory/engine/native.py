"""The engine's own CPU kernels (``kernels.c``): products with int4 / int8 weights and one-token
attention, built once per machine and loaded with ctypes.

PyTorch's weight-only kernels (``_weight_int4pack_mm_for_cpu``, ``_weight_int8pack_mm``) are
vectorised for AVX-512 only; on an AVX2 CPU they run scalar code, several times slower than the
float32 product they would replace (``docs/benchmarks/decode.md``). The file here is plain C
(AVX2 intrinsics where the compiler targets them, scalar loops elsewhere), so any C compiler builds
it in about a second; a C++ extension against PyTorch's headers would need those headers, Python's,
and a minute of compiling. The build is cached under ``$KVSHIFT_HOME/kernels``, named by a digest
of the source, the compiler and this CPU's features, and written by a temporary file renamed into
place, so processes building at once never load a half-written library.

OpenMP comes from ``libgomp.so.1``, which resolves to the runtime PyTorch has already loaded: one
thread pool, sized by ``torch.set_num_threads``. Where nothing can be built (no compiler, a
compiler without OpenMP is tried next, then none) :func:`kernels` returns ``None`` and the callers
use PyTorch's operators; ``KVSHIFT_NATIVE=0`` asks for that on purpose.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from importlib import resources
from pathlib import Path

import torch

__all__ = ["Layer", "Matrix", "Model", "NativeKernels", "kernels", "native_status"]

log = logging.getLogger("kvshift_memory")

_ABI_VERSION = 12
_COMPILE_TIMEOUT_S = 120.0
# a thread that finds another building waits this long, then runs PyTorch's operators for now
_BUILD_WAIT_S = 3 * _COMPILE_TIMEOUT_S + 30.0
# most specific first: a flag this compiler or CPU refuses drops to the next line
_FLAG_SETS = (
    ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"),
    ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno"),
    ("-O3", "-ffp-contract=off", "-fno-math-errno"),
)

_lock = threading.Lock()
_loaded: NativeKernels | None = None
_status: str | None = None

_P = ctypes.c_void_p
_I = ctypes.c_int64


class Matrix(ctypes.Structure):
    """``kv_matrix``: one weight matrix as the kernels read it (:class:`~.weights.QuantizedMatrix`
    builds it, and keeps the tensors it points into alive)."""

    _fields_ = [
        ("kind", _I),
        ("rows", _I),
        ("cols", _I),
        ("group", _I),
        ("data", _P),
        ("scale", _P),
        ("offset", _P),
    ]


class Layer(ctypes.Structure):
    """``kv_layer``: what ``kv_model_step`` reads of one decoder layer (:mod:`.stepping` builds it)."""

    _fields_ = [
        *(
            (name, _I)
            for name in (
                "hidden",
                "q_heads",
                "kv_heads",
                "head_dim",
                "intermediate",
                "window",
                "activation",
                "sandwich",
            )
        ),
        ("eps", ctypes.c_float),
        ("scaling", ctypes.c_float),
        *((name, _P) for name in ("input_norm", "attention_norm", "mlp_norm", "mlp_out_norm", "q_norm", "k_norm")),
        *((name, _P) for name in ("qkv_bias", "o_bias", "gate_up_bias", "down_bias")),
        *((name, Matrix) for name in ("qkv", "o", "gate_up", "down")),
    ]


class Model(ctypes.Structure):
    """``kv_model``: the layers, embedding, final norm and head ``kv_model_step`` runs."""

    _fields_ = [
        ("layers", _I),
        ("hidden", _I),
        ("vocab", _I),
        ("eps", ctypes.c_float),
        ("embed_scale", ctypes.c_float),
        ("layer", ctypes.POINTER(Layer)),
        ("embed", Matrix),
        ("head", Matrix),
        ("final_norm", _P),
    ]


class NativeKernels:
    """The loaded library. Every tensor given is contiguous float32 on the CPU unless said; shapes
    are the callers' to check (:mod:`.weights` and :mod:`.stepping` own the layouts), a call here
    passes raw pointers."""

    def __init__(self, library: ctypes.CDLL, path: Path, flags: tuple[str, ...]) -> None:
        self.path = path
        #: the compiler flags it was built with (``-fopenmp`` among them when it runs threaded)
        self.flags = flags
        self._lib = library
        library.kv_matmul.argtypes = [ctypes.POINTER(Matrix), _I, _P, _P]
        library.kv_dequantize.argtypes = [ctypes.POINTER(Matrix), _I, _P, _P]
        library.kv_attend_one.argtypes = [_I, _I, _I, _I, _P, _P, _P, _I, _I, ctypes.c_float, _P]
        pointers = ctypes.POINTER(_P)
        library.kv_model_step.argtypes = [
            ctypes.POINTER(Model),
            _I,
            _I,
            pointers,
            pointers,
            _I,
            pointers,
            pointers,
            _P,
            _I,
        ]
        for function in ("kv_matmul", "kv_dequantize", "kv_attend_one", "kv_model_step"):
            getattr(library, function).restype = None

    def matmul(self, matrix: Matrix, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out[m, n] = x[m, :] . W[n, :]``."""
        self._lib.kv_matmul(ctypes.byref(matrix), x.shape[0], x.data_ptr(), out.data_ptr())

    def dequantize(self, matrix: Matrix, rows: torch.Tensor | None, out: torch.Tensor) -> None:
        """The values of ``rows`` (int64 ids; ``None``: the first ``out.shape[0]``) into ``out``."""
        pointer = None if rows is None else rows.data_ptr()
        self._lib.kv_dequantize(ctypes.byref(matrix), out.shape[0], pointer, out.data_ptr())

    def attend_one(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        lo: int,
        hi: int,
        scaling: float,
        out: torch.Tensor,
    ) -> None:
        """One token's attention: ``query`` ``[q_heads, dim]`` over slots ``[lo, hi)`` of ``keys`` and
        ``values`` (``[1, kv_heads, capacity, dim]``), into ``out`` ``[q_heads, dim]``."""
        q_heads, dim = query.shape
        _, kv_heads, capacity, _ = keys.shape
        self._lib.kv_attend_one(
            q_heads,
            kv_heads,
            dim,
            capacity * dim,
            query.data_ptr(),
            keys.data_ptr(),
            values.data_ptr(),
            lo,
            hi,
            scaling,
            out.data_ptr(),
        )

    def model_step(
        self,
        model: Model,
        token: int,
        slot: int,
        keys: ctypes.Array,
        values: ctypes.Array,
        capacity: int,
        cos: ctypes.Array,
        signed_sin: ctypes.Array,
        logits: torch.Tensor,
    ) -> None:
        """One token through the whole model: its K/V written at ``slot`` of each layer's cache
        (``keys``/``values``: one pointer per layer to ``[1, kv_heads, capacity, head_dim]``), each
        layer rotated by its ``cos``/``signed_sin`` (one pointer per layer), the logits into
        ``logits``; on as many threads as ``torch.get_num_threads()``."""
        self._lib.kv_model_step(
            ctypes.byref(model),
            token,
            slot,
            keys,
            values,
            capacity,
            cos,
            signed_sin,
            logits.data_ptr(),
            torch.get_num_threads(),
        )


def _compiler() -> list[str] | None:
    configured = os.environ.get("CC")
    if configured:
        return shlex.split(configured)
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return [found]
    return None


def _cpu_identity() -> str:
    """What ``-march=native`` compiles for: the CPU's model and features where Linux says them."""
    try:
        lines = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        lines = []
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(sorted(set(wanted))) or f"{platform.machine()} {platform.processor()}"


def _compiler_version(compiler: list[str]) -> str:
    try:
        done = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout


def _build(source: bytes, compiler: list[str], folder: Path) -> tuple[Path, tuple[str, ...]] | str:
    """The built library and its flags, or why none could be built."""
    version = _compiler_version(compiler)
    identity = _cpu_identity()
    errors = []
    for flags in _FLAG_SETS:
        digest = hashlib.sha256(
            b"\0".join(
                [source, " ".join(compiler).encode(), version.encode(), " ".join(flags).encode(), identity.encode()]
            )
        ).hexdigest()[:24]
        target = folder / f"kernels-{digest}.so"
        if target.exists():
            return target, flags
        folder.mkdir(parents=True, exist_ok=True)
        handle, work = tempfile.mkstemp(prefix=f"{target.name}.tmp-", dir=folder)
        os.close(handle)
        with tempfile.TemporaryDirectory() as scratch:
            source_path = Path(scratch) / "kernels.c"
            source_path.write_bytes(source)
            command = [*compiler, *flags, "-shared", "-fPIC", "-o", work, str(source_path), "-lm"]
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=_COMPILE_TIMEOUT_S, check=False)
            except (OSError, subprocess.SubprocessError) as exc:
                errors.append(f"{' '.join(flags)}: {exc}")
                Path(work).unlink(missing_ok=True)
                continue
        if done.returncode != 0:
            errors.append(f"{' '.join(flags)}: {done.stderr.strip()[-300:]}")
            Path(work).unlink(missing_ok=True)
            continue
        os.replace(work, target)
        return target, flags
    return "; ".join(errors) or "no flags to try"


def _load() -> NativeKernels | str:
    if os.environ.get("KVSHIFT_NATIVE", "1") == "0":
        return "KVSHIFT_NATIVE=0"
    compiler = _compiler()
    if compiler is None:
        return "no C compiler found (set CC, or install gcc or clang)"
    from .loading import kvshift_home

    source = resources.files(__package__).joinpath("kernels.c").read_bytes()
    try:
        built = _build(source, compiler, kvshift_home() / "kernels")
    except OSError as exc:
        return f"could not write the kernels to {kvshift_home() / 'kernels'}: {exc}"
    if isinstance(built, str):
        return f"{' '.join(compiler)} could not build the kernels: {built}"
    path, flags = built
    try:
        library = ctypes.CDLL(str(path))
        version = library.kv_abi_version()
    except (OSError, AttributeError) as exc:
        return f"could not load {path}: {exc}"
    if version != _ABI_VERSION:
        return f"{path} is version {version}, not {_ABI_VERSION}"
    return NativeKernels(library, path, flags)


def kernels() -> NativeKernels | None:
    """The kernels, built or loaded on first use; ``None`` where they cannot be (the reason is
    logged once at INFO and given by :func:`native_status`)."""
    global _loaded, _status
    if _status is not None:
        return _loaded
    if not _lock.acquire(timeout=_BUILD_WAIT_S):
        return None
    try:
        if _status is None:
            outcome = _load()
            if isinstance(outcome, str):
                log.info("kvshift kernels not used: %s; PyTorch's operators run instead", outcome)
                _status = outcome
            else:
                _loaded, _status = outcome, f"built with {' '.join(outcome.flags)}"
    finally:
        _lock.release()
    return _loaded


def native_status() -> str:
    """What :func:`kernels` found: the flags the kernels were built with, or why there are none."""
    kernels()
    return _status or "being built by another thread"
