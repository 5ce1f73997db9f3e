"""The public surface is pinned: adding or removing a name is a deliberate change of this test."""

import kvshift_memory
from kvshift_memory import exceptions

EXPECTED = {
    "AgentMemory",
    "AgentSettings",
    "Reply",
    "ReplyStream",
    "SessionBusyError",
    "CheckReport",
    "ContextOverflowError",
    "CorruptFragmentError",
    "CorruptRecordError",
    "EngineSettings",
    "GCReport",
    "GenerationResult",
    "GenerationStream",
    "Grammar",
    "InvalidInputError",
    "KVShiftEngine",
    "KVShiftError",
    "MemoryNotFoundError",
    "MemoryRecord",
    "Message",
    "MemoryStore",
    "ModelLoadError",
    "ModelNotFoundError",
    "ReuseStats",
    "ScoreResult",
    "StoreBusyError",
    "StoreError",
    "VersionConflictError",
    "__version__",
    "exceptions",
}


def test_all_is_pinned():
    assert set(kvshift_memory.__all__) == EXPECTED
    for name in kvshift_memory.__all__:
        assert hasattr(kvshift_memory, name)


ADAPTERS = {
    "CONSTRAINED_REPETITION_PENALTY",
    "CORE_TOKENS",
    "CoreLine",
    "change_block",
    "core_text",
    "joins_core",
    "placed_lines",
    "read_block",
    "put_item",
    "list_items",
    "message_key",
    "item_of",
    "item_tenants",
    "get_item",
    "delete_item",
    "Item",
    "FEATURES",
    "Decision",
    "Engine",
    "MarkedSpan",
    "RECALL",
    "RecallSettings",
    "Store",
    "TOOL_LAYOUTS",
    "ToolLayout",
    "WriteBackModel",
    "archive",
    "archived_text",
    "closed_schema",
    "context_window",
    "explicit_request",
    "forget_closest",
    "format_tool_calls",
    "in_document_order",
    "is_call_name",
    "last_sentence",
    "marked_user_message",
    "parse_markers",
    "parse_tool_calls",
    "plausible_reply_ids",
    "recall",
    "refresh_item",
    "render_marker",
    "render_memories",
    "resolve_markers",
    "schema_instructions",
    "strip_markers",
    "sweep_items",
    "tool_call_grammar",
    "tool_response",
    "tools_instructions",
    "turn_features",
    "with_system_text",
}


def test_the_adapter_surface_is_pinned_and_the_integrations_use_nothing_else():
    import ast
    import pathlib

    from kvshift_memory import adapters

    assert set(adapters.__all__) == ADAPTERS
    for name in adapters.__all__:
        assert hasattr(adapters, name)
    integrations = pathlib.Path(kvshift_memory.__file__).parent.parent / "integrations"
    for path in integrations.rglob("*.py"):
        if "tests" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvshift_memory"):
                assert node.module in ("kvshift_memory", "kvshift_memory.adapters"), f"{path}: {node.module}"


def test_every_error_derives_from_the_base():
    for name in exceptions.__all__:
        error = getattr(exceptions, name)
        assert issubclass(error, exceptions.KVShiftError)


def test_no_unsafe_deserialisation_in_the_package():
    """Stored KV is untrusted input: never pickle, torch.load or eval."""
    import pathlib
    import re

    root = pathlib.Path(kvshift_memory.__file__).parent
    pattern = re.compile(r"\b(pickle|torch\.load|eval\(|exec\(|marshal)\b")
    offenders = [str(p) for p in root.rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def test_every_data_file_in_the_package_ships_in_wheels():
    """Files read through importlib.resources must be declared as package data, or wheels lack them."""
    import fnmatch
    import pathlib

    tomllib = __import__("pytest").importorskip("tomllib")
    root = pathlib.Path(kvshift_memory.__file__).parent
    declared = tomllib.loads((root.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for path in root.rglob("*"):
        if path.is_dir() or path.suffix in (".py", ".pyc"):
            continue
        package = ".".join(path.parent.relative_to(root.parent).parts)
        assert any(fnmatch.fnmatch(path.name, pattern) for pattern in declared.get(package, [])), path


def test_the_store_side_never_loads_torch():
    """A process that only stores and searches memories (directly or through the adapters, as a
    worker writing items does) must not pay for the model stack."""
    import subprocess
    import sys

    code = (
        "import sys; from kvshift_memory import MemoryStore, MemoryRecord; import kvshift_memory.store; "
        "import kvshift_memory.blobs; import kvshift_memory.adapters; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_store_layer_imports_neither_torch_nor_the_engine():
    """docs/store.md: the store moves bytes and metadata; the default embedder is the only model it may load, lazily."""
    import pathlib
    import re

    root = pathlib.Path(kvshift_memory.__file__).parent
    pattern = re.compile(
        r"^\s*(import torch|from torch|from \.\.(engine|kv)\b|import transformers|from transformers)", re.M
    )
    for path in [*(root / "store").rglob("*.py"), root / "blobs.py"]:
        assert not pattern.search(path.read_text()), path


def test_every_door_recalls_with_one_policy():
    """The agent and each adapter take their recall defaults from ``adapters.RECALL``."""
    import inspect

    from kvshift_memory import AgentSettings, adapters
    from langchain_kvshift import KVShiftMemory, KVShiftMiddleware
    from llama_index.memory.kvshift import KVShiftMemory as LlamaMemory
    from llama_index.memory.kvshift import KVShiftMemoryBlock

    policy = adapters.RECALL
    settings = AgentSettings()
    assert (settings.recall_k, settings.recall_min_score) == (policy.k, policy.min_score)
    assert (settings.importance_weight, settings.session_weight) == (policy.importance_weight, policy.session_weight)
    middleware = inspect.signature(KVShiftMiddleware.__init__).parameters
    assert (middleware["recall_k"].default, middleware["recall_min_score"].default) == (policy.k, policy.min_score)
    for model in (KVShiftMemory, LlamaMemory, KVShiftMemoryBlock):
        fields = model.model_fields
        assert (fields["recall_k"].default, fields["recall_min_score"].default) == (policy.k, policy.min_score), model
    recall = inspect.signature(adapters.recall).parameters
    assert [recall[name].default for name in ("k", "min_score", "importance_weight", "session_weight")] == [
        policy.k,
        policy.min_score,
        policy.importance_weight,
        policy.session_weight,
    ]
