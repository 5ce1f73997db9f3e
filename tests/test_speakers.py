"""Speaker detection and the recast encode context (kvshift_memory.engine.speakers)."""

from __future__ import annotations

import pytest

from kvshift_memory.engine.settings import builtin_encode_context
from kvshift_memory.engine.speakers import cast_speakers, speakers

CONTEXT = "(3 March)\nMaya: Hey Tom! Tomorrow?\nTom: Sure, Maya.\nMaya: Great.\n"


def test_speakers_open_a_line_and_come_in_order_of_first_appearance():
    assert speakers("(1 May)\nJohn: hi\nTim: hello John\nJohn: bye\n") == ("John", "Tim")
    assert speakers("I told John: hi") == ()  # not at a line's start
    assert speakers("john: lower case\nJohn:no space") == ()
    assert speakers("") == ()


def test_the_context_takes_the_memorys_speakers_wherever_a_name_stands_as_a_word():
    memory = "(1 May)\nJohn: I signed with the Wolves.\nTim: Congrats!"
    assert cast_speakers(CONTEXT, memory) == "(3 March)\nJohn: Hey Tim! Tomorrow?\nTim: Sure, John.\nJohn: Great.\n"
    # the same people, the other one speaking first: the same context
    assert cast_speakers(CONTEXT, "Tim: Hi John.\nJohn: Hi.") == cast_speakers(CONTEXT, memory)


def test_shared_names_stay_put():
    # the memory's own conversation: nothing to rename, and no two names swapped
    assert cast_speakers(CONTEXT, "Tom: hi\nMaya: hello") == CONTEXT
    assert cast_speakers(CONTEXT, "Tom: hi\nAnna: hello") == CONTEXT.replace("Maya", "Anna")
    assert (
        cast_speakers(CONTEXT, "Zed: hi\nMaya: hello")
        == "(3 March)\nMaya: Hey Zed! Tomorrow?\nZed: Sure, Maya.\nMaya: Great.\n"
    )
    # more speakers than the context has: the first in alphabetical order take its places
    three = "Cy: a\nBo: b\nAl: c"
    assert cast_speakers(CONTEXT, three) == "(3 March)\nAl: Hey Bo! Tomorrow?\nBo: Sure, Al.\nAl: Great.\n"


@pytest.mark.parametrize("memory", ["Lee: just me", "Lee: one\nLee: person", "Tom: only the shared one"])
def test_a_context_whose_speakers_would_not_all_be_renamed_stays_as_written(memory):
    assert cast_speakers(CONTEXT, memory) is CONTEXT


@pytest.mark.parametrize("memory", ["Budget for the Lisbon trip is 50k.", "", "a\nb\n", "x" * 1_000_000])
def test_a_memory_without_speakers_leaves_the_context_as_it_is(memory):
    assert cast_speakers(CONTEXT, memory) is CONTEXT


def test_names_are_text_not_patterns():
    hostile = "A.*: one\nB|C: two\n(?P<x>: three\nZ'oe: four\nAl-Amin: five"
    assert speakers(hostile) == ("Z'oe", "Al-Amin")
    assert (
        cast_speakers(CONTEXT, hostile)
        == "(3 March)\nAl-Amin: Hey Z'oe! Tomorrow?\nZ'oe: Sure, Al-Amin.\nAl-Amin: Great.\n"
    )


def test_the_builtin_context_has_two_speakers_to_recast():
    assert speakers(builtin_encode_context()) == ("Maya", "Tom")
