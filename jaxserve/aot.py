"""``python -m jaxserve.aot``: compile the serving steps for described TPU topologies (``jaxserve.tools.aot``)."""

from jaxserve.tools.aot import cli

if __name__ == "__main__":
    raise SystemExit(cli())
