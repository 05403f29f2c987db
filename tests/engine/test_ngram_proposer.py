from conveyor.engine.ngram_proposer import NgramProposer


def test_longest_recent_match_wins():
    proposer = NgramProposer(max_ngram=3, min_ngram=1)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 1, 2, 3, 9, 9, 1, 2, 3, 7, 1, 2, 3]
    # Suffix (1, 2, 3) last occurred at 6..8, followed by 7, 1, 2.
    assert proposer.propose(tokens, 3) == [7, 1, 2]
    assert proposer.propose(tokens, 1) == [7]


def test_falls_back_to_shorter_ngrams_and_to_nothing():
    proposer = NgramProposer(max_ngram=3, min_ngram=1)
    assert proposer.propose([4, 8, 6, 0, 6], 2) == [0, 6]  # only the 1-gram (6) repeats
    assert proposer.propose([1, 2, 3, 4], 4) == []  # nothing repeats
    assert proposer.propose([1, 2, 3, 1], 0) == []
    assert NgramProposer(min_ngram=2).propose([4, 8, 6, 0, 6], 2) == []


def test_draft_is_cut_at_the_end_of_the_context_and_the_window():
    proposer = NgramProposer(max_ngram=2, min_ngram=1, search_window=4)
    assert proposer.propose([3, 3], 5) == [3]  # the match at 0 is followed by one token only
    # The earlier repeat of (1, 2) lies outside the last 4 tokens.
    assert proposer.propose([1, 2, 9, 5, 8, 1, 2], 2) == []
