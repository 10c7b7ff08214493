"""Recommendation towers built from GEMM sites."""
from loka_jax.models.site import ActSite, DenseSite, EinsumSite, SiteConfig, site_name
