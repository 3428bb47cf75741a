"""``python -m jaxserve.capacity``: what fits on a device (``jaxserve.tools.capacity``)."""

from jaxserve.tools.capacity import main

if __name__ == "__main__":
    raise SystemExit(main())
