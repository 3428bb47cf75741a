"""Structured output offline: every sampled output (temperature 1) of a constrained request parses and matches
its schema, regex, choice or grammar; constrained and free requests share batches; bad grammars are refused."""

import json
import re

import jax
import jsonschema
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams, StructuredOutputsParams
from jaxserve.executor.sampler import SamplingTensors, sample
from tiny import build_tiny_model, train_tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", None]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = build_tiny_model("qwen2", tmp_path_factory.mktemp("so"), tokenizer=train_tokenizer())
    return LLM(str(path), page_size=8, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
               warmup=False, compilation_cache_dir=None, seed=0)


def _sampled(**so) -> SamplingParams:
    return SamplingParams(n=4, temperature=1.0, max_tokens=96, seed=7,
                          structured_outputs=StructuredOutputsParams(**so))


def test_json_schema_outputs_validate_at_temperature_one(llm):
    outs = llm.generate(["The quick brown fox", "Paged attention"], _sampled(json=PERSON, disable_any_whitespace=True))
    for out in outs:
        for c in out.outputs:
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.text), PERSON)


def test_json_object_regex_choice_and_grammar(llm):
    outs = llm.generate(["numbers 12345"] * 4, [
        _sampled(json_object=True, disable_any_whitespace=True),
        _sampled(regex=r"[a-c]{2,5}-\d{1,3}"),
        _sampled(choice=["red", "green", "blue"]),
        _sampled(grammar='start: "(" expr ")"\nexpr: NUM | NUM "+" NUM\nNUM: /[0-9]{1,2}/'),
    ])
    for c in outs[0].outputs:
        assert isinstance(json.loads(c.text), dict)
    for c in outs[1].outputs:
        assert re.fullmatch(r"[a-c]{2,5}-\d{1,3}", c.text), c.text
    assert {c.text for c in outs[2].outputs} <= {"red", "green", "blue"}
    for c in outs[3].outputs:
        assert re.fullmatch(r"\(\d{1,2}(\+\d{1,2})?\)", c.text), c.text
    for out in outs:
        assert all(c.finish_reason == "stop" for c in out.outputs)


def test_constrained_and_free_requests_share_a_batch(llm):
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = llm.generate("The quick brown fox", free)[0].outputs[0].token_ids
    both = llm.generate(["The quick brown fox", "The quick brown fox"],
                        [free, _sampled(choice=["yes", "no"])])
    assert both[0].outputs[0].token_ids == alone
    assert {c.text for c in both[1].outputs} <= {"yes", "no"}
    # a greedy constrained request takes the constrained argmax
    greedy = llm.generate("Paged attention", SamplingParams(
        temperature=0.0, max_tokens=8, structured_outputs={"regex": "[0-9]{3}"}))[0].outputs[0]
    assert re.fullmatch("[0-9]{3}", greedy.text) and greedy.finish_reason == "stop"


@pytest.mark.parametrize("so, field", [
    ({"json": {"type": "nonsense"}}, "structured_outputs.json"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"regex": "(("}, "structured_outputs.regex"),
    ({"grammar": "start: ??"}, "structured_outputs.grammar"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"regex": "a", "choice": ["b"]}, "structured_outputs"),
])
def test_invalid_grammars_are_refused_naming_the_field(llm, so, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate("hello", SamplingParams(structured_outputs=so))
    assert not llm.engine.has_unfinished()


def test_sampler_applies_the_packed_bitmask():
    rng = np.random.default_rng(0)
    vocab, slots = 100, 4
    logits = rng.normal(size=(slots, vocab)).astype(np.float32)
    bitmask = np.full((slots, 4), -1, np.int32)
    allowed = [3, 37, 64, 99]
    bitmask[0] = bitmask[1] = 0
    for t in allowed:
        bitmask[:2, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1, logprobs=2),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=1, logprobs=2)]
    build = dict(num_slots=slots, seeds=[1, 2, 3, 2], num_generated=[0] * 4, penalty_rows=[0] * 4)
    masked = jax.jit(sample)(logits, SamplingTensors.build(params, token_bitmask=bitmask, **build))
    free = jax.jit(sample)(logits, SamplingTensors.build(params, **build))
    ids = np.asarray(masked.token_ids)
    assert ids[0] == max(allowed, key=lambda t: logits[0, t]) and ids[1] in allowed
    assert set(np.asarray(masked.top_ids)[1, :2]) <= set(allowed)
    np.testing.assert_array_equal(ids[2:], np.asarray(free.token_ids)[2:])  # all-ones rows are untouched


def test_logit_bias_moves_the_choice(llm):
    base = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    free = llm.generate("The quick brown fox", base)[0].outputs[0].token_ids
    forced = llm.generate("The quick brown fox", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                                logit_bias={17: 100.0}))[0].outputs[0].token_ids
    banned = llm.generate("The quick brown fox", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                                logit_bias={free[0]: -100.0}))[0].outputs[0]
    assert forced == [17] * 4 and banned.token_ids[0] != free[0]
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate("hi", SamplingParams(logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={i: 1.0 for i in range(301)})


def test_the_constraint_starts_after_the_reasoning_end(llm):
    """``reasoning_end``: the output is free (the free greedy tokens) until it has written the marker, then
    constrained; the marker is taken from the free output itself, so the model surely writes it."""
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    out = llm.generate("Paged attention", free)[0].outputs[0]
    tok = llm.get_tokenizer()
    # the marker: the text of free tokens 3..5, so it is complete once token 5 is out
    head = tok.decode(out.token_ids[:6], skip_special_tokens=False)
    marker = tok.decode(out.token_ids[3:6], skip_special_tokens=False).strip()
    assert marker and marker in head and marker not in tok.decode(out.token_ids[:5], skip_special_tokens=False)
    later = llm.generate("Paged attention", SamplingParams(
        temperature=0.0, max_tokens=24, reasoning_end=marker, structured_outputs={"regex": "[0-9]{3}"}))
    got = later[0].outputs[0]
    assert got.token_ids[:6] == out.token_ids[:6]  # free until the marker is complete
    rest = tok.decode(got.token_ids[6:], skip_special_tokens=True)  # EOS ends it
    assert re.fullmatch("[0-9]{3}", rest) and got.finish_reason == "stop", (head, rest)
    # without it the constraint holds from the first token
    now = llm.generate("Paged attention", SamplingParams(temperature=0.0, max_tokens=8,
                                                         structured_outputs={"regex": "[0-9]{3}"}))
    assert re.fullmatch("[0-9]{3}", now[0].outputs[0].text)
    with pytest.raises(ValueError, match="reasoning_end"):
        SamplingParams(reasoning_end="")


def test_llm_chat_splits_the_reasoning_and_constrains_only_the_answer(llm):
    talk = [{"role": "user", "content": "Three digits?"}]
    params = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs={"regex": "[0-9]{3}"})
    llm.reasoning_parser = "qwen3"
    try:
        # thinking on: the random model never writes </think>, so all of it is free reasoning
        (thinking,) = llm.chat(talk, params)[0].outputs
        assert thinking.reasoning == thinking.text and thinking.content is None
        assert len(thinking.token_ids) == 12 and not re.fullmatch("[0-9]{3}", thinking.text)
        # thinking off: no reasoning, and the answer is constrained from its first token
        (answer,) = llm.chat(talk, params, chat_template_kwargs={"enable_thinking": False})[0].outputs
        assert answer.reasoning is None and re.fullmatch("[0-9]{3}", answer.content)
    finally:
        llm.reasoning_parser = None
    plain = llm.chat(talk, params)[0].outputs[0]  # no parser: constrained at once, no split
    assert re.fullmatch("[0-9]{3}", plain.text) and plain.reasoning is None and plain.content is None
    with pytest.raises(ValueError, match="reasoning"):
        LLM(reasoning_parser="nope")
