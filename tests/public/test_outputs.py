"""TokenRecord: the one typed form of a generated (or prompt) token's logprobs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxserve.engine.engine import Engine
from jaxserve.outputs import Logprob, TokenRecord

pytestmark = pytest.mark.quick


def test_record_knows_whether_the_chosen_token_is_among_the_top():
    inside = TokenRecord.of(7, -0.51, [3, 7], [-0.4, -0.5])
    assert inside.rank == 2 and inside.top == ((3, -0.4), (7, -0.5))
    assert inside.logprob == -0.5  # one value per token id: the top entry's
    assert inside.entry() == {7: Logprob(-0.5, 2), 3: Logprob(-0.4, 1)} and list(inside.entry()) == [7, 3]
    outside = TokenRecord.of(9, -3.0, [3, 7], [-0.4, -0.5])
    assert outside.rank is None
    assert outside.entry() == {9: Logprob(-3.0, None), 3: Logprob(-0.4, 1), 7: Logprob(-0.5, 2)}
    assert TokenRecord.of(9, -3.0, [], []).entry() == {9: Logprob(-3.0)}


def test_entry_is_vllms_logprob_with_the_decoded_token():
    entry = TokenRecord.of(9, -3.0, [3, 7], [-0.4, -0.5]).entry({3: "a", 7: "b", 9: "c"}.get)
    assert [(t, v.logprob, v.rank, v.decoded_token) for t, v in entry.items()] == [
        (9, -3.0, None, "c"), (3, -0.4, 1, "a"), (7, -0.5, 2, "b")]
    assert all(v.decoded_token is None for v in TokenRecord.of(9, -3.0, [3], [-0.4]).entry().values())
    import jaxserve

    assert jaxserve.Logprob is Logprob


def test_engine_decodes_logprob_tokens_once_and_not_without_a_tokenizer():
    calls = []

    class Tok:
        def decode(self, ids):
            calls.append(ids)
            return f"<{ids[0]}>"

    engine = SimpleNamespace(tokenizer=Tok(), _token_texts={})
    assert Engine._decoded_token(engine, 5) == "<5>" and Engine._decoded_token(engine, 5) == "<5>"
    assert calls == [[5]]
    assert Engine._decoded_token(SimpleNamespace(tokenizer=None, _token_texts={}), 5) is None


def test_record_drops_padding_past_a_small_vocabulary():
    """The sampler pads the top-n with id -1 when the vocabulary is smaller than n: no entries."""
    r = TokenRecord.of(1, -0.1, [1, 0, -1, -1], [-0.1, -2.4, float("-inf"), float("-inf")])
    assert r.top == ((1, -0.1), (0, -2.4)) and r.rank == 1 and -1 not in r.entry()
    assert [v.rank for v in r.entry().values()] == [1, 2]


def test_record_without_a_logprob_has_no_entry_and_survives_json():
    assert TokenRecord(4, None, None, ()).entry() == {} and TokenRecord(4, None, None, ()).entry(str) == {}
    r = TokenRecord.of(7, -0.51, [3, 7], [-0.4, -0.5])
    assert TokenRecord.from_json(r.to_json()) == r
