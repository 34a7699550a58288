"""Miles' import path of `DynamicFilterOutput` (`miles.rollout.filter_hub.base_types`);
the type lives in `miles.rollout.filters`."""

from miles.rollout.filters import DynamicFilterOutput

__all__ = ["DynamicFilterOutput"]
