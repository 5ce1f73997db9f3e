"""Every error the library raises on purpose derives from :class:`KVShiftError`.

Callers who only want to know "did kvshift refuse this?" catch the base class; the
subclasses say which part refused, so a caller can fix its input or its set-up.
"""

from __future__ import annotations

__all__ = [
    "KVShiftError",
    "InvalidInputError",
    "ContextOverflowError",
    "ModelNotFoundError",
    "ModelLoadError",
    "StoreError",
    "CorruptFragmentError",
    "CorruptRecordError",
    "MemoryNotFoundError",
    "VersionConflictError",
    "StoreBusyError",
    "SessionBusyError",
]


class KVShiftError(Exception):
    """Base class of every error raised by kvshift-memory."""


class InvalidInputError(KVShiftError, ValueError):
    """An argument has the wrong type, is empty, or takes a value we do not accept.

    Also a :class:`ValueError`, so code written against the usual Python contract keeps working.
    """


class ContextOverflowError(InvalidInputError):
    """The prompt (with the tokens asked for) does not fit in the model's context window."""


class ModelNotFoundError(KVShiftError):
    """The model files are not where they were looked for; the message names how to install them."""


class ModelLoadError(KVShiftError):
    """The model files were found but could not be loaded or converted."""


class StoreError(KVShiftError):
    """The memory store could not do what was asked (a backend refused, or the data is not sound)."""


class CorruptFragmentError(StoreError):
    """A stored fragment blob failed its checksum, format or shape check.

    The store reports it and the fragment is re-encoded from the memory's text; no answer uses it.
    """


class CorruptRecordError(StoreError):
    """A stored row was refused: it is damaged, or holds what this library never writes (a
    pickled value, a file outside the store folder). It is never served; :meth:`MemoryStore.check`
    reports it."""


class MemoryNotFoundError(StoreError, KeyError):
    """No live memory with that id for that tenant.

    Raised alike whether the id does not exist or belongs to another tenant, so that an error
    never tells one tenant what another holds.
    """

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class VersionConflictError(StoreError):
    """Another writer superseded or deleted the memory first; read it again and retry."""


class StoreBusyError(StoreError):
    """A lock of the store (a folder's database, another process's write) was not free within its
    timeout; nothing was written. Try again, or give the store a longer ``lock_timeout_s``."""


class SessionBusyError(KVShiftError):
    """A turn was asked of an agent session that is still answering another one.

    Turns of one session are serialised; this is raised when the wait passes the agent's
    ``busy_timeout_s``, or at once when the calling thread itself holds the open stream.
    """
