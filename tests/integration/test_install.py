"""A non-editable install trains: the wheel carries the configs, and nothing of the checkout is needed."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest
from helpers import REPO


@pytest.mark.slow
def test_the_wheel_ships_the_configs_and_trains_outside_the_checkout(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), "."],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=300,
    )
    wheel = next(tmp_path.glob("nanovlm-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {f"nanovlm/configs/{n}.yaml" for n in ("tiny_cpu", "base", "ddp", "fsdp")} <= set(names)
    assert not [n for n in names if n.startswith(("benchmarks/", "tests/", "configs/"))]
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    work = tmp_path / "work"  # no checkout here: the default config and the demo data come from the package
    work.mkdir()
    code = (
        f"import sys; sys.path.insert(0, {str(site)!r}); import nanovlm; "
        f"assert nanovlm.__file__.startswith({str(site)!r}), nanovlm.__file__; "
        "from nanovlm.cli.train import main; "
        "sys.exit(main(['trainer.max_steps=2', 'trainer.eval_at_end=false', 'trainer.progress_bar=false', "
        "'trainer.val_every_n_steps=0', 'checkpoint.every_n_steps=0', 'data.num_workers=0']))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=work, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (work / "runs" / "tiny_cpu" / "checkpoints" / "step-00000002.ckpt").is_file()
    assert len((work / "runs" / "tiny_cpu" / "steps.jsonl").read_text().splitlines()) == 2
