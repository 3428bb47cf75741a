"""The continuous-batching host loop around the executor: requests in, steps, outputs out. Imports no jax: the
executor, which does, is built on start-up."""
