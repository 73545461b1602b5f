"""The engine-agnostic virtual-memory KV cache manager."""

from .cache import Capacity, VirtualKVCache
from .config import KVCacheConfig
from .errors import (ConfigError, ContextLengthError, DriverError, InjectedFault, SlotError,
                     TensorError, UnsupportedError, VattnError)
from .layout import KVLayout, LayoutReport, layout_report

__all__ = ["VirtualKVCache", "KVCacheConfig", "Capacity", "KVLayout", "LayoutReport", "layout_report",
           "VattnError", "ConfigError", "SlotError", "ContextLengthError", "TensorError",
           "UnsupportedError", "DriverError", "InjectedFault"]
