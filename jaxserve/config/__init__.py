"""Configuration: one frozen, validated dataclass per concern (engine, scheduler, speculation) and the command-line
flags that build them. Host-only: imports no jax."""
