"""Multi-LoRA serving against transformers + PEFT: adapters built and saved by PEFT itself, each adapter's greedy
tokens equal to PEFT's merged model in one batch mixing three adapters and the base model, no compile when an
adapter is loaded or swapped, the least recently used one evicted, and prefix caching kept per adapter."""

import asyncio
import json
import os

import httpx
import numpy as np
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.numpy import save_file

from jaxserve import LLM, LoRARequest, SamplingParams
from jaxserve.config.engine import EngineConfig
from jaxserve.executor.runner import CompileCounter
from jaxserve.server.access import AdminConfig
from jaxserve.server.args import parse_args
from jaxserve.server.async_engine import AsyncEngine
from jaxserve.server.metrics import ServerMetrics
from jaxserve.server.openai.server import OpenAIServer
from tests.tiny import build_tiny_model, hf_greedy, hf_model

OPTIONS = dict(page_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=48, warmup=False,
               compilation_cache_dir=None)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
PROMPTS = [[5, 17, 42, 9, 33, 8, 71, 12, 3], [100, 7, 250, 64], [11, 12, 13, 14, 15, 16], [200, 3, 90]]
# name: (rank, alpha, targets, rsLoRA)
ADAPTERS = {
    "all": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "attn": (4, 8, ["q_proj", "v_proj", "o_proj"], False),
    "mlp": (2, 4, ["gate_proj", "up_proj", "down_proj"], True),
    "qk": (8, 32, ["q_proj", "k_proj"], False),
}


def make_adapter(base_dir, out, rank, alpha, targets, rslora, seed):
    model = hf_model(base_dir)
    peft = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                                            use_rslora=rslora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:  # PEFT starts B at zero: draw both so the adapter changes the tokens
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    peft.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_model("llama", root / "base", num_hidden_layers=1)
    paths = {name: make_adapter(base, root / name, *spec, seed=i)
             for i, (name, spec) in enumerate(ADAPTERS.items())}
    expected = {None: [hf_greedy(hf_model(base), p, GREEDY.max_tokens) for p in PROMPTS]}
    for name, path in paths.items():
        merged = PeftModel.from_pretrained(hf_model(base), path).merge_and_unload().eval()
        expected[name] = [hf_greedy(merged, p, GREEDY.max_tokens) for p in PROMPTS]
    # on a tensor mesh: the adapter slots are sharded as their projections' weights
    llm = LLM(str(base), enable_lora=True, max_loras=3, max_lora_rank=8, mesh="tensor=2", num_devices=2, **OPTIONS)
    requests = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(paths.items())}
    return llm, requests, expected, base


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_a_batch_mixing_three_adapters_and_the_base_model_matches_peft(setup):
    llm, requests, expected, _ = setup
    names = ["all", None, "attn", "mlp"]
    got = tokens(llm.generate(PROMPTS, GREEDY, lora_request=[requests.get(n) for n in names], use_tqdm=False))
    assert got == [expected[n][i] for i, n in enumerate(names)]
    assert len({tuple(expected[n][0]) for n in expected}) == len(expected)  # every adapter changes the tokens
    layer = llm.engine.executor.adapters.arrays[0]
    a, b = layer["self_attn"]["q_proj"]  # b's out axis split over tensor, as q_proj's weight's
    assert tuple(b.sharding.spec) == (None, None, "tensor") and a.sharding.is_fully_replicated
    a, b = layer["mlp"]["down_proj"]  # a's in axis split, as down_proj's weight's
    assert tuple(a.sharding.spec) == (None, "tensor", None) and b.sharding.is_fully_replicated
    # each adapter on every prompt, base model included, in one call: the same tokens
    for name in (None, "all", "attn", "mlp"):
        assert tokens(llm.generate(PROMPTS, GREEDY, lora_request=requests.get(name), use_tqdm=False)) == \
            expected[name]


def test_a_fourth_adapter_waits_or_evicts_and_nothing_compiles(setup):
    llm, requests, expected, _ = setup
    slots = llm.engine.executor.adapters
    # four adapters in one call with max_loras=3: one waits until another's requests finish; the least
    # recently used adapter is evicted for it
    names = ["qk", "all", "attn", "mlp"]
    lora = [requests[n] for n in names]
    for attempt in range(2):  # the first call may compile step shapes; the second swaps adapters all the same
        compiles, loads, evictions = CompileCounter(), slots.loads, slots.evictions
        got = tokens(llm.generate(PROMPTS, GREEDY, lora_request=lora, use_tqdm=False))
        assert got == [expected[n][i] for i, n in enumerate(names)]
        assert slots.evictions > evictions and slots.loads > loads and len(slots.slot_of) == 3
    assert compiles.count() == 0, "loading or swapping adapters must not compile"


def test_prefix_cache_is_never_shared_across_adapters(setup):
    llm, requests, expected, _ = setup
    prompt = PROMPTS[0][::-1]  # new to every adapter: two full pages to reuse, in a step shape already compiled
    run = lambda name: llm.generate([prompt], GREEDY, lora_request=requests.get(name), use_tqdm=False)[0]  # noqa: E731
    run("attn")
    assert run("attn").metrics.num_cached_tokens > 0
    other = run("mlp")
    assert other.metrics.num_cached_tokens == 0
    base = run(None)
    assert base.metrics.num_cached_tokens == 0


def test_bad_adapters_are_refused_naming_the_problem(setup, tmp_path):
    llm, requests, _, base = setup
    with pytest.raises(ValueError, match="rank r=8 is above max_lora_rank=4"):
        plain = LLM(str(base), enable_lora=True, max_lora_rank=4, **OPTIONS)
        plain.generate(PROMPTS[:1], GREEDY, lora_request=requests["all"], use_tqdm=False)
    moe = tmp_path / "moe"
    moe.mkdir()
    (moe / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2}))
    save_file({"base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_A.weight": np.zeros((2, 64), np.float32),
               "base_model.model.model.layers.0.mlp.experts.0.gate_proj.lora_B.weight": np.zeros((128, 2), np.float32)},
              str(moe / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="is a Mixture-of-Experts expert"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("moe", 9, str(moe)), use_tqdm=False)
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("none", 10, str(tmp_path)), use_tqdm=False)
    with pytest.raises(ValueError, match="no adapter named 'nope' is loaded"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("nope", 11), use_tqdm=False)
    assert tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False))  # still serving
    for argv, message in ((["--lora-modules", "a=/x"], "needs --enable-lora"),
                          (["--enable-lora", "--lora-modules", "a"], "must be NAME=PATH")):
        with pytest.raises(SystemExit) as e:
            parse_args(["--model", str(base), *argv])
        assert e.value.code == 2


def test_the_openai_model_field_selects_an_adapter_and_adapters_load_at_run_time(setup):
    llm, requests, expected, _ = setup

    async def main():
        engine = AsyncEngine(EngineConfig(model="unused", max_num_seqs=4), metrics=ServerMetrics("tiny"),
                             engine_factory=lambda config: llm.engine, lora_modules=[requests["attn"]])
        engine.start()
        await engine.wait_ready()
        admin = AdminConfig(lora_routes=True, allowed_paths=(os.path.dirname(requests["mlp"].lora_path),))
        app = OpenAIServer(engine, engine.metrics, ["tiny"], admin=admin).app()
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                         timeout=120) as http:
                def complete(model, i=1):
                    return http.post("/v1/completions", json={"model": model, "prompt": PROMPTS[i], "max_tokens": 6,
                                                              "temperature": 0, "return_token_ids": True})
                out = {"models": (await http.get("/v1/models")).json()["data"]}
                out["attn"] = (await complete("attn")).json()["choices"][0]["token_ids"]
                out["base"] = (await complete("tiny")).json()["choices"][0]["token_ids"]
                out["unknown"] = await complete("mlp")
                load = {"lora_name": "mlp", "lora_path": requests["mlp"].lora_path}
                out["load"] = await http.post("/v1/load_lora_adapter", json=load)
                out["mlp"] = (await complete("mlp", 2)).json()["choices"][0]["token_ids"]
                out["again"] = await http.post("/v1/load_lora_adapter", json=load)
                out["bad_path"] = await http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no"})
                out["unload"] = await http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"})
                out["unload_again"] = await http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"})
                out["gone"] = await complete("mlp")
        finally:
            await engine.stop()
        return out

    out = asyncio.run(main())
    assert [(m["id"], m["parent"]) for m in out["models"]] == [("tiny", None), ("attn", "tiny")]
    assert out["attn"] == expected["attn"][1] and out["base"] == expected[None][1]
    assert out["unknown"].status_code == 404 and out["unknown"].json()["error"]["param"] == "model"
    assert out["load"].status_code == 200 and out["load"].text == "Success: LoRA adapter 'mlp' added successfully."
    assert out["mlp"] == expected["mlp"][2]
    assert out["again"].status_code == 400 and "already been loaded" in out["again"].json()["error"]["message"]
    assert out["bad_path"].status_code == 400 and out["bad_path"].json()["error"]["param"] == "lora_path"
    assert out["unload"].status_code == 200 and out["unload_again"].status_code == 404
    assert out["gone"].status_code == 404
