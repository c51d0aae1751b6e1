"""Wall time and peak RSS of ``anyspeed convert`` in each direction vs. a plain file copy.

Run: ``python benchmarks/convert.py [--preset qwen2.5-1.5b] [--layers N] [--dir DIR]``. A random
bf16 model with the preset's shapes is written as an HF directory (one safetensors file, as the
published Qwen2.5-1.5B is), then converted HF -> Megatron (torch_dist and legacy, target TP2)
and each back to HF. Every conversion runs in its own process; "convert s" times the conversion
after the process has imported torch and Megatron ("process s" is the whole command), and its
peak RSS is the process's ``VmHWM`` (helper processes, if any, are reported separately). This
machine's disk is shared and its speed swings 2-3x from minute to minute, so each direction is
run ``--repeat`` times, each next to a fresh copy of the weight files it reads: "x copy" is the
median of the runs' conversion/copy ratios, "best x" the fastest conversion over the fastest
copy.
Goal (issue 5): peak RSS <= 1.5 x the largest safetensors shard + one layer, time <= 2 x copying
the bytes. MoE (issue 15): ``--preset qwen3-30b-a3b --layers 2 --hf-shard-size 2GB --ep 2``
(3.7 GB: every expert of two layers, the legacy layout split over 2 EP ranks).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import json, sys, threading, time
import psutil
from anyspeed.commands.convert import main

def peak_kb():  # this process's own high-water mark (not inherited from the parent)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

helpers = [0]
def watch():  # Megatron's checkpoint-writer processes, sampled
    me = psutil.Process()
    while True:
        for c in me.children(recursive=True):
            try:
                helpers[0] = max(helpers[0], c.memory_info().rss)
            except psutil.Error:
                pass
        time.sleep(0.05)

if __name__ == "__main__":
    threading.Thread(target=watch, daemon=True).start()
    import megatron.core, anyspeed.adaptor  # start-up cost, timed in process_s only
    t = time.perf_counter()
    rc = main(sys.argv[1:])
    wall = time.perf_counter() - t
    print("RESULT " + json.dumps({"rc": rc, "wall_s": wall, "rss": peak_kb() * 1024,
                                  "helpers_rss": helpers[0]}))
"""


def make_hf(directory: Path, preset_name: str, layers: int | None, shard: str) -> dict:
    """A random bf16 HF directory for the preset, written tensor by tensor."""
    import torch

    from anyspeed.convert import engine
    from anyspeed.convert.hf_io import ShardedWriter
    from anyspeed.models import get_preset
    from anyspeed.models.families import mapping_for
    from anyspeed.models.hf import hf_config
    from anyspeed.models.presets import HF_ARCHITECTURES

    preset = get_preset(preset_name)
    if layers:
        preset = dataclasses.replace(preset, num_layers=layers)
    directory.mkdir(parents=True)
    shapes = engine.hf_shapes(mapping_for(preset.family), preset)
    writer = ShardedWriter(directory, list(shapes.items()), shard)
    g = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        writer.add({name: (0.02 * torch.randn(shape, generator=g)).to(torch.bfloat16)})
    writer.close()
    cfg = dict(hf_config(preset), architectures=[HF_ARCHITECTURES[preset.family]],
               dtype="bfloat16")  # fmt: skip
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    (directory / "tokenizer.json").write_text("{}")
    layer = max(sum(math.prod(s) for n, s in shapes.items() if n.startswith(f"model.layers.{i}."))
                for i in range(preset.num_layers))  # fmt: skip
    return {"preset": preset.name, "layers": preset.num_layers, "layer_bytes": 2 * layer}


def run(argv: list[str]) -> dict:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not line:
        sys.exit(f"convert failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    res = json.loads(line[-1][7:])
    res["process_s"] = time.perf_counter() - start
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-1.5b")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers for a quick run")
    ap.add_argument("--hf-shard-size", default="5GB")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ep", type=int, default=1, help="expert-parallel ranks of the legacy layout")
    ap.add_argument("--repeat", type=int, default=5, help="runs per direction (median)")
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="anyspeed-convert-bench-"))
    hf = root / "hf"
    info = make_hf(hf, args.preset, args.layers, args.hf_shard_size)
    files = sorted(hf.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    largest = max(f.stat().st_size for f in files)

    def copy_s(source: Path) -> float:
        """A plain copy of the weight files the conversion reads (the same bytes, in the same
        page-cache state), measured next to each conversion."""
        names = (".safetensors", ".distcp", "model_optim_rng.pt")
        weights = [f for f in sorted(source.rglob("*")) if f.name.endswith(names)]
        os.sync()  # every timed run starts with no dirty pages left by the one before
        t = time.perf_counter()
        (root / "copy").mkdir()
        for i, f in enumerate(weights):
            shutil.copyfile(f, root / "copy" / f"{i}-{f.name}")
        dt = time.perf_counter() - t
        shutil.rmtree(root / "copy")
        return dt

    goal_rss = 1.5 * largest + info["layer_bytes"]
    tp = str(args.tp)
    steps = [
        ("hf -> torch_dist", "dist", ["--load-model-type", "hf", "--save-model-type", "mg",
                                      "--load-dir", str(hf), "--target-tensor-parallel-size", tp]),
        ("hf -> legacy TP" + tp + (f" EP{args.ep}" if args.ep > 1 else ""), "legacy",
         ["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", str(hf),
          "--target-tensor-parallel-size", tp, "--target-expert-parallel-size", str(args.ep),
          "--ckpt-format", "legacy"]),
        ("torch_dist -> hf", "hf_dist", ["--load-model-type", "mg", "--save-model-type", "hf",
                                         "--load-dir", str(root / "dist"), "--hf-cfg-dir",
                                         str(hf)]),
        ("legacy -> hf", "hf_legacy", ["--load-model-type", "mg", "--save-model-type", "hf",
                                       "--load-dir", str(root / "legacy"), "--hf-cfg-dir",
                                       str(hf)]),
    ]  # fmt: skip
    gb = 1e9
    print(f"model: {info['preset']} ({info['layers']} layers), bf16, {total / gb:.2f} GB in "
          f"{len(files)} file(s), largest {largest / gb:.2f} GB, one layer "
          f"{info['layer_bytes'] / gb:.3f} GB")  # fmt: skip
    print(f"goal: peak RSS <= {goal_rss / gb:.2f} GB, convert time <= 2 x copy time; each "
          f"direction run {args.repeat}x, each run next to its own copy")  # fmt: skip
    print(f"{'direction':<20} {'convert s':>9} {'copy s':>7} {'x copy':>7} {'best x':>6} "
          f"{'process s':>9} {'peak RSS GB':>11} {'x goal':>6} {'helpers GB':>10}")  # fmt: skip
    rows, same = [], []
    for label, out, argv in steps:
        runs, copies = [], []
        for _ in range(args.repeat):
            shutil.rmtree(root / out, ignore_errors=True)
            copies.append(copy_s(Path(argv[argv.index("--load-dir") + 1])))
            os.sync()
            runs.append(run([*argv, "--save-dir", str(root / out)]))
        walls = [x["wall_s"] for x in runs]
        r = dict(runs[0], wall_s=statistics.median(walls),
                 process_s=statistics.median(x["process_s"] for x in runs),
                 rss=max(x["rss"] for x in runs), copy_s=statistics.median(copies),
                 ratio=statistics.median(w / c for w, c in zip(walls, copies, strict=True)),
                 best_ratio=min(walls) / min(copies),
                 helpers_rss=max(x["helpers_rss"] for x in runs), direction=label,
                 all_wall_s=walls, all_copy_s=copies)  # fmt: skip
        rows.append(r)
        if out.startswith("hf_"):  # checked and removed now, with its source: less page cache
            same.append(_same(hf, root / out))
            shutil.rmtree(root / out)
            shutil.rmtree(argv[argv.index("--load-dir") + 1])
        print(f"{label:<20} {r['wall_s']:>9.2f} {r['copy_s']:>7.2f} {r['ratio']:>7.2f} "
              f"{r['best_ratio']:>6.2f} {r['process_s']:>9.2f} {r['rss'] / gb:>11.2f} "
              f"{r['rss'] / goal_rss:>6.2f} {r['helpers_rss'] / gb:>10.2f}",
              flush=True)  # fmt: skip
    print(f"round trips bit-identical: {all(same)}")
    print(json.dumps({"model": info, "bytes": total, "rows": rows}))
    if not args.dir:
        shutil.rmtree(root)


def _same(a: Path, b: Path) -> bool:
    """Every tensor equal, compared one at a time."""
    import torch

    from anyspeed.convert.hf_io import HFCheckpoint

    x, y = HFCheckpoint(a), HFCheckpoint(b)
    return set(x.names) == set(y.names) and all(
        x.get(n).dtype == y.get(n).dtype and torch.equal(x.get(n), y.get(n)) for n in x.names
    )


if __name__ == "__main__":
    main()
