"""The old name of nanogrpo_base.rows (the JSONL reader, DataError, prompt_text): the same module object, so
what still imports `rewards.rows` (nanogrpo/stages/cpt.py, nanogrpo/rollout.py, tests/test_data.py and
tests/test_data_formats.py), or patches the reader's internals through it, gets the reader itself. New code
imports nanogrpo_base.rows.
"""

import sys

from nanogrpo_base import rows

sys.modules[__name__] = rows
