"""Resource report of the Pallas Triton FP8 GEMM kernels for sm_90, compiled without a GPU.

Each kernel is traced and lowered for 'cuda' under an abstract H100 (as
tests/kernels/test_pallas_gemm.py::TritonLoweringTest does); the Triton module jax builds for
the `__gpu$xla.gpu.triton` custom call is captured as TTIR text and compiled by the pip `triton`
package for GPUTarget('cuda', 90, 32) with the config's num_warps/num_stages; `ptxas -v`
(bundled with triton) gives registers and spills. The what-if column recompiles the same TTIR
with `maxNumImpreciseAcc` set on the fp8 `tt.dot` (jax's lowering never sets it, and Triton
only picks wgmma (MMAv3) for an fp8 dot with an f32 accumulator when it is >= 32).

Needs Python >= 3.12 with jax >= 0.11 (abstract GPU devices) and `triton==3.6.0` (its wheel
bundles ptxas); no GPU. Not part of the CI environment (jax 0.10, no triton):

  python3 -m experiments.measure kernel_resources --out=docs/results/kernel_resources_sm90.md
"""
from __future__ import annotations

import datetime
import os
import re
import subprocess
import tempfile

import jax
import jax.numpy as jnp
from absl import app, flags

from kernels_pallas import compat
from kernels_pallas import epilogue as ep_lib
from kernels_pallas import gemm as gemm_lib
from kernels_pallas.tuning import TileConfig

SHAPES = ((2048, 256, 768), (4096, 512, 512), (2048, 1024, 1024), (8192, 1024, 1024),
          (2048, 4096, 1024), (2048, 16384, 1024), (2048, 123200, 1024))  # M, K, N
FUSED = ep_lib.Epilogue(block_size=256, activation="hard_swish", quantize_output=True)
PLAIN = ep_lib.Epilogue()


def _cfg(bm, bn, bk, warps, stages, n_sub=1):
  return TileConfig(block_m=bm, block_n=bn, block_k=bk, n_sub=n_sub, num_warps=warps,
                    num_stages=stages, batch_per_program=1)


# Autotuner winners measured on H200 (2026-11-26), keyed by (M, K, N).
TUNED = {
    "rowwise": {(2048, 256, 768): _cfg(32, 128, 128, 4, 4),
                (2048, 1024, 1024): _cfg(64, 128, 128, 4, 3),
                (8192, 1024, 1024): _cfg(128, 128, 64, 4, 4),
                (2048, 16384, 1024): _cfg(128, 128, 64, 4, 4),
                (2048, 123200, 1024): _cfg(128, 128, 128, 8, 3)},
    "fused": {(2048, 256, 768): _cfg(16, 256, 32, 4, 3, n_sub=3),
              (8192, 1024, 1024): _cfg(32, 256, 32, 8, 3, n_sub=4)},
}

# sm_90 (H100/H200 SXM) per-SM limits.
NUM_SMS, REGS_PER_SM, MAX_WARPS_PER_SM, MAX_BLOCKS_PER_SM = 132, 65536, 64, 32
SMEM_PER_SM, SMEM_RESERVED_PER_BLOCK = 228 * 1024, 1024
NOTES = """\
Columns: config `bm x bn[x n_sub] kK wW sS` (TileConfig block_m, block_n, n_sub, block_k,
num_warps, num_stages); grid programs = programs launched (batch 1); programs / 132 SMs = waves
at one program per SM; regs/thread, spills (stores + loads) from `ptxas -v`; smem = Triton's
dynamic shared memory (`metadata.shared`); smem model = `gemm.shared_memory_bytes` (the
project's estimate used by `validate_config`); programs/SM = resident programs per SM from
registers (64K/SM), shared memory (228 KiB/SM, 1 KiB reserved per block) and warps (64/SM);
waves = grid / (132 * programs/SM); MMA instruction = tensor-core instructions in the PTX;
fp8->f16 cvt = static count of `cvt.rn.f16x2.e4m3x2` (fp8 operands upcast before `mma.sync`).
What-if: the same TTIR recompiled with `maxNumImpreciseAcc` on the fp8 `tt.dot` (not reachable
from Pallas today: jax's `_dot_general_lowering` never sets it, so it is 0, and Triton's
`supportMMA(DotOp, 3)` refuses MMAv3/wgmma for an fp8 dot with an f32 accumulator when it is
< 32). wgmma also needs block_m % 64 == 0 and num_warps % 4 == 0. What-if acc in dot: jax
lowers `accs + pl.dot(a, b)` to `tt.dot(a, b, zeros)` + `arith.addf`, which Triton keeps
(two live accumulators); the rewrite feeds the running accumulator to `tt.dot` (what a native
Triton GEMM's `tl.dot(a, b, acc)` does). Blockwise scales multiply each partial product, so
nothing folds there. Both: the two rewrites together. None of the what-ifs ran on a GPU.
Caveat: the H200 runs compile the same TTIR with XLA's bundled Triton and ptxas, not pip
triton; the instruction choice follows the same Triton check, exact register counts may differ.
"""


def _triton():
  """(the pip triton package, its sm_90 target, that target's arch name, its bundled ptxas),
  imported on first use so that --help runs where triton is not installed."""
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.backends.nvidia.compiler import sm_arch_from_capability
  target = GPUTarget("cuda", 90, 32)
  ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
  return triton, target, sm_arch_from_capability(target.arch), ptxas


def lower_to_ttir(kernel, M, K, N, cfg):
  """(TTIR text, grid) of one gemm launch, lowered for 'cuda' on a CPU machine."""
  f8, f32, s = jnp.float8_e4m3fn, jnp.float32, jax.ShapeDtypeStruct
  if kernel == "blockwise":
    nkb = -(-K // 128)
    sa, sb, scales = s((1, nkb, M), f32), s((1, nkb, N), f32), gemm_lib.BLOCK_SCALES
  else:
    sa, sb, scales = s((1, M), f32), s((1, N), f32), gemm_lib.ROWWISE_SCALES
  ep = FUSED if kernel == "fused" else PLAIN
  fn = lambda a, b, x, y: gemm_lib.gemm(a, b, x, y, scales=scales, epilogue=ep, config=cfg)
  [(ttir, grid)] = compat.triton_modules(fn, s((1, M, K), f8), s((1, K, N), f8), sa, sb)
  return ttir, grid


def with_imprecise_acc(ttir, n):
  return re.sub(r"(tt\.dot [^:\n]*?inputPrecision = \w+)",
                rf"\1 {{maxNumImpreciseAcc = {n} : i32}}", ttir)


_DOT_ADD = re.compile(r"^(\s*)%(\w+) = tt\.dot (%\w+), (%\w+), %\w+, ([^\n]*)\n"
                      r"\s*%(\w+) = arith\.addf (%\w+), %\2 : [^\n]*\n", re.M)


def with_acc_in_dot(ttir):
  """`acc + dot(a, b, 0)` (what jax emits for `accs + pl.dot(...)`) -> `dot(a, b, acc)`."""
  def fold(m):
    if len(re.findall(rf"%{m.group(2)}\b", ttir)) != 2:  # the dot has another use
      return m.group(0)
    return f"{m.group(1)}%{m.group(6)} = tt.dot {m.group(3)}, {m.group(4)}, {m.group(7)}, " \
           f"{m.group(5)}\n"
  return _DOT_ADD.sub(fold, ttir)


def compile_sm90(ttir, cfg, dump_prefix=None):
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "kernel.ttir")
    with open(path, "w") as f:
      f.write(ttir)
    triton, target, arch, ptxas = _triton()
    k = triton.compile(path, target=target,
                       options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    ptx = k.asm["ptx"]
    ptx_path = os.path.join(tmp, "kernel.ptx")
    with open(ptx_path, "w") as f:
      f.write(ptx)
    log = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", ptx_path, "-o",
                          os.path.join(tmp, "kernel.o")], capture_output=True, text=True,
                         check=True).stderr
  if dump_prefix:
    for ext in ("ttir", "ttgir", "ptx"):
      with open(f"{dump_prefix}.{ext}", "w") as f:
        f.write(k.asm[ext])
  regs = int(re.search(r"Used (\d+) registers", log).group(1))
  spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
  mma = sorted(set(re.findall(r"(?:wgmma\.mma_async|mma\.sync)[\w.]*", ptx)))
  short = ", ".join(m.replace("wgmma.mma_async.sync.aligned.", "wgmma ")
                    .replace("mma.sync.aligned.", "mma.sync ") for m in mma) or "none"
  return dict(regs=regs, spills=spills, smem=int(k.metadata.shared), mma=short,
              wgmma="wgmma" in ptx, e4m3_mma=bool(re.search(r"(?:mma\.sync|wgmma)\S*e4m3", ptx)),
              cvt_e4m3=len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", ptx)))


def programs_per_sm(cfg, regs, smem):
  regs_per_warp = -(-regs * 32 // 256) * 256  # allocated per warp in units of 256
  by_regs = (REGS_PER_SM // regs_per_warp) // cfg.num_warps
  by_smem = SMEM_PER_SM // (smem + SMEM_RESERVED_PER_BLOCK)
  return max(0, min(by_regs, by_smem, MAX_WARPS_PER_SM // cfg.num_warps, MAX_BLOCKS_PER_SM))


def cases(kernels):
  for kernel in kernels:
    for M, K, N in SHAPES:
      if kernel == "fused" and (K > 1024 or N > 1024):
        continue
      ep = FUSED if kernel == "fused" else PLAIN
      scales = gemm_lib.BLOCK_SCALES if kernel == "blockwise" else gemm_lib.ROWWISE_SCALES
      default = gemm_lib.default_config((1, M, N, K), ep, scales)
      yield kernel, (M, K, N), "default", default
      tuned = TUNED.get(kernel, {}).get((M, K, N))
      if tuned is not None:
        yield kernel, (M, K, N), "tuned", tuned


def cfg_str(c):
  return (f"{c.block_m}x{c.block_n}" + (f"x{c.n_sub}" if c.n_sub > 1 else "") +
          f" k{c.block_k} w{c.num_warps} s{c.num_stages}")


OUT = flags.DEFINE_string("out", "", "Write the markdown report here.")
KERNELS = flags.DEFINE_list("kernels", ["rowwise", "blockwise", "fused"], "Kernel families.")
WHAT_IF_ACC = flags.DEFINE_integer(
    "what_if_acc", 1 << 30, "maxNumImpreciseAcc of the what-if compiles (Triton's own tl.dot "
    "default for fp8 on sm_90); 0 skips the what-if columns.")
DATE = flags.DEFINE_string("date", datetime.date.today().isoformat(), "Date in the header.")
DUMP_DIR = flags.DEFINE_string("dump_dir", "", "Also write ttir/ttgir/ptx per kernel here.")


def main(argv):
  del argv
  if DUMP_DIR.value:
    os.makedirs(DUMP_DIR.value, exist_ok=True)
  header = ("| kernel | M x K x N | config | bm x bn[x n_sub] kK warps stages | grid programs "
            "| programs / 132 SMs | regs/thread | spills (B) | smem (B) | smem model (B) "
            "| programs/SM | waves "
            "| MMA instruction | fp8->f16 cvt |")
  what_ifs = {}
  if WHAT_IF_ACC.value:
    what_ifs["maxNumImpreciseAcc"] = lambda t: with_imprecise_acc(t, WHAT_IF_ACC.value)
    what_ifs["acc in dot"] = with_acc_in_dot
    what_ifs["both"] = lambda t: with_acc_in_dot(with_imprecise_acc(t, WHAT_IF_ACC.value))
  for name in what_ifs:
    header += f" what-if {name}: regs / spills / smem / MMA |"
  rows = [header, "|" + "---|" * (header.count("|") - 1)]
  findings = []
  for kernel, (M, K, N), which, cfg in cases(KERNELS.value):
    problem = gemm_lib.validate_config(cfg, (1, M, N, K), FUSED if kernel == "fused" else PLAIN,
                                       gemm_lib.BLOCK_SCALES if kernel == "blockwise"
                                       else gemm_lib.ROWWISE_SCALES)
    shape = f"{M}x{K}x{N}"
    if problem:
      rows.append(f"| {kernel} | {shape} | {which} | {cfg_str(cfg)} | invalid: {problem} |")
      continue
    ttir, grid = lower_to_ttir(kernel, M, K, N, cfg)
    prefix = (os.path.join(DUMP_DIR.value, f"{kernel}_{shape}_{which}") if DUMP_DIR.value
              else None)
    r = compile_sm90(ttir, cfg, prefix)
    per_sm = programs_per_sm(cfg, r["regs"], r["smem"])
    waves = grid / (NUM_SMS * per_sm) if per_sm else float("inf")
    row = (f"| {kernel} | {shape} | {which} | {cfg_str(cfg)} | {grid} | {grid / NUM_SMS:.2f} "
           f"| {r['regs']} | {r['spills']} | {r['smem']} | {gemm_lib.shared_memory_bytes(cfg)} "
           f"| {per_sm} | {waves:.2f} "
           f"| {r['mma']} | {r['cvt_e4m3']} |")
    for name, rewrite in what_ifs.items():
      patched = rewrite(ttir)
      if patched == ttir:
        row += " (no change) |"
        continue
      w = compile_sm90(patched, cfg)
      kind = "wgmma" if w["wgmma"] else "mma.sync"
      row += f" {w['regs']} / {w['spills']} / {w['smem']} / {kind} |"
    rows.append(row)
    findings.append((r["wgmma"], r["e4m3_mma"]))
    print(row, flush=True)
  n_wgmma = sum(f[0] for f in findings)
  n_e4m3 = sum(f[1] for f in findings)
  summary = (f"{len(findings)} kernels compiled: {n_wgmma} emit wgmma, {n_e4m3} use an e4m3 MMA "
             f"instruction; the rest run `mma.sync` on fp8 operands upcast to f16.")
  table = "\n".join(rows)
  print(table)
  print(summary)
  if OUT.value:
    with open(OUT.value, "w") as f:
      f.write(f"# Pallas Triton FP8 GEMM resources on sm_90 ({DATE.value})\n\n"
              f"Compiled for sm_90 on a CPU machine, no GPU run. jax {jax.__version__}, "
              f"triton {_triton()[0].__version__} (bundled ptxas). Produced by "
              f"`experiments/tools/kernel_resources.py` (Python 3.12, jax 0.11, triton 3.6, "
              f"no GPU):\n\n"
              f"    python3 -m experiments.measure kernel_resources --date={DATE.value} "
              f"--out={OUT.value}\n\n"
              f"{NOTES}\n{summary}\n\n{table}\n")

