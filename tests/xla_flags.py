"""The XLA flags of every test process: this one (``conftest.py`` sets them before jax is imported) and the ones
tests start themselves (multi-host drivers, servers).

``--xla_backend_optimization_level=0`` turns off LLVM's optimisation of XLA:CPU's generated code. The tests' models
are tiny, so compiling their steps is most of the suite's time and running them very little; at level 0 a step
compiles in about three quarters of the CPU time (a disaggregation test file: 69 -> 51 s of CPU). XLA's own
optimisations (fusion, layout, its HLO passes) still run, matmuls still call the same library kernels, and float
semantics stay strict at every level (XLA:CPU's fast math is off by default), so the tests check the programs the
engine runs, only less optimised by LLVM.
"""


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test process of ``devices`` emulated CPU devices."""
    return f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
