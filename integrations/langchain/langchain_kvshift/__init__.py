"""LangChain integration of kvshift-memory: a chat model that reuses the KV cache it has read, a
chain memory and an agent middleware whose recalled memories bring their stored KV along."""

from __future__ import annotations

from typing import Any

from langchain_kvshift.chat_models import ChatKVShift
from langchain_kvshift.memory import KVShiftMemory

__all__ = ["ChatKVShift", "KVShiftMemory", "KVShiftMiddleware"]


def __getattr__(name: str) -> Any:
    if name == "KVShiftMiddleware":  # needs `langchain` (the agents package): the extra [agents]
        from langchain_kvshift.middleware import KVShiftMiddleware

        return KVShiftMiddleware
    raise AttributeError(f"module 'langchain_kvshift' has no attribute {name!r}")
