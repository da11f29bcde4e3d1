"""The config schema, YAML files and overrides: precedence, strict keys, typed values, clear messages."""

from pathlib import Path

import pytest

from nanovlm.config import (
    CONFIG_DIR,
    Config,
    ConfigError,
    image_token_count,
    load_config,
    save_config,
)

YAMLS = sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))


def test_configs_dir_has_the_documented_files():
    for name in ["tiny_cpu.yaml", "base.yaml", "ddp.yaml", "fsdp.yaml", "model_222m.yaml", "model_460m.yaml"]:
        assert name in YAMLS


@pytest.mark.parametrize("name", YAMLS)
def test_every_yaml_loads_against_the_schema(name):
    cfg = load_config([CONFIG_DIR / name])
    assert isinstance(cfg, Config)


def test_yaml_files_are_sparse():
    """A YAML file holds only what it changes: no key may repeat the schema default.

    Model size presets are exempt: they state a whole shape so they can be layered over any other file.
    """
    defaults = load_config()
    from omegaconf import OmegaConf

    default_tree = OmegaConf.structured(defaults)
    for name in [n for n in YAMLS if not n.startswith("model_")]:
        loaded = OmegaConf.load(CONFIG_DIR / name)
        for key in _leaf_keys(OmegaConf.to_container(loaded)):
            value = OmegaConf.select(loaded, key)
            assert value != OmegaConf.select(default_tree, key), f"{name}: {key} repeats the default"


def _leaf_keys(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _leaf_keys(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"


def test_precedence_defaults_then_files_then_overrides(tmp_path: Path):
    a = tmp_path / "a.yaml"
    b = tmp_path / "b.yaml"
    a.write_text("trainer:\n  max_steps: 11\n  log_every_n_steps: 3\noptim:\n  lr: 0.5\n")
    b.write_text("trainer:\n  max_steps: 22\n")
    cfg = load_config([a, b], ["optim.lr=0.25"])
    assert cfg.trainer.max_steps == 22  # later file wins over earlier file
    assert cfg.trainer.log_every_n_steps == 3  # earlier file wins over default
    assert cfg.optim.lr == 0.25  # override wins over files
    assert cfg.optim.weight_decay == Config().optim.weight_decay  # untouched default


def test_bare_config_name_is_looked_up_in_configs_dir():
    cfg = load_config(["model_460m.yaml"])
    assert cfg.model.language.hidden_size == 960
    assert image_token_count(cfg.model) == 64


def test_credentials_in_a_dataset_url_are_refused_without_being_shown():
    for url in ("s3://key:secret-pw@bucket/ds", "https://host/ds?X-Amz-Signature=secret-sig"):
        with pytest.raises(ConfigError) as e:
            load_config([], [f"data.train=[{url}]"])
        assert "data.train" in str(e.value) and "secret" not in str(e.value)
    assert load_config([], ["data.val=[s3://bucket/ds/val]"]).data.val == ["s3://bucket/ds/val"]


def test_smolvlm_preset_is_smolvlms_layout_on_top_of_base():
    cfg = load_config(["base.yaml", "model_smolvlm_256m.yaml"])
    assert image_token_count(cfg.model) == 64 and cfg.data.chat_format == "smolvlm"
    assert (cfg.model.vision.image_splitting, cfg.model.vision.longest_edge) == (True, 2048)
    assert cfg.data.tokenizer == cfg.model.vlm_checkpoint  # its own tokenizer: the ids of its embedding rows


def test_misspelled_override_names_key_and_suggestion():
    with pytest.raises(ConfigError) as e:
        load_config([], ["trainer.max_stepz=1"])
    assert "max_stepz" in str(e.value) and "trainer.max_steps" in str(e.value)


def test_misspelled_nested_key_in_yaml_names_file_key_and_suggestion(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  vision:\n    hiden_size: 64\n")
    with pytest.raises(ConfigError) as e:
        load_config([bad])
    msg = str(e.value)
    assert "model.vision.hiden_size" in msg and "model.vision.hidden_size" in msg and "bad.yaml" in msg


def test_misspelled_section_suggests_section():
    with pytest.raises(ConfigError, match="did you mean 'optim'"):
        load_config([], ["optimm.lr=1"])


@pytest.mark.parametrize(
    "override, key, expected",
    [
        ("trainer.max_steps=abc", "trainer.max_steps", "int"),
        ("data.max_tokens=1.5", "data.max_tokens", "int"),
        ("data.train_weights=[a]", "data.train_weights[0]", "float"),
        ("data.train=data/x", "data.train", "list[str]"),
    ],
)
def test_wrong_type_names_key_and_expected_type(override, key, expected):
    with pytest.raises(ConfigError) as e:
        load_config([], [override])
    assert key in str(e.value) and f"expected type: {expected})" in str(e.value)
    if expected.startswith("list"):  # a path without brackets: say how to write a list
        assert "write it in brackets, e.g. data.train=[a,b]" in str(e.value)


def test_bad_choice_and_shapes_are_rejected():
    with pytest.raises(ConfigError, match="model.attn_backend"):
        load_config([], ["model.attn_backend=magic"])
    with pytest.raises(ConfigError, match="pixel_shuffle_factor"):
        load_config([], ["model.projector.pixel_shuffle_factor=5"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config([], ["trainer.max_steps"])
    for tiles in (0, 37):  # a grid needs a tile; the markers name at most 6 x 6
        with pytest.raises(ConfigError, match="model.vision.max_tiles"):
            load_config([], ["model.vision.image_splitting=true", f"model.vision.max_tiles={tiles}"])
    assert load_config([], ["model.vision.max_tiles=0"]).model.vision.max_tiles == 0  # ignored without splitting
    split = ["model.vision.image_splitting=true", "model.vision.image_size=512", "model.vision.patch_size=16"]
    for edge in (256, 3073, 5000):  # below one tile; 7 tiles a side; past Idefics3's 4096 px
        with pytest.raises(ConfigError, match="'model.vision.longest_edge': .*at most 6 tiles a side"):
            load_config([], [*split, f"model.vision.longest_edge={edge}"])
    assert load_config([], [*split, "model.vision.longest_edge=2048"]).model.vision.longest_edge == 2048
    with pytest.raises(ConfigError, match="not found"):
        load_config(["no_such_file.yaml"])
    # a pack can hold one sample of max_tokens tokens: its positions must stay within the decoder's
    with pytest.raises(ConfigError, match="data.max_tokens=4096 exceeds model.language.max_position_embeddings=2048"):
        load_config(["tiny_cpu.yaml"], ["data.max_tokens=4096"])
    assert load_config(["tiny_cpu.yaml"], ["data.max_tokens=2048"]).data.max_tokens == 2048


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.accumulate_grad_batches=0", "'trainer.accumulate_grad_batches': 0; it must be >= 1"),
        ("trainer.max_steps=-5", "'trainer.max_steps': -5; it must be >= 1"),
        ("data.lookahead=0", "'data.lookahead': 0; it must be >= 1"),
        ("data.num_workers=-1", "'data.num_workers': -1; it must be >= 0"),
        ("optim.lr=-1", "'optim.lr': -1.0; it must be >= 0"),
        ("optim.warmup_steps=-1", "'optim.warmup_steps': -1; it must be >= 0"),
        ("optim.betas=[0.9]", "'optim.betas': [0.9]; two numbers in [0, 1)"),
        ("data.train_weights=[-1.0]", "weights must be >= 0"),
        ("data.shuffle_buffer=2000000", "'data.shuffle_buffer': 2000000; it must be <= 1048576"),
        ("trainer.devices=two", "'trainer.devices': 'two'; a number >= 1 or 'auto'"),
        ("trainer.devices=0", "'trainer.devices': 0; a number >= 1 or 'auto'"),
        ("data.train[0]=data/x", "set the whole list, e.g. data.train=[a,b]"),
    ],
)
def test_values_out_of_range_are_config_errors_naming_the_key(override, message):
    """They used to pass and fail later (ZeroDivisionError, Lightning's exception after the data setup, an
    IndexError) or never (a negative learning rate trained in reverse)."""
    with pytest.raises(ConfigError) as e:
        load_config(["tiny_cpu.yaml"], [override])
    assert message in str(e.value)
    for fine in ("data.shuffle_buffer=0", "data.max_image_pixels=0", "trainer.devices=2", "optim.lr=0"):
        load_config(["tiny_cpu.yaml"], [fine])


def test_resolved_config_round_trips_through_run_dir(tmp_path: Path):
    cfg = load_config(["tiny_cpu.yaml"], ["trainer.max_steps=7"])
    path = save_config(cfg, tmp_path / "run")
    again = load_config([path])
    assert again == cfg


def test_home_directory_in_path_keys_is_expanded():
    cfg = load_config(
        ["tiny_cpu.yaml"],
        ["trainer.run_dir=~/runs/x", "data.train=[~/d/a,data/b]", "checkpoint.init_from=~/c.ckpt"],
    )
    home = str(Path.home())
    assert cfg.trainer.run_dir == f"{home}/runs/x" and cfg.data.train == [f"{home}/d/a", "data/b"]
    assert cfg.checkpoint.init_from == f"{home}/c.ckpt" and cfg.checkpoint.resume == "auto"
    assert cfg.model.vision_checkpoint is None
