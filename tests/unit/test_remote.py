"""Remote datasets (data/remote.py) against real servers on loopback: moto's S3 API server and an HTTP server with
byte ranges that fails a share of its requests. Batches read from a URL equal those read from the local copy, with
workers, through exact and elastic resume and through faults; staged shards are checked, shared and evicted; a
vanished shard or a corrupt index is a named error; credentials appear in no message."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path

import fsspec
import pytest
import torch
from helpers.data import IMAGE_TOKENS, make_cfg, make_dm, take
from helpers.hub import hub_server
from helpers.servers import FaultPlan, gcs_server, http_server, s3_server, upload

from nanovlm.data.datamodule import PackedMultimodalDataModule
from nanovlm.data.index import DatasetIndexError, load_index
from nanovlm.data.remote import (
    Prefetcher,
    RemoteCounters,
    RemoteError,
    RemoteGoneError,
    RetryPolicy,
    ShardCache,
    ShardInfo,
    download,
    fetch_index,
    filesystem,
    is_remote,
    prefetch_depth,
    redact,
    with_retries,
)

pytest.importorskip("s3fs")
FAST = RetryPolicy(attempts=4, base_delay=0.001, max_delay=0.01)


@pytest.fixture(scope="module")
def data(tmp_path_factory, make_dataset):
    root = tmp_path_factory.mktemp("remote")
    make_dataset(root / "a", 60, samples_per_shard=16, seed=3, image_token_count=IMAGE_TOKENS)
    return root


def same_batches(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for x, y in zip(got, want):
        assert x["sample_keys"] == y["sample_keys"]
        for k in ("input_ids", "labels", "cu_seqlens", "pixel_values"):
            assert torch.equal(x[k], y[k]), k


def test_urls_are_recognised_and_redacted():
    assert is_remote("s3://b/p") and is_remote("HTTPS://h/x") and is_remote("hf://datasets/o/n")
    assert not is_remote("/data/x") and not is_remote("data/s3://x") and not is_remote("file:///x")
    assert redact("https://user:pw@host/a/b.tar?X-Amz-Signature=abc#f") == "https://host/a/b.tar"
    assert redact("see https://user:p@ss@host/a and s3://b/k?sig=1.") == "see https://host/a and s3://b/k"


def test_retries_are_bounded_counted_and_a_gone_object_fails_at_once():
    counters, calls = RemoteCounters(), []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("connection reset by peer")
        return "ok"

    assert with_retries(flaky, "s3://b/x", FAST, counters) == "ok" and counters.retries == 2
    calls.clear()

    def gone():
        calls.append(1)
        raise FileNotFoundError("b/x")

    with pytest.raises(RemoteError, match="s3://b/x is gone"):
        with_retries(gone, "s3://b/x", FAST, counters)
    assert len(calls) == 1  # not retried
    url = "https://user:secret-pw@host/x.tar?token=secret-token"

    def down():
        raise TimeoutError(f"timeout reading {url}")

    with pytest.raises(RemoteError) as e:
        with_retries(down, redact(url), FAST, counters)
    assert "still failing after 4 attempts" in str(e.value) and "https://host/x.tar" in str(e.value)
    assert "secret" not in str(e.value)


def test_training_from_s3_equals_local_with_exact_and_elastic_resume(data, tiny_tokenizer, tmp_path, monkeypatch):
    """moto's S3 server, found through AWS_ENDPOINT_URL: 2 workers read the same batches as from the local copy;
    a state saved mid-epoch (from either copy: the content hash names the data, not its place) resumes exactly,
    and elastically onto 2 ranks with nothing lost or repeated."""
    local_cfg = make_cfg([data / "a"], num_workers=2)
    ref_dm = make_dm(local_cfg, tiny_tokenizer)
    per_epoch = ref_dm.current_split().batches_per_rank()
    want = take(ref_dm, per_epoch + 2)  # into the second epoch
    with s3_server(monkeypatch) as (fs, bucket):
        upload(fs, data / "a", f"{bucket}/sets/a")
        cfg = make_cfg([f"s3://{bucket}/sets/a"], num_workers=2, cache_dir=str(tmp_path / "cache"))
        dm = make_dm(cfg, tiny_tokenizer)
        same_batches(take(dm, 3), want[:3])
        state = dm.state_dict()
        assert state["dataset_names"] == [f"s3://{bucket}/sets/a"]  # the plain URL: credentials stay in the env
        again = make_dm(cfg, tiny_tokenizer)
        again.load_state_dict(state)
        same_batches(take(again, per_epoch - 1), want[3 : per_epoch + 2])
        from_local_state = make_dm(cfg, tiny_tokenizer)
        local_state = make_dm(local_cfg, tiny_tokenizer)
        take(local_state, 3)
        from_local_state.load_state_dict(local_state.state_dict())
        same_batches(take(from_local_state, 2), want[3:5])
        # elastic: the rest of the epoch on 2 ranks x 1 worker, from S3 and from the local copy alike
        rest = {}
        for name, c in (("s3", cfg), ("local", local_cfg)):
            c = make_cfg(c.data.train, num_workers=1, cache_dir=c.data.cache_dir)
            keys = []
            for rank in range(2):
                r = PackedMultimodalDataModule(c.data, c.model, tiny_tokenizer, rank=rank, world_size=2)
                r.setup("fit")
                r.load_state_dict(state)
                n = r.current_split().batches_per_rank()
                keys += [k for b in take(r, n) for k in b["sample_keys"]]
            rest[name] = keys
        assert rest["s3"] == rest["local"]
        seen = [k for b in want[:3] for k in b["sample_keys"]] + rest["s3"]
        assert len(seen) == len(set(seen))  # nothing repeated (what is left opens the next epoch as carry)


def test_training_from_gcs_equals_local_and_resumes_exactly(data, tiny_tokenizer, tmp_path, monkeypatch):
    """gs:// through gcsfs against a GCS API emulator on loopback (STORAGE_EMULATOR_HOST): 2 workers read the
    local copy's batches, and a state saved mid-epoch resumes exactly."""
    pytest.importorskip("gcsfs")
    pytest.importorskip("gcp_storage_emulator")
    want = take(make_dm(make_cfg([data / "a"], num_workers=2), tiny_tokenizer), 5)
    with gcs_server(monkeypatch) as (fs, bucket):
        upload(fs, data / "a", f"{bucket}/sets/a")
        cfg = make_cfg([f"gs://{bucket}/sets/a"], num_workers=2, cache_dir=str(tmp_path / "cache"))
        dm = make_dm(cfg, tiny_tokenizer)
        same_batches(take(dm, 3), want[:3])
        again = make_dm(cfg, tiny_tokenizer)
        again.load_state_dict(dm.state_dict())
        same_batches(take(again, 2), want[3:5])
        assert dm.state_dict()["dataset_names"] == [f"gs://{bucket}/sets/a"]
        assert len(list((tmp_path / "cache").rglob("*.tar"))) == len(load_index(data / "a").shards)  # staged


def test_training_from_the_hub_equals_local_and_resumes_exactly(data, tiny_tokenizer, tmp_path):
    """hf:// through huggingface_hub's HfFileSystem against a Hub API server on loopback: 2 workers read the local
    copy's batches, a state saved mid-epoch resumes exactly, and every shard is fetched whole, once."""
    want = take(make_dm(make_cfg([data / "a"], num_workers=2), tiny_tokenizer), 5)
    with hub_server(data, "org/vlm") as (_, log):
        cfg = make_cfg(["hf://datasets/org/vlm/a"], num_workers=2, cache_dir=str(tmp_path / "cache"))
        dm = make_dm(cfg, tiny_tokenizer)
        same_batches(take(dm, 3), want[:3])
        again = make_dm(cfg, tiny_tokenizer)
        again.load_state_dict(dm.state_dict())
        same_batches(take(again, 2), want[3:5])
    assert dm.state_dict()["dataset_names"] == ["hf://datasets/org/vlm/a"]
    shards = [s.name for s in load_index(data / "a").shards]
    assert len(list((tmp_path / "cache").rglob("*.tar"))) == len(shards)  # staged
    fetched = [line for line in log if "/resolve/" in line and ".tar" in line]
    assert sorted(line.rsplit("/", 1)[1] for line in fetched) == sorted(shards)  # one whole request per shard


def test_a_shard_gone_from_the_hub_is_a_named_error(data, tmp_path):
    """A shard deleted from the repository after the client listed its directory (so the client still believes
    it is there): the 404 (an httpx response, not botocore's dict) fails at once with the URL, not after every
    retry."""
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(data / "a", repo / "a")
    name = load_index(data / "a").shards[0].name
    with hub_server(repo, "org/vlm") as (_, log):
        fs, path = filesystem("hf://datasets/org/vlm/a")
        assert f"{path}/{name}" in fs.ls(path, detail=False)
        (repo / "a" / name).unlink()
        with pytest.raises(RemoteGoneError, match=f"hf://datasets/org/vlm/a/{name} is gone"):
            download(f"hf://datasets/org/vlm/a/{name}", tmp_path / "out", FAST)
    assert sum(1 for line in log if name in line) == 1, log  # not retried


def test_http_faults_lose_and_repeat_nothing(data, tiny_tokenizer, tmp_path, caplog):
    """30% of requests answered 503, reset, cut short or delayed: the epoch is the local epoch, batch for
    batch; the retries are counted and logged without credentials."""
    local = make_dm(make_cfg([data / "a"]), tiny_tokenizer)
    n = local.current_split().batches_per_rank()
    want = take(local, n)
    with http_server(data, FaultPlan(rate=0.3, seed=5)) as (url, faults, _):
        cfg = make_cfg([url.replace("http://", "http://user:pw@") + "/a"], cache_dir=str(tmp_path / "cache"))
        with caplog.at_level(logging.WARNING, logger="nanovlm.data.remote"):
            dm = make_dm(cfg, tiny_tokenizer)
            dm.shard_cache.policy = FAST
            same_batches(take(dm, n), want)
        local2 = make_dm(make_cfg([data / "a"], num_workers=2), tiny_tokenizer)
        n2 = local2.current_split().batches_per_rank()
        with_workers = make_cfg([url + "/a"], num_workers=2, cache_dir=str(tmp_path / "cache2"))
        same_batches(take(make_dm(with_workers, tiny_tokenizer), n2), take(local2, n2))  # through 2 worker processes
    assert sum(faults.done[k] for k in ("503", "reset", "truncate")) >= 3
    assert dm.shard_cache.counters.retries >= 1 and "retry" in caplog.text
    assert dm.telemetry()["remote"]["fetched"] == len(load_index(data / "a").shards)  # what the training log shows
    assert ":pw@" not in caplog.text


@contextlib.contextmanager
def s3_behind_a_proxy(monkeypatch, data, faults: FaultPlan):
    """``data/a`` in moto's S3 server, which clients reach through a fault proxy; yields (bucket, the proxy's
    request log)."""
    with s3_server(monkeypatch) as (fs, bucket):
        upload(fs, data / "a", f"{bucket}/a")
        host, port = os.environ["AWS_ENDPOINT_URL"].removeprefix("http://").split(":")
        with http_server(None, faults, upstream=(host, int(port))) as (url, _, log):
            monkeypatch.setenv("AWS_ENDPOINT_URL", url)
            fsspec.filesystem("s3").clear_instance_cache()  # clients made for moto's own address
            yield bucket, log


def test_s3_faults_lose_and_repeat_nothing_and_no_log_holds_a_signature(
    data, tiny_tokenizer, tmp_path, monkeypatch, caplog
):
    """Shards come from S3 as one GET of a presigned URL each (data/presigned.py), here through a proxy in front
    of moto that answers 30% of the requests 503, resets them, cuts them short or delays them: 2 workers read the
    local epoch, batch for batch. A store that keeps failing is a named error; neither it nor the logs (urllib3's
    debug lines included) hold the signature, the key id or the secret."""
    local = make_dm(make_cfg([data / "a"], num_workers=2), tiny_tokenizer)
    n = local.current_split().batches_per_rank()
    want = take(local, n)
    index = load_index(data / "a")
    faults = FaultPlan(rate=0.3, seed=7)
    with s3_behind_a_proxy(monkeypatch, data, faults) as (bucket, log):
        cfg = make_cfg([f"s3://{bucket}/a"], num_workers=2, cache_dir=str(tmp_path / "cache"))
        with caplog.at_level(logging.WARNING, logger="nanovlm.data.remote"):
            dm = make_dm(cfg, tiny_tokenizer)
            dm.shard_cache.policy = FAST
            same_batches(take(dm, n), want)
        fetches = [line for line in log if any(f"/{s.name}" in line for s in index.shards)]
        assert {line.split()[0] for line in fetches} == {"GET"}  # no HEAD first: one request per attempt
        assert all("X-Amz-Algorithm=AWS4-HMAC-SHA256" in line for line in fetches), fetches[:2]  # presigned, SigV4
        assert sum(faults.done[k] for k in ("503", "reset", "truncate")) >= 3
        assert "retry" in caplog.text
        faults.rate, faults.kinds = 1.0, ("503",)
        u = f"s3://{bucket}/a/{index.shards[0].name}"
        cache = ShardCache(tmp_path / "c", 10**9, {u: ShardInfo(index.shards[0].size_bytes)}, FAST)
        failing = pytest.raises(RemoteError, match=f"{u}: still failing after 4 attempts .*HTTP 503")
        with caplog.at_level(logging.DEBUG, logger="urllib3"), failing as e:
            cache.open(u)
    assert f"GET /{bucket}/a/{index.shards[0].name} " in caplog.text  # urllib3's debug line, without its query
    for text in (str(e.value), caplog.text):
        for secret in ("Signature", "X-Amz-Credential", "test-key-id", "test-secret"):
            assert secret not in text


def test_a_store_that_refuses_presigned_urls_is_read_by_s3fs_transfer(data, tmp_path, monkeypatch, caplog):
    """A missing key answered to a presigned GET is gone (s3fs's transfer says so), and the host keeps its
    presigned GETs. A 403 without an error code about the object (a store that refuses query signatures, a clock
    skew, another region) hands the fetch to s3fs's own transfer, which signs its headers, and the process keeps
    using it for that host."""
    from nanovlm.data import presigned

    monkeypatch.setattr(presigned, "_REFUSED", set())
    index = load_index(data / "a")
    faults = FaultPlan()
    with s3_behind_a_proxy(monkeypatch, data, faults) as (bucket, log):
        urls = [f"s3://{bucket}/a/{s.name}" for s in index.shards]
        shards = {u: ShardInfo(s.size_bytes, s.crc32) for u, s in zip(urls, index.shards)}
        cache = ShardCache(tmp_path / "c", 10**9, shards | {urls[0] + ".gone": ShardInfo(1)}, FAST)
        with pytest.raises(RemoteGoneError):
            cache.open(urls[0] + ".gone")
        assert ["Signature=" in line for line in log if line.startswith("GET")] == [True, False]  # then s3fs's
        assert not presigned._REFUSED
        log.clear()
        faults.refuse_presigned = True
        with caplog.at_level(logging.WARNING, logger="nanovlm.data.presigned"):
            for u in urls:
                assert cache.open(u).read() == (data / "a" / u.rsplit("/", 1)[1]).read_bytes()
        gets = [line.split()[1] for line in log if line.startswith("GET")]
        assert ["Signature=" in g for g in gets] == [True] + [False] * len(urls)  # one refusal, then s3fs's
        assert caplog.text.count("HTTP 403 to a presigned GET") == 1


def test_prepare_data_writes_to_s3(tmp_path, tiny_tokenizer, monkeypatch, capsys):
    """prepare_data --output s3://...: the uploaded dataset trains exactly as the same JSONL prepared locally; a
    re-run with less data replaces it and removes the shards its index no longer lists."""
    import json

    from helpers.synthetic import synthetic_image

    from nanovlm.cli.prepare_data import main

    rng = __import__("numpy").random.default_rng(0)
    (tmp_path / "img.png").write_bytes(synthetic_image(rng, 20, 16, "PNG"))
    rows = [
        {"image": "img.png", "conversations": [{"from": "human", "value": f"<image>q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
        for i in range(30)
    ]  # fmt: skip
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "small.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:5]))
    monkeypatch.setenv("NANOVLM_CACHE", str(tmp_path / "cache"))
    common = ["--tokenizer", tiny_tokenizer.name_or_path, "--samples-per-shard", "8"]
    assert main(["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "local"), *common]) == 0
    with s3_server(monkeypatch) as (fs, bucket):
        url = f"s3://{bucket}/sets/qa"
        assert main(["--input", str(tmp_path / "in.jsonl"), "--output", url, *common]) == 0
        assert "uploaded" in capsys.readouterr().out
        assert sorted(p.rsplit("/", 1)[1] for p in fs.glob(f"{bucket}/sets/qa/shard-*.tar")) == [
            f"shard-00000{i}.tar" for i in range(4)
        ]
        cfg = make_cfg([url], cache_dir=str(tmp_path / "cache"))
        same_batches(
            take(make_dm(cfg, tiny_tokenizer), 3), take(make_dm(make_cfg([tmp_path / "local"]), tiny_tokenizer), 3)
        )
        assert main(["--input", str(tmp_path / "small.jsonl"), "--output", url, *common]) == 0
        assert len(fs.glob(f"{bucket}/sets/qa/shard-*.tar")) == 1
        assert load_index(url, cache_dir=str(tmp_path / "cache")).num_samples == 5


def test_held_out_evaluation_reads_remote_directories(data, tmp_path):
    from nanovlm.train.evaluate import iter_answered_records

    want = [r.key for r in iter_answered_records([str(data / "a")], limit=100)]
    with http_server(data) as (url, _, _):
        got = [r.key for r in iter_answered_records([f"{url}/a"], limit=100, cache_dir=str(tmp_path / "c"))]
    assert got == want and len(got) > 0


def test_prefetch_asks_no_more_than_the_node_cache_holds_for_every_worker(
    data, tiny_tokenizer, tmp_path, monkeypatch, caplog
):
    """Each worker prefetches ``data.prefetch_shards`` ahead only where the node's cache holds that many for every
    worker of every rank beside a fetch in flight: past that one worker's prefetch evicts another's before it is
    read (twice the bytes per epoch, measured by the stream benchmark). The reduced depth is a logged warning."""
    index = load_index(data / "a")
    shards = {f"s3://b/a/{s.name}": ShardInfo(s.size_bytes, s.crc32) for s in index.shards}
    size = max(i.size for i in shards.values())

    def depth(per_worker: int, workers: int = 2) -> int:
        return prefetch_depth(ShardCache(tmp_path, per_worker * workers * size, shards), 2, workers)

    with caplog.at_level(logging.WARNING, logger="nanovlm.data.remote"):
        assert depth(3) == depth(100) == 2 and not caplog.text
        assert depth(2) == 1 and depth(1) == 0 and "raise data.cache_max_bytes" in caplog.text
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks of 2 workers on the node: 4 workers share it
    with http_server(data) as (url, _, _):
        cfg = make_cfg([f"{url}/a"], cache_dir=str(tmp_path / "c"), num_workers=2, cache_max_bytes=8 * size)
        dm = make_dm(cfg, tiny_tokenizer)
        dm.setup("fit")
        assert dm.prefetch_shards == 1 and dm._stream_spec().prefetch_shards == 1


def test_staged_shards_are_checked_shared_and_evicted(data, tmp_path):
    index = load_index(data / "a")
    with http_server(data) as (url, _, log):
        shards = {f"{url}/a/{s.name}": ShardInfo(s.size_bytes, s.crc32) for s in index.shards}
        urls = list(shards)
        assert all(i.crc32 for i in shards.values())  # written by prepare
        size = max(i.size for i in shards.values())
        cache = ShardCache(tmp_path / "c", int(2.5 * size), shards, FAST)
        threads = [threading.Thread(target=cache.local, args=(urls[0],)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sum(1 for line in log if line.startswith("GET") and urls[0].rsplit("/", 1)[1] in line) == 1
        cache.local(urls[1])
        cache.want([urls[0], urls[3]])  # the plan reads shard 0 again next: shard 1 goes first
        cache.local(urls[2])
        staged = {p.name for p in (tmp_path / "c").iterdir() if not p.name.endswith(".lock")}
        assert len(staged) == 2 and any(urls[0].rsplit("/", 1)[1] in n for n in staged)
        # a staged copy damaged on disk (same size) is caught by its CRC in a process that has not checked it yet
        path = cache.local(urls[0])
        blob = bytearray(path.read_bytes())
        blob[700] ^= 0xFF
        path.write_bytes(bytes(blob))
        fresh = ShardCache(tmp_path / "c", int(2.5 * size), shards, FAST)
        assert fresh.local(urls[0]).read_bytes() != bytes(blob) and fresh.counters.refetched == 1
        # an object replaced by other bytes (here: its size in the index is wrong) is never trusted
        bad = ShardCache(tmp_path / "d", 10 * size, {urls[1]: ShardInfo(shards[urls[1]].size + 1)}, FAST)
        with pytest.raises(RemoteError, match=r"still failing .*the index says"):
            bad.local(urls[1])
        assert not list((tmp_path / "d").glob("*.tar")) and not list((tmp_path / "d").glob(".*part"))


def test_eviction_takes_read_copies_before_ones_a_worker_reads_next(data, tmp_path):
    """Two caches on one directory are two workers of a node, each knowing only its own plan. A copy no one has
    read yet (a prefetch) and one another worker reads next (``want``) are evicted after every copy that was read,
    however long ago they were staged: one worker's fetch never evicts what another prefetched for its reader."""
    index = load_index(data / "a")
    with http_server(data) as (url, _, _):
        shards = {f"{url}/a/{s.name}": ShardInfo(s.size_bytes, s.crc32) for s in index.shards}
        urls = list(shards)
        size = max(i.size for i in shards.values())
        w1, w2 = (ShardCache(tmp_path / "c", 2 * size, shards, FAST) for _ in range(2))

        def staged() -> set[str]:
            return {u for u in urls if w1._path(u).exists()}

        w2.local(urls[0])  # w2's prefetch: staged first, not read yet
        w1.open(urls[1]).close()  # read by w1
        w1.local(urls[2])  # the read copy goes, not the older unread one
        assert staged() == {urls[0], urls[2]}
        w1.open(urls[2]).close()
        w2.open(urls[0]).close()  # now both are read, shard 0 last
        w2.want([urls[2]])  # w1 read it; w2 reads it next
        w1.local(urls[3])
        assert staged() == {urls[2], urls[3]}
        w2.open(urls[2]).close()  # read now: it goes before shard 3, not read yet
        w1.local(urls[1])
        assert staged() == {urls[1], urls[3]}


def test_a_shard_the_reader_holds_takes_no_place_in_the_prefetch_depth(data, tmp_path):
    """The packer's look-ahead spans two shards where one ends and the next begins, so a reader often holds the
    shard it finishes while it reads the next: the one held open needs no fetch and no room in the cache, and the
    depth counts from the first shard it does not hold."""
    import time

    from nanovlm.data.reader import ShardReader

    index = load_index(data / "a")
    with http_server(data) as (url, _, log):
        shards = {f"{url}/a/{s.name}": ShardInfo(s.size_bytes, s.crc32) for s in index.shards}
        urls = list(shards)
        cache = ShardCache(tmp_path / "c", 10 * max(i.size for i in shards.values()), shards, FAST)
        reader = ShardReader(cache=cache)
        path, off, n, key = next(iter(index.sample_refs()))
        reader.read_members(urls[0], off, n, key)
        assert reader.holds(urls[0]) and not reader.holds(urls[1])
        prefetch = Prefetcher(cache, concurrency=2, ahead=1, held=reader.holds)
        prefetch.upcoming(urls[:4])  # held, read next, one ahead, beyond the depth
        deadline = time.monotonic() + 30
        while not all(cache._path(u).exists() for u in urls[1:3]) and time.monotonic() < deadline:
            time.sleep(0.02)
        prefetch.close()
        reader.close()
    assert all(cache._path(u).exists() for u in urls[1:3]) and not cache._path(urls[3]).exists()
    assert cache.counters.fetched == 3  # shard 0 by the reader, 1 and 2 by prefetch


def test_prefetch_near_an_epoch_end_asks_for_the_next_epochs_first_shards(make_dataset, tiny_tokenizer, tmp_path):
    """A worker's next epoch starts in other shards (its chunk of a new order, after the samples it carries), so
    within the last packs of an epoch prefetch asks for the shards of the next epoch's first packs, and the new
    epoch's first reads find them staged rather than waiting for them."""
    from nanovlm.data.stream import LOOKAHEAD, PackStream

    class Asked:
        def __init__(self) -> None:
            self.lists: list[list[str]] = []

        def upcoming(self, urls) -> None:
            self.lists.append(list(urls))

    make_dataset(tmp_path / "ds", 96, samples_per_shard=4, image_token_count=IMAGE_TOKENS)
    dm = make_dm(make_cfg([tmp_path / "ds"], num_workers=2), tiny_tokenizer)
    dm.setup("fit")
    stream, asked = PackStream(dm._stream_spec(), dm.position, dm.current_split()), Asked()
    packs, n = stream._packs(0, 0, asked), dm.current_split().packs_per_slot
    read_in_epoch_0 = {r.path for _ in range(n) for r in next(packs).refs}  # slot 0's packs of epoch 0
    asked_in_epoch_0 = {u for urls in asked.lists for u in urls}
    assert n // 2 < LOOKAHEAD - 1  # the first packs of epoch 1 below lie within epoch 0's last look-ahead
    first = [next(packs) for _ in range(n // 2)]
    assert first[0].epoch == 1 and first[-1].epoch == 1
    new_shards = {r.path for p in first for r in p.refs} - read_in_epoch_0
    assert new_shards and new_shards <= asked_in_epoch_0


def _deleted_but_open(directory: Path) -> int:
    """Bytes of the files under ``directory`` that are deleted but still held open by this process."""
    held = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(directory)) and target.endswith(" (deleted)"):
                held += os.fstat(int(fd)).st_size
    return held


def test_readers_hold_few_evicted_copies_and_fetch_a_shard_read_again(make_dataset, tmp_path):
    """A copy the cache evicts keeps its disk space while a reader holds it open: a reader holds at most
    MAX_OPEN_STAGED copies, so the disk holds at most cache_max_bytes and that many shards more, and an epoch
    that reads a shard again fetches it again rather than reading a deleted file (counted in bytes per epoch)."""
    from nanovlm.data.reader import MAX_OPEN_STAGED, ShardReader

    index = make_dataset(tmp_path / "srv" / "ds", 48, samples_per_shard=4, image_token_count=IMAGE_TOKENS)
    assert len(index.shards) == 12
    with http_server(tmp_path / "srv") as (url, _, _):
        shards = {f"{url}/ds/{s.name}": ShardInfo(s.size_bytes, s.crc32) for s in index.shards}
        size = max(i.size for i in shards.values())
        cache = ShardCache(tmp_path / "c", 2 * size, shards, FAST)
        reader, local = ShardReader(cache=cache), ShardReader()
        for _ in range(2):  # two epochs
            for path, off, n, key in index.sample_refs():
                got = reader.read_members(f"{url}/ds/{Path(path).name}", off, n, key)
                assert got == local.read_members(str(path), off, n, key)
                staged = sum(p.stat().st_size for p in (tmp_path / "c").glob("*.tar"))
                assert staged <= 2 * size and _deleted_but_open(tmp_path / "c") <= MAX_OPEN_STAGED * size
        assert cache.counters.fetched == 2 * len(index.shards)
        reader.close()


def test_wait_counts_the_fetches_readers_wait_for_and_not_the_prefetched(data, tmp_path):
    """``wait_ms``: a reader opening a shard that is not staged waits for its fetch (here 0.3 s of latency per
    request), and one whose prefetch is still in flight waits for that fetch instead of making its own; a shard
    staged beforehand opens at once."""
    index = load_index(data / "a")
    with http_server(data, FaultPlan(rate=1.0, kinds=("delay",), delay_s=0.3)) as (url, _, _):
        shards = {f"{url}/a/{s.name}": ShardInfo(s.size_bytes, s.crc32) for s in index.shards}
        urls = list(shards)
        cache = ShardCache(tmp_path / "c", 10 * max(i.size for i in shards.values()), shards, FAST)
        cache.open(urls[0]).close()
        assert cache.counters.wait_ms >= 300 and cache.counters.snapshot()["wait_ms"] == cache.counters.wait_ms
        cache.local(urls[1])  # staged beforehand, as a finished prefetch leaves it
        waited = cache.counters.wait_ms
        cache.open(urls[1]).close()
        assert cache.counters.wait_ms - waited < 100
        prefetch = Prefetcher(cache, ahead=0)
        prefetch.upcoming([urls[2]])  # in flight while the reader asks for it
        cache.open(urls[2]).close()
        prefetch.close()
        assert cache.counters.wait_ms - waited >= 200 and cache.counters.fetched == 3


def test_the_shard_read_next_is_fetched_before_the_ones_after_it(data, tmp_path):
    """Prefetch starts the shards after the one read next only once that one is staged: sharing the link with
    them would delay the shard the reader waits for (every request here waits 0.3 s before its answer)."""
    import time

    index = load_index(data / "a")
    with http_server(data, FaultPlan(rate=1.0, kinds=("delay",), delay_s=0.3)) as (url, _, log):
        shards = {f"{url}/a/{s.name}": ShardInfo(s.size_bytes, s.crc32) for s in index.shards}
        urls = list(shards)[:3]
        cache = ShardCache(tmp_path / "c", 10 * max(i.size for i in shards.values()), shards, FAST)
        prefetch = Prefetcher(cache, concurrency=2, ahead=2)
        prefetch.upcoming(urls)
        time.sleep(0.15)  # the first shard's request is waiting for its answer

        def asked(u: str) -> bool:
            return any(u.rsplit("/", 1)[1] in line for line in log)

        assert asked(urls[0]) and not asked(urls[1]) and not asked(urls[2])
        for u in urls:  # then the others, each fetched once
            cache.open(u).close()
        prefetch.close()
    assert cache.counters.fetched == 3 and all(asked(u) for u in urls)


def test_closing_the_prefetcher_with_a_fetch_queued_returns_at_once(data, tmp_path):
    """The pool cancels a queued fetch, and so runs its callbacks, while it holds its own lock: the callback that
    would start the shards after it must not submit (a worker at the end of its epoch would hang on itself)."""
    index = load_index(data / "a")
    with http_server(data, FaultPlan(rate=1.0, kinds=("delay",), delay_s=0.3)) as (url, _, _):
        shards = {f"{url}/a/{s.name}": ShardInfo(s.size_bytes, s.crc32) for s in index.shards}
        urls = list(shards)
        cache = ShardCache(tmp_path / "c", 10 * max(i.size for i in shards.values()), shards, FAST)
        prefetch = Prefetcher(cache, concurrency=1, ahead=1)
        prefetch.upcoming(urls[:2])  # the first shard in flight
        prefetch.upcoming(urls[2:4])  # the next plan's first shard queued behind it
        closing = threading.Thread(target=prefetch.close, daemon=True)
        closing.start()
        closing.join(5)
        assert not closing.is_alive()
        prefetch.upcoming(urls[1:3])  # after close: nothing, and no error


def _reader_process(cache: ShardCache, urls: list[str], seed: int, out) -> None:
    import random as rnd
    import zlib

    try:
        for url in rnd.Random(seed).sample(urls * 3, 3 * len(urls)):
            with cache.open(url) as f:
                assert f"{zlib.crc32(f.read()):08x}" == cache.shards[url].crc32
        out.put(("ok", cache.counters.fetched))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out.put(("error", repr(e)))


def test_processes_sharing_a_small_cache_never_read_a_missing_or_partial_shard(data, tmp_path):
    """Three processes read every shard three times, in their own orders, through one cache that holds 2.5
    shards: each copy they open is whole and checked (eviction never pulls one from under a reader), and the cache
    ends within its cap."""
    import multiprocessing as mp

    index = load_index(data / "a")
    with http_server(data) as (url, _, _):
        shards = {f"{url}/a/{s.name}": ShardInfo(s.size_bytes, s.crc32) for s in index.shards}
        cap = int(2.5 * max(i.size for i in shards.values()))
        ctx = mp.get_context("fork")
        out = ctx.Queue()
        procs = [
            ctx.Process(target=_reader_process, args=(ShardCache(tmp_path / "c", cap, shards, FAST), list(shards), s, out))
            for s in range(3)
        ]  # fmt: skip
        for p in procs:
            p.start()
        results = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
    assert all(r[0] == "ok" for r in results), results
    staged = [p for p in (tmp_path / "c").iterdir() if p.name.endswith(".tar")]
    assert sum(p.stat().st_size for p in staged) <= cap
    assert not [p.name for p in (tmp_path / "c").iterdir() if p.name.endswith((".part", ".dl"))]


def test_a_local_disk_error_is_named_and_not_retried(data, tmp_path):
    """Writing the staged copy fails (here: its temporary name is taken by a directory): one attempt, and the
    error names the cache directory, not the store."""
    import os

    index = load_index(data / "a")
    with http_server(data) as (url, _, log):
        u = f"{url}/a/{index.shards[0].name}"
        cache = ShardCache(tmp_path / "c", 10**9, {u: ShardInfo(index.shards[0].size_bytes)}, FAST)
        (tmp_path / "c").mkdir()
        blocker = tmp_path / "c" / f".{cache._path(u).name}.{os.getpid()}.{threading.get_ident()}.part"
        blocker.mkdir()
        with pytest.raises(RemoteError, match=f"cannot stage .* in {tmp_path / 'c'}"):
            cache.open(u)
        assert sum(1 for line in log if line.startswith("GET")) <= 1  # not retried


def _fetch_under_file_size_limit(cache: ShardCache, url: str, limit: int, out) -> None:
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG, as a full disk does
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    try:
        cache.open(url)
        out.put("opened")
    except RemoteError as e:
        out.put(str(e))


def test_a_disk_that_fills_mid_fetch_is_named_and_not_retried(data, tmp_path):
    """The local disk refuses a write halfway through a fetch (a file size limit stands in for a full disk): one
    request, and the error names the cache directory, not the store."""
    import multiprocessing as mp

    index = load_index(data / "a")
    size = index.shards[0].size_bytes
    with http_server(data) as (url, _, log):
        u = f"{url}/a/{index.shards[0].name}"
        # the index claims a small size, so the reservation fits under the limit and the copy is what hits it
        cache = ShardCache(tmp_path / "c", 10**9, {u: ShardInfo(size // 4)}, FAST)
        out = mp.get_context("fork").Queue()
        proc = mp.get_context("fork").Process(target=_fetch_under_file_size_limit, args=(cache, u, size // 2, out))
        proc.start()
        message = out.get(timeout=60)
        proc.join(30)
    assert message.startswith("cannot stage") and str(tmp_path / "c") in message, message
    assert sum(1 for line in log if line.startswith("GET")) == 1  # not retried


def test_a_vanished_shard_is_a_named_error(data, tiny_tokenizer, tmp_path, monkeypatch):
    with s3_server(monkeypatch) as (fs, bucket):
        upload(fs, data / "a", f"{bucket}/a")
        dm = make_dm(make_cfg([f"s3://{bucket}/a"], cache_dir=str(tmp_path / "cache")), tiny_tokenizer)
        dm.shard_cache.policy = FAST
        for s in load_index(data / "a").shards:
            fs.rm(f"{bucket}/a/{s.name}")
        with pytest.raises(Exception) as e:  # the producer's error, naming the shard
            take(dm, 2)
        message = str(e.value)
        assert f"s3://{bucket}/a/shard-0000" in message and "is gone" in message


def test_the_index_is_fetched_checked_and_reused(data, tmp_path):
    with http_server(data) as (url, _, log):
        root = fetch_index(f"{url}/a", tmp_path / "cache")
        assert load_index(root, check_files=False).content_hash == load_index(data / "a").content_hash
        log.clear()
        assert fetch_index(f"{url}/a", tmp_path / "cache") == root
        assert [line.split()[1] for line in log if line.startswith("GET")] == ["/a/index/meta.json"]  # reused
    damaged = tmp_path / "damaged"
    import shutil

    shutil.copytree(data / "a", damaged / "a")
    col = damaged / "a" / "index" / "text_tokens.npy"
    blob = bytearray(col.read_bytes())
    blob[-1] ^= 0x01
    col.write_bytes(bytes(blob))
    with http_server(damaged) as (url, _, _):
        with pytest.raises(DatasetIndexError, match=r"text_tokens.npy: content does not match"):
            fetch_index(f"{url}/a", tmp_path / "cache2")
        assert not any((tmp_path / "cache2" / "indexes").glob("*/index"))  # nothing half-fetched is kept
        with pytest.raises(FileNotFoundError, match="no index at .*/missing"):
            fetch_index(f"{url}/missing", tmp_path / "cache2", FAST)


def test_the_index_columns_are_fetched_at_once(data, tmp_path):
    """The columns' requests are in flight together, as many as a process keeps connections to a host (each
    answer held back 0.5 s): a remote index costs a round trip or two, not one per column."""
    from nanovlm.data.index import COLUMNS
    from nanovlm.data.presigned import CONNECTIONS

    with http_server(data, FaultPlan(rate=1.0, kinds=("delay",), delay_s=0.5)) as (url, faults, log):
        root = fetch_index(f"{url}/a", tmp_path / "cache")
    assert load_index(root, check_files=False).content_hash == load_index(data / "a").content_hash
    assert sum(".npy" in line for line in log) == len(COLUMNS)
    assert faults.most_in_flight == min(len(COLUMNS), CONNECTIONS) > 1


def _pools_after_fork(out) -> None:
    from nanovlm.data import presigned

    out.put(len(presigned._POOLS))


def _client_data_loaded_by_a_first_get(url: str, dest: str, out) -> None:
    """In a forked process, as a DataLoader worker: the botocore data files its first presigned GET loads, the
    botocore sessions it makes, and the access key its URLs are signed with (its own environment's)."""
    import botocore.loaders
    import botocore.session

    loaded, sessions = [], []
    load_file = botocore.loaders.JSONFileLoader.load_file
    register = botocore.session.Session._register_builtin_handlers

    def counted(self, path, *args, **kwargs):
        found = load_file(self, path, *args, **kwargs)
        if found is not None:
            loaded.append(os.path.basename(path))
        return found

    def made(self, *args, **kwargs):
        sessions.append(1)
        return register(self, *args, **kwargs)

    botocore.loaders.JSONFileLoader.load_file = counted
    botocore.session.Session._register_builtin_handlers = made
    os.environ["AWS_ACCESS_KEY_ID"] = "worker-key-id"  # credentials resolve here, never in the parent
    from nanovlm.data.presigned import _signer, get_presigned

    fs, path = filesystem(url)
    get_presigned(fs, path, Path(dest))
    out.put((loaded, len(sessions), "worker-key-id" in _signer(fs).url(path)))


def test_workers_forked_after_the_cache_is_made_load_no_client_data(data, tmp_path, monkeypatch):
    """``shard_cache`` (made in the trainer's process) loads the S3 client's data and makes a spare session on it:
    a worker forked after it makes its first presigned GET without loading any data or making a session (about
    95 ms of CPU each), where a process forked before loads the service model and the rest and makes its session
    itself; either way the worker signs with the credentials of its own environment."""
    import multiprocessing as mp

    from nanovlm.data import presigned
    from nanovlm.data.remote import shard_cache

    index = load_index(data / "a")
    ctx = mp.get_context("fork")
    with s3_server(monkeypatch) as (fs, bucket):
        upload(fs, data / "a", f"{bucket}/a")
        url = f"s3://{bucket}/a/{index.shards[0].name}"
        loaded = []
        for warmed in (False, True):
            presigned._LOADERS.clear()
            presigned._SPARES.clear()
            if warmed:
                index.source = f"s3://{bucket}/a"  # as fetch_index leaves it
                assert shard_cache([index], tmp_path / "c", 1 << 30) is not None
                [(_, spare)] = presigned._SPARES.values()
                assert spare._credentials is None  # never used here: nothing of this process crosses the fork
            out = ctx.Queue()
            p = ctx.Process(target=_client_data_loaded_by_a_first_get, args=(url, str(tmp_path / f"{warmed}"), out))
            p.start()
            loaded.append(out.get(timeout=60))
            p.join(30)
            assert (tmp_path / f"{warmed}").read_bytes() == (data / "a" / index.shards[0].name).read_bytes()
    presigned._LOADERS.clear()
    presigned._SPARES.clear()
    (cold, cold_sessions, cold_key), (warm, warm_sessions, warm_key) = loaded
    assert "service-2" in cold and "endpoint-rule-set-1" in cold and cold_sessions >= 1
    assert warm == [] and warm_sessions == 0
    assert cold_key and warm_key


def test_preloading_the_client_data_is_only_a_speed_up(monkeypatch, caplog):
    """``warm`` that cannot load botocore's data (a botocore without a file it expects) logs it and returns: the
    workers then load their own, as without it; the trainer's setup never fails on it."""
    from nanovlm.data import presigned

    def broken(kwargs: dict):
        raise FileNotFoundError("endpoint-rule-set-1")

    monkeypatch.setattr(presigned, "_loader", broken)
    fs = fsspec.filesystem("s3", key="k", secret="s", skip_instance_cache=True)
    with caplog.at_level(logging.DEBUG, logger="nanovlm.data.presigned"):
        presigned.warm(fs)
    assert "not preloaded" in caplog.text and "endpoint-rule-set-1" in caplog.text


def test_presigned_gets_go_through_the_environment_proxy_and_verify_as_told(monkeypatch):
    """The presigned GET honours HTTP(S)_PROXY (with its user:password) and NO_PROXY as botocore does, and the
    verify setting s3fs was given (a CA bundle path, or False); a forked process opens its own connections."""
    import base64
    import multiprocessing as mp

    import urllib3

    from nanovlm.data import presigned

    presigned._POOLS.clear()  # (the dict itself: a fork clears it)
    monkeypatch.setenv("HTTPS_PROXY", "http://me:p%40ss@proxy.internal:3128")
    monkeypatch.setenv("NO_PROXY", "store.internal")
    via = presigned._pool("https://bucket.s3.example.com/k?X-Amz-Signature=s", None)
    assert isinstance(via, urllib3.ProxyManager) and via.proxy.host == "proxy.internal"
    assert via.proxy_headers["proxy-authorization"] == "Basic " + base64.b64encode(b"me:p@ss").decode()
    direct = presigned._pool("https://store.internal/b/k", "/etc/ca.pem")
    assert not isinstance(direct, urllib3.ProxyManager) and direct.connection_pool_kw["ca_certs"] == "/etc/ca.pem"
    unverified = presigned._pool("https://store.internal/b/k", False)
    assert unverified.connection_pool_kw["cert_reqs"] == "CERT_NONE"
    assert presigned._pool("https://store.internal/b/k", "/etc/ca.pem") is direct  # reused within a process
    out = mp.get_context("fork").Queue()
    child = mp.get_context("fork").Process(target=_pools_after_fork, args=(out,))
    child.start()
    assert out.get(timeout=30) == 0 and len(presigned._POOLS) == 3
    child.join(30)
