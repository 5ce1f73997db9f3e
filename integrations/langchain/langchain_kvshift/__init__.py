"""LangChain integration of kvshift-memory: a chat model that reuses the KV cache it has read."""

from langchain_kvshift.chat_models import ChatKVShift

__all__ = ["ChatKVShift"]
