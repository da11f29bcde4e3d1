"""The peers in the ``remote`` section: megatron-energon's loader and LitData's ``StreamingDataset``, each after
its own preparation step, reading the same shards (local, and from the same S3 server) with the same per-sample
work as ours: parse the members, decode and resize the images, tokenize (``SampleProcessor``), in the DataLoader
workers. Samples are collated 32 to a batch in the workers (concatenated tensors), as a training loader would:
one tensor per sample across the worker queue would cost the peers more than their reading does. They do not
pack, so their batches vary in tokens; ours are fixed-budget packs.

The peers are not dependencies: ``PEERS_INSTALL`` installs them beside a CPU torch (LitData's requirement of
torchvision would pull a CUDA torch; nothing used here needs torchvision). Where they are missing, the section
says so and reports our rows alone.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import epoch_times

PEERS_INSTALL = (
    "pip install megatron-energon==7.4.1 && pip install --no-deps litdata==0.2.76 && pip install obstore tifffile boto3"
)
BATCH = 32  # samples per peer batch


def available() -> dict[str, bool]:
    """Which peers import here."""
    out = {}
    for name, module in (("energon", "megatron.energon"), ("litdata", "litdata")):
        try:
            __import__(module)
            out[name] = True
        except Exception:  # noqa: BLE001 - a broken install is as good as none
            out[name] = False
    return out


class Work:
    """Our per-sample work on one sample's members (suffix -> bytes), in a worker: ``SampleProcessor.process``,
    what our producer calls (images, tokens, placeholder and length checks); batches of it collated."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor

    def __call__(self, key: str, members: dict) -> tuple[str, Any]:
        from nanovlm.data.format import SampleError, members_to_record

        try:
            sample = self.processor.process(members_to_record({k: bytes(v) for k, v in members.items()}, key))
        except SampleError:
            return key, None
        return key, (sample.input_ids, sample.labels, sample.pixel_values)

    @staticmethod
    def collate(samples: list[tuple[str, Any]]) -> tuple[list[str], list]:
        import torch

        done = [s for _, s in samples if s is not None]
        tensors = [torch.cat([s[i] for s in done]) if done else None for i in range(3)]
        return [k for k, _ in samples], tensors


def _timed(batches, expected: int, on_first: Callable[[], None] | None = None) -> dict[str, Any]:
    """Drain an epoch of (keys, tensors) batches, timed as ours is (``common.epoch_times``); every key exactly
    once, and the token ids delivered. ``on_first`` runs when the first batch is in."""
    it = iter(batches)
    t_start = time.perf_counter()  # after iter(), as for ours
    keys, tensors = next(it)
    t_first = time.perf_counter()
    if on_first is not None:
        on_first()
    keys, tokens = list(keys), _tokens(tensors)
    first = len(keys)
    for batch_keys, tensors in it:
        keys += batch_keys
        tokens += _tokens(tensors)
    t_end = time.perf_counter()
    if len(keys) != expected or len(set(keys)) != expected:
        raise RuntimeError(f"a peer epoch read {len(keys)} samples ({len(set(keys))} distinct), not {expected}")
    return epoch_times(t_start, t_first, t_end, first, len(keys)) | {"tokens": tokens}  # tokens: the whole epoch


def _tokens(tensors: list) -> int:
    return 0 if tensors[0] is None else int(tensors[0].numel())


# ------------------------------------------------------------------------------------------------------
# megatron-energon


def prepare_energon(shards: Path, work: Path) -> tuple[Path, float]:
    """The shards (hard links, else copies) in ``work/energon/ds``, through ``energon prepare`` (its index and
    split files): (the dataset directory, seconds)."""
    ds = work / "energon" / "ds"
    shutil.rmtree(ds, ignore_errors=True)
    ds.mkdir(parents=True)
    for tar in sorted(shards.glob("*.tar")):
        try:
            os.link(tar, ds / tar.name)
        except OSError:
            shutil.copy2(tar, ds / tar.name)
    energon = shutil.which("energon") or str(Path(sys.executable).with_name("energon"))
    cmd = [energon, "prepare", str(ds), "--non-interactive", "--split-ratio", "1,0,0"]
    cmd += ["--sample-type", "CrudeWebdataset", "--num-workers", "2", "--no-progress"]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"energon prepare failed ({done.returncode}): {done.stderr[-2000:]}")
    return ds, time.perf_counter() - t0


def energon_epoch(
    path: str,
    processor: Any,
    expected: int,
    workers: int = 2,
    msc: dict | None = None,
    on_first: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """One epoch of ``path`` (a prepared directory, or ``msc://BUCKET/ds`` with ``msc`` = {config: the MSC config
    file to write, endpoint_url, cache_dir: None for no cache}) through energon's ``get_train_dataset`` + ``get_loader`` (its crude webdataset: raw members)."""
    from megatron.energon import Cooker, DefaultTaskEncoder, WorkerConfig, get_loader, get_train_dataset, stateless

    work = Work(processor)

    @stateless
    def raw(crude: dict) -> dict:
        return crude

    class Encoder(DefaultTaskEncoder):
        decoder = None  # members stay bytes: the image work is ours
        cookers = [Cooker(raw)]

        @stateless
        def encode_sample(self, s: dict):
            return work(s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")})

        def batch(self, samples):
            return Work.collate(samples)

    if msc is not None:
        _msc_config(msc["config"], msc["endpoint_url"], msc.get("cache_dir"), path.split("/")[2])
    wc = WorkerConfig(rank=0, world_size=1, num_workers=workers)
    ds = get_train_dataset(
        path, split_part="train", worker_config=wc, batch_size=BATCH, shuffle_buffer_size=None,
        max_samples_per_sequence=None, task_encoder=Encoder(), repeat=False,
    )  # fmt: skip
    loader = get_loader(ds)
    _drop_pooled_connections()
    return _timed(loader, expected, on_first)


def _msc_config(path: Path, endpoint_url: str, cache_dir: str | None, bucket: str) -> None:
    """energon reads object storage through multi-storage-client: a profile named ``bucket`` for that S3 bucket,
    with MSC's local cache where ``cache_dir`` is given; its config file reaches the forked workers by env."""
    import yaml
    from multistorageclient import shortcuts

    options = {"base_path": bucket, "endpoint_url": endpoint_url, "region_name": "us-east-1"}
    creds = {"access_key": os.environ["AWS_ACCESS_KEY_ID"], "secret_key": os.environ["AWS_SECRET_ACCESS_KEY"]}
    profile = {
        "storage_provider": {"type": "s3", "options": options},
        "credentials_provider": {"type": "S3Credentials", "options": creds},
        "caching_enabled": cache_dir is not None,
    }
    cfg: dict[str, Any] = {"profiles": {bucket: profile}}
    if cache_dir is not None:
        cfg["cache"] = {"size": "20G", "location": cache_dir, "check_source_version": False}
    path.write_text(yaml.safe_dump(cfg))
    os.environ["MSC_CONFIG"] = str(path)
    shortcuts._STORAGE_CLIENT_CACHE.clear()  # MSC keeps one client per profile and process


def _drop_pooled_connections() -> None:
    """energon forks its workers with the parent's MSC client inside its dataset paths; both workers would then
    share the parent's pooled keep-alive connection (crossed responses: checksum errors, broken tar headers,
    60 s timeouts). Closing the pool before the fork gives each worker its own."""
    from multistorageclient import shortcuts

    for client in list(shortcuts._STORAGE_CLIENT_CACHE.values()):
        s3 = getattr(getattr(client, "_storage_provider", None), "_s3_client", None)
        if s3 is not None:
            s3._endpoint.http_session.close()


# ------------------------------------------------------------------------------------------------------
# LitData


def _tar_samples(shard: str):
    """LitData's ``optimize`` function: one item per sample of a tar shard (grouped by ``index.scan_tar``, as our
    index groups them), (key, pickled {suffix: bytes}); the images stay encoded (a sample's fields must be alike
    across samples, and ours hold 0-n images)."""
    from nanovlm.data.index import scan_tar

    blob = Path(shard).read_bytes()
    for ts in scan_tar(shard):
        yield ts.key, pickle.dumps({suffix: blob[o : o + n] for suffix, o, n in ts.members})


def prepare_litdata(shards: Path, work: Path) -> tuple[Path, float]:
    """The shards converted by ``litdata.optimize`` into its chunks in ``work/litdata/ds``: (the dataset
    directory, seconds). The index's shards are converted, and a chunk holds as many samples as a shard does on
    average, so both loaders fetch the same samples per request."""
    import litdata as ld

    from nanovlm.data.index import load_index

    out = work / "litdata" / "ds"
    shutil.rmtree(out, ignore_errors=True)
    index = load_index(shards)
    per_chunk = max(1, round(index.num_samples / len(index.shards)))
    t0 = time.perf_counter()
    method = multiprocessing.get_start_method(allow_none=True)
    try:
        ld.optimize(
            fn=_tar_samples, inputs=[str(index.shard_path(s)) for s in index.shards], output_dir=str(out),
            chunk_size=per_chunk, num_workers=2, reorder_files=False, verbose=False,
        )  # fmt: skip
    finally:  # optimize sets the process-wide start method to spawn (force=True) and leaves it so
        multiprocessing.set_start_method(method, force=True)
    return out, time.perf_counter() - t0


def _allow_plain_http() -> None:
    """LitData's workers fetch with obstore under client options of its own, which ignore AWS_ALLOW_HTTP: a plain
    http endpoint (the loopback server) needs it said. Run at import, so spawned workers (LitData spawns them when
    obstore is in use) do it too as they unpickle the transform."""
    try:
        from litdata.streaming import downloader
    except Exception:  # noqa: BLE001 - LitData not installed
        return
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = "true"


_allow_plain_http()


class _LitTransform:
    def __init__(self, processor: Any) -> None:
        self.work = Work(processor)

    def __call__(self, item):
        key, blob = item
        return self.work(key, pickle.loads(blob))


def litdata_epoch(
    path: str,
    processor: Any,
    expected: int,
    workers: int = 2,
    cache_dir: str | None = None,
    endpoint_url: str = "",
    on_first: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """One shuffled epoch of ``path`` (a local directory or ``s3://bucket/ds``) through ``StreamingDataset`` +
    ``StreamingDataLoader``; remote chunks are cached in ``cache_dir``."""
    import litdata as ld

    options = {"endpoint_url": endpoint_url} if endpoint_url else {}
    ds = ld.StreamingDataset(
        path, cache_dir=cache_dir, shuffle=True, transform=_LitTransform(processor), max_cache_size="20GB",
        storage_options=options,
    )  # fmt: skip
    loader = ld.StreamingDataLoader(ds, batch_size=BATCH, num_workers=workers, collate_fn=Work.collate)
    return _timed(loader, expected, on_first)
