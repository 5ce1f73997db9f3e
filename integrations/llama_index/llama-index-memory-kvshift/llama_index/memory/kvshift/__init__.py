"""LlamaIndex memory integration of kvshift-memory."""

from llama_index.memory.kvshift.base import KVShiftMemory
from llama_index.memory.kvshift.block import KVShiftMemoryBlock

__all__ = ["KVShiftMemory", "KVShiftMemoryBlock"]
