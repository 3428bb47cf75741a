"""The smallest decode bucket (``shapes.decode_floor``): two rows on a GPU, where one sequence decodes in a
two-row step, one row elsewhere."""

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.executor import builder
from jaxserve.executor.batch import StepShapes, decode_floor
from tests.tiny import build_tiny_model

pytestmark = pytest.mark.quick

OPTIONS = dict(page_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=48, warmup=False,
               compilation_cache_dir=None)


def test_the_floor_is_the_smallest_decode_bucket():
    assert decode_floor("gpu") == decode_floor("cuda") == 2 and decode_floor("cpu") == decode_floor("tpu") == 1
    shapes = StepShapes(8, 64, 16, min_decode_seqs=2)
    assert shapes.decode_buckets() == [2, 4, 8] and shapes.seq_bucket(1) == 2 and shapes.seq_bucket(3) == 4
    assert StepShapes(8, 64, 16).decode_buckets() == [1, 2, 4, 8]
    assert StepShapes(1, 64, 16, min_decode_seqs=2).decode_buckets() == [1]  # never above max_num_seqs


def test_one_sequence_in_a_two_row_bucket_decodes_as_in_a_one_row_bucket(tmp_path, monkeypatch):
    folder = build_tiny_model("llama", tmp_path / "m", num_hidden_layers=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)
    prompt = [[5, 17, 42, 9, 33, 8, 71, 12, 3]]

    def run():
        llm = LLM(str(folder), **OPTIONS)
        out = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
        return llm.engine.executor.shapes, out.token_ids, [r[t].logprob for r, t in zip(out.logprobs, out.token_ids)]

    one_row, tokens, logprobs = run()
    monkeypatch.setattr(builder, "decode_floor", lambda platform: 2)  # the GPU's floor, on this CPU
    two_rows, tokens2, logprobs2 = run()
    assert one_row.decode_buckets()[0] == 1 and two_rows.decode_buckets()[0] == 2
    assert tokens2 == tokens
    np.testing.assert_allclose(logprobs2, logprobs, rtol=1e-5, atol=1e-5)
