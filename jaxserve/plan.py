"""``python -m jaxserve.plan``: the deployment planner (``jaxserve.tools.plan``)."""

from jaxserve.tools.plan.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
