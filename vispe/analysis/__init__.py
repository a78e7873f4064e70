"""Analysis of positional encodings: PESI metrics (LOOPE) and cosine-similarity maps."""
from .pesi import (
    cosine_similarity_maps,
    materialize_pe,
    pesi_from_similarity,
    pesi_metrics,
    plot_similarity_maps,
    rotary_kernel_maps,
    similarity_maps,
)

__all__ = [
    "cosine_similarity_maps",
    "materialize_pe",
    "pesi_from_similarity",
    "pesi_metrics",
    "plot_similarity_maps",
    "rotary_kernel_maps",
    "similarity_maps",
]
