"""Sample schema: the three JSONL formats, WebDataset members, and every rejection reason.

Faults in one sample's members (``members_to_record``, ``parse_jsonl_line``) raise ``SampleError`` with the exact
reason, so the skip log can name the sample and why.

Security: shard members are never unpickled. Each hostile input carries a payload whose effect is visible:
unpickling it creates a marker file. A control test first shows that the payload really fires when unpickled (so
"the marker does not exist" means "nothing unpickled it", not "the payload is broken"); then the code is run on it.
The same payloads go through the DataModule (unit/test_datamodule.py), prepare_data (unit/test_prepare.py) and
checkpoint loading (unit/test_checkpoint.py).
"""

import json
import pickle

import pytest
from helpers.faults import (
    JSONL_REASON,
    bad_json_variants,
    conversation,
    hostile_members,
    json_bytes,
    pickle_payload,
    png,
    reason_of,
)

from nanovlm.data.format import (
    CAPTION_PROMPT,
    Record,
    SampleError,
    check_key,
    members_to_record,
    parse_jsonl_line,
    record_to_json,
    validate_messages,
)


def reason(fn, *args):
    with pytest.raises(SampleError) as e:
        fn(*args)
    return e.value.reason


def test_native_line():
    line = json.dumps(
        {
            "images": ["a.jpg", "b.png"],
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "<image> and <image>: same?"},
                {"role": "assistant", "content": "no"},
            ],
            "id": 7,
        }
    )
    messages, refs, extra = parse_jsonl_line(line)
    assert refs == ["a.jpg", "b.png"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    assert messages[1]["content"] == "<image> and <image>: same?"
    assert extra == {"id": 7}
    # the first line of a file saved with a UTF-8 byte-order mark (it was rejected as bad_json)
    assert parse_jsonl_line(b"\xef\xbb\xbf" + line.encode()) == (messages, refs, extra)


def test_llava_line_maps_roles_and_keeps_placeholder():
    line = json.dumps(
        {
            "id": "x1",
            "image": "coco/1.jpg",
            "conversations": [
                {"from": "human", "value": "<image>\nWhat is it?"},
                {"from": "gpt", "value": "A cat."},
                {"from": "human", "value": "Colour?"},
                {"from": "gpt", "value": "Black."},
            ],
        }
    )
    messages, refs, extra = parse_jsonl_line(line)
    assert refs == ["coco/1.jpg"]
    assert messages == [
        {"role": "user", "content": "<image>\nWhat is it?"},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": "Colour?"},
        {"role": "assistant", "content": "Black."},
    ]
    assert extra == {"id": "x1"}


def test_llava_line_without_placeholder_gets_one_before_first_user_turn():
    line = json.dumps(
        {"image": "a.jpg", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]}
    )
    messages, refs, _ = parse_jsonl_line(line)
    assert messages[0]["content"] == "<image>\nHi"


def test_caption_line():
    messages, refs, extra = parse_jsonl_line(json.dumps({"image": "a.jpg", "caption": " A dog. ", "w": 3}))
    assert refs == ["a.jpg"]
    assert messages == [{"role": "user", "content": CAPTION_PROMPT}, {"role": "assistant", "content": "A dog."}]
    assert extra == {"w": 3}


@pytest.mark.parametrize(
    "line,expected",
    [
        (b"{not json", "bad_json"),
        (b"\xff\xfe{}", "bad_utf8"),
        (b'["a"]', "unknown_format"),
        (b'{"text": "hello"}', "unknown_format"),
        (b'{"messages": "hi"}', "missing_messages"),
        (b'{"messages": []}', "empty_conversation"),
        (
            b'{"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": ""}]}',
            "empty_conversation",
        ),
        (b'{"messages": [{"role": "user", "content": "hi"}]}', "no_assistant_turn"),
        (b'{"messages": [{"role": "robot", "content": "hi"}]}', "bad_role"),
        (
            b'{"images": ["a.jpg"], "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]}',
            "image_count_mismatch",
        ),
        (
            b'{"messages": [{"role": "user", "content": "<image>"}, {"role": "assistant", "content": "x"}]}',
            "image_count_mismatch",
        ),
        (b'{"image": ["a.jpg", "b.jpg"], "caption": "two"}', "image_count_mismatch"),
        (
            b'{"images": [3], "messages": [{"role": "user", "content": "<image>"}, {"role": "assistant", "content": "x"}]}',
            "bad_image_ref",
        ),
        (b'{"conversations": [{"from": "alien", "value": "x"}]}', "bad_role"),
    ],
)
def test_bad_lines_have_reasons(line, expected):
    assert reason(parse_jsonl_line, line, "k") == expected


def test_sample_error_carries_key_and_detail():
    with pytest.raises(SampleError) as e:
        validate_messages([{"role": "user", "content": "<image>"}], 1, key="k9")
    assert e.value.key == "k9" and e.value.reason == "no_assistant_turn"
    assert "k9" in str(e.value)


def test_members_native_orders_images_by_number_and_ignores_unsafe_members():
    conv = {
        "messages": [{"role": "user", "content": "<image><image>"}, {"role": "assistant", "content": "ok"}],
        "answer": "ok",
    }
    members = {
        "1.png": b"second",
        "0.jpg": b"first",
        "json": json.dumps(conv).encode(),
        "pyd": b"\x80\x04pickle",
        "pickle": b"\x80\x04",
        "pth": b"PK\x03\x04",
        "2.pickle": b"x",
    }
    r = members_to_record(members, "k")
    assert r.images == [b"first", b"second"]
    assert r.extra == {"answer": "ok"}
    assert r.messages[1]["content"] == "ok"


def test_members_caption_from_txt_and_json_metadata_kept():
    r = members_to_record({"jpg": b"img", "txt": b"a cat ", "json": b'{"width": 3, "captions": []}'}, "c1")
    assert r.images == [b"img"]
    assert r.messages[-1] == {"role": "assistant", "content": "a cat"}
    assert r.extra == {"width": 3, "captions": []}


def test_members_llava_json():
    conv = {"conversations": [{"from": "human", "value": "What?"}, {"from": "gpt", "value": "A dog"}]}
    r = members_to_record({"jpg": b"i", "json": json.dumps(conv).encode()}, "k")
    assert r.messages[0]["content"] == "<image>\nWhat?" and r.images == [b"i"]


@pytest.mark.parametrize(
    "members,expected",
    [
        ({"jpg": b"i"}, "missing_messages"),
        ({"jpg": b"i", "json": b'{"owl": 1}'}, "missing_messages"),
        ({"txt": b"caption only"}, "missing_image"),
        ({"jpg": b"i", "txt": b"\xff\xfe"}, "bad_utf8"),
        ({"jpg": b"i", "json": b"{broken"}, "bad_json"),
        ({"jpg": b"i", "json": b"[1]"}, "bad_json"),
        (
            {"json": b'{"messages": [{"role": "user", "content": "<image>"}, {"role": "assistant", "content": "x"}]}'},
            "image_count_mismatch",
        ),
    ],
)
def test_members_bad(members, expected):
    assert reason(members_to_record, members, "k") == expected


def test_keys_with_dots_are_refused():
    assert check_key("a-b_c/0001") == "a-b_c/0001"
    for bad in ("a.b", "", "a b", "ä"):
        assert reason(check_key, bad) == "bad_key"


def test_record_to_json_is_deterministic_and_round_trips():
    r = Record("k", [{"role": "user", "content": "é"}, {"role": "assistant", "content": "x"}], [], {"b": 1, "a": 2})
    blob = record_to_json(r)
    assert blob == record_to_json(Record("k", r.messages, [], {"a": 2, "b": 1}))
    assert json.loads(blob) == {"a": 2, "b": 1, "messages": r.messages}


def test_llava_placeholder_goes_into_the_first_user_turn_only():
    from nanovlm.data.format import parse_json_sample

    obj = {
        "image": "a.jpg",
        "conversations": [
            {"from": "human", "value": "q1"},
            {"from": "gpt", "value": "a1"},
            {"from": "human", "value": "q2"},
            {"from": "gpt", "value": "a2"},
        ],
    }
    msgs, _, _ = parse_json_sample(obj, "k")
    assert msgs[0]["content"] == "<image>\nq1" and msgs[2]["content"] == "q2"


def test_numbered_images_sort_numerically():
    members = {f"{i}.png": bytes([i]) for i in range(12)}
    text = "<image>" * 12
    members["json"] = json.dumps(
        {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "x"}]}
    ).encode()
    assert members_to_record(members, "k").images == [bytes([i]) for i in range(12)]  # 2.png before 10.png


def test_a_blank_assistant_turn_is_no_answer():
    assert (
        reason(validate_messages, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}], 0)
        == "no_assistant_turn"
    )


# ----------------------------------------------------------------------------------------------------------
# faults in one sample's JSON / text


@pytest.mark.parametrize("name", sorted(bad_json_variants()))
def test_bad_json_member_is_rejected_with_its_reason(name):
    data, reason = bad_json_variants()[name]
    with pytest.raises(SampleError) as exc:
        members_to_record({"0.png": png(), "json": data}, "k1")
    assert exc.value.reason == reason
    assert exc.value.key == "k1"  # the skip log can name the sample


@pytest.mark.parametrize("name", sorted(bad_json_variants()))
def test_bad_jsonl_line_is_rejected_with_its_reason(name):
    """The same faults as JSONL lines for prepare_data (images given as a one-element path list)."""
    data, reason = bad_json_variants()[name]
    reason = JSONL_REASON.get(name, reason)
    try:
        obj = json.loads(data.decode("utf-8"))
        if isinstance(obj, dict):
            obj["images"] = ["a.png"]
            data = json.dumps(obj).encode("utf-8")
    except (UnicodeDecodeError, json.JSONDecodeError):
        pass  # the fault is in the bytes themselves
    assert reason_of(parse_jsonl_line, data, "k2") == reason


def test_invalid_utf8_caption_txt_is_bad_utf8():
    assert reason_of(members_to_record, {"jpg": png(), "txt": b"a \xc3\x28 caption"}, "k") == "bad_utf8"


def test_members_without_conversation_or_caption_are_missing_messages():
    assert reason_of(members_to_record, {"0.png": png(), "cls": b"3"}, "k") == "missing_messages"


# ----------------------------------------------------------------------------------------------------------
# security: the payloads are live, and shard members are never unpickled


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
