"""What ``anyspeed features`` shows: every feature, whether it is on, and the patches it applies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from anyspeed.device import DeviceInfo, detect
from anyspeed.features import registry
from anyspeed.features.base import Feature
from anyspeed.patching import PatchManager


def _row(feature: Feature, args: Any, device: DeviceInfo) -> dict[str, Any]:
    ok, why = feature.available(device)
    on = feature.is_enabled(args, device)
    pm = PatchManager()
    if on:
        feature.register_patches(pm, args, device)
    return {
        "name": feature.name,
        "level": feature.level,
        "flags": list(feature.flags),
        "flag_notes": feature.flag_notes(),
        "available": ok,
        "note": why,
        "on": on,
        "description": feature.description,
        "patches": [{"target": p.target, "kind": p.kind, "reason": p.reason} for p in pm.patches()],
    }


def build(argv: Sequence[str]) -> dict[str, Any]:
    """The report for a training command line; FeatureError (one line) when it is refused."""
    device = detect()
    args = registry.parse_args(argv)
    registry.validate(args, device)
    return {
        "device": device.type,
        "device_name": device.name,
        "dist_backend": device.dist_backend,
        "optimization_level": args.optimization_level,
        "features": [_row(f, args, device) for f in registry.features()],
    }


def text(report: dict[str, Any], with_patches: bool) -> str:
    """The report as the table ``anyspeed features`` prints."""
    rows = report["features"]
    out = [
        f"device: {report['device']} ({report['device_name']}), process groups: "
        f"{report['dist_backend']}, --optimization-level {report['optimization_level']}",
        f"{'feature':<22} {'level':>5}  {'available':<10} {'on':<4} flags",
    ]
    for r in rows:
        avail = "yes" if r["available"] else "no"
        shown = " ".join(r["flags"]) or "-"
        if r["flag_notes"]:  # listed below the table, each with its note
            shown = f"{len(r['flag_notes'])} flags, listed below"
        on = "on" if r["on"] else "off"
        out.append(f"{r['name']:<22} {r['level']:>5}  {avail:<10} {on:<4} {shown}")
        out.append(f"{'':<22}        {r['description']}" + (f" [{r['note']}]" if r["note"] else ""))
    for r in rows:
        if r["flag_notes"]:
            out.append(f"\nflags of {r['name']}:")
            out += [f"  {flag:<40} {note}" for flag, note in r["flag_notes"].items()]
    if not with_patches:
        out.append(
            "\n(pass a training command line, e.g. `anyspeed features --optimization-level 0`, "
            "to list the patches each enabled feature applies)"
        )
        return "\n".join(out)
    for r in rows:
        if r["patches"]:
            out.append(f"\npatches applied by {r['name']} ({len(r['patches'])}):")
            out += [f"  {p['kind']:<7} {p['target']:<70} {p['reason']}" for p in r["patches"]]
    return "\n".join(out)
