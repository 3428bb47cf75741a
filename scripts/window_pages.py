"""Pages one sequence holds while it runs, with and without releasing the pages behind the attention window.

Host-only (the real Scheduler and BlockManager, no model): a prompt prefilled in chunks, then decoded token by
token; prints the pages held at the end of the prefill, the most held at any step, and at the end, for each
window (``none`` = every layer global, nothing released). A page holds ``page_size`` tokens of every layer.

    python scripts/window_pages.py --prompt-len 32000 --output-len 768 --windows none,4096,1024
"""

from __future__ import annotations

import argparse

from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler import Scheduler, SchedulerConfig
from jaxserve.sequence import Sequence


def run(prompt_len: int, output_len: int, page_size: int, chunk: int, window: int | None) -> dict:
    total = prompt_len + output_len
    cfg = SchedulerConfig(num_pages=-(-total // page_size) + 1, page_size=page_size, max_model_len=total,
                          max_num_seqs=1, max_num_batched_tokens=chunk, attention_window=window)
    sched = Scheduler(cfg)
    seq = Sequence("r", [3] * prompt_len, SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0))
    sched.add(seq)
    bm, most, after_prefill, last = sched.block_manager, 0, None, 0
    while sched.has_unfinished():
        out = sched.schedule()
        most = max(most, bm.pages_held(seq))
        sched.update(out, [5] * len(out.scheduled))
        if after_prefill is None and seq.num_output_tokens:
            after_prefill = bm.pages_held(seq)
        if not seq.is_finished:
            last = bm.pages_held(seq)
    return dict(after_prefill=after_prefill, most=most, at_end=last, released=bm.num_released_pages)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-len", type=int, default=32000)
    p.add_argument("--output-len", type=int, default=768)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--windows", default="none,4096,1024")
    args = p.parse_args(argv)
    print(f"prompt {args.prompt_len} + output {args.output_len} tokens, page size {args.page_size}, prefill chunks "
          f"of {args.max_num_batched_tokens}")
    print("| window | pages held after prefill | most held at any step | held at the last step | released |")
    print("| --- | --- | --- | --- | --- |")
    for w in args.windows.split(","):
        window = None if w == "none" else int(w)
        r = run(args.prompt_len, args.output_len, args.page_size, args.max_num_batched_tokens, window)
        print(f"| {w} | {r['after_prefill']} | {r['most']} | {r['at_end']} | {r['released']} |")


if __name__ == "__main__":
    main()
