"""The LoKA Probe: streaming per-site statistics during training, per-site kernel errors and
timings, and the ProbeReport (`loka.probe/2`) that Dispatch selects kernels from.

  report = loka_jax.probe(model, variables, batches, loss_fn)   # this package, called
  probe = loka_jax.Probe(model, loss_fn)                         # in the user's own loop
  from loka_jax.probe import run_probe, ProbeConfig, ProbeOptions, load_report

Calling the package runs `streaming.probe` (see there for its arguments): the public
`loka_jax.probe(...)` and the subpackage `loka_jax.probe.<module>` are one name.
"""
import sys
import types

from loka_jax.probe.collector import ProbeConfig, SiteProbe, init_state, make_observe, site_state
from loka_jax.probe.training import ProbeCollector, probe_sites
from loka_jax.probe.eligibility import (Criteria, Verdict, assess, assess_site, best_kernel,
                                        summarize_report)
from loka_jax.probe.evaluate import EvalConfig, evaluate_site
from loka_jax.probe.report import (ProbeReportError, SCHEMA, load_report, markdown, save_report,
                                   site_table, validate_report)
from loka_jax.probe.runner import ProbeOptions, ProbeResult, run_probe
from loka_jax.probe.plots import write_plots
from loka_jax.probe import streaming
from loka_jax.probe.streaming import Probe, ProbeInputError

__all__ = [
    "Criteria", "EvalConfig", "Probe", "ProbeCollector", "ProbeConfig", "ProbeInputError",
    "ProbeOptions", "ProbeReportError", "ProbeResult", "SCHEMA", "SiteProbe", "Verdict",
    "assess", "assess_site", "best_kernel", "evaluate_site", "init_state", "load_report",
    "make_observe", "markdown", "probe_sites", "run_probe", "save_report", "site_state",
    "site_table", "summarize_report", "validate_report", "write_plots"]


class _CallablePackage(types.ModuleType):
  """This package, callable as `loka_jax.probe(model, variables, batches, loss_fn, ...)`."""

  def __call__(self, *args, **kwargs):
    return streaming.probe(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
