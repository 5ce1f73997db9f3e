"""A session's working window, kept in the store so that another process continues it.

The window is saved as JSON after every change (:meth:`MemoryStore.save_session`, compare-and-set)
and read back by an :class:`~kvshift_memory.AgentMemory` of the same user and session in a new
process, or on another worker behind a load balancer. Memories are saved by id and version and read
again from the store: one deleted or superseded since is not shown again. The replies' token ids
are kept, so the prompt rebuilt is the very same tokens and its K/V can be restored from the
store's chunks. What is read back is untrusted: anything malformed leaves the window empty (the
memories themselves are in the store either way).
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any, get_args

from .. import inputs
from ..exceptions import InvalidInputError
from ..protocols import Store
from .turns import Turn
from .writeback import Decision

__all__ = ["decode_window", "encode_window"]

logger = logging.getLogger("kvshift_memory.agent")

FORMAT = "kvshift-session/1"
_DECISIONS = frozenset(get_args(Decision))


def encode_window(turns: list[Turn], previous: str) -> bytes:
    """The window and the last turn's text (a write-back feature) as the bytes a store keeps."""
    return json.dumps(
        {
            "format": FORMAT,
            "previous": previous,
            "turns": [
                {
                    "user": turn.user,
                    "recalled": [[record.id, record.version] for record in turn.recalled],
                    "tokens": turn.tokens,
                    "reply": turn.reply,
                    "reply_ids": turn.reply_ids,
                    "importance": turn.importance,
                    "decision": turn.decision,
                    "archived": None if turn.archived is None else [turn.archived.id, turn.archived.version],
                    "previous": turn.previous,
                }
                for turn in turns
            ],
        },
        ensure_ascii=False,
    ).encode("utf-8")


def decode_window(raw: bytes, store: Store, user_id: str) -> tuple[list[Turn], str]:
    """The window saved in ``raw``, its memories read again from ``store`` (``user_id``'s only).

    A memory recalled into a turn that is gone or superseded is left out of the turn; a turn whose
    own memory was deleted leaves the window (as :meth:`AgentMemory.forget` does in-process).

    :returns: (turns, previous); ``([], "")`` when ``raw`` is malformed (logged).
    :raises StoreError: the store could not be read.
    """
    try:
        data = json.loads(raw.decode("utf-8"))
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("turns"), list):
            raise ValueError("not a saved session")
        turns = []
        for item in data["turns"]:
            turn = _turn(item, store, user_id)
            if turn is not None:
                turns.append(turn)
        previous = inputs.check_text(data.get("previous", ""), "previous", allow_empty=True)
    except (ValueError, TypeError, KeyError, RecursionError, InvalidInputError) as exc:
        logger.warning("the saved session of %r is unusable, starting with an empty window: %s", user_id, exc)
        return [], ""
    return turns, previous


def _turn(item: Any, store: Store, user_id: str) -> Turn | None:
    if not isinstance(item, dict):
        raise ValueError("a turn is an object")
    decision = item["decision"]
    if decision not in _DECISIONS:
        raise ValueError(f"unknown decision {decision!r}")
    reply_ids = item["reply_ids"]
    if reply_ids is not None and not (
        isinstance(reply_ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in reply_ids)
    ):
        raise ValueError("reply_ids are a list of ints")
    importance, tokens = item["importance"], item["tokens"]
    if not isinstance(importance, (int, float)) or isinstance(importance, bool) or not math.isfinite(importance):
        raise ValueError("importance is a number")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise ValueError("tokens is a count")
    archived = None
    if item["archived"] is not None:
        memory_id, version = _reference(item["archived"])
        current = store.get(memory_id, tenant=user_id)  # a store that fails raises: the saved window stays
        if current is None:
            return None  # the memory this turn stated was deleted: the turn leaves the window
        if current.version == version:
            archived = current
        else:
            decision = "archive" if decision == "defer" else decision  # superseded: archived once already
    recalled = tuple(record for ref in item["recalled"] if (record := _live(store, ref, user_id)) is not None)
    return Turn(
        user=inputs.check_text(item["user"], "user"),
        recalled=recalled,
        tokens=tokens,
        reply=inputs.check_text(item["reply"], "reply", allow_empty=True),
        reply_ids=reply_ids,
        importance=float(importance),
        decision=decision,
        archived=archived,
        previous=inputs.check_text(item["previous"], "previous", allow_empty=True),
    )


def _reference(ref: Any) -> tuple[str, int]:
    if (
        not isinstance(ref, list)
        or len(ref) != 2
        or not isinstance(ref[0], str)
        or not isinstance(ref[1], int)
        or isinstance(ref[1], bool)
    ):
        raise ValueError("a memory is saved as [id, version]")
    return inputs.check_identifier(ref[0], "memory id"), ref[1]


def _live(store: Store, ref: Any, user_id: str) -> Any:
    """The memory ``ref`` names if it is still live at that version, else ``None``."""
    memory_id, version = _reference(ref)
    record = store.get(memory_id, tenant=user_id)
    return record if record is not None and record.version == version else None
