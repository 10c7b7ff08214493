"""Tower presets (`tiny`, `small`, `large`), model construction, Mods, FLOP counts.

`get_config(model, preset)` returns an ml_collections ConfigDict with a comment on every key;
`build_model(config, features, site_config)` turns it into a Linen module whose
`__call__(batch, *, train=False)` returns float32 logits [B]; `apply_mods` switches Mods on;
`tower_flops(config, features)` counts the forward FLOPs per example of every GEMM site from
the equations in MODELS.md (2 per multiply-add; embedding gathers, norms, activations and
softmax not counted; a training step costs about 3x).

Preset regimes: `tiny` runs in CPU tests; `small` is the recommendation regime where FP8
struggles (widths 128-1024); `large` targets one 80 GB GPU at batch 4096 (InterFormer: 512,
because attention over 516 sequence tokens materializes B x heads x 516^2 scores).

Forward FLOPs per example (`flops_per_example`, default features; kept true by the tests):

| model       | tiny    | small  | large  |
|-------------|---------|--------|--------|
| dlrm        | 14,944  | 4.92 M | 61.2 M |
| dcnv2       | 33,344  | 32.1 M | 399 M  |
| wukong      | 35,264  | 51.6 M | 6.12 G |
| dhen        | 177,216 | 104 M  | 1.48 G |
| interformer | 828,864 | 317 M  | 5.50 G |

Wukong large (l=8, n_F=n_L=96, k=96, FMB MLP 3x8192) is 6.1 GFLOP forward, ~18 GFLOP per
trained example, near the public 22 GFLOP scale point; it holds 3.0 B dense parameters
(~48 GB with fp32 parameters, gradients and Adam state), meant to fit one 80 GB GPU beside
its activations at batch 4096.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Any, Callable, Dict, Mapping, NamedTuple, Sequence, Tuple, Union

import flax.linen as nn
import jax
import ml_collections

from loka_jax.data.spec import FeatureSpec
from loka_jax.mods import NORMS
from loka_jax.models import embedding
from loka_jax.models.dcnv2 import DCNv2
from loka_jax.models.dhen import DHEN, MODULES as DHEN_MODULES
from loka_jax.models.dlrm import DLRM
from loka_jax.models.interformer import InterFormer, InterFormerArch
from loka_jax.models.layers import TowerOptions
from loka_jax.models.site import ActSite, DenseSite, EinsumSite, SiteConfig, site_name
from loka_jax.models.wukong import Wukong
from loka_jax.kernels import ACT_ACT, ACT_WEIGHT, EinsumSpec

MODEL_NAMES = ("dlrm", "dcnv2", "wukong", "dhen", "interformer")
PRESETS = ("tiny", "small", "large")
MODS = ("no_bias", "blocknorm", "hard_swish")

# Cardinalities of the 26 categorical columns of the public Criteo display-ads data: realistic,
# very uneven table sizes for the synthetic default feature sets (capped per preset).
CRITEO_VOCABS = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593,
                 3194, 27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105,
                 142572)
VOCAB_CAP = 100_000  # rows per table at small/large, so tables fit beside the towers

# The documented forward FLOPs per example of every preset (see the table above).
DOCUMENTED_FLOPS = {
    ("dlrm", "tiny"): 14_944, ("dlrm", "small"): 4_916_992, ("dlrm", "large"): 61_211_136,
    ("dcnv2", "tiny"): 33_344, ("dcnv2", "small"): 32_060_928,
    ("dcnv2", "large"): 399_142_912,
    ("wukong", "tiny"): 35_264, ("wukong", "small"): 51_615_744,
    ("wukong", "large"): 6_122_101_760,
    ("dhen", "tiny"): 177_216, ("dhen", "small"): 104_052_736,
    ("dhen", "large"): 1_476_691_968,
    ("interformer", "tiny"): 828_864, ("interformer", "small"): 316_844_032,
    ("interformer", "large"): 5_502_504_960,
}


def _vocabs(count: int, cap: int):
  """`count` Criteo-like vocabulary sizes (cycling the 26 columns), capped at `cap`."""
  return tuple(min(CRITEO_VOCABS[i % len(CRITEO_VOCABS)], cap) for i in range(count))


def _features(num_dense, vocab_sizes, bag_size, num_seq=0, seq_len=0, seq_vocab=0):
  return dict(num_dense=num_dense, vocab_sizes=tuple(vocab_sizes), bag_size=bag_size,
              num_seq=num_seq, seq_len=seq_len, seq_vocab=seq_vocab)


def _check_name(kind: str, value: str, valid: Sequence[str]) -> str:
  if value not in valid:
    raise ValueError(f"unknown {kind} {value!r}; valid: {', '.join(valid)}")
  return value


def _common(model: str, preset: str, activation: str, mlp_norm: bool) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.model = model                  # tower name, one of MODEL_NAMES
  c.preset = preset                # size preset, one of PRESETS
  c.activation = activation        # tower activation (the hard_swish mod replaces it)
  c.norm = "layernorm"             # normalization of the tower (the blocknorm mod replaces it)
  c.use_bias = True                # biases in dense sites (the no_bias mod drops them)
  c.mlp_norm = mlp_norm            # Norm after every hidden MLP layer (Linear -> Norm -> act)
  c.pooling = "sum"                # embedding-bag pooling over the masked ids: 'sum' | 'mean'
  c.max_vocab = VOCAB_CAP          # table rows cap; larger vocabularies hash ids modulo the cap
  c.dense_tokens = 1               # d-wide tokens the bottom MLP makes from the dense features
  # Dense features enter as sign(x) log(1 + |x|) ('signed_log1p', as DLRM pipelines treat
  # counts) or raw ('none', e.g. to feed outlier channels straight into the first GEMM).
  c.dense_transform = "signed_log1p"
  c.mods = ml_collections.ConfigDict(dict(
      no_bias=False,               # drop every bias except the final prediction layer's
      blocknorm=False,             # every LayerNorm -> parameter-free BlockNorm
      hard_swish=False,            # tower activation -> hard swish
      # BlockNorm block width: 256 as in LoKA; 16 at tiny so tiny widths hold several blocks.
      block_size=16 if preset == "tiny" else 256))
  return c


def _dlrm(preset: str) -> ml_collections.ConfigDict:
  c = _common("dlrm", preset, "relu", mlp_norm=False)
  if preset == "tiny":
    c.features = _features(8, (1000,) * 8, 3)   # 8 dense, 8 tables x 1k ids, bags of 3
    c.embed_dim = 16                            # d: width of every token
    c.bottom_mlp = (32,)                        # bottom MLP hidden widths (then -> d, ReLU)
    c.top_mlp = (64, 32)                        # top MLP hidden widths (then -> 1)
    c.batch_size = 256                          # default training batch
  elif preset == "small":
    c.features = _features(13, _vocabs(26, VOCAB_CAP), 4)  # Criteo layout, multi-hot bags of 4
    c.embed_dim = 128                           # d (MLPerf DLRMv2)
    c.bottom_mlp = (512, 256)                   # 13 -> 512 -> 256 -> 128
    c.top_mlp = (1024, 1024, 512, 256)          # -> 1
    c.batch_size = 4096
  else:
    c.features = _features(13, _vocabs(26, VOCAB_CAP), 4)
    c.embed_dim = 256
    c.bottom_mlp = (1024, 512)                  # 13 -> 1024 -> 512 -> 256
    c.top_mlp = (4096, 4096, 2048, 1024)        # top MLP 4096 wide, -> 1
    c.batch_size = 4096
  return c


def _dcnv2(preset: str) -> ml_collections.ConfigDict:
  c = _common("dcnv2", preset, "relu", mlp_norm=False)
  if preset == "tiny":
    c.features = _features(8, (1000,) * 8, 3)
    c.embed_dim = 16                            # d; cross width D = (tables + 1) * d
    c.bottom_mlp = (32,)                        # bottom MLP hidden widths (then -> d, ReLU)
    c.num_cross_layers = 2                      # stacked cross layers
    c.cross_rank = 8                            # r of W = U V; 0 = full-rank W
    c.top_mlp = (64, 32)                        # over-arch hidden widths (then -> 1)
    c.batch_size = 256
  elif preset == "small":                       # MLPerf DLRMv2 (DCNv2) layout
    c.features = _features(13, _vocabs(26, VOCAB_CAP), 4)
    c.embed_dim = 128
    c.bottom_mlp = (512, 256)
    c.num_cross_layers = 3
    c.cross_rank = 512
    c.top_mlp = (1024, 1024, 512, 256)
    c.batch_size = 4096
  else:
    c.features = _features(13, _vocabs(26, VOCAB_CAP), 4)
    c.embed_dim = 256
    c.bottom_mlp = (1024, 512)
    c.num_cross_layers = 3
    c.cross_rank = 0                            # full rank: W is D x D (D = 6912)
    c.top_mlp = (4096, 4096, 2048, 1024)        # over-arch 4096 wide
    c.batch_size = 4096
  return c


def _wukong(preset: str) -> ml_collections.ConfigDict:
  c = _common("wukong", preset, "swish", mlp_norm=True)
  c.attentive_y = False                         # Y = MLP(linear compression of X) per example
  if preset == "tiny":
    c.features = _features(8, (1000,) * 8, 3)   # n0 = 9 tokens: layer 0 projects its residual
    c.embed_dim = 16                            # d
    c.bottom_mlp = (32,)                        # dense -> 32 -> dense_tokens * d
    c.num_layers = 2                            # l: Wukong layers
    c.fmb_tokens = 4                            # n_F: tokens out of the FMB
    c.lcb_tokens = 4                            # n_L: tokens out of the LCB
    c.fm_rank = 4                               # k: columns of Y (n x k)
    c.fmb_mlp = (32, 32)                        # FMB MLP hidden widths (then -> n_F * d)
    c.head_mlp = (32,)                          # head MLP hidden widths (then -> 1)
    c.batch_size = 256
  elif preset == "small":
    c.features = _features(13, _vocabs(26, VOCAB_CAP), 4)
    c.embed_dim = 128
    c.bottom_mlp = (512, 256)                   # the Criteo search space's bottom MLP
    c.num_layers = 4
    c.fmb_tokens = 16
    c.lcb_tokens = 16
    c.fm_rank = 24
    c.fmb_mlp = (1024, 1024, 1024)              # MLP 3x1024
    c.head_mlp = (1024, 512)
    c.batch_size = 4096
  else:                                         # near the public l=8, n=96, k=96, MLP 3x8192
    c.features = _features(13, _vocabs(26, VOCAB_CAP), 4)
    c.embed_dim = 128
    c.bottom_mlp = (512, 256)
    c.num_layers = 8
    c.fmb_tokens = 96
    c.lcb_tokens = 96
    c.fm_rank = 96
    c.fmb_mlp = (8192, 8192, 8192)              # MLP 3x8192
    c.head_mlp = (2048, 1024)
    c.batch_size = 4096
  return c


def _dhen(preset: str) -> ml_collections.ConfigDict:
  c = _common("dhen", preset, "swish", mlp_norm=True)
  c.modules = DHEN_MODULES                      # ensemble members: dot, attention, dcn, linear
  c.ensemble = "sum"                            # 'sum' or 'concat' (+ token-axis projection)
  c.layer_tokens = 0                            # tokens out of each layer; 0 keeps n
  if preset == "tiny":
    c.features = _features(8, (1000,) * 7, 3)   # n = 7 tables + 1 dense token = 8
    c.embed_dim = 16                            # d
    c.bottom_mlp = (32,)                        # dense -> 32 -> dense_tokens * d
    c.num_layers = 2                            # stacked DHEN layers
    c.dot_mlp = (32,)                           # dot module MLP hidden widths (-> n * d)
    c.num_heads = 2                             # self-attention heads
    c.attention_ffn = 32                        # self-attention FFN width
    c.dcn_rank = 0                              # DCN module: 0 = full-rank W over n * d
    c.head_mlp = (32,)                          # head MLP hidden widths (then -> 1)
    c.batch_size = 256                          # default training batch
  elif preset == "small":
    c.features = _features(13, _vocabs(31, VOCAB_CAP), 4)  # n = 31 + 1 = 32
    c.embed_dim = 128
    c.bottom_mlp = (512, 256)
    c.num_layers = 3
    c.dot_mlp = (1024,)
    c.num_heads = 4
    c.attention_ffn = 512
    c.dcn_rank = 512
    c.head_mlp = (1024, 512)
    c.batch_size = 4096
  else:
    c.features = _features(13, _vocabs(63, VOCAB_CAP), 4)  # n = 63 + 1 = 64
    c.embed_dim = 256
    c.bottom_mlp = (1024, 512)
    c.num_layers = 4
    c.dot_mlp = (4096,)                         # MLPs 4096
    c.num_heads = 8
    c.attention_ffn = 1024
    c.dcn_rank = 1024
    c.head_mlp = (4096, 4096)
    c.batch_size = 4096
  return c


def _interformer(preset: str) -> ml_collections.ConfigDict:
  c = _common("interformer", preset, "swish", mlp_norm=True)
  c.interaction_modules = DHEN_MODULES          # the DHEN layer of the interaction arch
  c.ensemble = "sum"                            # DHEN ensemble: 'sum' or 'concat'
  c.gate_mlp = ()                               # gating MLP hidden widths (then -> m * d)
  c.gate_activation = "sigmoid"                 # Gating(Z) = act(Z * MLP(Z))
  c.seq_merge = "masknet"                       # attribute merge: 'masknet' or 'sum'
  c.use_rotary = True                           # rotary positions in the sequence attention
  c.num_cls = 4                                 # n_sum: X_sum tokens = CLS tokens of S
  c.num_pma = 2                                 # PMA learnable queries in S_sum
  c.num_recent = 2                              # most recent events in S_sum
  if preset == "tiny":
    c.features = _features(8, (1000,) * 7, 3, num_seq=2, seq_len=16, seq_vocab=1000)  # n = 8
    c.embed_dim = 16                            # d (tokens and sequence events)
    c.bottom_mlp = (32,)                        # dense -> 32 -> dense_tokens * d
    c.num_layers = 2                            # interleaved layers
    c.num_heads = 2                             # heads of every attention (MHA, PMA, DHEN)
    c.num_cls = 2                               # n_sum (4 at small and large)
    c.dot_mlp = (32,)                           # DHEN dot module MLP hidden widths
    c.attention_ffn = 32                        # DHEN self-attention FFN width
    c.dcn_rank = 0                              # DHEN DCN module rank (0 = full)
    c.interaction_mlp = (32,)                   # token-wise MLP after the DHEN layer (-> d)
    c.masknet_hidden = (32,)                    # MaskNet mask MLP hidden widths (-> A * d)
    c.head_mlp = (32,)                          # prediction MLP hidden widths (then -> 1)
    c.batch_size = 256                          # default training batch
  elif preset == "small":
    c.features = _features(13, _vocabs(31, VOCAB_CAP), 4, num_seq=2, seq_len=128,
                           seq_vocab=VOCAB_CAP)  # n = 32, T = 128
    c.embed_dim = 128
    c.bottom_mlp = (512, 256)
    c.num_layers = 3
    c.num_heads = 4
    c.dot_mlp = (512,)
    c.attention_ffn = 256
    c.dcn_rank = 256
    c.interaction_mlp = (256,)
    c.masknet_hidden = (256,)
    c.head_mlp = (1024, 512)
    c.batch_size = 4096
  else:
    c.features = _features(13, _vocabs(63, VOCAB_CAP), 4, num_seq=2, seq_len=512,
                           seq_vocab=VOCAB_CAP)  # n = 64, T = 512
    c.embed_dim = 256
    c.bottom_mlp = (1024, 512)
    c.num_layers = 4
    c.num_heads = 8
    c.dot_mlp = (1024,)
    c.attention_ffn = 1024
    c.dcn_rank = 512
    c.interaction_mlp = (1024,)
    c.masknet_hidden = (512,)
    c.head_mlp = (2048, 1024)
    c.batch_size = 512                          # attention scores: B x 8 x 516^2 per layer
  return c


_BUILDERS = {"dlrm": _dlrm, "dcnv2": _dcnv2, "wukong": _wukong, "dhen": _dhen,
             "interformer": _interformer}


def get_config(model: str, preset: str) -> ml_collections.ConfigDict:
  """The preset's ConfigDict, with `flops_per_example` computed for its default features."""
  _check_name("model", model, MODEL_NAMES)
  _check_name("preset", preset, PRESETS)
  c = _BUILDERS[model](preset)
  # Forward FLOPs per example of the GEMM sites (tower_flops) for c.features: DOCUMENTED_FLOPS.
  c.flops_per_example = tower_flops(c, FeatureSpec.from_dict(dict(c.features)))
  return c


# A Mods entry `keep_bias:PATTERN` keeps, under No Bias, the biases of the dense sites whose
# path matches the glob PATTERN (e.g. `keep_bias:top_mlp/*`); repeat it for more patterns.
# Why: No Bias with Hard Swish spikes DCNv2 `large` where neither does alone
# (docs/BENCHMARKS.md, thirty-fifth session), and a spike read names the module to keep.
KEEP_BIAS = "keep_bias:"


class ModsError(ValueError):
  """A Mods list that cannot apply: an unknown Mod, or a keep_bias pattern that cannot."""


def parse_mods(mods: Union[str, Sequence[str]]) -> Tuple[Tuple[str, ...], Tuple[str, ...]]:
  """(the Mods named, in order, 'all' expanded; the keep_bias patterns), or ModsError naming
  an unknown Mod, an empty pattern, or patterns without No Bias. The one reader of a Mods list:
  configs (`apply_mods`), the bench's Mods sets and its towers take it from here."""
  if isinstance(mods, str):
    mods = mods.split(",")
  names = [m.strip() for m in mods if m and m.strip()]
  patterns = tuple(m[len(KEEP_BIAS):] for m in names if m.startswith(KEEP_BIAS))
  names = [m for m in names if not m.startswith(KEEP_BIAS)]
  unknown = [m for m in names if m not in MODS + ("all",)]
  if unknown:
    raise ModsError(f"unknown Mod(s) {unknown}; valid: {', '.join(MODS)}, all, "
                    f"{KEEP_BIAS}PATTERN")
  if any(not p for p in patterns):
    raise ModsError(f"an empty {KEEP_BIAS} pattern; name the sites, e.g. "
                    f"{KEEP_BIAS}top_mlp/dense_0 or {KEEP_BIAS}cross_*")
  names = MODS if "all" in names else tuple(dict.fromkeys(names))
  if patterns and "no_bias" not in names:
    raise ModsError(f"{KEEP_BIAS}{patterns[0]} keeps biases that only No Bias drops: add "
                    "no_bias (or all) to the Mods")
  return names, patterns


def apply_mods(config: ml_collections.ConfigDict, mods: Sequence[str]) -> ml_collections.ConfigDict:
  """A copy of `config` with the named Mods on ('no_bias', 'blocknorm', 'hard_swish', 'all'),
  and No Bias's exceptions (`keep_bias:PATTERN` entries) in `mods.keep_bias`."""
  out = ml_collections.ConfigDict(config.to_dict())
  names, patterns = parse_mods(mods)
  for name in names:
    out.mods[name] = True
  if patterns:
    out.mods.keep_bias = patterns
  return out


def tower_options(config, site_config: SiteConfig) -> TowerOptions:
  """The tower-wide options with the config's Mods resolved."""
  mods = config.mods
  norm = "blocknorm" if mods.blocknorm else config.norm
  _check_name("norm", norm, NORMS)
  return TowerOptions(site=site_config,
                      activation="hard_swish" if mods.hard_swish else config.activation,
                      norm=norm, block_size=int(mods.block_size),
                      use_bias=bool(config.use_bias) and not mods.no_bias,
                      keep_bias=(tuple(mods.get("keep_bias", ()))
                                 if config.use_bias and mods.no_bias else ()))


def check_keep_bias(model: nn.Module, config, example_batch: Callable[[], Any]) -> None:
  """ModsError naming each of `config`'s keep_bias patterns that keeps no bias: one that
  matches no dense site whose bias No Bias drops (a misspelt pattern, a site without a bias
  by design such as a low-rank `v`, or one with a bias anyway such as the prediction layer),
  which would otherwise train plain No Bias silently. `model` is traced abstractly (no
  compilation) with and without its patterns (`TowerOptions.keep_bias`) on `example_batch()`,
  which is only called, and the model only traced, when there are patterns."""
  patterns = tuple(config.mods.get("keep_bias", ()))
  if not patterns:
    return
  batch = example_batch()
  with_patterns = _site_biases(model, batch)
  without = _site_biases(
      model.clone(opts=dataclasses.replace(model.opts, keep_bias=())), batch)
  kept = [s for s, biased in with_patterns.items() if biased and not without.get(s, False)]
  missing = [p for p in patterns if not any(fnmatch.fnmatchcase(s, p) for s in kept)]
  if missing:
    anyway = sorted(s for s, biased in without.items() if biased)
    raise ModsError(f"keep_bias pattern(s) {missing} keep no bias: they match no dense site "
                    "whose bias No Bias drops (patterns are globs over site paths; its dense "
                    f"sites: {', '.join(sorted(with_patterns))}"
                    + (f"; with a bias anyway: {', '.join(anyway)}" if anyway else "") + ")")


def _site_biases(model: nn.Module, batch) -> Dict[str, bool]:
  """Each dense site's path -> whether it has a bias, from an abstract init on `batch`."""
  sites: Dict[str, bool] = {}

  def visit(module, args):
    if isinstance(module, DenseSite):
      sites[site_name(module)] = bool(module.use_bias)

  trace_sites(model, None, batch, visit)
  return sites


def as_feature_spec(features) -> FeatureSpec:
  if isinstance(features, FeatureSpec):
    return features
  if isinstance(features, (Mapping, ml_collections.ConfigDict)):
    return FeatureSpec.from_dict(dict(features))
  raise TypeError(f"features must be a FeatureSpec or a dict, got {type(features).__name__}")


def _ints(values) -> tuple:
  return tuple(int(v) for v in values)


def build_model(config, features: FeatureSpec, site_config: SiteConfig) -> nn.Module:
  """The Linen tower for `config`; `module(batch, train=False)` -> float32 logits [B]."""
  model = _check_name("model", config.model, MODEL_NAMES)
  features = as_feature_spec(features)
  if not isinstance(site_config, SiteConfig):
    raise TypeError(f"site_config must be a SiteConfig, got {type(site_config).__name__}")
  opts = tower_options(config, site_config)
  front = dict(features=features, opts=opts, embed_dim=int(config.embed_dim),
               bottom_mlp=_ints(config.bottom_mlp), max_vocab=int(config.max_vocab),
               pooling=config.pooling, dense_transform=config.dense_transform)
  if model in ("dlrm", "dcnv2"):
    extra = (dict(num_cross_layers=int(config.num_cross_layers),
                  cross_rank=int(config.cross_rank)) if model == "dcnv2" else {})
    cls = DCNv2 if model == "dcnv2" else DLRM
    return cls(top_mlp=_ints(config.top_mlp), mlp_norm=bool(config.mlp_norm), **extra, **front)
  if model == "wukong":
    return Wukong(num_layers=int(config.num_layers), fmb_tokens=int(config.fmb_tokens),
                  lcb_tokens=int(config.lcb_tokens), fm_rank=int(config.fm_rank),
                  fmb_mlp=_ints(config.fmb_mlp), head_mlp=_ints(config.head_mlp),
                  attentive_y=bool(config.attentive_y), dense_tokens=int(config.dense_tokens),
                  mlp_norm=bool(config.mlp_norm), **front)
  if model == "dhen":
    return DHEN(num_layers=int(config.num_layers), modules=tuple(config.modules),
                head_mlp=_ints(config.head_mlp), layer_tokens=int(config.layer_tokens),
                ensemble=config.ensemble, dot_mlp=_ints(config.dot_mlp),
                num_heads=int(config.num_heads), attention_ffn=int(config.attention_ffn),
                dcn_rank=int(config.dcn_rank), dense_tokens=int(config.dense_tokens),
                mlp_norm=bool(config.mlp_norm), **front)
  if features.num_seq < 1:
    raise ValueError("interformer needs behaviour sequences: the feature spec has num_seq=0; "
                     "use data with num_seq >= 1 (seq_ids, seq_mask)")
  return InterFormer(arch=interformer_arch(config), dense_tokens=int(config.dense_tokens),
                     **front)


def interformer_arch(config) -> InterFormerArch:
  return InterFormerArch(
      num_layers=int(config.num_layers), num_heads=int(config.num_heads),
      num_cls=int(config.num_cls), num_pma=int(config.num_pma),
      num_recent=int(config.num_recent), head_mlp=_ints(config.head_mlp),
      interaction_modules=tuple(config.interaction_modules), ensemble=config.ensemble,
      dot_mlp=_ints(config.dot_mlp), attention_ffn=int(config.attention_ffn),
      dcn_rank=int(config.dcn_rank), interaction_mlp=_ints(config.interaction_mlp),
      gate_mlp=_ints(config.gate_mlp), gate_activation=config.gate_activation,
      seq_merge=config.seq_merge, masknet_hidden=_ints(config.masknet_hidden),
      use_rotary=bool(config.use_rotary), mlp_norm=bool(config.mlp_norm))


# ----------------------------------------------------------------------------- FLOP counts

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
  model = _check_name("model", config.model, MODEL_NAMES)
  d = int(config.embed_dim)
  dense_tokens = 1 if model in ("dlrm", "dcnv2") else int(config.dense_tokens)
  n = embedding.num_input_tokens(features, dense_tokens)
  total = 0
  if features.num_dense:
    total += _mlp_flops(features.num_dense, _ints(config.bottom_mlp) + (dense_tokens * d,))
  if model == "dlrm":
    top_in = n * (n - 1) // 2 + (d if features.num_dense else 0)
    return total + 2 * n * n * d + _mlp_flops(top_in, _ints(config.top_mlp) + (1,))
  if model == "dcnv2":
    width = n * d
    total += int(config.num_cross_layers) * _cross_flops(width, int(config.cross_rank))
    return total + _mlp_flops(width, _ints(config.top_mlp) + (1,))
  if model == "wukong":
    n_f, n_l, k = int(config.fmb_tokens), int(config.lcb_tokens), int(config.fm_rank)
    for _ in range(int(config.num_layers)):
      fm = 4 * n * d * k                                   # P = X^T Y and F = X P
      if config.attentive_y:
        fm += _mlp_flops(d, (k, k), rows=n)                # Y from X
      total += fm + _mlp_flops(n * k, _ints(config.fmb_mlp) + (n_f * d,))
      total += _token_linear_flops(n, n_l, d)              # LCB
      if n != n_f + n_l:
        total += _token_linear_flops(n, n_f + n_l, d)      # residual projection
      n = n_f + n_l
    return total + _mlp_flops(n * d, _ints(config.head_mlp) + (1,))
  if model == "dhen":
    for _ in range(int(config.num_layers)):
      n_out = int(config.layer_tokens) or n
      total += _dhen_layer_flops(n, n_out, d, tuple(config.modules), config.ensemble,
                                 _ints(config.dot_mlp), int(config.attention_ffn),
                                 int(config.dcn_rank))
      n = n_out
    return total + _mlp_flops(n * d, _ints(config.head_mlp) + (1,))
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


# ----------------------------------------------------------------------------- inspection

class SiteProduct(NamedTuple):
  """One GEMM site's product as the model calls it (shapes include the batch axis)."""
  kind: str                  # 'act_weight' or 'act_act'
  spec: str                  # einsum spec of the forward product
  lhs_shape: Tuple[int, ...]
  rhs_shape: Tuple[int, ...]

  @property
  def flops(self) -> int:
    return EinsumSpec.parse(self.spec).flops(self.lhs_shape, self.rhs_shape)


def trace_sites(model: nn.Module, variables, batch,
                visit: Callable[[nn.Module, tuple], None]) -> None:
  """Calls `visit(site module, call args)` at every site call (DenseSite, EinsumSite, ActSite)
  of one forward pass of `model` on `batch`, traced abstractly (no compilation);
  `variables=None` traces `model.init` instead (same forward pass, no variables needed)."""
  def record(next_fun, args, kwargs, context):
    if context.method_name == "__call__" and isinstance(context.module,
                                                        (DenseSite, EinsumSite, ActSite)):
      visit(context.module, args)
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    if variables is None:
      jax.eval_shape(lambda b: model.init(jax.random.PRNGKey(0), b), batch)
    else:
      jax.eval_shape(lambda v, b: model.apply(v, b), variables, batch)


def site_products(model: nn.Module, variables, batch) -> Dict[str, SiteProduct]:
  """{site name: SiteProduct} of one forward pass, in call order, traced abstractly (no
  compilation). Names are the sites' Linen paths, the keys of plans and probe reports.

  `variables=None` traces `model.init` instead (same forward pass, no variables needed).
  """
  found: Dict[str, SiteProduct] = {}

  def visit(module, args):
    if isinstance(module, DenseSite):
      shape = tuple(args[0].shape)
      product = SiteProduct(ACT_WEIGHT, "mk,kn->mn", (math.prod(shape[:-1]), shape[-1]),
                            (shape[-1], int(module.features)))
    elif isinstance(module, EinsumSite):
      product = SiteProduct(ACT_WEIGHT, str(EinsumSpec.parse(module.spec)),
                            tuple(args[0].shape), tuple(module.weight_shape))
    else:
      product = SiteProduct(ACT_ACT, str(EinsumSpec.parse(module.spec)), tuple(args[0].shape),
                            tuple(args[1].shape))
    found[site_name(module)] = product

  trace_sites(model, variables, batch, visit)
  return found
