"""A jitted device function (the sampler, prompt-logprob scoring) whose calls run executables made ready at
warm-up, chosen by the arguments' structure, shapes and dtypes.

``jax.jit`` traces and lowers a function again in every process before it can even look in the persistent
compilation cache; for the sampler's variants that is most of a warm start's Python work. ``prepare`` instead
loads each variant's executable from the executable store (``jaxserve.executor.executable_store``) when it
holds it, else lowers, compiles and saves it there, as the runner does for the steps. A call whose arguments match no prepared variant goes through the jitted function, as before.
"""

from __future__ import annotations

import jax

from jaxserve.executor.executable_store import compile_fresh


def signature(args: tuple) -> tuple:
    """What selects a prepared executable: the arguments' tree structure, and each leaf's shape and dtype."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    return treedef, tuple((leaf.shape, leaf.dtype) for leaf in leaves)


class PreparedFunction:
    """``jitted`` (a ``jax.jit`` function of positional arguments), with the executables ``prepare`` made ready.

    ``prepare`` is called from one thread (warm-up); calls may come from any thread after it.
    """

    def __init__(self, name: str, jitted):
        self.name = name
        self.jitted = jitted
        self.executables: dict[tuple, jax.stages.Compiled] = {}

    def __call__(self, *args):
        if self.executables:
            compiled = self.executables.get(signature(args))
            if compiled is not None:
                return compiled(*args)
        return self.jitted(*args)

    def store_key(self, args: tuple) -> tuple:
        """The key of these arguments' executable in the executable store (stable across processes)."""
        treedef, leaves = signature(args)
        return self.name, str(treedef), tuple((tuple(shape), str(dtype)) for shape, dtype in leaves)

    def prepare(self, args: tuple, devices: list, store=None, compiles=None) -> bool:
        """Make the executable of ``args`` ready: loaded from ``store`` (an ``ExecutableStore``, or None) onto
        ``devices`` (where it runs, in order), else lowered and compiled (by XLA, not read from the compilation
        cache, when there is a store: ``compile_fresh``) and saved there, unless ``compiles`` (a
        ``CompileCounter``) shows this thread read it from that cache after all. Returns whether it was loaded."""
        key = self.store_key(args)
        compiled = store.load(key, devices) if store is not None else None
        loaded = compiled is not None
        if compiled is None and store is None:
            compiled = self.jitted.lower(*args).compile()
        elif compiled is None:
            hits = compiles.thread_cache_hits() if compiles is not None else 0
            compiled = compile_fresh(self.jitted.lower(*args))
            # saved before it ever runs: XLA:CPU's sort thunks do not serialize once they have run
            if compiles is None or compiles.thread_cache_hits() == hits:
                store.save(key, compiled)
        self.executables[signature(args)] = compiled
        return loaded
