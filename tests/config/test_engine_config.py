"""One configuration source: every scheduler option is an EngineConfig field, hence a flag and an LLM keyword."""

import argparse
import dataclasses
import inspect

import pytest

from jaxserve.config.args import add_engine_args, engine_config_from_args
from jaxserve.config.engine import EngineConfig
from jaxserve.config.scheduler import SchedulerConfig
from jaxserve.llm import LLM

pytestmark = pytest.mark.quick

# Known once the model and the pool are: set by the executor (windows and the windowed pool from the model).
DERIVED = {"num_pages", "max_model_len", "attention_window", "local_window", "local_pages", "state_slots"}


def test_every_scheduler_option_is_a_flag_and_reaches_the_scheduler():
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    scheduler_fields = {f.name for f in dataclasses.fields(SchedulerConfig)}
    assert scheduler_fields - DERIVED <= engine_fields
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--long-prefill-token-threshold", "24", "--max-num-seqs", "4",
                              "--no-enable-chunked-prefill", "--max-num-batched-tokens", "512"])
    sched = engine_config_from_args(args).scheduler_config(num_pages=64, max_model_len=256)
    assert (sched.long_prefill_token_threshold, sched.max_num_seqs, sched.enable_chunked_prefill) == (24, 4, False)
    assert sched.pages_per_seq == 16


def test_llm_takes_the_engine_options_without_repeating_their_defaults():
    params = inspect.signature(LLM.__init__).parameters
    # reasoning_parser is the offline API's own (how chat splits its answer), not an engine option
    assert list(params) == ["self", "model", "reasoning_parser", "engine_options"]
    assert params["reasoning_parser"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "reasoning_parser" not in {f.name for f in dataclasses.fields(EngineConfig)}


def test_bad_options_name_themselves():
    with pytest.raises(ValueError, match="long_prefill_token_threshold=-1"):
        EngineConfig(long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="attention_backend='flash'"):
        EngineConfig(attention_backend="flash")
    with pytest.raises(ValueError, match="max_num_batched_tokens=8 must be >= max_num_seqs=16"):
        EngineConfig(max_num_seqs=16, max_num_batched_tokens=8)
