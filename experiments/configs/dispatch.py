"""Settings of Dispatch, `python3 -m experiments.dispatch`: select a plan (per site and pass, the
fastest eligible kernel) from a ProbeReport.

  python3 -m experiments.dispatch --config.report=/tmp/wk_probe/probe_report.json \
      --config.out=plan.json --config.select.min_sqnr_wgrad_db=0
"""
import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  config.report = config_dict.placeholder(str)  # the ProbeReport (loka.probe/2) to select from
  config.out = config_dict.placeholder(str)     # where the plan (loka.plan/1) is written

  # The budget a kernel must meet at a site and pass to be eligible (eligibility.Criteria).
  config.select = select = ml_collections.ConfigDict()
  select.metric = "sqnr"    # accuracy by pessimistic SQNR, or by MERE (paper parity)
  # Largest acceptable error: with metric mere the MERE bound (default 0.2); with sqnr the
  # relative RMS error, i.e. every pass needs SQNR >= -20 log10(max_error) dB. Unset: the
  # bars below.
  select.max_error = config_dict.placeholder(float)
  select.min_sqnr_fwd_db = config_dict.placeholder(float)   # forward SQNR bar; unset: 25 dB
  select.min_sqnr_grad_db = config_dict.placeholder(float)  # gradient SQNR bar; unset: 20 dB
  # The weight gradient's (grad_rhs) bar where it should differ from min_sqnr_grad_db, which
  # then holds for the input gradient alone; unset: the same bar.
  select.min_sqnr_wgrad_db = config_dict.placeholder(float)
  # Largest underflow fraction of any operand; unset: 0.01.
  select.max_underflow = config_dict.placeholder(float)
  select.min_speedup = 1.05   # pessimistic speedup over xla_bf16 a kernel needs; 0: accuracy only
  # Per-site budgets: JSON (text or a file) {regex: {criteria field: value}}, e.g.
  # {"top_mlp/.*": {"min_sqnr_fwd_db": 30}}; the first fullmatch wins.
  select.site_budgets = config_dict.placeholder(str)
  # train: every pass (for run.precision=loka); serve: forwards only, judged on the forward
  # alone, for the exported inference model (`dispatch.export`); training refuses it.
  select.objective = "train"

  # Where the speedups come from.
  config.timing = timing = ml_collections.ConfigDict()
  # Device kind the plan is for; unset: the report's. Where the report's timings are not
  # valid for it, its committed timing table is used.
  timing.target_device = config_dict.placeholder(str)
  # Timing table (path or device kind) to use instead of the target device's committed one.
  timing.table = config_dict.placeholder(str)
  # With a report timed on the target device: take the kernel passes its probe left untimed
  # (judged unsafe before their statistics were read, dominated, not then candidates) from its
  # device's table (timing.table, else the committed one), so a plan is selected again once
  # the card's table times them, without probing again.
  timing.fill_from_table = False

  # With select.objective=serve: also write the serving proposal here (every bf16 forward that
  # is safe on accuracy alone and that the export serves as a static-scale e4m3 dot, in FP8).
  # Untimed: time its export against the plan's before serving it (the bench's --serve_plan).
  config.serving_proposal = config_dict.placeholder(str)

  # Check the plan against the probed model (rebuilt from the report's run, as `run` below
  # sets it), so a plan that does not fit fails here, naming every offending site.
  config.check = True

  # The probed run the plan is checked against: a field set here replaces the report's
  # (unset: the report's).
  config.run = run = ml_collections.ConfigDict()
  run.model = config_dict.placeholder(str)       # tower: dlrm, dcnv2, wukong, dhen, interformer
  run.preset = config_dict.placeholder(str)      # model size: tiny, small or large
  run.data = config_dict.placeholder(str)        # synthetic, movielens or criteo
  run.data_spec = config_dict.placeholder(str)   # JSON spec of the synthetic data
  run.data_path = config_dict.placeholder(str)   # input file or directory (criteo TSV)
  run.data_cache = config_dict.placeholder(str)  # cache directory of downloaded data (MovieLens)
  run.mods = config_dict.placeholder(str)        # Mods, comma-separated ('' for none)
  run.seed = config_dict.placeholder(int)        # parameters and data order
  run.batch_size = 0     # the check's batch; 0: the report's run's
  return config
