"""Tower construction: a preset's config (presets.py) with its Mods resolved
(`tower_options`) turned into a Linen module (`build_model`)."""
from __future__ import annotations

from typing import Mapping, Sequence

import flax.linen as nn
import ml_collections

from loka_jax.data.spec import FeatureSpec
from loka_jax.mods import NORMS
from loka_jax.models.dcnv2 import DCNv2
from loka_jax.models.dhen import DHEN
from loka_jax.models.dlrm import DLRM
from loka_jax.models.interformer import InterFormer, InterFormerArch
from loka_jax.models.layers import TowerOptions
from loka_jax.models.site import SiteConfig
from loka_jax.models.wukong import Wukong

MODEL_NAMES = ("dlrm", "dcnv2", "wukong", "dhen", "interformer")


def check_name(kind: str, value: str, valid: Sequence[str]) -> str:
  """`value`, or ValueError naming the valid ones."""
  if value not in valid:
    raise ValueError(f"unknown {kind} {value!r}; valid: {', '.join(valid)}")
  return value


def tower_options(config, site_config: SiteConfig) -> TowerOptions:
  """The tower-wide options with the config's Mods resolved."""
  mods = config.mods
  norm = "blocknorm" if mods.blocknorm else config.norm
  check_name("norm", norm, NORMS)
  return TowerOptions(site=site_config,
                      activation="hard_swish" if mods.hard_swish else config.activation,
                      norm=norm, block_size=int(mods.block_size),
                      use_bias=bool(config.use_bias) and not mods.no_bias,
                      keep_bias=(tuple(mods.get("keep_bias", ()))
                                 if config.use_bias and mods.no_bias else ()))


def as_feature_spec(features) -> FeatureSpec:
  if isinstance(features, FeatureSpec):
    return features
  if isinstance(features, (Mapping, ml_collections.ConfigDict)):
    return FeatureSpec.from_dict(dict(features))
  raise TypeError(f"features must be a FeatureSpec or a dict, got {type(features).__name__}")


def ints(values) -> tuple:
  """A config's widths as a tuple of ints."""
  return tuple(int(v) for v in values)


def build_model(config, features: FeatureSpec, site_config: SiteConfig) -> nn.Module:
  """The Linen tower for `config`; `module(batch, train=False)` -> float32 logits [B]."""
  model = check_name("model", config.model, MODEL_NAMES)
  features = as_feature_spec(features)
  if not isinstance(site_config, SiteConfig):
    raise TypeError(f"site_config must be a SiteConfig, got {type(site_config).__name__}")
  opts = tower_options(config, site_config)
  front = dict(features=features, opts=opts, embed_dim=int(config.embed_dim),
               bottom_mlp=ints(config.bottom_mlp), max_vocab=int(config.max_vocab),
               pooling=config.pooling, dense_transform=config.dense_transform)
  if model in ("dlrm", "dcnv2"):
    extra = (dict(num_cross_layers=int(config.num_cross_layers),
                  cross_rank=int(config.cross_rank)) if model == "dcnv2" else {})
    cls = DCNv2 if model == "dcnv2" else DLRM
    return cls(top_mlp=ints(config.top_mlp), mlp_norm=bool(config.mlp_norm), **extra, **front)
  if model == "wukong":
    return Wukong(num_layers=int(config.num_layers), fmb_tokens=int(config.fmb_tokens),
                  lcb_tokens=int(config.lcb_tokens), fm_rank=int(config.fm_rank),
                  fmb_mlp=ints(config.fmb_mlp), head_mlp=ints(config.head_mlp),
                  attentive_y=bool(config.attentive_y), dense_tokens=int(config.dense_tokens),
                  mlp_norm=bool(config.mlp_norm), **front)
  if model == "dhen":
    return DHEN(num_layers=int(config.num_layers), modules=tuple(config.modules),
                head_mlp=ints(config.head_mlp), layer_tokens=int(config.layer_tokens),
                ensemble=config.ensemble, dot_mlp=ints(config.dot_mlp),
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
      num_recent=int(config.num_recent), head_mlp=ints(config.head_mlp),
      interaction_modules=tuple(config.interaction_modules), ensemble=config.ensemble,
      dot_mlp=ints(config.dot_mlp), attention_ffn=int(config.attention_ffn),
      dcn_rank=int(config.dcn_rank), interaction_mlp=ints(config.interaction_mlp),
      gate_mlp=ints(config.gate_mlp), gate_activation=config.gate_activation,
      seq_merge=config.seq_merge, masknet_hidden=ints(config.masknet_hidden),
      use_rotary=bool(config.use_rotary), mlp_norm=bool(config.mlp_norm))
