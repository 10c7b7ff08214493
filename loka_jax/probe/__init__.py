"""The LoKA Probe: streaming per-site statistics during training, per-site kernel errors and
timings, and the ProbeReport (`loka.probe/1`) that Dispatch selects kernels from.

  report = loka_jax.probe(model, variables, batches, loss_fn)   # this package, called
  probe = loka_jax.Probe(model, loss_fn)                         # in the user's own loop
  from loka_jax.probe import run_probe, ProbeConfig, ProbeOptions, load_report

Calling the package runs `streaming.probe` (see there for its arguments): the public
`loka_jax.probe(...)` and the subpackage `loka_jax.probe.<module>` are one name.

Names are imported lazily: the GEMM sites import `loka_jax.probe.hooks` while the models
package is still loading, so this package must not import the models at import time.
"""
import importlib
import sys
import types

_EXPORTS = {
    "ProbeCollector": "training", "ProbeConfig": "collector", "SiteProbe": "collector",
    "init_state": "collector", "make_observe": "collector", "probe_sites": "training",
    "site_state": "collector",
    "Criteria": "eligibility", "Verdict": "eligibility", "assess": "eligibility",
    "assess_site": "eligibility", "best_kernel": "eligibility",
    "summarize_report": "eligibility",
    "EvalConfig": "evaluate", "evaluate_site": "evaluate",
    "SCHEMA": "report", "ProbeReportError": "report", "load_report": "report",
    "markdown": "report", "save_report": "report", "site_table": "report",
    "validate_report": "report",
    "ProbeOptions": "runner", "ProbeResult": "runner", "run_probe": "runner",
    "write_plots": "plots",
    "Probe": "streaming", "ProbeInputError": "streaming",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f"module 'loka_jax.probe' has no attribute {name!r}")
  return getattr(importlib.import_module(f"loka_jax.probe.{module}"), name)


class _CallablePackage(types.ModuleType):
  """This package, callable as `loka_jax.probe(model, variables, batches, loss_fn, ...)`."""

  def __call__(self, *args, **kwargs):
    return importlib.import_module("loka_jax.probe.streaming").probe(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
