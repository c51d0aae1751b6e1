"""``anyspeed`` command line: ``pretrain``, ``preprocess``, ``convert``, ``features`` and more.

``anyspeed features [TRAINING FLAGS...]`` lists every feature with its level, flags and
availability on this device; given a training command line it also says which features would
be on and every patch they would apply. ``anyspeed smoke`` trains a tiny GPT on N local
processes through megatron.core (launched with torchrun).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence


def _features_report(argv: Sequence[str], as_json: bool) -> int:
    from anyspeed import features as F
    from anyspeed.device import detect
    from anyspeed.patching import PatchManager

    device = detect()
    try:
        args = F.parse_args(argv)
        F.validate(args, device)
    except F.FeatureError as exc:
        print(f"anyspeed: error: {exc}", file=sys.stderr)
        return 2
    F._load_builtin_features()
    rows = []
    for feat in F.FEATURES:
        ok, why = feat.available(device)
        on = feat.is_enabled(args, device)
        pm = PatchManager()
        if on:
            feat.register_patches(pm, args, device)
        rows.append(
            {
                "name": feat.name,
                "level": feat.level,
                "flags": list(feat.flags),
                "available": ok,
                "note": why,
                "on": on,
                "description": feat.description,
                "patches": [
                    {"target": p.target, "kind": p.kind, "reason": p.reason} for p in pm.patches()
                ],
            }
        )
    if as_json:
        print(
            json.dumps(
                {
                    "device": device.type,
                    "device_name": device.name,
                    "dist_backend": device.dist_backend,
                    "optimization_level": args.optimization_level,
                    "features": rows,
                },
                indent=1,
            )
        )
        return 0
    print(
        f"device: {device.type} ({device.name}), process groups: {device.dist_backend}, "
        f"--optimization-level {args.optimization_level}"
    )
    print(f"{'feature':<22} {'level':>5}  {'available':<10} {'on':<4} flags")
    for r in rows:
        avail = "yes" if r["available"] else "no"
        flags = " ".join(r["flags"]) or "-"
        print(
            f"{r['name']:<22} {r['level']:>5}  {avail:<10} {'on' if r['on'] else 'off':<4} {flags}"
        )
        print(f"{'':<22}        {r['description']}" + (f" [{r['note']}]" if r["note"] else ""))
    if argv:
        for r in rows:
            if not r["patches"]:
                continue
            print(f"\npatches applied by {r['name']} ({len(r['patches'])}):")
            for p in r["patches"]:
                print(f"  {p['kind']:<7} {p['target']:<70} {p['reason']}")
    else:
        print(
            "\n(pass a training command line, e.g. `anyspeed features --optimization-level 0`, "
            "to list the patches each enabled feature applies)"
        )
    return 0


def _smoke(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(
        prog="anyspeed smoke", description="train a tiny GPT through megatron.core"
    )
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--train-iters", type=int, default=30)
    p.add_argument("--log-interval", type=int, default=5)
    args, rest = p.parse_known_args(argv)
    if "WORLD_SIZE" not in os.environ:
        from anyspeed.training.smoke import parse, spec_and_layout

        try:  # refuse a bad layout here, before torchrun starts any process
            spec, layout = spec_and_layout(parse(argv))
            layout.validate(args.nproc_per_node, spec)
        except ValueError as exc:
            print(f"anyspeed: error: {exc}", file=sys.stderr)
            return 2
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.nproc_per_node}",
            "-m",
            "anyspeed.training.smoke",
            *argv,
        ]
        return subprocess.call(cmd)
    from anyspeed.training.smoke import main

    return main(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``anyspeed`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print(
            "\ncommands: demo | pretrain [--nproc-per-node N] FLAGS... | preprocess ... | "
            "train-tokenizer ... | convert ... | models | features [--json] [TRAINING FLAGS...] "
            "| smoke [--nproc-per-node N ...]"
        )
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "features":
        as_json = "--json" in rest
        return _features_report([a for a in rest if a != "--json"], as_json)
    if cmd == "smoke":
        return _smoke(rest)
    if cmd == "pretrain":
        from anyspeed.training.pretrain import main as pretrain_main

        return pretrain_main(rest)
    if cmd == "demo":
        from anyspeed.training.demo import main as demo_main

        return demo_main(rest)
    if cmd == "convert":
        from anyspeed.convert.cli import main as convert_main

        return convert_main(rest)
    if cmd == "models":
        from anyspeed.models.presets import PRESETS

        for name, p in PRESETS.items():
            print(f"{name:<16} {p.family:<8} {p.num_parameters() / 1e6:>10,.1f}M params")
        return 0
    if cmd in ("preprocess", "train-tokenizer"):
        from anyspeed.data.cli import main as data_main

        return data_main([cmd, *rest])
    print(
        f"anyspeed: error: unknown command {cmd!r} (try: demo, pretrain, preprocess, "
        "train-tokenizer, convert, models, features, smoke)",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
