"""The whole preprocessing run: one job, or file groups in parallel merged in input order."""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import sys
import time

import numpy as np

from anyspeed.data.pipeline import (
    Config,
    Job,
    check_written,
    prepare,
    run_job,
    tokenizers_single_threaded,
)
from anyspeed.data.progress import Stats, summary
from anyspeed.data.readers import InputFile
from anyspeed.data.workers import init_worker, mp_context, stop_pool
from anyspeed.data.writer import dataset_paths, merge_datasets


def _partition_files(files: list[InputFile], k: int) -> list[list[InputFile]]:
    """Split the ordered file list into at most k contiguous groups of similar total size."""
    k = min(k, len(files))
    total = sum(f.size for f in files) or 1
    groups: list[list[InputFile]] = [[] for _ in range(k)]
    seen = 0
    for i, f in enumerate(files):
        g = min(k - 1, seen * k // total)
        g = max(g, k - (len(files) - i))  # leave at least one file for each later group
        g = min(g, i)
        groups[g].append(f)
        seen += f.size
    return [g for g in groups if g]


def run_partitioned(job: Job) -> Stats:
    """Process contiguous file groups in parallel into partial datasets, then merge in order."""
    groups = _partition_files(job.files, job.cfg.partitions)
    tag = f".tmp-{os.getpid()}"
    parts = []
    for i, files in enumerate(groups):
        prefixes = {k: f"{p}.part{i:03d}{tag}" for k, p in job.prefixes.items()}
        parts.append(
            dataclasses.replace(job, files=files, prefixes=prefixes, workers=1, allow_empty=True)
        )
    stats = Stats()
    start = time.monotonic()
    try:
        with tokenizers_single_threaded():
            pool = mp_context().Pool(
                min(job.workers, len(parts)),
                initializer=init_worker,
                initargs=(os.getpid(), list(job.prefixes.values())),
            )
            try:
                pending = [pool.apply_async(run_job, (p,)) for p in parts]
                for i, res in enumerate(pending):
                    got = res.get()
                    stats.merge(got)
                    if job.progress:
                        print(
                            f"anyspeed preprocess: partition {i + 1}/{len(parts)} done "
                            f"({got.records} documents)",
                            file=sys.stderr,
                        )
                pool.close()
            finally:
                stop_pool(pool)
        check_written(stats, job.cfg)
        for key, prefix in job.prefixes.items():
            merge_datasets([p.prefixes[key] for p in parts], prefix, np.dtype(job.dtypes[key]))
            for path in dataset_paths(prefix):
                stats.outputs[path] = os.path.getsize(path)
    finally:
        for p in parts:
            for prefix in p.prefixes.values():
                for path in glob.glob(glob.escape(prefix) + "*"):
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(path)
    stats.seconds = time.monotonic() - start
    return stats


def preprocess(cfg: Config) -> Stats:
    """Validate ``cfg`` and run it; prints progress and the summary to stderr."""
    job, _ = prepare(cfg)
    stats = run_prepared(job)
    if cfg.progress:
        print(summary(stats), file=sys.stderr)
    return stats


def run_prepared(job: Job) -> Stats:
    """Run a prepared job: file groups in parallel with ``--partitions``, else one job."""
    if job.cfg.partitions > 1 and len(job.files) > 1:
        return run_partitioned(job)
    return run_job(job)
