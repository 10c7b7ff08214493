"""Where a step's device time goes: per GEMM site, per pass, per kernel class, and the time
outside the sites per name scope.

`profile_calls` runs argument-less step calls under `jax.profiler.trace` (a Perfetto trace),
`device_events` reads the device's kernel events (and op-line spans) back, and `split`
attributes each kernel to a GEMM site and pass through the compiled HLO: every HLO
instruction carries the jax name stack of the code it came from (`op_name="jit(train_step)/
transpose(jvp(Wukong))/layer_0/fmb/mlp/dense_0/..."`), so a kernel event naming its HLO
instruction (`hlo_op`), or covered by a device op-line span named by one, names its site,
and `transpose(` marks the backward pass (an instruction XLA made without an op_name, such
as the FP8 GEMM's transposed operand copy, takes its user's: `hlo_op_names`); each profile
records how many kernels mapped (`attribution`). Kernels are also classed by what they are
(cuBLASLt FP8 GEMM, cuBLAS/cuBLASLt GEMM, XLA's Triton GEMM, a Pallas kernel, a fusion, a
copy, ...) from their names, and the kernels outside every site by the module path of their
op_name (`scope_of`), which two programs with differently numbered fusions share. This is
the profile the headline benchmark asks for where a target is missed: the per-site time
split, which kernels ran, and what XLA fused.
"""
from __future__ import annotations

import bisect
import collections
import glob
import gzip
import json
import os
import re
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import jax

# (class, pattern on the kernel name), first match wins.
KERNEL_CLASSES = (
    ("pallas", r"^loka_"),  # every Pallas kernel of kernels_pallas is named loka_<kernel>
    # cuBLASLt's nvjet kernels spell operand types in their name: tst = bf16 x bf16, while
    # qq... / qr... (e4m3 / e5m2 operands) appear only in FP8 steps' profiles (H100, H200).
    ("gemm_fp8", r"e4m3|e5m2|f8f8|fp8|^nvjet_sm\d+_[qr][qr]"),
    ("gemm_xla_triton", r"^triton_gemm|gemm_fusion|__triton_gemm"),
    ("gemm_cublas", r"gemm|xmma|cutlass|cublas|matmul|sm90_|sm80_"),
    ("reduce_fusion", r"reduce|reduction"),
    ("fusion", r"fusion"),
    ("copy_or_transpose", r"copy|transpose|memcpy|memset"),
    ("collective", r"nccl|all_reduce|all-reduce|all_gather|reduce_scatter"),
)
_OP_NAME = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?op_name="([^"]+)"', re.M)
INSTRUCTION_LINE = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$', re.M)
REFERENCE = re.compile(r'%([\w.\-]+)')
_HOPS = 3


def kernel_class(name: str) -> str:
  lower = name.lower()
  for cls, pattern in KERNEL_CLASSES:
    if re.search(pattern, lower):
      return cls
  return "other"


def hlo_op_names(hlo_text: str, inherit: bool = True) -> Dict[str, str]:
  """{HLO instruction name: its op_name metadata} of a compiled module's text.

  XLA makes some instructions with no op_name of their own: the FP8 GEMM's transposed operand
  copies (`wrapped_transpose.N`: Hopper's FP8 GEMM takes only the "TN" layout, so a weight
  gradient's operands are copied transposed) and layout fusions. With `inherit`, such an
  instruction takes the op_name of its first user that has one (what it was made for: the
  copy belongs to the GEMM that reads it, with that GEMM's site and pass), else of its first
  operand, over up to `_HOPS` hops (a copy feeding a layout fusion feeding the GEMM).
  """
  own = {m.group(1): m.group(2) for m in _OP_NAME.finditer(hlo_text)}
  if not inherit:
    return own
  operands = {m.group(1): REFERENCE.findall(m.group(2).split("metadata=")[0])
              for m in INSTRUCTION_LINE.finditer(hlo_text)}
  users: Dict[str, List[str]] = collections.defaultdict(list)
  for name, refs in operands.items():
    for ref in refs:
      if ref in operands and ref != name:
        users[ref].append(name)
  out = dict(own)
  for _ in range(_HOPS):
    found = {}
    for name in operands:
      if name not in out:
        named = next((n for n in users[name] + operands[name] if n in out), None)
        if named is not None:
          found[name] = out[named]
    if not found:
      break
    out.update(found)
  return out


def site_of(op_name: str, sites: Iterable[str]) -> Optional[str]:
  """The GEMM site whose path appears in `op_name` (the longest, as paths nest)."""
  hits = [s for s in sites if f"/{s}/" in f"/{op_name}/"]
  return max(hits, key=len) if hits else None


def pass_of(op_name: str) -> str:
  return "backward" if "transpose(" in op_name else "forward"


_WRAPPER = re.compile(r"^(?:transpose|jvp|vmap|remat|checkpoint)\((.*)\)$")
# Control-flow frames of the name stack: not modules, so never part of a scope's path.
_CONTROL_FLOW = re.compile(r"^(?:cond|while|body|cond_fun|body_fun|branch_\d+_fun)$")
OUTSIDE_THE_MODEL = "(outside the model)"
# The training step applies its update under a `lax.cond` (never a non-finite update:
# `train.loop`), so what runs in a cond outside every module is the optimizer's update. At
# the large presets it is a fifth of the step (its update of the embedding tables' every
# row), worth its own row rather than a share of the loss's.
OPTIMIZER_UPDATE = "(optimizer update)"


def scope_of(op_name: Optional[str], depth: int = 2) -> str:
  """Where in the program a kernel outside the sites came from, coarse enough to compare
  two programs whose kernels are numbered differently: the op_name's module path cut to
  `depth` names (`jit(...)` frames and control-flow frames dropped, `jvp(...)` /
  `transpose(...)` unwrapped, the primitive itself dropped), with " (bwd)" for the backward
  pass. `jit(train_step)/transpose(jvp(DLRM))/embeddings/embeddings.bags/jit(_take)/
  scatter-add` is "DLRM/embeddings (bwd)"; the loss, outside every module, is "(outside the
  model)", and the guarded optimizer update (`jit(train_step)/cond/branch_1_fun/...`)
  "(optimizer update)"."""
  if not op_name:
    return "(no op name)"
  first = op_name.split(";")[0]  # a fusion of several ops names them all, ';'-separated
  path, guarded = [], False
  for frame in first.split("/")[:-1]:
    if frame.startswith("jit("):
      continue
    while (wrapped := _WRAPPER.match(frame)):
      frame = wrapped.group(1)
    if _CONTROL_FLOW.match(frame):
      guarded = guarded or (frame == "cond" and not path)
      continue
    if frame:
      path.append(frame)
  label = "/".join(path[:depth]) or (OPTIMIZER_UPDATE if guarded else OUTSIDE_THE_MODEL)
  return label + (" (bwd)" if pass_of(first) == "backward" else "")


def profile_calls(calls: Mapping[str, Callable[[], object]], logdir: str,
                  iterations: int = 5) -> str:
  """Runs each warm call `iterations` times under the profiler; returns the trace's path."""
  for call in calls.values():  # compiled and warm before tracing
    jax.block_until_ready(call())
  os.makedirs(logdir, exist_ok=True)
  with jax.profiler.trace(logdir, create_perfetto_trace=True):
    for name, call in calls.items():
      for _ in range(iterations):
        with jax.profiler.TraceAnnotation(f"loka_step:{name}"):
          jax.block_until_ready(call())
  found = sorted(glob.glob(os.path.join(logdir, "**", "perfetto_trace.json.gz"),
                           recursive=True), key=os.path.getmtime)
  if not found:
    raise FileNotFoundError(f"the profiler wrote no perfetto_trace.json.gz under {logdir}")
  return found[-1]


def _device_threads(events: Sequence[Mapping]) -> Dict[int, Dict[int, str]]:
  """{GPU pid: {tid: thread name}} from a trace's metadata events."""
  devices = {e["pid"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"
             and "/device:GPU" in str(e.get("args", {}).get("name", ""))}
  threads: Dict[int, Dict[int, str]] = {pid: {} for pid in devices}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "thread_name" and e.get("pid") in devices:
      threads[e["pid"]][e.get("tid")] = str(e.get("args", {}).get("name", ""))
  return threads


def _is_kernel_thread(name: str) -> bool:
  return "kernel" in name.lower() or "stream" in name.lower()


def device_events(trace_path: str) -> Tuple[List[Dict], List[Dict]]:
  """(kernels, op spans) of the GPU processes ('/device:GPU:*') of a Perfetto trace.

  kernels: [{name, dur_us, ts, pid, hlo_op, hlo_module, arg_keys}], the complete ('X') events
  of the device's kernel streams. Where the trace names a device's threads and some hold
  "Kernel" or "Stream", only those count: the device's other lines (e.g. one span per XLA
  op, named by its HLO instruction) cover the same time and become the op spans
  [{name, ts, end, pid}], which name the instruction of kernels whose own event does not.
  A trace with no GPU process (a CPU run) gives ([], []).
  """
  events = _trace_events(trace_path)
  streams = {pid: {tid for tid, name in named.items() if _is_kernel_thread(name)}
             for pid, named in _device_threads(events).items()}
  kernels, spans = [], []
  for e in events:
    pid = e.get("pid")
    if e.get("ph") != "X" or pid not in streams:
      continue
    ts = float(e.get("ts", 0.0))
    if streams[pid] and e.get("tid") not in streams[pid]:
      spans.append({"name": e.get("name", ""), "ts": ts,
                    "end": ts + float(e.get("dur", 0.0)), "pid": pid})
      continue
    args = e.get("args") or {}
    kernels.append({"name": e.get("name", ""), "dur_us": float(e.get("dur", 0.0)), "ts": ts,
                    "pid": pid, "hlo_op": args.get("hlo_op"), "tf_op": args.get("tf_op"),
                    "hlo_module": args.get("hlo_module"), "arg_keys": sorted(args)})
  return kernels, spans


def _trace_events(trace_path: str) -> List[Dict]:
  with gzip.open(trace_path, "rt") as f:
    data = json.load(f)
  return data["traceEvents"] if isinstance(data, dict) else data


def _span_index(spans: Sequence[Mapping], op_names: Mapping[str, str]) -> Dict:
  """{pid: (starts, spans in start order, longest span)} of the spans naming an instruction."""
  by_pid: Dict = {}
  for sp in sorted((sp for sp in spans if sp["name"] in op_names), key=lambda sp: sp["ts"]):
    by_pid.setdefault(sp["pid"], []).append(sp)
  return {pid: ([sp["ts"] for sp in ordered], ordered,
                max(sp["end"] - sp["ts"] for sp in ordered))
          for pid, ordered in by_pid.items()}


def _op_at(index: Mapping, pid, ts: float) -> Optional[str]:
  """The instruction of the innermost span covering `ts` on `pid`: spans nest, so it is the
  latest-starting one that still covers it (none starts earlier than the longest span)."""
  if pid not in index:
    return None
  starts, ordered, longest = index[pid]
  i = bisect.bisect_right(starts, ts) - 1
  while i >= 0 and starts[i] >= ts - longest:
    if ordered[i]["end"] > ts:
      return ordered[i]["name"]
    i -= 1
  return None


def _normal(name: str) -> str:
  """An instruction name as a kernel or trace may spell it: no '%', '_' for '.' and '-'
  (XLA names an emitted kernel after its instruction, `loop_convert_fusion.3` ->
  `loop_convert_fusion_3`)."""
  return name.lstrip("%").replace(".", "_").replace("-", "_")


def _instruction(event: Mapping, op_names: Mapping[str, str], normal: Mapping[str, str],
                 index: Mapping) -> Optional[str]:
  """The module instruction a kernel ran: its `hlo_op` arg (as spelled, or normalized), else
  the innermost op span covering its start, else its own name normalized."""
  hlo_op = event.get("hlo_op")
  if hlo_op in op_names:
    return hlo_op
  if hlo_op and _normal(hlo_op) in normal:
    return normal[_normal(hlo_op)]
  return (_op_at(index, event.get("pid"), event.get("ts", 0.0))
          or normal.get(_normal(event.get("name", ""))))


def split(events: Sequence[Mapping], op_names: Mapping[str, str], sites: Iterable[str],
          steps: int, top: int = 15, spans: Sequence[Mapping] = (),
          top_in_scope: int = 5) -> Dict:
  """Per-step device time by site and pass, by kernel class and by kernel (top `top`), and
  outside the sites by name scope (each scope's kernels per step and its top `top_in_scope`).

  A kernel names its HLO instruction through its `hlo_op` arg, else through the innermost op
  span (`device_events`) covering its start, else through its own name (`_instruction`); the
  instruction's op_name metadata in the compiled module names the site. Where the module's
  text has none for it, the event's own `tf_op` arg (the profiler's copy of that metadata)
  does."""
  sites = list(sites)
  normal = {_normal(k): k for k in op_names}
  unmatched: List[str] = []
  by_site: Dict[str, Dict[str, float]] = collections.defaultdict(
      lambda: {"forward": 0.0, "backward": 0.0})
  by_class: Dict[str, float] = collections.Counter()
  by_kernel: Dict[str, float] = collections.Counter()
  by_scope: Dict[str, float] = collections.Counter()  # the time outside the sites
  in_scope: Dict[str, Dict[str, float]] = collections.defaultdict(collections.Counter)
  launches: Dict[str, int] = collections.Counter()
  total = unattributed = 0.0
  with_op = in_module = with_tf_op = 0
  arg_keys = set()
  index = _span_index(spans, op_names)
  seen: Dict[str, Dict] = {}
  for e in events:
    arg_keys.update(e.get("arg_keys") or ())
    with_op += bool(e.get("hlo_op"))
    hlo_op = _instruction(e, op_names, normal, index)
    in_module += hlo_op is not None
    if hlo_op is None and e.get("hlo_op") and len(unmatched) < 5 \
        and e["hlo_op"] not in unmatched:
      unmatched.append(e["hlo_op"])
    us = e["dur_us"] / steps
    total += us
    by_class[kernel_class(e["name"])] += us
    by_kernel[e["name"]] += us
    op_name = op_names.get(hlo_op or "") or e.get("tf_op")
    with_tf_op += bool(e.get("tf_op"))
    site = site_of(op_name, sites) if op_name else None
    # What the top kernels were mapped through, so an unsplit profile shows why at a glance.
    seen.setdefault(e["name"], {"hlo_op": e.get("hlo_op"), "op_name": op_name, "site": site})
    if site is None:
      unattributed += us
      scope = scope_of(op_name)
      by_scope[scope] += us
      in_scope[scope][e["name"]] += us
      launches[scope] += 1
    else:
      by_site[site][pass_of(op_name)] += us
  return {"steps": steps, "device_us_per_step": total,
          "sites_us": {s: dict(v) for s, v in sorted(by_site.items())},
          "outside_sites_us": unattributed,
          # Where that time went, so two programs' extra time outside the sites can be
          # compared scope by scope (their fusions are numbered differently).
          "outside_by_scope_us": dict(by_scope.most_common()),
          # What each scope ran: how many kernels a step, and the largest, so a scope that
          # grew shows whether it ran more kernels or slower ones.
          "outside_scope_kernels": {
              scope: {"kernels_per_step": launches[scope] / steps,
                      "top": [{"name": n, "us": us, "hlo_op": seen[n]["hlo_op"]}
                              for n, us in in_scope[scope].most_common(top_in_scope)]}
              for scope, _ in by_scope.most_common()},
          # Why kernels did or did not map to sites: how many named an HLO instruction, how
          # many of those the compiled module has, and which event args the trace carried.
          "attribution": {"kernel_events": len(events), "with_hlo_op": with_op,
                          "hlo_op_in_module": in_module, "with_tf_op": with_tf_op,
                          "arg_keys": sorted(arg_keys),
                          "op_spans": len(spans),
                          # Examples of both sides, to see a naming mismatch at a glance.
                          "unmatched_hlo_ops": unmatched,
                          "module_instructions": sorted(op_names)[:5]},
          "classes_us": dict(by_class.most_common()),
          "top_kernels_us": [{"name": n, "us": us, "class": kernel_class(n), **seen[n]}
                             for n, us in by_kernel.most_common(top)]}


def markdown(profiles: Mapping[str, Mapping]) -> str:
  """Side-by-side tables of several profiled steps (e.g. bf16 vs the plan, train and infer)."""
  names = list(profiles)
  lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names),
           "| device us / step | " + " | ".join(
               f"{profiles[n]['device_us_per_step']:,.0f}" for n in names) + " |"]
  classes = sorted({c for p in profiles.values() for c in p["classes_us"]})
  lines += [f"| {c} | " + " | ".join(f"{profiles[n]['classes_us'].get(c, 0.0):,.0f}"
                                     for n in names) + " |" for c in classes]
  sites = sorted({s for p in profiles.values() for s in p["sites_us"]})
  lines += ["", "| site (fwd / bwd us) | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names)]
  for s in sites:
    cells = []
    for n in names:
      v = profiles[n]["sites_us"].get(s)
      cells.append("-" if v is None else f"{v['forward']:,.0f} / {v['backward']:,.0f}")
    lines.append(f"| {s} | " + " | ".join(cells) + " |")
  lines.append("| outside the sites | " + " | ".join(
      f"{profiles[n]['outside_sites_us']:,.0f}" for n in names) + " |")
  lines += _scope_table(profiles, names)
  lines += _scope_differences(profiles, names)
  for n in names:
    a = profiles[n].get("attribution")
    if a and not profiles[n]["sites_us"] and a["kernel_events"]:
      lines += ["", f"{n}: no kernel mapped to a site: {a['with_hlo_op']} of "
                f"{a['kernel_events']} kernel events named an HLO instruction, "
                f"{a['hlo_op_in_module']} mapped to one of the compiled module's (own arg "
                f"or one of {a.get('op_spans', 0)} op spans); event args: "
                f"{', '.join(a['arg_keys']) or 'none'}."]
      if a.get("unmatched_hlo_ops"):
        lines.append(f"Unmatched hlo_op args, e.g. {', '.join(a['unmatched_hlo_ops'])}; the "
                     f"module's instructions, e.g. {', '.join(a['module_instructions'])}.")
  for n in names:
    lines += ["", f"Top kernels, {n}:", "",
              "| kernel | class | us / step | site (or the HLO op it named) |",
              "|---|---|---|---|"]
    lines += [f"| `{k['name'][:90]}` | {k['class']} | {k['us']:,.1f} | {_mapped_to(k)} |"
              for k in profiles[n]["top_kernels_us"]]
  return "\n".join(lines)


def _ranked_scopes(profiles: Iterable[Mapping]) -> List[str]:
  """Every scope outside the sites, largest first by its largest value in any profile (a
  profile written before the split by scope has none)."""
  profiles = list(profiles)
  scopes = {s for p in profiles for s in p.get("outside_by_scope_us", {})}
  return sorted(scopes, key=lambda s: (-max(p.get("outside_by_scope_us", {}).get(s, 0.0)
                                            for p in profiles), s))


def _scope_table(profiles: Mapping[str, Mapping], names: Sequence[str],
                 top: int = 12) -> List[str]:
  """The time outside the sites by name scope: the `top` scopes by their largest value in any
  profile, the rest summed. Profiles written before the split by scope are left out."""
  have = [n for n in names if "outside_by_scope_us" in profiles[n]]
  if not have:
    return []
  ranked = _ranked_scopes(profiles[n] for n in have)
  lines = ["", "Outside the sites, by name scope (us / step):", "",
           "| scope | " + " | ".join(have) + " |", "|---|" + "---|" * len(have)]
  for s in ranked[:top]:
    lines.append(f"| {s} | " + " | ".join(
        f"{profiles[n]['outside_by_scope_us'].get(s, 0.0):,.0f}" for n in have) + " |")
  if len(ranked) > top:
    lines.append(f"| {len(ranked) - top} other scopes | " + " | ".join(
        f"{sum(profiles[n]['outside_by_scope_us'].get(s, 0.0) for s in ranked[top:]):,.0f}"
        for n in have) + " |")
  return lines


SITES_FWD, SITES_BWD = "GEMM sites, forward", "GEMM sites, backward"
OTHER_OUTSIDE = "other scopes outside the sites"


def step_parts(profiles: Mapping[str, Mapping], scopes: int = 4
               ) -> Tuple[List[str], Dict[str, List[float]]]:
  """(part labels, {profile: us per part}): each profiled step's device time in parts that
  sum to it, the same parts for every profile so they can be drawn side by side: the GEMM
  sites' forward and backward, the `scopes` scopes outside the sites with the largest value
  in any profile, and the rest outside the sites (all of it for a profile written before the
  split by scope)."""
  ranked = _ranked_scopes(profiles.values())[:scopes]
  labels = [SITES_FWD, SITES_BWD, *ranked, OTHER_OUTSIDE]
  parts = {}
  for name, p in profiles.items():
    fwd = sum(v["forward"] for v in p["sites_us"].values())
    bwd = sum(v["backward"] for v in p["sites_us"].values())
    by_scope = p.get("outside_by_scope_us", {})
    named = [by_scope.get(s, 0.0) for s in ranked]
    parts[name] = [fwd, bwd, *named, p["outside_sites_us"] - sum(named)]
  return labels, parts


def _scope_differences(profiles: Mapping[str, Mapping], names: Sequence[str],
                       scopes: int = 3, min_spread_us: float = 50.0) -> List[str]:
  """The scopes outside the sites whose time differs most between the profiles (at least
  `min_spread_us` between the largest and the smallest, the `scopes` largest such), each with
  what every profile ran there: kernels per step, time, and its largest kernels. Comparing a
  scope's kernels says whether a program runs more of them or the same ones slower."""
  have = [n for n in names if "outside_scope_kernels" in profiles[n]]
  if len(have) < 2:
    return []
  spread = {}
  for s in {s for n in have for s in profiles[n]["outside_by_scope_us"]}:
    values = [profiles[n]["outside_by_scope_us"].get(s, 0.0) for n in have]
    if max(values) - min(values) >= min_spread_us:
      spread[s] = max(values) - min(values)
  lines = []
  for s in sorted(spread, key=lambda s: (-spread[s], s))[:scopes]:
    lines += ["", f"What ran in `{s}` (differs by {spread[s]:,.0f} us / step):", "",
              "| profile | kernels / step | us / step | largest kernels (us / step) |",
              "|---|---|---|---|"]
    for n in have:
      ran = profiles[n]["outside_scope_kernels"].get(s)
      if ran is None:
        lines.append(f"| {n} | 0 | 0 | - |")
        continue
      top = ", ".join(f"`{k['name'][:60]}` {k['us']:,.1f}" for k in ran["top"])
      lines.append(f"| {n} | {ran['kernels_per_step']:,.1f} | "
                   f"{profiles[n]['outside_by_scope_us'][s]:,.0f} | {top} |")
  return lines


def _mapped_to(kernel: Mapping) -> str:
  """A top kernel's site, else the HLO op its event named (older profiles have neither)."""
  if kernel.get("site"):
    return kernel["site"]
  return f"`{kernel['hlo_op']}` (no site)" if kernel.get("hlo_op") else "-"
