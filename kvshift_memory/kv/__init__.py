"""KV state that moves: fragments, RoPE shifts and the working cache they are assembled into."""

from .cache import ForwardStep, ShiftCache, current_step
from .fragment import Fragment
from .rope import RotaryLayer, shift_keys

__all__ = ["ForwardStep", "Fragment", "RotaryLayer", "ShiftCache", "current_step", "shift_keys"]
