"""Offline tokenizer: special tokens, chat template, determinism, fingerprint."""

import pytest

from nanovlm.data.tokenizer import SPECIAL_TOKENS, build_tokenizer, load_tokenizer, tokenizer_fingerprint


def test_special_tokens_are_single_ids(tiny_tokenizer):
    tok = tiny_tokenizer
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS)
    assert all(i is not None and i >= 0 for i in ids)
    assert tok.pad_token == "<|pad|>" and tok.eos_token == "<|im_end|>"
    assert tok("<image>", add_special_tokens=False)["input_ids"] == [tok.convert_tokens_to_ids("<image>")]
    assert len(tok) <= 512


def test_chat_template_is_chatml(tiny_tokenizer):
    msgs = [{"role": "user", "content": "what colour?"}, {"role": "assistant", "content": "red"}]
    text = tiny_tokenizer.apply_chat_template(msgs, tokenize=False)
    assert text == "<|im_start|>user\nwhat colour?<|im_end|>\n<|im_start|>assistant\nred<|im_end|>\n"
    prompt = tiny_tokenizer.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_round_trip_any_text(tiny_tokenizer):
    text = "Zebra ünïcode 123 never seen!"
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tiny_tokenizer.decode(ids) == text


def test_build_is_deterministic_and_saved(tmp_path):
    texts = ["red square on blue", "green circle", "how many stars?"] * 20
    a = build_tokenizer(tmp_path / "a", texts, vocab_size=300)
    b = build_tokenizer(tmp_path / "b", texts, vocab_size=300)
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(b)
    c = build_tokenizer(tmp_path / "c", texts + ["zebra zebra zebra"], vocab_size=300)
    assert tokenizer_fingerprint(c) != tokenizer_fingerprint(a)
    reloaded = load_tokenizer(tmp_path / "a")
    assert tokenizer_fingerprint(reloaded) == tokenizer_fingerprint(a)
    # Rebuilding into an existing directory replaces it.
    build_tokenizer(tmp_path / "a", texts + ["zebra zebra zebra"], vocab_size=300)
    assert tokenizer_fingerprint(load_tokenizer(tmp_path / "a")) == tokenizer_fingerprint(c)


def test_fingerprint_sees_chat_template(tiny_tokenizer, tmp_path):
    tiny_tokenizer.save_pretrained(tmp_path / "t")
    tok = load_tokenizer(tmp_path / "t")
    fp = tokenizer_fingerprint(tok)
    tok.chat_template = "{{ messages }}"
    assert tokenizer_fingerprint(tok) != fp


def test_fingerprint_sees_how_text_is_split_not_only_the_vocabulary(tiny_tokenizer, tmp_path):
    """Same vocabulary, another pre-tokenizer (prefix space): other token counts, so another fingerprint."""
    import json

    from nanovlm.data.processing import SampleProcessor

    tiny_tokenizer.save_pretrained(tmp_path / "t")
    spec = json.loads((tmp_path / "t" / "tokenizer.json").read_text())
    spec["pre_tokenizer"]["add_prefix_space"] = not spec["pre_tokenizer"].get("add_prefix_space", False)
    (tmp_path / "t" / "tokenizer.json").write_text(json.dumps(spec))
    other = load_tokenizer(tmp_path / "t")
    msgs = [{"role": "user", "content": "what colour is it"}, {"role": "assistant", "content": "red"}]
    counts = [SampleProcessor(t, 8, 4).text_tokens(msgs) for t in (tiny_tokenizer, other)]
    assert counts[0] != counts[1]  # the change matters ...
    assert other.get_vocab() == tiny_tokenizer.get_vocab()  # ... though the vocabulary is the same
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(tiny_tokenizer)


def test_load_adds_missing_special_tokens(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(
        ["plain text only"] * 5,
        trainers.BpeTrainer(vocab_size=280, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    PreTrainedTokenizerFast(tokenizer_object=bpe).save_pretrained(tmp_path / "bare")
    tok = load_tokenizer(tmp_path / "bare")
    for t in SPECIAL_TOKENS:
        assert tok(t, add_special_tokens=False)["input_ids"] == [tok.convert_tokens_to_ids(t)]
    assert tok.pad_token is not None and tok.chat_template
    # a tokenizer that pads already (SmolVLM's pads with <|im_end|>) gets no <|pad|>: one token more would not fit
    # the embedding of the checkpoint it comes with
    PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="plain").save_pretrained(tmp_path / "pads")
    padded = load_tokenizer(tmp_path / "pads")
    assert "<|pad|>" not in padded.get_vocab() and len(padded) == len(tok) - 1


def test_missing_local_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer directory not found"):
        load_tokenizer(tmp_path / "nope" / "tok")
