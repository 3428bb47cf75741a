"""The compiled steps update the donated KV cache in place: no copy of the page pool per step."""

import pytest

from jaxserve.config.engine import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.executor.batch import StepKind
from jaxserve.models.demo import DEMO_CONFIG, byte_tokenizer, write_random_checkpoint

NUM_PAGES = 37  # an odd count, so the pool's shape is recognisable in the compiled program
# The attention shape of a ~100M Llama (hidden 768, 12 query and 4 KV heads of 64), one layer: the shape at
# which a scatter into a reshaped view of the pool made XLA copy the whole pool every step.
CONFIG = dict(DEMO_CONFIG, hidden_size=768, num_hidden_layers=1, num_attention_heads=12, num_key_value_heads=4,
              intermediate_size=2048)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = write_random_checkpoint(tmp_path_factory.mktemp("m"), CONFIG)
    byte_tokenizer().save_pretrained(folder)
    return Engine(EngineConfig(model=str(folder), page_size=16, num_pages=NUM_PAGES, max_model_len=320,
                               max_num_seqs=8, max_num_batched_tokens=256, warmup=False, compilation_cache_dir=None))


@pytest.mark.parametrize("decode", [True, False])
def test_steps_do_not_copy_the_kv_pool(engine, decode):
    kind = StepKind.DECODE if decode else StepKind.PREFILL
    batch = engine.executor.make_batch([[5]] if decode else [[5, 6, 7]], [200], [list(range(13))], kind=kind)
    hlo = engine.executor.runner.lower(kind, batch).compile().as_text()
    pool = f"[4,{NUM_PAGES},16,64]"
    copies = [line.strip()[:120] for line in hlo.splitlines() if " copy(" in line and pool in line]
    assert not copies, copies
