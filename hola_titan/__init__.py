"""hola-titan: distributed pretraining for HOLA (Hippocampal Linear Attention) and its baselines."""

from hola_titan.kernels.hola.cache import HolaCache
from hola_titan.ops import hola_attention

__all__ = ["HolaCache", "hola_attention"]
__version__ = "0.1.0"
