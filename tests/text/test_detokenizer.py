import json
import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from jaxserve.sampling_params import SamplingParams
from jaxserve.text.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.quick

SAMPLES = [
    "The quick brown fox jumps over the lazy dog.",
    "Héllo wörld, café naïve façade résumé über straße.",
    "日本語のテキストと中文文本，还有한국어 문장。",
    "Emoji 😀🎉👍🏽 and flags 🇫🇷 mixed in text ✨.",
    "def f(x):\n    return x * 2  # code\n\ttabs",
    "Numbers 12345 and symbols <>&%$#@! STOP stop",
]
# Characters the tokenizers never see in training: byte-level BPE splits them into byte tokens, the
# SentencePiece-style model falls back to <0x..> tokens.
UNSEEN = "Ωმ🦀中𝔘ñ"


def corpus(n=300, seed=0):
    rng = random.Random(seed)
    return [" ".join(rng.choice(SAMPLES) for _ in range(3)) for _ in range(n)]


def byte_level_bpe():
    """GPT-2 / Llama-3 style: byte-level pre-tokenizer and decoder."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>")


def sentencepiece_bpe(strip_leading_space=True):
    """Llama-2 style: "▁" for spaces, <0x..> byte fallback; Gemma-style when the decoder keeps the space."""
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    prepend = [normalizers.Prepend("▁")] if strip_leading_space else []  # Gemma neither adds nor strips it
    base.normalizer = normalizers.Sequence(prepend + [normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=500, limit_alphabet=60, special_tokens=["<unk>", "<s>", "</s>"])
    base.train_from_iterator(corpus(), trainer)
    model = json.loads(base.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = base.normalizer
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if strip_leading_space else []))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


BUILDERS = {"byte_level": byte_level_bpe, "llama2": sentencepiece_bpe, "gemma": lambda: sentencepiece_bpe(False)}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def tok(request):
    return BUILDERS[request.param]()


def stream(tok, ids, *, chunks=1, rng=None, prompt=(), **kw):
    """Feed ids a few at a time; return (deltas including the final flush, detokenizer)."""
    det = IncrementalDetokenizer(tok, prompt, **kw)
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, chunks) if rng else chunks
        deltas.append(det.add(ids[i : i + n]))
        i += n
    deltas.append(det.finish())
    return deltas, det


def decode(tok, ids, skip=True):
    return tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_fixture_tokenizers_exercise_byte_tokens(tok):
    ids = tok.encode(UNSEEN, add_special_tokens=False)
    assert len(ids) > len(UNSEEN)  # multi-byte characters are split over several tokens
    assert decode(tok, ids) == UNSEEN


@pytest.mark.parametrize("skip", [True, False])
def test_random_token_sequences_concatenate_to_full_decode(tok, skip):
    rng = random.Random(1)
    vocab = len(tok)
    for _ in range(150):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        deltas, det = stream(tok, ids, chunks=3, rng=rng, skip_special_tokens=skip)
        assert "".join(deltas) == decode(tok, ids, skip) == det.output_text, ids


def reference_stop(text, stops, include):
    """Read the text one character at a time and stop at the first stop string to complete."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            s = max(hits, key=len)
            return text[: end if include else end - len(s)], s
    return text, None


@pytest.mark.parametrize("include", [False, True])
def test_random_token_sequences_with_stop_strings(tok, include):
    rng = random.Random(2)
    vocab = len(tok)
    hits = 0
    for _ in range(150):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        text = decode(tok, ids)
        other = decode(tok, [rng.randrange(vocab) for _ in range(4)])
        stops = []
        for source in (text, other, text):
            if source:
                i = rng.randrange(len(source))
                stops.append(source[i : i + rng.randint(1, 4)])
        deltas, det = stream(tok, ids, chunks=3, rng=rng, stop=stops, include_stop_str_in_output=include)
        want, reason = reference_stop(text, stops, include)
        assert ("".join(deltas), det.stop_reason) == (want, reason), (ids, stops)
        hits += reason is not None
    assert hits > 100


def test_real_text_streams_whole_characters(tok):
    for text in SAMPLES + [UNSEEN, UNSEEN + " " + SAMPLES[2] + UNSEEN]:
        ids = tok.encode(text, add_special_tokens=False)
        deltas, _ = stream(tok, ids)
        assert all("\ufffd" not in d for d in deltas), deltas
        assert "".join(deltas) == decode(tok, ids)


def test_special_tokens_in_the_middle(tok):
    eos = tok.eos_token_id
    a = tok.encode("Hello world", add_special_tokens=False)
    b = tok.encode(" again 😀", add_special_tokens=False)
    ids = a + [eos] + b + [eos]
    for skip in (True, False):
        deltas, _ = stream(tok, ids, skip_special_tokens=skip)
        assert "".join(deltas) == decode(tok, ids, skip)
    assert tok.eos_token not in "".join(stream(tok, ids)[0])


@pytest.mark.parametrize("name, text", [("byte_level", " ".join(SAMPLES * 8)), ("llama2", "a cat, a dog and Hé " * 60)])
def test_window_stays_small(name, text):
    # Runs of byte-fallback tokens are decoded as a whole, so the SentencePiece case uses text without them.
    tok = BUILDERS[name]()
    ids = tok.encode(text, add_special_tokens=False)
    det = IncrementalDetokenizer(tok)
    widths = []
    inner = det._decode
    det._decode = lambda window: widths.append(len(window)) or inner(window)
    streamed = "".join(det.add([t]) for t in ids) + det.finish()
    assert streamed == decode(tok, ids)
    assert len(ids) > 300 and max(widths) <= 8
    assert len(det._ids) < 300  # ids before the window are dropped


def test_prompt_context_keeps_word_start_space():
    tok = sentencepiece_bpe()
    prompt = tok.encode("The quick brown", add_special_tokens=False)
    out = tok.encode("fox jumps", add_special_tokens=False)  # starts with a word-start piece
    plain, _ = stream(tok, out)
    in_context, _ = stream(tok, out, prompt=prompt, prompt_context=True)
    assert "".join(plain) == "fox jumps" == decode(tok, out)
    assert "".join(in_context) == " fox jumps" == decode(tok, prompt + out)[len(decode(tok, prompt)) :]


def ids_for(tok, text):
    return tok.encode(text, add_special_tokens=False)


def assert_split(tok, ids, s):
    """The stop string spans several tokens (otherwise the test would not exercise boundaries)."""
    assert not any(s in tok.convert_tokens_to_string([t]) for t in tok.convert_ids_to_tokens(ids))


def test_stop_string_across_tokens_is_cut_and_never_partially_emitted(tok):
    text = "Numbers 12345 and symbols STOP after the stop"
    ids = ids_for(tok, text)
    assert_split(tok, ids, "symbols STOP")
    det = IncrementalDetokenizer(tok, stop=["symbols STOP"])
    shown = ""
    for t in ids:
        shown += det.add([t])
        # Not even the start of the stop string is shown before it is known whether it completes.
        assert "symb" not in shown
        if det.finished:
            break
    assert det.finished and det.stop_reason == "symbols STOP"
    assert shown == det.output_text == "Numbers 12345 and "
    assert det.add(ids) == "" and det.finish() == ""


def test_held_back_tail_is_released_when_not_a_stop(tok):
    text = "so a quick brown fox and a lazy dog."  # not in the training text, so split into small pieces
    ids = ids_for(tok, text)
    stops = ["quick brown cat", "dog!"]
    det = IncrementalDetokenizer(tok, stop=stops)
    shown, longest_hold = "", 0
    for i, t in enumerate(ids):
        shown += det.add([t])
        so_far = decode(tok, ids[: i + 1])
        # Exactly the longest tail that could still grow into a stop string is held.
        hold = max((n for n in range(1, len(so_far) + 1) if any(s.startswith(so_far[-n:]) for s in stops)), default=0)
        assert shown == so_far[: len(so_far) - hold]
        longest_hold = max(longest_hold, hold)
    assert longest_hold >= len("quick b") and not det.finished
    assert shown == text and det.finish() == "" and det.stop_reason is None


def test_include_stop_str_in_output(tok):
    ids = ids_for(tok, "Héllo wörld, café naïve façade")
    deltas, det = stream(tok, ids, stop=["wörld, ca"], include_stop_str_in_output=True)
    assert "".join(deltas) == "Héllo wörld, ca" == det.output_text
    assert det.stop_reason == "wörld, ca"


def test_earliest_stop_wins_and_multibyte_stops(tok):
    ids = ids_for(tok, "日本語のテキストと中文文本，还有한국어 문장。")
    deltas, det = stream(tok, ids, stop=["한국어", "中文"])
    assert det.stop_reason == "中文" and "".join(deltas) == "日本語のテキストと"
    ids += ids_for(tok, UNSEEN)
    deltas, det = stream(tok, ids, stop=["🦀中"])
    full = decode(tok, ids)
    assert det.stop_reason == "🦀中" and "".join(deltas) == full[: full.index("🦀中")]


def test_stop_found_in_text_released_by_finish(tok):
    ids = ids_for(tok, "café STO")
    det = IncrementalDetokenizer(tok, stop=["STOP", "O"])
    text = det.add(ids)
    assert det.stop_reason == "O" and text == "café ST"
    det = IncrementalDetokenizer(tok, stop=["STOP"])
    text = det.add(ids)
    assert text == "café " and not det.finished
    assert det.finish() == "STO" and det.stop_reason is None


def test_invalid_stop_strings_raise(tok):
    with pytest.raises(ValueError, match="stop"):
        IncrementalDetokenizer(tok, stop=[""])


def test_configured_from_sampling_params(tok):
    ids = ids_for(tok, "Héllo wörld, café") + [tok.eos_token_id]
    params = SamplingParams(stop=("café",), include_stop_str_in_output=True, skip_special_tokens=False)
    deltas, det = stream(tok, ids, prompt=ids[:2])  # plain defaults
    assert "".join(deltas) == decode(tok, ids)
    det = IncrementalDetokenizer.for_request(tok, ids[:2], params)
    assert det.add(ids).endswith("café") and det.stop_reason == "café"
    with pytest.raises(ValueError, match="include_stop_str_in_output"):
        SamplingParams(include_stop_str_in_output="yes")
    with pytest.raises(ValueError, match="skip_special_tokens"):
        SamplingParams(skip_special_tokens=None)
