"""Security: nothing in a dataset or a checkpoint is ever executed, and nothing outside the image root is read.

Each hostile input carries a payload whose effect is visible: unpickling it creates a marker file. A control
test first shows that the payload really fires when unpickled (so "the marker does not exist" means "nothing
unpickled it", not "the payload is broken"); then every path that touches such data is run on it.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from faults import conversation, json_bytes, malicious_checkpoint, pickle_payload, png, rewrite_shard, tar_bytes

from nanovlm.data.format import SampleError, members_to_record
from nanovlm.data.prepare import resolve_image_path

HOSTILE_SUFFIXES = ("pyd", "pickle", "pkl", "pth", "pt", "npy")


# ----------------------------------------------------------------------------------------------------------
# the payloads are live


def test_control_pickle_payload_creates_its_marker(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle_payload(marker)
    assert not marker.exists()  # building the payload runs nothing
    pickle.loads(payload)
    assert marker.exists()


def test_control_webdataset_default_decoder_would_unpickle(tmp_path):
    """Why the project must never use webdataset's default decoders on shards: they unpickle .pyd members."""
    from webdataset import autodecode

    marker = tmp_path / "pwned_by_wds"
    autodecode.basichandlers("sample.pyd", pickle_payload(marker))
    assert marker.exists()


def test_control_full_unpickling_of_the_checkpoint_creates_its_marker(tmp_path):
    marker = tmp_path / "pwned_by_ckpt"
    path = malicious_checkpoint(tmp_path / "evil.ckpt", marker)
    assert not marker.exists()
    torch.load(path, weights_only=False)
    assert marker.exists()


# ----------------------------------------------------------------------------------------------------------
# shard members are never unpickled


def hostile_members(marker: Path) -> dict[str, bytes]:
    return {suffix: pickle_payload(marker) for suffix in HOSTILE_SUFFIXES} | {"0.pyd": pickle_payload(marker)}


def test_members_to_record_ignores_pickle_members(tmp_path):
    marker = tmp_path / "pwned"
    members = {"0.png": png(), "json": json_bytes(conversation(1))} | hostile_members(marker)
    record = members_to_record(members, "k")
    assert len(record.images) == 1 and record.messages[-1]["content"] == "a red square"
    assert not marker.exists()


def test_caption_sample_made_only_of_pickles_is_skipped_not_loaded(tmp_path):
    marker = tmp_path / "pwned"
    with pytest.raises(SampleError) as exc:
        members_to_record(hostile_members(marker), "k")
    assert exc.value.reason == "missing_messages"
    assert not marker.exists()


def _dataset_with_hostile_members(path: Path, tokenizer, marker: Path) -> list[str]:
    """A written dataset whose every sample also carries pickle / torch members; returns the keys."""
    from nanovlm.data.format import Record
    from nanovlm.data.prepare import write_dataset

    records = [Record(f"s{i:03d}", conversation(1, answer=f"answer {i}")["messages"], [png(seed=i)]) for i in range(12)]
    write_dataset(records, path, tokenizer, image_token_count=16, samples_per_shard=6)
    evil = [(f"{r.key}.{suffix}", pickle_payload(marker)) for r in records for suffix in HOSTILE_SUFFIXES]
    for shard in range(2):
        keys = {r.key for r in records[shard * 6 : shard * 6 + 6]}
        rewrite_shard(path, shard, lambda k, s, d: d, extra=[(n, d) for n, d in evil if n.split(".")[0] in keys])
    return [r.key for r in records]


def test_datamodule_never_unpickles_shard_members(tmp_path, tiny_tokenizer):
    from test_reliability_data import data_module, run_epochs

    marker = tmp_path / "pwned"
    keys = _dataset_with_hostile_members(tmp_path / "ds", tiny_tokenizer, marker)
    dm = data_module(tmp_path / "ds", tiny_tokenizer)
    delivered = run_epochs(dm)[0]
    assert sorted(delivered) == keys  # the hostile members are ignored, the samples train
    assert dm.telemetry()["skips_by_reason"] == {}
    assert not marker.exists()


def test_datamodule_worker_processes_never_unpickle_shard_members(tmp_path, tiny_tokenizer):
    """Same with a DataLoader worker process (the decode path of real runs)."""
    from test_reliability_data import data_module, run_epochs

    marker = tmp_path / "pwned"
    keys = _dataset_with_hostile_members(tmp_path / "ds", tiny_tokenizer, marker)
    delivered = run_epochs(data_module(tmp_path / "ds", tiny_tokenizer, **{"data.num_workers": 1}))[0]
    assert sorted(delivered) == keys
    assert not marker.exists()


def test_prepare_data_index_only_never_unpickles_shard_members(tmp_path, tiny_tokenizer):
    """Indexing someone else's shards (``--input DIR``) reads them but never loads pickles."""
    from nanovlm.cli.prepare_data import main

    marker = tmp_path / "pwned"
    shards = tmp_path / "foreign"
    shards.mkdir()
    members = []
    for i in range(4):
        members += [(f"x{i}.jpg", png(seed=i)), (f"x{i}.json", json_bytes(conversation(1)))]
        members += [(f"x{i}.{suffix}", pickle_payload(marker)) for suffix in HOSTILE_SUFFIXES]
    (shards / "part-0.tar").write_bytes(tar_bytes(members))
    assert main(["--input", str(shards), "--output", str(shards), "--tokenizer", tiny_tokenizer.name_or_path]) == 0
    index = json.loads((shards / "index.json").read_text())
    assert index["shards"][0]["keys"] == ["x0", "x1", "x2", "x3"]
    assert not marker.exists()


def test_postscript_image_is_never_handed_to_ghostscript(tmp_path, monkeypatch):
    """PIL would open an EPS member named .jpg/.png and run Ghostscript on it when decoding; only raster
    formats are opened. A stand-in ``gs`` first on PATH would leave a marker if anything ran it."""
    from PIL import Image

    from nanovlm.data.prepare import inspect_image
    from nanovlm.data.processing import decode_image

    marker = tmp_path / "gs_ran"
    fake_gs = tmp_path / "bin" / "gs"
    fake_gs.parent.mkdir()
    fake_gs.write_text(f'#!/bin/sh\n[ "$1" = "--version" ] && echo 10.0 && exit 0\ntouch {marker}\nexit 1\n')
    fake_gs.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_gs.parent}{os.pathsep}{os.environ['PATH']}")
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 16\nnewpath 0 0 moveto 16 16 lineto stroke\nshowpage\n"
    with pytest.raises(subprocess.CalledProcessError):  # control: PIL itself does run "gs" on these bytes
        Image.open(io.BytesIO(eps)).load()
    assert marker.exists()
    marker.unlink()
    for decode in (inspect_image, decode_image):
        with pytest.raises(SampleError, match="unreadable_image"):
            decode(eps)
    assert not marker.exists()


def test_tar_member_names_cannot_write_outside(tmp_path, tiny_tokenizer):
    """Members named ``../../x`` or ``/abs/x`` (tar slip): nothing extracts shards to disk, so nothing is
    written anywhere, whatever the names say; such members are just not part of any sample."""
    from nanovlm.cli.prepare_data import main

    shards = tmp_path / "a" / "b" / "foreign"
    shards.mkdir(parents=True)
    escaped = tmp_path / "a" / "escaped.txt"
    absolute = tmp_path / "absolute.txt"
    members = [("x0.jpg", png()), ("x0.json", json_bytes(conversation(1)))]
    members += [("../../escaped.txt", b"owned"), (str(absolute), b"owned")]
    (shards / "part-0.tar").write_bytes(tar_bytes(members))
    main(["--input", str(shards), "--output", str(shards), "--tokenizer", tiny_tokenizer.name_or_path])
    index = json.loads((shards / "index.json").read_text())
    assert index["shards"][0]["keys"][0] == "x0"
    assert not escaped.exists() and not absolute.exists()
    assert sorted(p.name for p in shards.iterdir()) == ["index.json", "part-0.tar", "rejected.jsonl"]


# ----------------------------------------------------------------------------------------------------------
# image paths in JSONL stay inside --image-root


@pytest.fixture
def image_root(tmp_path):
    root = tmp_path / "images"
    (root / "sub").mkdir(parents=True)
    (root / "ok.png").write_bytes(png())
    (root / "sub" / "ok2.png").write_bytes(png(seed=1))
    outside = tmp_path / "secret.png"
    outside.write_bytes(png(seed=2))
    (root / "link.png").symlink_to(outside)
    (root / "linkdir").symlink_to(tmp_path)
    return root


@pytest.mark.parametrize(
    "ref",
    ["../secret.png", "../../etc/passwd", "sub/../../secret.png", "link.png", "linkdir/secret.png", "/etc/passwd"],
)
def test_image_path_escaping_the_root_is_unsafe_path(image_root, ref):
    with pytest.raises(SampleError) as exc:
        resolve_image_path(ref, image_root, key="k")
    assert exc.value.reason == "unsafe_path"


def test_image_paths_inside_the_root_resolve(image_root):
    assert resolve_image_path("ok.png", image_root) == (image_root / "ok.png").resolve()
    assert resolve_image_path("sub/../sub/ok2.png", image_root) == (image_root / "sub" / "ok2.png").resolve()
    assert resolve_image_path(str(image_root.parent / "secret.png"), image_root, allow_absolute=True).is_file()


def test_prepare_data_rejects_escaping_paths_and_lists_them(tmp_path, image_root, tiny_tokenizer, capsys):
    """End to end: unsafe lines are counted, listed in rejected.jsonl with reason unsafe_path, never read
    (no content of the outside file reaches the shards), and the safe lines are written."""
    from nanovlm.cli.prepare_data import main

    lines = {
        "ok.png": "ok",
        "sub/ok2.png": "ok",
        "../secret.png": "unsafe_path",
        "../../../../../../etc/passwd": "unsafe_path",
        "link.png": "unsafe_path",
        "linkdir/secret.png": "unsafe_path",
        str(image_root.parent / "secret.png"): "unsafe_path",  # absolute, not allowed by default
        "/etc/passwd": "unsafe_path",
        "missing.png": "missing_image",
    }
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("".join(json.dumps({"images": [ref]} | conversation(1)) + "\n" for ref in lines))
    out = tmp_path / "out"
    args = ["--input", str(jsonl), "--output", str(out), "--image-root", str(image_root)]
    assert main([*args, "--tokenizer", tiny_tokenizer.name_or_path]) == 0
    rejected = [json.loads(x) for x in (out / "rejected.jsonl").read_text().splitlines()]
    expected = [(f"data.jsonl:{i + 1}", reason) for i, reason in enumerate(lines.values()) if reason != "ok"]
    assert [(r["source"], r["reason"]) for r in rejected] == expected
    index = json.loads((out / "index.json").read_text())
    assert sum(s["num_samples"] for s in index["shards"]) == 2
    secret = (image_root.parent / "secret.png").read_bytes()
    for shard in out.glob("shard-*.tar"):
        assert secret not in shard.read_bytes()
    assert "unsafe_path=6" in capsys.readouterr().out


def test_absolute_paths_are_accepted_only_when_allowed(tmp_path, image_root, tiny_tokenizer):
    from nanovlm.cli.prepare_data import main

    jsonl = tmp_path / "abs.jsonl"
    jsonl.write_text(json.dumps({"images": [str(image_root.parent / "secret.png")]} | conversation(1)) + "\n")
    out = tmp_path / "out"
    args = ["--input", str(jsonl), "--output", str(out), "--image-root", str(image_root)]
    assert main([*args, "--tokenizer", tiny_tokenizer.name_or_path]) == 1  # nothing written: an error
    assert json.loads((out / "rejected.jsonl").read_text())["reason"] == "unsafe_path"
    assert main([*args, "--tokenizer", tiny_tokenizer.name_or_path, "--allow-absolute-paths"]) == 0
    assert json.loads((out / "index.json").read_text())["shards"][0]["num_samples"] == 1


# ----------------------------------------------------------------------------------------------------------
# checkpoints are loaded without executing pickled code


def test_checkpoint_io_refuses_code_in_a_checkpoint(tmp_path):
    from nanovlm.train.checkpoint import AtomicCheckpointIO

    marker = tmp_path / "pwned"
    path = malicious_checkpoint(tmp_path / "step-00000001.ckpt", marker)
    with pytest.raises(pickle.UnpicklingError):
        AtomicCheckpointIO().load_checkpoint(path)
    with pytest.raises(pickle.UnpicklingError):  # asking for full unpickling does not get it either
        AtomicCheckpointIO().load_checkpoint(path, weights_only=False)
    assert not marker.exists()


def test_checkpoint_io_loads_a_plain_checkpoint(tmp_path):
    from nanovlm.train.checkpoint import AtomicCheckpointIO

    io = AtomicCheckpointIO()
    state = {"state_dict": {"w": torch.arange(4.0)}, "global_step": 3, "loops": {"x": [1, 2]}}
    io.save_checkpoint(state, tmp_path / "step-00000003.ckpt")
    loaded = io.load_checkpoint(tmp_path / "step-00000003.ckpt")
    assert loaded["global_step"] == 3 and torch.equal(loaded["state_dict"]["w"], torch.arange(4.0))


def test_training_code_has_no_unsafe_deserialization():
    """Static guard for future code on the training path (data, model, train, cli; the benchmark's webdataset
    baseline is out of scope): no pickle / marshal, no torch.load without weights_only=True, no webdataset
    decoder. The behaviour tests above prove today's paths; this keeps a new path from quietly adding one."""
    root = Path(__file__).resolve().parent.parent / "nanovlm"
    offenders = []
    unsafe = re.compile(
        r"\bpickle\.loads?\(|\bmarshal\.loads?\(|\bdill\b|\bcloudpickle\b|autodecode|\.decode\(\s*[\"'](pil|rgb|torch\w*|l)[\"']"
    )
    for sub in ("data", "model", "train", "cli"):
        for path in (root / sub).rglob("*.py"):
            text = path.read_text()
            for n, line in enumerate(text.splitlines(), 1):
                if unsafe.search(line):
                    offenders.append(f"{path.relative_to(root.parent)}:{n}: {line.strip()}")
            for m in re.finditer(r"torch\.load\(([^)]*)\)", text):
                if "weights_only=True" not in m.group(1) and not m.group(1).strip().startswith("weights_only"):
                    offenders.append(f"{path.relative_to(root.parent)}: torch.load({m.group(1)})")
    assert offenders == []


@pytest.mark.skipif(sys.platform != "linux", reason="symlink semantics")
def test_prepare_data_never_follows_symlinked_jsonl_images_out_of_root_even_via_dotdot(tmp_path, image_root):
    """A symlink inside the root pointing to a directory outside, then ``..`` out of it: still outside."""
    ref = "linkdir/images/../secret.png"
    with pytest.raises(SampleError) as exc:
        resolve_image_path(ref, image_root)
    assert exc.value.reason == "unsafe_path"
    assert os.path.exists(image_root / "linkdir" / "secret.png")


def test_resume_from_a_malicious_checkpoint_refuses_without_running_it(tmp_path, tiny_tokenizer):
    """The real resume path (``checkpoint.resume=auto`` through the train CLI and Lightning) loads with
    weights_only=True: a planted checkpoint holding code is refused and the code never runs."""
    from test_reliability_process import overrides

    from nanovlm.cli.train import main
    from nanovlm.data.demo import make_demo_data

    data = tmp_path / "demo"
    make_demo_data(data, train_samples=24, val_samples=4, samples_per_shard=24, image_token_count=4)
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    marker = tmp_path / "pwned"
    malicious_checkpoint(run_dir / "checkpoints" / "step-00000009.ckpt", marker)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        main([*overrides(data, run_dir), "trainer.max_steps=12"])
    assert not marker.exists()
