"""``python scripts/new_project.py NAME [-o DIR]``: create a new project from template/ (cookiecutter)."""

from __future__ import annotations

import argparse
import keyword
import re
import sys
from collections.abc import Sequence
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent.parent.parent / "template"


# Package names a project must not take: folders of the rendered project itself, and what it imports (a package
# named ``json`` shadows the standard library; one named ``nanovlm`` or ``torch`` would replace the real one on
# ``pip install -e .``).
_TAKEN = {"tests", "scripts", "configs", "template", "nanovlm", "torch", "torchvision", "lightning",
          "pytorch_lightning", "transformers", "tokenizers", "webdataset", "numpy", "pil", "omegaconf", "yaml",
          "cookiecutter", "pytest", "tqdm", "matplotlib", "safetensors", "flash_attn"}  # fmt: skip


def check_name(name: str) -> str | None:
    """Why ``name`` cannot make a project (its folder and Python package names follow from it), else None."""
    slug = name.lower().replace(" ", "-").replace("_", "-")  # as template/cookiecutter.json derives them
    package = slug.replace("-", "_")
    if not re.fullmatch(r"[a-z][a-z0-9]*(-[a-z0-9]+)*", slug) or keyword.iskeyword(package):
        return (
            f"project name {name!r} would make the folder {slug!r} and the Python package {package!r}; use letters, "
            "digits and single spaces, '-' or '_' between them, starting with a letter (e.g. 'Shapes QA')"
        )
    if package in _TAKEN or package in sys.stdlib_module_names:
        return (
            f"project name {name!r} would make the Python package {package!r}, which is taken (a folder of the "
            "project, the standard library, or a package it imports); choose another name"
        )
    return None


def check_text(what: str, text: str) -> str | None:
    """Why a description or author cannot go into pyproject.toml and the README as given, else None."""
    if any(c in text for c in '"\\\n\r'):
        return f"{what} {text!r} holds a quote, backslash or line break; they would break pyproject.toml"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="scripts/new_project.py",
        description="Create a project built on nanovlm: configs/experiment.yaml (sparse override), a sample "
        "decoding hook, scripts/train.py and scripts/prepare_data.py wrappers, and a CPU smoke test.",
    )
    p.add_argument("name", help="project name, e.g. 'Shapes QA' (folder: shapes-qa, package: shapes_qa)")
    p.add_argument("-o", "--output-dir", default=".", help="where to create the project folder (default: .)")
    p.add_argument("--description", default=None, help="one-line description")
    p.add_argument("--author", default=None, help="author name for pyproject.toml")
    args = p.parse_args(argv)
    problem = (
        check_name(args.name)
        or (args.description and check_text("--description", args.description))
        or (args.author and check_text("--author", args.author))
    )
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        from cookiecutter.main import cookiecutter
    except ImportError:
        print("error: new_project.py renders template/ with cookiecutter: pip install cookiecutter", file=sys.stderr)
        return 2

    context = {"project_name": args.name}
    if args.description:
        context["description"] = args.description.rstrip(".")  # the template ends its sentences itself
    if args.author:
        context["author"] = args.author
    try:
        path = cookiecutter(str(TEMPLATE), no_input=True, extra_context=context, output_dir=args.output_dir)
    except Exception as e:  # e.g. the folder exists already
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"created {path}\nnext: cd {path} && pip install -e . && python -m pytest -q")
    return 0


if __name__ == "__main__":
    sys.exit(main())
