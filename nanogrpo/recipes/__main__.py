import sys

from nanogrpo.recipes import main

sys.exit(main(sys.argv[1:]))
