"""Imported only after a patch is applied: its copy of ``greet`` is the patched one."""

from patch_target import greet


def call() -> str:
    return greet("late")
