"""LlamaIndex memory integration of kvshift-memory."""

from llama_index.memory.kvshift.base import KVShiftMemory
from llama_index.memory.kvshift.block import KVShiftMemoryBlock
from llama_index.memory.kvshift.retriever import KVShiftRetriever

__all__ = ["KVShiftMemory", "KVShiftMemoryBlock", "KVShiftRetriever"]
