"""KVShiftMemory without a model: its variables and the inputs it refuses."""

from __future__ import annotations

import pytest

from kvshift_memory import InvalidInputError, MemoryStore
from langchain_kvshift import KVShiftMemory


def test_kvshift_memory_refuses_what_it_cannot_read(tmp_path):
    with MemoryStore(tmp_path / "store") as store:  # no search or add happens: the embedder never loads
        memory = KVShiftMemory(store=store, user_id="alice", session_id="s1")
        assert memory.memory_variables == ["history"]
        with pytest.raises(InvalidInputError, match="input_key"):
            memory.load_memory_variables({"input": "hi", "other": "there"})
        with pytest.raises(InvalidInputError, match="one text output"):
            memory.save_context({"input": "hi"}, {"response": "a", "extra": "b"})
        assert memory.load_memory_variables({"input": "  "}) == {"history": ""}
