"""LlamaIndex memory integration of kvshift-memory."""

from llama_index.memory.kvshift.base import KVShiftMemory

__all__ = ["KVShiftMemory"]
