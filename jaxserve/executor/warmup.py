"""The start-up's compiles: every step shape (and the sampler) made ready before serving, or with
``compile_in_background`` the largest shapes first and the rest on threads once serving has started
(``jaxserve.executor.background_compile``); and the compile guard's count of compilations after warm-up.

``Warmup`` owns the step shapes a step may run at (``shapes``: narrowed to the compiled ones while the others
compile in the background), so the executor packs each step into a shape that is ready.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time

import jax
import numpy as np

from jaxserve.executor import compile_progress
from jaxserve.executor.background_compile import BackgroundCompile
from jaxserve.executor.batch import StepKind, StepShapes
from jaxserve.executor.runner import CompileCounter
from jaxserve.executor.executable_store import ExecutableStore

logger = logging.getLogger(__name__)


class Warmup:
    """One executor's start-up compiles (``jaxserve.executor.protocol.Startup``).

    ``executor``: the ``Executor`` whose runner's steps and sampler are made ready (through its ``runner``,
    ``padding_batch`` and ``warm_sampler``); ``counter``: the compilations counted since the executor started
    building (loading's included, in the summary).
    """

    def __init__(self, executor, shapes: StepShapes, counter: CompileCounter):
        self._executor = executor
        self.shapes = shapes  # the step shapes, those not compiled yet left out (``StepShapes.compiled``)
        self._counter = counter
        self.done = False  # warm-up has run: a compilation in a step now is the compile guard's business
        self.summary: dict | None = None  # the start's figures (``compile_progress.Progress.finish``)
        self.late_compilations = 0
        self._later: BackgroundCompile | None = None  # the shapes compiling after start-up

    def run(self) -> None:
        """Make every bucket shape of both steps ready (loaded from the executable store when it holds the shape,
        else compiled and saved there) and compile the sampler, so serving never compiles."""
        ex, start = self._executor, time.perf_counter()
        runner = ex.runner
        shapes = self.shapes.all_shapes()
        store = (ExecutableStore.for_runner(ex.config, runner)
                 if ex.adapters is None else None)  # (the store's programs take no adapters)
        held = [shape for shape in shapes if store is not None and store.holds(runner.step_key(
            StepKind.DECODE if shape[0] else StepKind.PREFILL, ex.padding_batch(*shape)))]
        later = self.shapes_for_later(shapes, held)
        shapes = [shape for shape in shapes if shape not in later]
        progress = compile_progress.start(len(shapes) + 4, ex.config.compilation_cache_dir, counter=self._counter,
                                          stored=len(held) == len(shapes), later=len(later))
        if jax.process_count() > 1:  # the followers compile each shape as they follow it: run them all
            out = None
            for decode, num_tokens, num_seqs, pages in shapes:
                batch = ex.padding_batch(decode, num_tokens, num_seqs, pages)
                out = jax.block_until_ready(runner.run(StepKind.DECODE if decode else StepKind.PREFILL, batch))
                progress.tick()
            ex.warm_sampler(runner.local(out).logits, progress, store)
        else:
            # The shapes on a thread pool, one per core (XLA's compiler and the executable loads release the GIL;
            # tracing and lowering do not); the sampler meanwhile in this thread, on logits shaped and placed as
            # a step's (nothing runs: the steps' cache stays untouched while they are lowered).
            workers = min(len(shapes), os.cpu_count() or 1)
            with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jaxserve-compile") as pool:
                # the largest prefill shapes (the longest compiles) first, so no thread is left with one at the end
                ordered = sorted(shapes, key=lambda shape: (shape[0], -shape[1]))
                done = [pool.submit(self._prepare_shape, shape, store) for shape in ordered]
                logits = jax.device_put(np.zeros((runner.num_logit_rows, ex.info.model_config.vocab_size),
                                                 np.float32), runner.sample_device)
                ex.warm_sampler(logits, progress, store)
                for future in concurrent.futures.as_completed(done):
                    future.result()
                    progress.tick()
        if store is not None:
            progress.stored = (store.hits, store.misses)
        self.summary = progress.finish()
        self.done = True
        logger.debug("warm-up prepared the steps and the sampler in %.1fs", time.perf_counter() - start)
        if later:
            self._compile_later(shapes, later, store)

    def shapes_for_later(self, shapes: list, held: list) -> list:
        """With ``compile_in_background``, the shapes left for after start-up, in the order to compile them:
        all but the largest prefill and decode shapes (every step fits one) and those the store holds (loading is
        quick). Smaller shapes first, a decode and a prefill shape in turn: they are the most padded meanwhile.
        None on a multi-process run (the followers compile what the leader runs) or with speculation (its
        drafter's steps have shapes of their own)."""
        if not self.compiles_in_background or jax.process_count() > 1 or self._executor.spec is not None:
            return []
        first = {max((s for s in shapes if s[0] == decode), key=lambda s: s[1]) for decode in (False, True)}
        later = [s for s in shapes if s not in first and s not in held]
        rank = {s: i for kind in (False, True) for i, s in enumerate(sorted(
            (s for s in shapes if s[0] == kind), key=lambda s: s[1]))}
        return sorted(later, key=lambda s: (rank[s], not s[0]))

    @property
    def compiles_in_background(self) -> bool:
        """``compile_in_background``, with None ("auto") resolved: on, except on a GPU. XLA's GPU compiler picks
        kernels by timing candidates on the device, so compiling beside serving slows both (docs/benchmarks/gpu-kit.md,
        "GPU: the check kit on an NVIDIA H200, fourth run")."""
        setting = self._executor.config.compile_in_background
        return setting if setting is not None else self._executor.runner.sample_device.platform != "gpu"

    def _compile_later(self, ready: list, later: list, store) -> None:
        """Serve with the ``ready`` shapes while ``later`` compile on background threads (half the cores: the
        host loop keeps the rest)."""
        self.shapes = self.shapes.with_compiled({(s[0], s[1]) for s in ready})

        def add(shape) -> None:  # called under the background compile's lock: one shape at a time
            if self.shapes.compiled is not None:
                self.shapes = self.shapes.with_compiled(self.shapes.compiled | {(shape[0], shape[1])})

        # Lowered against the arrays' descriptions, taken now: serving donates the pool at every step, and
        # ``sleep`` deletes it (and the weights), while a shape compiles.
        state = self._executor.runner.abstract_state()
        self._later = BackgroundCompile(later, lambda shape: self._prepare_shape(shape, store, state), add,
                                        workers=max(1, (os.cpu_count() or 2) // 2))

    def _prepare_shape(self, shape, store, state: tuple | None = None) -> bool:
        decode, num_tokens, num_seqs, pages = shape
        kind = StepKind.DECODE if decode else StepKind.PREFILL
        return self._executor.runner.prepare(kind, self._executor.padding_batch(decode, num_tokens, num_seqs, pages),
                                             store, state)

    @property
    def pending(self) -> int:
        """Step shapes still compiling in the background (``compile_in_background``); 0 once all are ready."""
        return 0 if self._later is None else self._later.pending

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every step shape compiling in the background is ready; returns whether all are."""
        return self._later is None or (self._later.wait(timeout) and self.shapes.compiled is None)

    def stop(self, timeout: float) -> None:
        """Stop compiling shapes in the background, waiting at most ``timeout`` seconds for those being compiled
        (the interpreter's exit waits for the rest)."""
        if self._later is not None and not self._later.stop(timeout):
            logger.info("%d step shape(s) still compiling in the background; not waiting for them",
                        self._later.compiling())

    def compiled_while_serving(self, n: int, shape: str) -> None:
        """The compile guard: warm-up compiles every shape serving uses, so a compilation in a step is a bug
        that stalls it (counted in ``jaxserve_compilations_after_warmup_total``)."""
        self.late_compilations += n
        logger.warning("%d XLA compilation(s) after warm-up, in the step of shape %s (warm-up should have compiled "
                       "it; the step waited for the compiler)", n, shape)
