"""Registers the variants of a timm-style model of this package with timm, so `timm.create_model(name)` builds them.

timm's `register_model` takes an entry point named after the model and finds the pretrained configs in its module's
`default_cfgs`; one entry point per variant is made here instead of being written out once per name.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable

from timm.data.constants import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import register_model


def imagenet_cfg(**fields) -> dict:
    """A variant's pretrained config (what `default_cfgs` holds): ImageNet-1k at 224 px with ImageNet's mean and std,
    no weights to download; `fields` add the model's own (crop, interpolation, first conv, classifier)."""
    return dict(
        url="",
        num_classes=1000,
        input_size=(3, 224, 224),
        pool_size=None,
        mean=IMAGENET_DEFAULT_MEAN,
        std=IMAGENET_DEFAULT_STD,
        license="apache-2.0",
        **fields,
    )


def register_variants(module: str, names: Iterable[str], create: Callable[..., object]) -> None:
    """Register `create(name, pretrained, **kwargs)` under each of `names` as an entry point of `module`."""
    for name in names:
        register_model(_entry_point(module, name, create))


def _entry_point(module: str, name: str, create: Callable[..., object]) -> Callable[..., object]:
    def entry_point(pretrained: bool = False, **kwargs):
        return create(name, pretrained, **kwargs)

    entry_point.__name__ = entry_point.__qualname__ = name
    entry_point.__module__ = module
    entry_point.__doc__ = f"{name}: see {module}.VARIANTS."
    setattr(sys.modules[module], name, entry_point)  # importable as module.name, as a written-out one would be
    return entry_point
