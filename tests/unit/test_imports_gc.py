"""core/launch/imports.py: heavy imports with the garbage collector off, what they made frozen after."""

from __future__ import annotations

import gc

from core.launch.imports import imports_without_collection


def test_the_collector_is_off_inside_and_what_was_made_is_frozen_after():
    assert gc.isenabled()
    before = gc.get_freeze_count()
    try:
        with imports_without_collection():
            assert not gc.isenabled()
            made = [[i] for i in range(1000)]  # 1,001 new container objects
        assert gc.isenabled()
        assert gc.get_freeze_count() >= before + len(made)
        walked = {id(obj) for obj in gc.get_objects()}  # the generations the collector walks
        assert not any(id(x) in walked for x in made)
    finally:
        gc.unfreeze()


def test_a_collector_switched_off_before_stays_off():
    gc.disable()
    try:
        with imports_without_collection():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.unfreeze()
