"""Inference export: FP8-stored weights and static activation scales calibrated by the probe.

  exported = export(get_config("wukong", "small"), params, plan, report, batch=batch)
  logits = exported.apply(batch)                       # jitted, static scales
  fn = jax.jit(exported.forward)                       # pure: fn(exported.variables, batch)
  exported.save("/tmp/wukong_export"); again = load("/tmp/wukong_export")

Per GEMM site, by the plan's forward kernel:
  fp8          an FP8 forward with tensorwise or rowwise scaling (XLA, Flax delayed, or a
               Pallas kernel of those granularities): the weight is stored in e4m3 with the
               kernel's weight scales (tensorwise: one; rowwise: one per output column),
               contracted axes last (`weight_axes`: a `kn` weight is stored `nk`, the
               operand layout Hopper's FP8 GEMMs read, so no transpose runs per call), and
               every activation operand is quantized with a *static* tensorwise scale,
               amax_max / 448, where amax_max is the largest amax the probe saw on that operand
               (report `stats.{lhs,rhs}.amax.max`, times `amax_headroom`): no reduction over
               activations at run time; larger values saturate. The product is one e4m3 dot
               (fast accumulation, as the forward kernels) with the scales applied after it:
               in the output dtype when one scalar scale covers the product (tensorwise, as
               Flax's delayed-scaling forward), else in float32 (rowwise weight scales).
  fp8_weights  a block-scaled forward (1x128 / 128x128 scales vary along the contraction, so
               they cannot be applied after one dot): the weight is stored in e4m3 with its
               block scales and dequantized to bf16 for a bf16 product.
  high         a bf16/fp32 forward, or a site the report has no statistics of: the plan's own
               kernel, the weight stored in the compute dtype (bf16).
Every other parameter (embeddings, norms, biases) is kept as it is.

Saved form (`save`): DIR/arrays.npz (every variable; e4m3 arrays stored as their bytes,
uint8, bf16 as uint16) and DIR/manifest.json (`loka.export/1`: dtypes, shapes, the npz's
sha256, per-site modes and scales, the plan, the model config when exported from a preset
config, and the memory saved). The manifest is written last, so a directory without one is
an unfinished export.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
from typing import Any, Dict, Mapping, Optional

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from loka_jax import jsonio
from loka_jax.plan.binding import apply as apply_plan
from loka_jax.plan.file import as_plan, to_kernel_plan
from loka_jax.kernels import ACT_WEIGHT, EinsumSpec, KernelPlan, registry
from loka_jax.kernels.base import dot_einsum
from loka_jax.models.site import ActSite, DenseSite, EinsumSite, site_name
from loka_jax.precision import E4M3, QTensor, quantize
from loka_jax.precision.qtensor import ROWWISE, TENSORWISE
from loka_jax.precision.scaling import quantize_with_scale, scale_from_amax

SCHEMA = "loka.export/1"
EXPORT = "export"            # variable collection of the exported sites' weights and scales
FP8, FP8_WEIGHTS, HIGH = "fp8", "fp8_weights", "high"
ARRAYS, MANIFEST = "arrays.npz", "manifest.json"
_STORED = {"float8_e4m3fn": np.uint8, "bfloat16": np.uint16}  # saved as their bytes


class ExportError(ValueError):
  """An export that cannot be made, or a saved one that cannot be read."""


@dataclasses.dataclass(frozen=True)
class SiteExport:
  """How one site runs in the exported model."""
  name: str
  kind: str
  spec: str
  mode: str                        # fp8 | fp8_weights | high
  kernel: str                      # the plan's forward kernel
  granularity: Optional[str]       # of the stored weight (None: not FP8)
  reason: str
  amax: Dict[str, float] = dataclasses.field(default_factory=dict)  # calibrated operand amax
  # The stored weight's axis letters (None: the spec's own order, as exports made before the
  # contraction-last layout stored it).
  weight_axes: Optional[str] = None

  def to_dict(self) -> Dict[str, Any]:
    return dataclasses.asdict(self)


# ----------------------------------------------------------------------------- the forward


def _weight_scale_on_output(spec: EinsumSpec, scale: jax.Array) -> jax.Array:
  """A weight scale (keepdims over its contracting axes) laid out to broadcast on the output."""
  contracting = spec.contracting_axes("rhs")
  squeezed = jnp.squeeze(scale, axis=contracting)
  letters = [c for i, c in enumerate(spec.rhs) if i not in contracting]
  order = sorted(range(len(letters)), key=lambda i: spec.out.index(letters[i]))
  squeezed = jnp.transpose(squeezed, order)
  placed = [letters[i] for i in order]
  shape = [squeezed.shape[placed.index(c)] if c in placed else 1 for c in spec.out]
  return squeezed.reshape(shape)


def _static_fp8(spec: EinsumSpec, lhs, lhs_scale, rhs_q, rhs_scale, out_dtype, kind: str):
  """e4m3 product of an activation quantized with a static scale and a stored (or
  statically quantized) right operand; scales applied after the dot.

  With one scale for the whole product (tensorwise operands), the dot writes the output
  dtype and the scale follows in it: the form of Flax's delayed-scaling forward (`out_dq`),
  which cuBLASLt runs as one FP8 GEMM. With per-column weight scales (rowwise) the product
  stays float32 until scaled. At the largest tower on an H200 the
  float32 form served the plan at 1.24x bf16 and the output-dtype form at 1.40x; the planned
  model itself ran 1.58x over bf16+Mods.
  """
  lhs_q = quantize_with_scale(lhs, lhs_scale, E4M3)
  if kind == ACT_WEIGHT:
    scale = lhs_scale * _weight_scale_on_output(spec, rhs_scale)
  else:
    scale = lhs_scale * rhs_scale
  if scale.size == 1:
    out = dot_einsum(spec, lhs_q, rhs_q, precision=lax.Precision.DEFAULT,
                     preferred_element_type=out_dtype)
    return out * scale.reshape(()).astype(out_dtype)
  out = dot_einsum(spec, lhs_q, rhs_q, precision=lax.Precision.DEFAULT,
                   preferred_element_type=jnp.float32)
  return (out * scale).astype(out_dtype)


@dataclasses.dataclass(frozen=True)
class _Exported:
  """Interceptor: exported sites compute from the `export` collection; the rest run as
  planned."""
  sites: Mapping[str, SiteExport]

  def __call__(self, next_fun, args, kwargs, context):
    module = context.module
    if context.method_name != "__call__" or not isinstance(module, (DenseSite, EinsumSite,
                                                                    ActSite)):
      return next_fun(*args, **kwargs)
    info = self.sites.get(site_name(module))
    if info is None or info.mode == HIGH:
      return next_fun(*args, **kwargs)
    from loka_jax.models.fused import FusedDenseNormAct  # mods import the sites: import late
    if isinstance(module, FusedDenseNormAct):
      return _fused_dense(module, info, *args, **kwargs)
    if isinstance(module, DenseSite):
      return _dense(module, info, *args, **kwargs)
    if isinstance(module, EinsumSite):
      return _einsum(module, info, *args, **kwargs)
    return _act(module, info, *args, **kwargs)


def contraction_last(spec: EinsumSpec) -> str:
  """The weight's (rhs) letters with batch axes first, then the free axes in the output's
  order, then the contracted axes in the activation's order: the layout in which cuBLASLt's
  FP8 GEMM on Hopper (both operands contraction-major, "TN") reads the weight as stored.
  Stored as `kn`, an e4m3 weight is transposed by a separate kernel on every call (421 us a
  step at the largest tower's exported forward on an H200)."""
  batch = [c for c in spec.out if c in spec.rhs and c in spec.lhs]
  free = [c for c in spec.out if c in spec.rhs and c not in spec.lhs]
  contracted = [c for c in spec.lhs if c in spec.rhs and c not in spec.out]
  axes = "".join(batch + free + contracted)
  return axes if sorted(axes) == sorted(spec.rhs) else spec.rhs


def _weight_product(module, info: SiteExport, spec: EinsumSpec, x):
  """The act x weight product of an exported site (output dtype of its policy)."""
  policy = module.config.policy
  x = x.astype(policy.compute_dtype)
  get = lambda n: module.get_variable(EXPORT, n)
  if info.mode == FP8:
    stored = EinsumSpec(spec.lhs, info.weight_axes or spec.rhs, spec.out)
    return _static_fp8(stored, x, get("lhs_scale"), get("weight"), get("weight_scale"),
                       policy.output_dtype, ACT_WEIGHT)
  contracting = spec.contracting_axes("rhs")
  w = QTensor(get("weight"), get("weight_scale"), info.granularity, contracting)
  return registry.get("xla_bf16").einsum(spec, x, w.dequantize(policy.compute_dtype),
                                         pass_name="fwd", out_dtype=policy.output_dtype)


def _dense(module, info: SiteExport, x):
  lead = x.shape[:-1]
  x2 = x.reshape((math.prod(lead), x.shape[-1]))
  out = _weight_product(module, info, EinsumSpec.parse("mk,kn->mn"), x2)
  out = out.reshape(lead + (module.features,))
  if module.use_bias:
    out = out + module.get_variable("params", "bias").astype(out.dtype)
  return out


def _fused_dense(module, info, x):
  if isinstance(x, QTensor):
    x = x.dequantize(module.config.policy.compute_dtype)
  return module.epilogue(_dense(module, info, x))


def _einsum(module, info, x):
  spec = EinsumSpec.parse(module.spec)
  out = _weight_product(module, info, spec, x)
  if module.bias_axes:
    bias = module.get_variable("params", "bias")
    shape = [1] * out.ndim
    for i, axis in enumerate(module.bias_axes):
      shape[spec.out.index(axis)] = bias.shape[i]
    out = out + bias.astype(out.dtype).reshape(shape)
  return out


def _act(module, info, lhs, rhs):
  policy = module.config.policy
  spec = EinsumSpec.parse(module.spec)
  lhs, rhs = lhs.astype(policy.compute_dtype), rhs.astype(policy.compute_dtype)
  rhs_scale = module.get_variable(EXPORT, "rhs_scale")
  return _static_fp8(spec, lhs, module.get_variable(EXPORT, "lhs_scale"),
                     quantize_with_scale(rhs, rhs_scale, E4M3), rhs_scale,
                     policy.output_dtype, info.kind)


# ----------------------------------------------------------------------------- the model


def _nbytes(tree) -> int:
  return int(sum(np.asarray(x).nbytes if not hasattr(x, "nbytes") else x.nbytes
                 for x in jax.tree.leaves(tree)))


@dataclasses.dataclass(eq=False)
class ExportedModel:
  """A planned model for serving: `variables` hold the exported weights and static scales.

  `forward(variables, batch)` is pure and jittable (float32 logits [B]); `apply(batch)` runs
  it jitted on this model's own variables.
  """
  module: nn.Module
  variables: Dict[str, Any]
  sites: Dict[str, SiteExport]
  plan: Dict[str, Any]
  memory: Dict[str, Any]
  config_json: Optional[str] = None
  features: Optional[Dict[str, Any]] = None

  def __post_init__(self):
    self._interceptor = _Exported(dict(self.sites))
    self._jitted = jax.jit(self.forward)

  def forward(self, variables, batch) -> jax.Array:
    """Inference logits with static activation scales (trace it under jax.jit)."""
    with nn.intercept_methods(self._interceptor):
      return self.module.apply(variables, batch, train=False).astype(jnp.float32)

  def apply(self, batch) -> jax.Array:
    return self._jitted(self.variables, batch)

  def mode_counts(self) -> Dict[str, int]:
    counts: Dict[str, int] = {}
    for s in self.sites.values():
      counts[s.mode] = counts.get(s.mode, 0) + 1
    return counts

  # ------------------------------------------------------------------- files

  def save(self, directory: str) -> Dict[str, Any]:
    """Writes arrays.npz and then manifest.json into `directory`; returns the manifest."""
    os.makedirs(directory, exist_ok=True)
    flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(self.variables), sep="/")
    arrays, entries = {}, {}
    for i, (key, value) in enumerate(sorted(flat.items())):
      value = np.asarray(jax.device_get(value))
      dtype = str(value.dtype)
      stored = value.view(_STORED[dtype]) if dtype in _STORED else value
      arrays[f"a{i:05d}"] = stored
      entries[key] = {"id": f"a{i:05d}", "dtype": dtype, "shape": list(value.shape)}
    path = os.path.join(directory, ARRAYS)
    tmp = path + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)
    manifest = {"schema": SCHEMA,
                "created": datetime.datetime.now().isoformat(timespec="seconds"),
                "arrays_sha256": jsonio.file_sha256(path), "arrays": entries,
                "sites": {n: s.to_dict() for n, s in self.sites.items()},
                "plan": self.plan, "memory": self.memory, "config": self.config_json,
                "features": self.features}
    jsonio.write_json_atomic(os.path.join(directory, MANIFEST), manifest)
    return manifest




def _site_stats(report: Optional[Mapping], name: str) -> Mapping:
  return (((report or {}).get("sites") or {}).get(name) or {}).get("stats") or {}


def _amax(stats: Mapping, operand: str) -> Optional[float]:
  value = ((stats.get(operand) or {}).get("amax") or {}).get("max")
  if value is None or not math.isfinite(float(value)) or float(value) <= 0:
    return None
  return float(value)


def serves_static_fp8(kernel_name: str) -> bool:
  """Whether a site whose forward runs `kernel_name` exports as `fp8` (given the report's amax
  statistics): an FP8 kernel of tensorwise or rowwise scaling, whose scales can be applied
  after one e4m3 dot. Block-scaled kernels export as `fp8_weights`, the rest as `high`."""
  from loka_jax.probe.candidates import granularity_of
  kernel = registry.get(kernel_name)
  return kernel.fp8 and (granularity_of(kernel) or TENSORWISE) in (TENSORWISE, ROWWISE)


def _plan_site(name: str, product, kernel_plan: KernelPlan, report, headroom: float
               ) -> SiteExport:
  """The export mode of one site from the plan's forward kernel and the report's stats."""
  from loka_jax.probe.candidates import granularity_of
  fwd = kernel_plan.choice_for(name).fwd
  kernel = registry.get(fwd)
  base = dict(name=name, kind=product.kind, spec=str(EinsumSpec.parse(product.spec)),
              kernel=fwd)
  if not kernel.fp8:
    return SiteExport(mode=HIGH, granularity=None, reason=f"plan runs {fwd}", **base)
  stats = _site_stats(report, name)
  operands = ("lhs",) if product.kind == ACT_WEIGHT else ("lhs", "rhs")
  amax = {op: _amax(stats, op) for op in operands}
  granularity = granularity_of(kernel) or TENSORWISE
  if not serves_static_fp8(fwd):
    if product.kind != ACT_WEIGHT:
      return SiteExport(mode=HIGH, granularity=None, reason=f"{fwd} is {granularity}: an act x "
                        "act site has no weight to store; bf16 product", **base)
    return SiteExport(mode=FP8_WEIGHTS, granularity=granularity,
                      reason=f"{fwd} is {granularity}: block scales vary along the contraction, "
                             "so e4m3 storage with a bf16 product", **base)
  missing = [op for op, v in amax.items() if v is None]
  if missing:
    return SiteExport(mode=HIGH, granularity=None,
                      reason=f"the report has no amax statistics of {', '.join(missing)}: no "
                             "static scale; bf16 weights, the plan's kernel", **base)
  return SiteExport(mode=FP8, granularity=granularity,
                    reason=f"{fwd}: e4m3 weights ({granularity}), static activation scales",
                    amax={op: v * headroom for op, v in amax.items()}, **base)


def _node(tree: Dict, path, create: bool = False):
  for key in path:
    if key not in tree:
      if not create:
        return None
      tree[key] = {}
    tree = tree[key]
  return tree


def export(target, params, plan, report: Optional[Mapping], *, batch,
           policy=None, features=None, amax_headroom: float = 1.0) -> ExportedModel:
  """The planned model of `target` with FP8-stored weights and static activation scales.

  Args:
    target: a preset config (ml_collections) or a loka_jax module (as `dispatch.apply`).
    params: the trained parameters (the `params` collection).
    plan: the plan (Plan, its JSON, a path or a KernelPlan); its forward kernels decide each
      site's mode (module docstring).
    report: the ProbeReport whose per-site amax statistics calibrate the static scales.
    batch: an example batch (shapes only).
    amax_headroom: multiplies every calibrated amax (> 1 leaves room above what the probe saw).
  """
  if amax_headroom <= 0:
    raise ExportError(f"amax_headroom must be > 0, got {amax_headroom}")
  kernel_plan = to_kernel_plan(plan)
  plan_json = (as_plan(plan).to_dict() if not isinstance(plan, KernelPlan) else
               {"kernel_plan": repr(kernel_plan)})
  module = apply_plan(target, kernel_plan, policy=policy, features=features)
  from loka_jax.models.presets import site_products
  products = site_products(module, None, batch)
  params = jax.device_get(flax.core.unfreeze(params))
  out_params = jax.tree.map(np.asarray, params)
  exported: Dict[str, Any] = {}
  sites: Dict[str, SiteExport] = {}
  weights_before = weights_after = 0
  for name, product in products.items():
    info = _plan_site(name, product, kernel_plan, report, amax_headroom)
    path = name.split("/")
    node = _node(out_params, path)
    kernel = None if node is None else node.get("kernel")
    if product.kind == ACT_WEIGHT and kernel is None:
      raise ExportError(f"site {name}: no parameter {'/'.join(path + ['kernel'])} in params; "
                        "pass the trained parameters of this model")
    spec = EinsumSpec.parse(product.spec)
    if info.mode != HIGH:
      store = _node(exported, path, create=True)
      for op, amax in info.amax.items():
        store[f"{op}_scale"] = np.asarray(scale_from_amax(jnp.float32(amax), E4M3))
    if product.kind == ACT_WEIGHT:
      weights_before += kernel.nbytes
      if info.mode == HIGH:
        node["kernel"] = np.asarray(jnp.asarray(kernel).astype(module_dtype(module, policy)))
        weights_after += node["kernel"].nbytes
      else:
        try:
          q = quantize(jnp.asarray(kernel, jnp.float32), E4M3, info.granularity,
                       spec.contracting_axes("rhs"))
        except ValueError as e:
          raise ExportError(f"site {name}: cannot store its weight {info.granularity}: {e}"
                            ) from e
        del node["kernel"]
        store["weight"], store["weight_scale"] = np.asarray(q.data), np.asarray(q.scale)
        if info.mode == FP8:  # an FP8 product reads it: contracted axes last
          axes = contraction_last(spec)
          order = [spec.rhs.index(c) for c in axes]
          store["weight"] = np.transpose(store["weight"], order)
          store["weight_scale"] = np.transpose(store["weight_scale"], order)
          info = dataclasses.replace(info, weight_axes=axes)
        weights_after += store["weight"].nbytes + store["weight_scale"].nbytes
    sites[name] = info
  variables = {"params": out_params}
  if exported:
    variables[EXPORT] = exported
  before, after = _nbytes(params), _nbytes(variables)
  memory = {"params_bytes": before, "exported_bytes": after, "saved_bytes": before - after,
            "saved_fraction": (before - after) / before if before else 0.0,
            "site_weight_bytes": weights_before, "site_weight_bytes_exported": weights_after}
  config_json, feature_dict = None, None
  if hasattr(target, "to_json") and hasattr(target, "model"):
    config_json = target.to_json()
    feats = features if features is not None else target.features
    feature_dict = (dataclasses.asdict(feats) if dataclasses.is_dataclass(feats)
                    else json.loads(json.dumps(dict(feats), default=list)))
  return ExportedModel(module, variables, sites, plan_json, memory, config_json, feature_dict)


def module_dtype(module, policy=None):
  """The compute dtype high-precision site weights are stored in."""
  if policy is not None:
    return policy.compute_dtype
  from loka_jax.precision import BF16
  config = getattr(getattr(module, "opts", None), "site", None) or getattr(module, "config",
                                                                            None)
  return getattr(getattr(config, "policy", None), "compute_dtype", BF16.compute_dtype)


# ----------------------------------------------------------------------------- loading


def _read_manifest(directory: str) -> Dict[str, Any]:
  path = os.path.join(directory, MANIFEST)
  if not os.path.exists(path):
    raise ExportError(f"{directory}: no {MANIFEST}; not an exported model, or its export did "
                      "not finish: export it again")
  manifest = jsonio.read_json(path, "export manifest", "export the model again", ExportError)
  if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
    raise ExportError(f"{path}: schema "
                      f"{manifest.get('schema') if isinstance(manifest, dict) else None!r}"
                      f" is not {SCHEMA!r}; export the model again")
  for key in ("arrays", "sites", "plan", "arrays_sha256"):
    if key not in manifest:
      raise ExportError(f"{path}: missing field {key!r}; export the model again")
  return manifest


def load(directory: str, target=None, *, policy=None, features=None) -> ExportedModel:
  """The ExportedModel saved in `directory`. `target` (preset config or module) is needed
  when the export was made from a module rather than a preset config."""
  manifest = _read_manifest(directory)
  path = os.path.join(directory, ARRAYS)
  if not os.path.exists(path):
    raise ExportError(f"{directory}: {ARRAYS} is missing; export the model again")
  if jsonio.file_sha256(path) != manifest["arrays_sha256"]:
    raise ExportError(f"{path}: checksum differs from the manifest's: the file is corrupt or "
                      "was replaced; export the model again")
  try:
    with np.load(path) as npz:
      stored = {k: npz[k] for k in npz.files}
  except Exception as e:  # zip / npy errors of a damaged file
    raise ExportError(f"{path}: unreadable ({type(e).__name__}: {e}); export the model again"
                      ) from e
  flat = {}
  for key, entry in manifest["arrays"].items():
    if entry["id"] not in stored:
      raise ExportError(f"{path}: array {key!r} is missing; export the model again")
    value = stored[entry["id"]]
    dtype = entry["dtype"]
    if dtype in _STORED:
      value = value.view(getattr(ml_dtypes, dtype))
    if list(value.shape) != entry["shape"] or str(value.dtype) != dtype:
      raise ExportError(f"{path}: array {key!r} is {value.dtype}{list(value.shape)}, the "
                        f"manifest says {dtype}{entry['shape']}; export the model again")
    flat[key] = value
  variables = flax.traverse_util.unflatten_dict(flat, sep="/")
  plan = manifest["plan"]
  if "kernel_plan" in plan:
    raise ExportError(f"{directory}: exported with an in-memory KernelPlan, which the manifest "
                      "cannot rebuild; export with a loka.plan/1 plan")
  if target is None:
    if not manifest.get("config"):
      raise ExportError(f"{directory}: exported from a module, not a preset config: pass the "
                        "model as `target`")
    import ml_collections
    target = ml_collections.ConfigDict(json.loads(manifest["config"]))
    if features is None and manifest.get("features"):
      from loka_jax.data.spec import FeatureSpec
      features = FeatureSpec.from_dict(manifest["features"])
  module = apply_plan(target, to_kernel_plan(plan), policy=policy, features=features)
  sites = {n: SiteExport(**s) for n, s in manifest["sites"].items()}
  return ExportedModel(module, variables, sites, plan, manifest.get("memory") or {},
                       manifest.get("config"), manifest.get("features"))


# Package-level names (`loka_jax.dispatch.export` is this module, so the function is
# re-exported there as `export_model`).
export_model = export
load_export = load
