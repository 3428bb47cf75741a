"""``python -m jaxserve.plan``: the deployment planner (``jaxserve.tools.plan``)."""

from jaxserve.tools.plan import main

if __name__ == "__main__":
    raise SystemExit(main())
