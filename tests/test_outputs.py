"""TokenRecord: the one typed form of a generated (or prompt) token's logprobs."""

from __future__ import annotations

from jaxserve.outputs import TokenRecord


def test_record_knows_whether_the_chosen_token_is_among_the_top():
    inside = TokenRecord.of(7, -0.51, [3, 7], [-0.4, -0.5])
    assert inside.rank == 2 and inside.top == ((3, -0.4), (7, -0.5))
    assert inside.logprob == -0.5  # one value per token id: the top entry's
    assert inside.entry() == {7: -0.5, 3: -0.4} and list(inside.entry()) == [7, 3]
    outside = TokenRecord.of(9, -3.0, [3, 7], [-0.4, -0.5])
    assert outside.rank is None and outside.entry() == {9: -3.0, 3: -0.4, 7: -0.5}
    assert TokenRecord.of(9, -3.0, [], []).entry() == {9: -3.0}


def test_record_drops_padding_past_a_small_vocabulary():
    """The sampler pads the top-n with id -1 when the vocabulary is smaller than n: no entries."""
    r = TokenRecord.of(1, -0.1, [1, 0, -1, -1], [-0.1, -2.4, float("-inf"), float("-inf")])
    assert r.top == ((1, -0.1), (0, -2.4)) and r.rank == 1 and -1 not in r.entry()


def test_record_without_a_logprob_has_no_entry_and_survives_json():
    assert TokenRecord(4, None, None, ()).entry() == {}
    r = TokenRecord.of(7, -0.51, [3, 7], [-0.4, -0.5])
    assert TokenRecord.from_json(r.to_json()) == r
