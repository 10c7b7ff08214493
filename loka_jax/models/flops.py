"""Forward FLOPs per example of every GEMM site of a tower (`tower_flops`), from the
towers' equations (each model module states its own): 2 per multiply-add; embedding gathers,
norms, activations and softmax not counted (a training step costs about 3x)."""
from __future__ import annotations

from typing import Sequence

from loka_jax.data.spec import FeatureSpec
from loka_jax.models import embedding
from loka_jax.models.build import MODEL_NAMES, as_feature_spec, check_name, interformer_arch, ints
from loka_jax.models.interformer import InterFormerArch


def _mlp_flops(width_in: int, widths: Sequence[int], rows: int = 1) -> int:
  total, prev = 0, width_in
  for w in widths:
    total += 2 * rows * prev * w
    prev = w
  return total


def _token_linear_flops(n_in: int, n_out: int, d: int) -> int:
  return 2 * n_in * n_out * d


def _cross_flops(width: int, rank: int) -> int:
  return 2 * width * width if rank <= 0 else 4 * width * rank


def _self_attention_flops(length: int, d: int, queries: int = None) -> int:
  """Projections and the two act x act products (scores, context). Self-attention projects
  q, k, v and out; PMA (`queries` learnable seeds) projects only k, v and out."""
  if queries is None:
    return 8 * length * d * d + 4 * length * length * d
  return 2 * d * d * (2 * length + queries) + 4 * queries * length * d


def _dhen_layer_flops(n: int, n_out: int, d: int, modules, ensemble, dot_mlp, ffn,
                      dcn_rank) -> int:
  total = 0
  proj = 0 if n == n_out else _token_linear_flops(n, n_out, d)
  for m in modules:
    if m == "dot":
      total += 2 * n * n * d + _mlp_flops(n * (n - 1) // 2, tuple(dot_mlp) + (n_out * d,))
    elif m == "attention":
      total += _self_attention_flops(n, d) + _mlp_flops(d, (ffn, d), rows=n) + proj
    elif m == "dcn":
      total += _cross_flops(n * d, dcn_rank) + proj
    else:
      total += _token_linear_flops(n, n_out, d)
  if ensemble == "concat":
    total += _token_linear_flops(len(modules) * n_out, n_out, d)
  return total + proj  # the shortcut


def tower_flops(config, features) -> int:
  """Forward FLOPs per example of every GEMM site of the tower (2 per multiply-add)."""
  features = as_feature_spec(features)
  model = check_name("model", config.model, MODEL_NAMES)
  d = int(config.embed_dim)
  dense_tokens = 1 if model in ("dlrm", "dcnv2") else int(config.dense_tokens)
  n = embedding.num_input_tokens(features, dense_tokens)
  total = 0
  if features.num_dense:
    total += _mlp_flops(features.num_dense, ints(config.bottom_mlp) + (dense_tokens * d,))
  if model == "dlrm":
    top_in = n * (n - 1) // 2 + (d if features.num_dense else 0)
    return total + 2 * n * n * d + _mlp_flops(top_in, ints(config.top_mlp) + (1,))
  if model == "dcnv2":
    width = n * d
    total += int(config.num_cross_layers) * _cross_flops(width, int(config.cross_rank))
    return total + _mlp_flops(width, ints(config.top_mlp) + (1,))
  if model == "wukong":
    n_f, n_l, k = int(config.fmb_tokens), int(config.lcb_tokens), int(config.fm_rank)
    for _ in range(int(config.num_layers)):
      fm = 4 * n * d * k                                   # P = X^T Y and F = X P
      if config.attentive_y:
        fm += _mlp_flops(d, (k, k), rows=n)                # Y from X
      total += fm + _mlp_flops(n * k, ints(config.fmb_mlp) + (n_f * d,))
      total += _token_linear_flops(n, n_l, d)              # LCB
      if n != n_f + n_l:
        total += _token_linear_flops(n, n_f + n_l, d)      # residual projection
      n = n_f + n_l
    return total + _mlp_flops(n * d, ints(config.head_mlp) + (1,))
  if model == "dhen":
    for _ in range(int(config.num_layers)):
      n_out = int(config.layer_tokens) or n
      total += _dhen_layer_flops(n, n_out, d, tuple(config.modules), config.ensemble,
                                 ints(config.dot_mlp), int(config.attention_ffn),
                                 int(config.dcn_rank))
      n = n_out
    return total + _mlp_flops(n * d, ints(config.head_mlp) + (1,))
  return total + _interformer_flops(interformer_arch(config), features, n, d)


def _interformer_flops(arch: InterFormerArch, features: FeatureSpec, n: int, d: int) -> int:
  attrs, length = features.num_seq, features.seq_len
  seq_tokens = arch.num_cls + length
  m = arch.summary_tokens
  total = 0
  if arch.seq_merge == "masknet":
    total += _mlp_flops(attrs * d, arch.masknet_hidden + (attrs * d,), rows=length)
    total += _mlp_flops(attrs * d, (d,), rows=length)

  def cross():
    flops = _token_linear_flops(n, arch.num_cls, d)
    flops += _mlp_flops(arch.num_cls * d, arch.gate_mlp + (arch.num_cls * d,))
    flops += _self_attention_flops(seq_tokens, d, queries=arch.num_pma)
    return flops + _mlp_flops(m * d, arch.gate_mlp + (m * d,))

  for _ in range(arch.num_layers):
    total += cross()
    total += _dhen_layer_flops(n + m, n, d, arch.interaction_modules, arch.ensemble,
                               arch.dot_mlp, arch.attention_ffn, arch.dcn_rank)
    total += _mlp_flops(d, arch.interaction_mlp + (d,), rows=n)
    total += _mlp_flops(arch.num_cls * d, (d * d,))               # W_p = X_sum W
    total += 2 * seq_tokens * d * d                               # S W_p
    total += _self_attention_flops(seq_tokens, d)
  total += cross()
  return total + _mlp_flops((arch.num_cls + m) * d, arch.head_mlp + (1,))
