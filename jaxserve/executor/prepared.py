"""A jitted device function (the sampler, prompt-logprob scoring) whose calls run executables made ready at
warm-up, chosen by the arguments' structure, shapes and dtypes.

``jax.jit`` traces and lowers a function again in every process before it can even look in the persistent
compilation cache; for the sampler's variants that is most of a warm start's Python work. ``prepare`` instead
loads each variant's executable from the executable store (``jaxserve.executor.executable_store``) when it
holds it, else lowers, compiles and saves it there, as the runner does for the steps. A call whose arguments match no prepared variant goes through the jitted function, as before.
"""

from __future__ import annotations

import jax

from jaxserve.executor.executable_store import load_or_compile


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

    def prepare(self, args: tuple, devices: list, store, compiles) -> bool:
        """Make the executable of ``args`` ready: loaded from ``store`` (an ``ExecutableStore``, or None) onto
        ``devices`` (where it runs, in order), else lowered, compiled and saved there (``load_or_compile``;
        ``compiles``: the ``CompileCounter`` it needs). Returns whether it was loaded."""
        sig = signature(args)
        treedef, leaves = sig  # the store's key: stable across processes
        key = self.name, str(treedef), tuple((tuple(shape), str(dtype)) for shape, dtype in leaves)
        self.executables[sig], loaded = load_or_compile(store, key, devices, lambda: self.jitted.lower(*args),
                                                        compiles)
        return loaded
