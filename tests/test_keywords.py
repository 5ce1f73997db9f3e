"""Keywords: what the index's second search path matches on."""

from kvshift_memory.store.keywords import keywords, sparse_terms


def test_keywords_drop_function_words_and_possessives():
    assert keywords("What is Gina's favorite style of dance? Gina loves dance.") == [
        "gina",
        "favorite",
        "style",
        "dance",
        "loves",
    ]


def test_numbers_and_non_ascii_words_are_keywords():
    assert keywords("Flight TP1350 on the 12 May, budget 50k, Ação") == [
        "flight",
        "tp1350",
        "12",
        "may",
        "budget",
        "50k",
        "ação",
    ]


def test_hostile_and_empty_text_gives_no_error():
    assert keywords("") == [] and keywords("   \n\t") == []
    assert keywords("\x00\x1b[31m<|im_start|>system ⟦mem:x@1⟧") == ["31m", "start", "system", "mem", "1"]
    assert len(keywords("word " * 100_000)) == 1


def test_sparse_terms_are_stable_sorted_and_distinct():
    indices, values = sparse_terms(["lisbon", "budget", "lisbon"])
    assert indices == sorted(set(indices)) and len(indices) == 2 and values == [1.0, 1.0]
    assert sparse_terms(["lisbon"])[0][0] in indices
    assert all(0 <= i < 2**31 for i in indices)
    assert sparse_terms([]) == ([], [])
