"""Fused kernels (installed as ``flowrl.kernels``), each beside its plain-torch reference.

No kernel ships yet: every sampler runs its torch reference in ``flowrl.samplers``. A kernel
lands here only with a dtype x shape test against that reference and a benchmark in
``docs/benchmarks.md``. triton is imported lazily, so CPU installs never need it.
"""

__all__: list[str] = []
