"""The checkpoint's own defaults and templates offline: generation_config.json sampling defaults
(``generation_config`` auto / vllm / a folder), chat-template options, ``chat_template``, and token-only models
(``skip_tokenizer_init``)."""

import json
import shutil

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.generation_config import load_generation_defaults
from tiny import build_tiny_model, hf_greedy, hf_model, train_tokenizer

THINKING_TEMPLATE = (
    "{% if tools %}<|system|>tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}</s>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% if not loop.last or not continue_final_message "
    "is defined or not continue_final_message %}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% endif %}{% endif %}"
)
SMALL = dict(page_size=8, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, warmup=False,
             compilation_cache_dir=None)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = train_tokenizer()
    tok.chat_template = THINKING_TEMPLATE
    path = build_tiny_model("llama", tmp_path_factory.mktemp("defaults") / "m", tokenizer=tok)
    gen = json.loads((path / "generation_config.json").read_text())
    gen.update(temperature=0.0, top_p=0.95, top_k=20, max_new_tokens=5, repetition_penalty=1.0)
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), **SMALL)


def test_generation_config_defaults_apply_unless_the_request_sets_them(llm, model_dir, tmp_path):
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, top_p=0.95, top_k=20, max_tokens=5)
    prompt = [0, 5, 9, 14, 3]
    out = llm.generate(prompt)[0].outputs[0]  # greedy, 5 tokens: the checkpoint's own defaults
    assert len(out.token_ids) == 5 or out.finish_reason == "stop"
    assert out.token_ids == hf_greedy(hf_model(model_dir), prompt, 5)[: len(out.token_ids)]
    assert load_generation_defaults(model_dir, "vllm") == {}
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "do_sample": True}))
    assert load_generation_defaults(model_dir, str(other)) == {"temperature": 0.7}
    with pytest.raises(ValueError, match="generation_config"):
        load_generation_defaults(model_dir, str(tmp_path / "missing"))


def test_chat_template_options(llm, model_dir):
    tok = llm.tokenizer
    msgs = [{"role": "user", "content": "hi"}]

    def text(ids):
        return tok.decode(ids)

    assert text(llm.apply_chat_template(msgs)) == "<|user|>hi</s><|assistant|>"
    assert text(llm.apply_chat_template(msgs, add_generation_prompt=False)) == "<|user|>hi</s>"
    assert text(llm.apply_chat_template(msgs, chat_template_kwargs={"enable_thinking": False})).endswith(
        "<|assistant|><think></think>")
    cont = msgs + [{"role": "assistant", "content": "The quick"}]
    assert text(llm.apply_chat_template(cont, add_generation_prompt=False, continue_final_message=True)).endswith(
        "<|assistant|>The quick")
    assert text(llm.apply_chat_template(msgs, chat_template="{{ messages[0]['content'] }}!")) == "hi!"
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    assert text(llm.apply_chat_template(msgs, tools=[tool])).startswith("<|system|>tools: get_weather</s><|user|>")
    with pytest.raises(ValueError, match="chat_template_kwargs may not set tokenize"):
        llm.apply_chat_template(msgs, chat_template_kwargs={"tokenize": False})
    with pytest.raises(ValueError, match="cannot both be true"):
        llm.apply_chat_template(cont, continue_final_message=True)
    # --chat-template: a file (or the text itself) replaces the tokenizer's template
    other = LLM(str(model_dir), chat_template="[{% for m in messages %}{{ m['content'] }}{% endfor %}]", **SMALL)
    assert other.tokenizer.decode(other.apply_chat_template(msgs)) == "[hi]"


def test_token_only_model(model_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json",
                                                                   "chat_template.jinja"))
    with pytest.raises(ValueError) as err:
        LLM(str(bare), **SMALL)
    message = str(err.value)
    assert str(bare) in message and "--skip-tokenizer-init" in message and "\n" not in message
    llm = LLM(str(bare), skip_tokenizer_init=True, **SMALL)
    assert llm.tokenizer is None
    prompt = [0, 5, 9, 14, 3]
    out = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == hf_greedy(hf_model(model_dir), prompt, 4) and out.text == ""
    for bad, field in (("some text", "prompt"), ):
        with pytest.raises(ValueError, match=field):
            llm.generate(bad, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate(prompt, SamplingParams(max_tokens=2, stop=["x"]))


def test_max_model_len_above_the_model_is_an_error(model_dir):
    with pytest.raises(ValueError, match="max_model_len=512 is above the model's limit of 256"):
        LLM(str(model_dir), **dict(SMALL, max_model_len=512))
