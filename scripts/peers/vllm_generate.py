"""Peer run: the workload through vLLM's offline ``LLM.generate`` (run with vLLM's own Python).

    VLLM_CPU_KVCACHE_SPACE=2 /path/to/vllm-venv/bin/python scripts/peers/vllm_generate.py WORKLOAD.json \
        --model M [--dtype float32] [--max-num-seqs 48]

Token-id prompts and ``skip_tokenizer_init`` so no tokenizer is involved; the workload's ``params`` (if any) are
the requests' ``SamplingParams`` keywords. Prints one JSON line:
{"seconds", "output_tokens", "startup_seconds"}.
"""

import argparse
import json
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("workload")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-seqs", type=int, default=64)
    args = p.parse_args()
    from vllm import LLM, SamplingParams

    w = json.load(open(args.workload))
    start = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, skip_tokenizer_init=True, max_num_seqs=args.max_num_seqs,
              max_model_len=w["max_model_len"], seed=0)
    startup = time.perf_counter() - start
    # The workload may carry its own sampling parameters (SamplingParams keywords); greedy by default.
    options = w.get("params") or dict(max_tokens=w["output_len"], ignore_eos=True, temperature=0.0)
    params = SamplingParams(**options, detokenize=False)
    prompts = [{"prompt_token_ids": p} for p in w["prompts"]]
    llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0, detokenize=False))
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"seconds": seconds, "output_tokens": tokens, "startup_seconds": startup}), flush=True)


if __name__ == "__main__":
    main()
