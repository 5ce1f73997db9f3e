"""LlamaIndex LLM integration of kvshift-memory."""

from llama_index.llms.kvshift.base import KVShiftLLM

__all__ = ["KVShiftLLM"]
