"""Recommendation towers built from GEMM sites."""
from loka_jax.models.site import ActSite, DenseSite, EinsumSite, SiteConfig, site_name
from loka_jax.models.embedding import EMBEDDINGS, Embeddings, check_batch
from loka_jax.models.layers import MLP, TowerOptions
from loka_jax.models.presets import (MODEL_NAMES, MODS, PRESETS, SiteProduct, apply_mods,
                                     build_model, get_config, site_products, tower_flops,
                                     tower_options)
