"""LangChain integration of kvshift-memory: a chat model that reuses the KV cache it has read, a
LangGraph store and an agent middleware whose recalled memories bring their stored KV along, a
retriever whose documents do too, and the classic chain memory."""

from __future__ import annotations

from typing import Any

from langchain_kvshift.chat_models import ChatKVShift
from langchain_kvshift.retrievers import KVShiftRetriever

__all__ = ["ChatKVShift", "KVShiftMemory", "KVShiftMiddleware", "KVShiftRetriever", "KVShiftStore"]


def __getattr__(name: str) -> Any:
    # both need `langchain` and `langgraph` (the agents packages): the extra [agents]
    if name == "KVShiftMiddleware":
        from langchain_kvshift.middleware import KVShiftMiddleware

        return KVShiftMiddleware
    if name == "KVShiftMemory":  # a langchain-classic BaseMemory (ConversationChain): the extra [classic]
        from langchain_kvshift.memory import KVShiftMemory

        return KVShiftMemory
    if name == "KVShiftStore":
        from langchain_kvshift.store import KVShiftStore

        return KVShiftStore
    raise AttributeError(f"module 'langchain_kvshift' has no attribute {name!r}")
