"""Checkpoint loading: config formats, sharded files, bad checkpoints, orbax conversion, hub ids."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve import LLM, SamplingParams
from jaxserve.models.checkpoint import resolve_model_path
from jaxserve.models.config import ModelConfig
from jaxserve.models.loader import load_model
from tiny import build_tiny_model, hf_greedy, hf_model, train_tokenizer

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT = [5, 17, 99, 23, 4, 250, 31]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"), tokenizer=train_tokenizer())


@pytest.fixture(scope="module")
def llama_tokens(llama):
    """The safetensors checkpoint's greedy tokens for PROMPT, which the other formats must give (one engine)."""
    llm = LLM(str(llama), page_size=4, max_num_seqs=1, warmup=False, compilation_cache_dir=None)
    return llm.generate(PROMPT, GREEDY)[0].outputs[0].token_ids


def edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def copy_model(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_old_rope_format_gives_same_config(llama, tmp_path):
    new = ModelConfig.from_pretrained(llama)
    old = copy_model(llama, tmp_path / "old")
    cfg = json.loads((old / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")  # the oldest spelling
    cfg["rope_scaling"] = params
    (old / "config.json").write_text(json.dumps(cfg))
    assert ModelConfig.from_pretrained(old) == new
    assert new.rope.kind == "llama3" and new.rope.theta == 500000.0


def test_unsupported_architecture_lists_supported(llama, tmp_path):
    bad = copy_model(llama, tmp_path / "bad")
    edit_config(bad, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model(str(bad))


def test_sharded_checkpoint_loads_identically(llama, llama_tokens, tmp_path):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(llama).save_pretrained(sharded, max_shard_size="40KB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / f).write_bytes((llama / f).read_bytes())
    assert (sharded / "model.safetensors.index.json").exists() and len(list(sharded.glob("*.safetensors"))) > 2
    a = llama_tokens
    b = LLM(str(sharded), page_size=4, max_num_seqs=1, warmup=False, compilation_cache_dir=None).generate(PROMPT, GREEDY)[0].outputs[0].token_ids
    assert a == b == hf_greedy(hf_model(llama), PROMPT, 12)


def test_pickled_checkpoint_refused(llama, tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_bytes((llama / "config.json").read_bytes())
    (folder / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="pickled.*pytorch_model.bin.*safetensors"):
        load_model(str(folder))


def test_missing_unexpected_and_misshaped_tensors_named(llama, tmp_path):
    tensors = load_file(llama / "model.safetensors")
    cases = {
        "missing": ({k: v for k, v in tensors.items() if "layers.1.mlp.up_proj" not in k},
                    r"missing tensors \['model.layers.1.mlp.up_proj.weight'\]"),
        "unexpected": ({**tensors, "model.layers.9.extra.weight": np.zeros(3, np.float32)},
                       r"unexpected tensors \['model.layers.9.extra.weight'\]"),
        "misshaped": ({**tensors, "model.norm.weight": np.zeros(65, np.float32)},
                      r"model.norm.weight: checkpoint shape \(65,\).*model's \(64,\)"),
    }
    for name, (content, message) in cases.items():
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_bytes((llama / "config.json").read_bytes())
        save_file(content, folder / "model.safetensors")
        with pytest.raises(ValueError, match=message):
            load_model(str(folder))


def test_bfloat16_checkpoint_auto_dtype(llama, tmp_path):
    from transformers import AutoModelForCausalLM
    import torch

    folder = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16).save_pretrained(folder)
    model, cfg, _ = load_model(str(folder), dtype="auto")
    assert cfg.torch_dtype == "bfloat16"
    assert model.layers[0].mlp.up_proj.weight.get_value().dtype == np.dtype("bfloat16")
    model32, _, _ = load_model(str(folder), dtype="float32")
    assert model32.layers[0].mlp.up_proj.weight.get_value().dtype == np.float32
    np.testing.assert_array_equal(np.asarray(model32.layers[0].mlp.up_proj.weight.get_value()),
                                  np.asarray(model.layers[0].mlp.up_proj.weight.get_value()).astype(np.float32))
    with pytest.raises(ValueError, match="dtype='float8'"):
        load_model(str(folder), dtype="float8")


def test_convert_to_orbax_and_load(llama, llama_tokens, tmp_path):
    dst = tmp_path / "orbax"
    subprocess.run([sys.executable, "scripts/convert_checkpoint.py", str(llama), str(dst)], check=True,
                   cwd=Path(__file__).parents[2])
    assert (dst / "params").is_dir() and not list(dst.glob("*.safetensors"))
    a = llama_tokens
    llm = LLM(str(dst), page_size=4, max_num_seqs=1, dtype="bfloat16", warmup=False, compilation_cache_dir=None)
    assert llm.engine.executor.runner.params["norm"]["weight"].get_value().dtype == np.dtype("bfloat16")
    b = LLM(str(dst), page_size=4, max_num_seqs=1, warmup=False, compilation_cache_dir=None).generate(PROMPT, GREEDY)[0].outputs[0].token_ids
    assert a == b


def test_hub_id_goes_to_snapshot_download(monkeypatch, llama):
    calls = []

    def fake_snapshot_download(repo_id, allow_patterns, revision=None, cache_dir=None):
        calls.append((repo_id, allow_patterns, revision, cache_dir))
        return str(llama)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model_path("meta-llama/Llama-3.2-1B") == llama
    assert calls[0][0] == "meta-llama/Llama-3.2-1B" and "*.safetensors" in calls[0][1]
    assert calls[0][2:] == (None, None)  # the main branch, the Hugging Face cache
    assert resolve_model_path("org/model", revision="v2", download_dir="/models") == llama
    assert calls[-1][0] == "org/model" and calls[-1][2:] == ("v2", "/models")
    assert resolve_model_path(str(llama)) == llama
    with pytest.raises(ValueError, match="is not a folder"):
        resolve_model_path("./no/such/folder")


def test_tokenizer_problems_fail_before_the_executor_is_built(tmp_path):
    """The tokenizer loads on a thread of its own beside the executor; a folder without one, or a chat template
    that is neither a file nor a template, still fails first, before any weight is loaded or program compiled."""
    from jaxserve.config.engine import EngineConfig
    from jaxserve.engine.engine import Engine

    built = []

    def executor_factory(*args, **kwargs):
        built.append(args)
        raise AssertionError("the executor was built")

    folder = build_tiny_model("llama", tmp_path / "m")
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        Engine(EngineConfig(model=str(folder), chat_template="no template here"), executor_factory=executor_factory)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink(missing_ok=True)
    with pytest.raises(ValueError, match="has no tokenizer"):
        Engine(EngineConfig(model=str(folder)), executor_factory=executor_factory)
    assert built == []



@pytest.mark.parametrize("shape", [(1, 1), (3, 700), (700, 3), (513, 257)])
def test_transposed_is_the_contiguous_transpose(shape):
    from jaxserve.models.loader import transposed

    a = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    t = transposed(a)
    assert t.flags.c_contiguous and t.dtype == a.dtype
    np.testing.assert_array_equal(t, a.T)
