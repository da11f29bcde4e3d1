"""Remote datasets (data/remote.py, data/index.py's fetch_index) against real servers on loopback: moto's S3 API
server and an HTTP server with byte ranges that fails a share of its requests. Batches read from a URL equal those
read from the local copy, with workers, through exact and elastic resume and through faults; a vanished shard or a
corrupt index is a named error; credentials appear in no message. The shard cache's own tests: test_shard_cache.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import fsspec
import pytest
import torch
from helpers.data import make_cfg, make_dm, take
from helpers.hub import hub_server
from helpers.servers import FaultPlan, gcs_server, http_server, s3_server, upload

from nanovlm.data.datamodule import PackedMultimodalDataModule
from nanovlm.data.index import DatasetIndexError, fetch_index, load_index
from nanovlm.data.remote import (
    RemoteCounters,
    RemoteError,
    RemoteGoneError,
    RetryPolicy,
    download,
    filesystem,
    is_remote,
    redact,
    with_retries,
)
from nanovlm.data.shard_cache import ShardCache, ShardInfo

pytest.importorskip("s3fs")
FAST = RetryPolicy(attempts=4, base_delay=0.001, max_delay=0.01)


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


def test_training_from_s3_equals_local_with_exact_and_elastic_resume(served, tiny_tokenizer, tmp_path, monkeypatch):
    """moto's S3 server, found through AWS_ENDPOINT_URL: 2 workers read the same batches as from the local copy;
    a state saved mid-epoch (from either copy: the content hash names the data, not its place) resumes exactly,
    and elastically onto 2 ranks with nothing lost or repeated."""
    local_cfg = make_cfg([served / "a"], num_workers=2)
    ref_dm = make_dm(local_cfg, tiny_tokenizer)
    per_epoch = ref_dm.current_split().batches_per_rank()
    want = take(ref_dm, per_epoch + 2)  # into the second epoch
    with s3_server(monkeypatch) as (fs, bucket):
        upload(fs, served / "a", f"{bucket}/sets/a")
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


def test_training_from_gcs_equals_local_and_resumes_exactly(served, tiny_tokenizer, tmp_path, monkeypatch):
    """gs:// through gcsfs against a GCS API emulator on loopback (STORAGE_EMULATOR_HOST): 2 workers read the
    local copy's batches, and a state saved mid-epoch resumes exactly."""
    pytest.importorskip("gcsfs")
    pytest.importorskip("gcp_storage_emulator")
    want = take(make_dm(make_cfg([served / "a"], num_workers=2), tiny_tokenizer), 5)
    with gcs_server(monkeypatch) as (fs, bucket):
        upload(fs, served / "a", f"{bucket}/sets/a")
        cfg = make_cfg([f"gs://{bucket}/sets/a"], num_workers=2, cache_dir=str(tmp_path / "cache"))
        dm = make_dm(cfg, tiny_tokenizer)
        same_batches(take(dm, 3), want[:3])
        again = make_dm(cfg, tiny_tokenizer)
        again.load_state_dict(dm.state_dict())
        same_batches(take(again, 2), want[3:5])
        assert dm.state_dict()["dataset_names"] == [f"gs://{bucket}/sets/a"]
        assert len(list((tmp_path / "cache").rglob("*.tar"))) == len(load_index(served / "a").shards)  # staged


def test_training_from_the_hub_equals_local_and_resumes_exactly(served, tiny_tokenizer, tmp_path):
    """hf:// through huggingface_hub's HfFileSystem against a Hub API server on loopback: 2 workers read the local
    copy's batches, a state saved mid-epoch resumes exactly, and every shard is fetched whole, once."""
    want = take(make_dm(make_cfg([served / "a"], num_workers=2), tiny_tokenizer), 5)
    with hub_server(served, "org/vlm") as (_, log):
        cfg = make_cfg(["hf://datasets/org/vlm/a"], num_workers=2, cache_dir=str(tmp_path / "cache"))
        dm = make_dm(cfg, tiny_tokenizer)
        same_batches(take(dm, 3), want[:3])
        again = make_dm(cfg, tiny_tokenizer)
        again.load_state_dict(dm.state_dict())
        same_batches(take(again, 2), want[3:5])
    assert dm.state_dict()["dataset_names"] == ["hf://datasets/org/vlm/a"]
    shards = [s.name for s in load_index(served / "a").shards]
    assert len(list((tmp_path / "cache").rglob("*.tar"))) == len(shards)  # staged
    fetched = [line for line in log if "/resolve/" in line and ".tar" in line]
    assert sorted(line.rsplit("/", 1)[1] for line in fetched) == sorted(shards)  # one whole request per shard


def test_a_shard_gone_from_the_hub_is_a_named_error(served, tmp_path):
    """A shard deleted from the repository after the client listed its directory (so the client still believes
    it is there): the 404 (an httpx response, not botocore's dict) fails at once with the URL, not after every
    retry."""
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(served / "a", repo / "a")
    name = load_index(served / "a").shards[0].name
    with hub_server(repo, "org/vlm") as (_, log):
        fs, path = filesystem("hf://datasets/org/vlm/a")
        assert f"{path}/{name}" in fs.ls(path, detail=False)
        (repo / "a" / name).unlink()
        with pytest.raises(RemoteGoneError, match=f"hf://datasets/org/vlm/a/{name} is gone"):
            download(f"hf://datasets/org/vlm/a/{name}", tmp_path / "out", FAST)
    assert sum(1 for line in log if name in line) == 1, log  # not retried


def test_http_faults_lose_and_repeat_nothing(served, tiny_tokenizer, tmp_path, caplog):
    """30% of requests answered 503, reset, cut short or delayed: the epoch is the local epoch, batch for
    batch; the retries are counted and logged without credentials."""
    local = make_dm(make_cfg([served / "a"]), tiny_tokenizer)
    n = local.current_split().batches_per_rank()
    want = take(local, n)
    with http_server(served, FaultPlan(rate=0.3, seed=5)) as (url, faults, _):
        cfg = make_cfg([url.replace("http://", "http://user:pw@") + "/a"], cache_dir=str(tmp_path / "cache"))
        with caplog.at_level(logging.WARNING, logger="nanovlm.data.remote"):
            dm = make_dm(cfg, tiny_tokenizer)
            dm.shard_cache.policy = FAST
            same_batches(take(dm, n), want)
        local2 = make_dm(make_cfg([served / "a"], num_workers=2), tiny_tokenizer)
        n2 = local2.current_split().batches_per_rank()
        with_workers = make_cfg([url + "/a"], num_workers=2, cache_dir=str(tmp_path / "cache2"))
        same_batches(take(make_dm(with_workers, tiny_tokenizer), n2), take(local2, n2))  # through 2 worker processes
    assert sum(faults.done[k] for k in ("503", "reset", "truncate")) >= 3
    assert dm.shard_cache.counters.retries >= 1 and "retry" in caplog.text
    assert dm.telemetry()["remote"]["fetched"] == len(load_index(served / "a").shards)  # what the training log shows
    assert ":pw@" not in caplog.text


@contextlib.contextmanager
def s3_behind_a_proxy(monkeypatch, served, faults: FaultPlan):
    """``data/a`` in moto's S3 server, which clients reach through a fault proxy; yields (bucket, the proxy's
    request log)."""
    with s3_server(monkeypatch) as (fs, bucket):
        upload(fs, served / "a", f"{bucket}/a")
        host, port = os.environ["AWS_ENDPOINT_URL"].removeprefix("http://").split(":")
        with http_server(None, faults, upstream=(host, int(port))) as (url, _, log):
            monkeypatch.setenv("AWS_ENDPOINT_URL", url)
            fsspec.filesystem("s3").clear_instance_cache()  # clients made for moto's own address
            yield bucket, log


def test_s3_faults_lose_and_repeat_nothing_and_no_log_holds_a_signature(
    served, tiny_tokenizer, tmp_path, monkeypatch, caplog
):
    """Shards come from S3 as one GET of a presigned URL each (data/presigned.py), here through a proxy in front
    of moto that answers 30% of the requests 503, resets them, cuts them short or delays them: 2 workers read the
    local epoch, batch for batch. A store that keeps failing is a named error; neither it nor the logs (urllib3's
    debug lines included) hold the signature, the key id or the secret."""
    local = make_dm(make_cfg([served / "a"], num_workers=2), tiny_tokenizer)
    n = local.current_split().batches_per_rank()
    want = take(local, n)
    index = load_index(served / "a")
    faults = FaultPlan(rate=0.3, seed=7)
    with s3_behind_a_proxy(monkeypatch, served, faults) as (bucket, log):
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


def test_a_store_that_refuses_presigned_urls_is_read_by_s3fs_transfer(served, tmp_path, monkeypatch, caplog):
    """A missing key answered to a presigned GET is gone (s3fs's transfer says so), and the host keeps its
    presigned GETs. A 403 without an error code about the object (a store that refuses query signatures, a clock
    skew, another region) hands the fetch to s3fs's own transfer, which signs its headers, and the process keeps
    using it for that host."""
    from nanovlm.data import presigned

    monkeypatch.setattr(presigned, "_REFUSED", set())
    index = load_index(served / "a")
    faults = FaultPlan()
    with s3_behind_a_proxy(monkeypatch, served, faults) as (bucket, log):
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
                assert cache.open(u).read() == (served / "a" / u.rsplit("/", 1)[1]).read_bytes()
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


def test_held_out_evaluation_reads_remote_directories(served, tmp_path):
    from nanovlm.train.evaluate import iter_answered_records

    want = [r.key for r in iter_answered_records([str(served / "a")], limit=100)]
    with http_server(served) as (url, _, _):
        got = [r.key for r in iter_answered_records([f"{url}/a"], limit=100, cache_dir=str(tmp_path / "c"))]
    assert got == want and len(got) > 0


def test_a_vanished_shard_is_a_named_error(served, tiny_tokenizer, tmp_path, monkeypatch):
    with s3_server(monkeypatch) as (fs, bucket):
        upload(fs, served / "a", f"{bucket}/a")
        dm = make_dm(make_cfg([f"s3://{bucket}/a"], cache_dir=str(tmp_path / "cache")), tiny_tokenizer)
        dm.shard_cache.policy = FAST
        for s in load_index(served / "a").shards:
            fs.rm(f"{bucket}/a/{s.name}")
        with pytest.raises(Exception) as e:  # the producer's error, naming the shard
            take(dm, 2)
        message = str(e.value)
        assert f"s3://{bucket}/a/shard-0000" in message and "is gone" in message


def test_the_index_is_fetched_checked_and_reused(served, tmp_path):
    with http_server(served) as (url, _, log):
        root = fetch_index(f"{url}/a", tmp_path / "cache")
        assert load_index(root, check_files=False).content_hash == load_index(served / "a").content_hash
        log.clear()
        assert fetch_index(f"{url}/a", tmp_path / "cache") == root
        assert [line.split()[1] for line in log if line.startswith("GET")] == ["/a/index/meta.json"]  # reused
    damaged = tmp_path / "damaged"
    import shutil

    shutil.copytree(served / "a", damaged / "a")
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


def test_the_index_columns_are_fetched_at_once(served, tmp_path):
    """The columns' requests are in flight together, as many as a process keeps connections to a host (each
    answer held back 0.5 s): a remote index costs a round trip or two, not one per column."""
    from nanovlm.data.index import COLUMNS
    from nanovlm.data.presigned import CONNECTIONS

    with http_server(served, FaultPlan(rate=1.0, kinds=("delay",), delay_s=0.5)) as (url, faults, log):
        root = fetch_index(f"{url}/a", tmp_path / "cache")
    assert load_index(root, check_files=False).content_hash == load_index(served / "a").content_hash
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


def test_workers_forked_after_the_cache_is_made_load_no_client_data(served, tmp_path, monkeypatch):
    """``shard_cache`` (made in the trainer's process) loads the S3 client's data and makes a spare session on it:
    a worker forked after it makes its first presigned GET without loading any data or making a session (about
    95 ms of CPU each), where a process forked before loads the service model and the rest and makes its session
    itself; either way the worker signs with the credentials of its own environment."""
    import multiprocessing as mp

    from nanovlm.data import presigned
    from nanovlm.data.shard_cache import shard_cache

    index = load_index(served / "a")
    ctx = mp.get_context("fork")
    with s3_server(monkeypatch) as (fs, bucket):
        upload(fs, served / "a", f"{bucket}/a")
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
            assert (tmp_path / f"{warmed}").read_bytes() == (served / "a" / index.shards[0].name).read_bytes()
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
