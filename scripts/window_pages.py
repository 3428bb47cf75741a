"""Pages one sequence holds while it runs: with one pool and nothing released, with pages behind the window
released (every layer windowed), and with a separate pool for the windowed layers of an interleaved model.

Host-only (the real Scheduler and block managers, no model): a prompt prefilled in chunks, then decoded token by
token; prints the pages held at the end of the prefill, the most held at any step, and at the last step. A page
holds ``page_size`` tokens of one layer group (every layer with one pool; with a windowed pool, the global
layers' pages and the windowed layers' pages are counted apart).

    python scripts/window_pages.py --prompt-len 32000 --output-len 768 --windows 4096,1024 \
        --interleaved 34:5:1024
"""

from __future__ import annotations

import argparse

from jaxserve.config.scheduler import SchedulerConfig
from jaxserve.sampling_params import SamplingParams
from jaxserve.scheduler.scheduler import Scheduler
from jaxserve.scheduler.sequence import Sequence
from jaxserve.scheduler.window_pool import window_pages_needed
from scripts import bench_results


def run(prompt_len: int, output_len: int, page_size: int, chunk: int, *, window: int | None = None,
        local_window: int | None = None) -> dict:
    """Pages held by one sequence: ``window`` (every layer windowed) or ``local_window`` (a windowed pool)."""
    total = prompt_len + output_len
    local = window_pages_needed(local_window, page_size, 1, chunk) if local_window else 0
    cfg = SchedulerConfig(num_pages=-(-total // page_size) + 1, page_size=page_size, max_model_len=total,
                          max_num_seqs=1, max_num_batched_tokens=chunk, attention_window=window,
                          local_window=local_window, local_pages=local)
    sched = Scheduler(cfg)
    seq = Sequence("r", [3] * prompt_len, SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0))
    sched.add(seq)
    bm = sched.block_manager
    pools = [bm.full, bm.windowed] if local_window else [bm]
    most, after_prefill, last = [0] * len(pools), None, None
    while sched.has_unfinished():
        out = sched.schedule()
        held = [p.pages_held(seq) for p in pools]
        most = [max(a, b) for a, b in zip(most, held)]
        last = held
        sched.update(out, [5] * len(out.scheduled))
        if after_prefill is None and seq.num_output_tokens:
            after_prefill = [p.pages_held(seq) for p in pools]
    return dict(after_prefill=after_prefill, most=most, last=last, pool_pages=[p.num_pages for p in pools])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-len", type=int, default=32000)
    p.add_argument("--output-len", type=int, default=768)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--windows", default="4096,1024", help="all-windowed models' windows to run")
    p.add_argument("--interleaved", default="34:5:1024,26:4:512",
                   help="LAYERS:GLOBAL_LAYERS:WINDOW shapes of interleaved models (Gemma 3 4B, 1B)")
    bench_results.add_arguments(p)
    args = p.parse_args(argv)
    figures = bench_results.Results(args)
    a = (args.prompt_len, args.output_len, args.page_size, args.max_num_batched_tokens)
    print(f"prompt {args.prompt_len} + output {args.output_len} tokens, page size {args.page_size}, prefill chunks "
          f"of {args.max_num_batched_tokens}\n")
    print("| model | pages held after prefill | most held at any step | held at the last step |")
    print("| --- | --- | --- | --- |")
    r = run(*a)
    print(f"| one pool, nothing released | {r['after_prefill'][0]} | {r['most'][0]} | {r['last'][0]} |")
    for w in args.windows.split(","):
        r = run(*a, window=int(w))
        print(f"| every layer windowed, window {w} | {r['after_prefill'][0]} | {r['most'][0]} | {r['last'][0]} |")
    full = run(*a)["last"][0]
    print("\n| interleaved model | windowed-pool pages held (most / last) | page-layers held at the last step: "
          "one pool | windowed pool | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for shape in args.interleaved.split(","):
        layers, global_layers, window = map(int, shape.split(":"))
        r = run(*a, local_window=window)
        before = full * layers
        after = r["last"][0] * global_layers + r["last"][1] * (layers - global_layers)
        print(f"| {layers} layers ({global_layers} global), window {window} | {r['most'][1]} / {r['last'][1]} | "
              f"{before} | {after} | {before / after:.1f}x |")
        figures.add(f"{layers} layers ({global_layers} global), window {window}: page-layers held at the last step, "
                    "one pool / windowed pool", before / after, "x")
    figures.save()


if __name__ == "__main__":
    main()
