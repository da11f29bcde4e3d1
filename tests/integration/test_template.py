"""template/ renders with cookiecutter and the rendered project's own smoke test passes (so it cannot rot)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO


def render(out: Path, *extra: str, slug: str = "my-vlm-project") -> Path:
    subprocess.run(
        [sys.executable, "-m", "cookiecutter", "--no-input", str(REPO / "template"), "-o", str(out), *extra],
        check=True,
        timeout=120,
    )
    return out / slug


def test_template_renders_with_sparse_config(tmp_path):
    project = render(tmp_path)
    expected = [
        "pyproject.toml",
        "README.md",
        "configs/experiment.yaml",
        "scripts/train.py",
        "scripts/prepare_data.py",
        "tests/test_smoke.py",
        "my_vlm_project/decode.py",
    ]
    for rel in expected:
        assert (project / rel).is_file(), rel
    text = "".join((project / rel).read_text() for rel in expected)
    assert "{{" not in text and "cookiecutter" not in text
    # the experiment config is a valid sparse override of nanovlm's default config
    from nanovlm.config import load_config

    cfg = load_config(["tiny_cpu.yaml", project / "configs" / "experiment.yaml"])
    assert cfg.data.train == ["data/my_vlm_project/train"] and cfg.trainer.run_dir == "runs/my_vlm_project"
    assert len((project / "configs" / "experiment.yaml").read_text().splitlines()) < 20
    proc = subprocess.run(
        [sys.executable, "scripts/train.py", "--print-config", "trainer.max_steps=3"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "run_dir: runs/my_vlm_project" in proc.stdout and "max_steps: 3" in proc.stdout


@pytest.mark.slow
def test_rendered_project_smoke_test_passes(tmp_path):
    project = render(tmp_path, "project_name=Shapes QA", slug="shapes-qa")
    assert (project / "shapes_qa" / "decode.py").is_file()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "3 passed" in proc.stdout


def test_new_project_script_creates_and_refuses_to_overwrite(tmp_path):
    cmd = [sys.executable, "scripts/new_project.py", "Shapes QA", "-o", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "shapes-qa" / "shapes_qa" / "decode.py").is_file()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "already exists" in proc.stderr


@pytest.mark.parametrize("name", ["123 bad/name", "class", "my.vlm", "x!"])
def test_new_project_refuses_names_that_make_no_valid_package(tmp_path, name):
    """'123 bad/name' used to create 123-bad/name/123_bad/name/ with a syntax error in its prepare_data.py."""
    cmd = [sys.executable, "scripts/new_project.py", name, "-o", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"error: project name {name!r}" in proc.stderr, proc.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "argv,message",
    [
        (["tests"], "which is taken"),  # cookiecutter failed half-way: tests/tests exists
        (["json"], "which is taken"),  # shadowed the standard library in the project's own scripts
        (["nanovlm"], "which is taken"),  # `pip install -e .` would replace the library
        (["shapes_"], "would make the folder 'shapes-'"),  # not a valid distribution name
        (["ok", "--description", 'A "quoted" VLM'], "would break pyproject.toml"),
        (["ok", "--author", "back\\slash"], "would break pyproject.toml"),
    ],
)
def test_new_project_refuses_names_and_texts_that_make_a_broken_project(tmp_path, argv, message, capsys):
    from nanovlm.cli.new_project import main

    assert main([*argv, "-o", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_new_project_without_cookiecutter_says_how_to_install_it(tmp_path, monkeypatch, capsys):
    from nanovlm.cli.new_project import main

    monkeypatch.setitem(sys.modules, "cookiecutter", None)
    monkeypatch.setitem(sys.modules, "cookiecutter.main", None)
    assert main(["Shapes QA", "-o", str(tmp_path)]) == 2
    assert "pip install cookiecutter" in capsys.readouterr().err
