#!/usr/bin/env python
"""Create a new project from template/: python scripts/new_project.py "My Project" [-o DIR]."""

import sys

from nanovlm.cli.new_project import main

if __name__ == "__main__":
    sys.exit(main())
