"""Public names that changed, still accepted under their old spelling for a while, with a warning."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from .exceptions import InvalidInputError

__all__ = ["renamed_keyword"]

P = ParamSpec("P")
R = TypeVar("R")


def renamed_keyword(old: str, new: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Let a function's keyword ``new`` also be passed as ``old``, its former name.

    A call that passes ``old`` gets a :class:`DeprecationWarning` naming ``new`` and runs as if it
    had passed ``new``. The type checker sees only ``new``, so it flags the old spelling.

    :raises InvalidInputError: (from the wrapped function) both names passed in one call.
    """

    def rename(function: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(function)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            if old in kwargs:
                if new in kwargs:
                    raise InvalidInputError(f"{old}= is the former name of {new}=: pass only {new}=")
                warnings.warn(f"{old}= is deprecated: pass {new}= instead", DeprecationWarning, stacklevel=2)
                moved: dict[str, Any] = kwargs
                moved[new] = moved.pop(old)
            return function(*args, **kwargs)

        return call

    return rename
