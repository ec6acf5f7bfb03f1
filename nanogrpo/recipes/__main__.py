"""`python -m nanogrpo.recipes [NAME]`: every embedded data file with its rows and path, or one file's path."""

import sys

from nanogrpo.recipes import main

sys.exit(main(sys.argv[1:]))
