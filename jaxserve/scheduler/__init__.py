"""Scheduling on the host: sequences, which run each step with how many tokens, their slots, KV page pools and the
prefix cache, data replicas, and the step result the device hands back. Imports no jax."""
