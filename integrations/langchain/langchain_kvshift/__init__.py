"""LangChain integration of kvshift-memory: a chat model that reuses the KV cache it has read, and a
chain memory whose recalled items bring their stored KV along."""

from langchain_kvshift.chat_models import ChatKVShift
from langchain_kvshift.memory import KVShiftMemory

__all__ = ["ChatKVShift", "KVShiftMemory"]
