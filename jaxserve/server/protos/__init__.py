"""Generated gRPC modules for jaxserve.proto (regenerate with ``python scripts/gen_protos.py``)."""
