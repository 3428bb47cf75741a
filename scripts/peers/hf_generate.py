"""Peer run: the workload through Hugging Face transformers' batched ``generate`` (PyTorch).

    python scripts/peers/hf_generate.py WORKLOAD.json --model M --batch-sizes 8,16,48 [--dtype float32]

Prints one JSON line per batch size: {"batch_size", "seconds", "output_tokens"}.
"""

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM


def run(model, prompts, out_len, batch_size, pad_id):
    total = 0
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in chunk])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len,
                                 do_sample=False, pad_token_id=pad_id)
        total += (out.shape[1] - width) * len(chunk)
    return total


def main():
    p = argparse.ArgumentParser()
    p.add_argument("workload")
    p.add_argument("--model", required=True)
    p.add_argument("--batch-sizes", default="8,16,48")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    w = json.load(open(args.workload))
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).eval()
    run(model, w["prompts"][:2], 2, 2, 0)  # warm-up
    for bs in map(int, args.batch_sizes.split(",")):
        start = time.perf_counter()
        tokens = run(model, w["prompts"], w["output_len"], bs, 0)
        print(json.dumps({"batch_size": bs, "seconds": time.perf_counter() - start, "output_tokens": tokens}),
              flush=True)


if __name__ == "__main__":
    main()
