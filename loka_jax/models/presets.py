"""Tower presets (`tiny`, `small`, `large`): each model's size table and `get_config`.

`get_config(model, preset)` returns an ml_collections ConfigDict with a comment on every key;
`build_model(config, features, site_config)` (build.py) turns it into a Linen module whose
`__call__(batch, *, train=False)` returns float32 logits [B]; `apply_mods` (mods_config.py)
switches Mods on; `tower_flops(config, features)` (flops.py) counts the forward FLOPs per
example of every GEMM site from the towers' equations (2 per multiply-add; embedding
gathers, norms, activations and softmax not counted; a training step costs about 3x). Those
names, and site inspection's (`site_products`, site.py), are importable from here too.

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

import ml_collections

from loka_jax.data.spec import FeatureSpec
from loka_jax.models.build import (MODEL_NAMES, as_feature_spec, build_model, check_name,
                                   interformer_arch, tower_options)
from loka_jax.models.dhen import MODULES as DHEN_MODULES
from loka_jax.models.flops import tower_flops
from loka_jax.models.mods_config import (KEEP_BIAS, MODS, ModsError, apply_mods, check_keep_bias,
                                         parse_mods)
from loka_jax.models.site import SiteProduct, site_products, trace_sites

# The presets' names and those of the modules beside them (build.py, flops.py, mods_config.py,
# site.py) that callers import from here.
__all__ = ["DOCUMENTED_FLOPS", "KEEP_BIAS", "MODEL_NAMES", "MODS", "PRESETS", "ModsError",
           "SiteProduct", "apply_mods", "as_feature_spec", "build_model", "check_keep_bias",
           "get_config", "interformer_arch", "parse_mods", "site_products", "tower_flops",
           "tower_options", "trace_sites"]

PRESETS = ("tiny", "small", "large")

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
  check_name("model", model, MODEL_NAMES)
  check_name("preset", preset, PRESETS)
  c = _BUILDERS[model](preset)
  # Forward FLOPs per example of the GEMM sites (tower_flops) for c.features: DOCUMENTED_FLOPS.
  c.flops_per_example = tower_flops(c, FeatureSpec.from_dict(dict(c.features)))
  return c
