"""The agent layer: turn loop, working window, write-back and corrections over an engine and a store."""

from .memory import AgentMemory, AgentSettings, Reply, ReplyStream
from .writeback import WriteBackModel

__all__ = ["AgentMemory", "AgentSettings", "Reply", "ReplyStream", "WriteBackModel"]
