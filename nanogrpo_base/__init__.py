"""The small base under both of nanogrpo's packages: the machinery the trainer (nanogrpo/) and the graders
(rewards/) both need, which is neither training nor grading.

    ranges.py   each numeric flag's allowed range (a Range on its field), the one check of a command's flags
    rows.py     reading JSONL rows safely (DataError), checking prompts, a prompt or a transcript as text
    files.py    the umask's file mode, and the one writer of weights files (.safetensors)
    limits.py   a call stopped at its time limit (a timer signal on the main thread, else a thread)

It imports neither nanogrpo nor rewards (tests/test_imports.py checks it), so both build on it and a grader
stays usable without the trainer.
"""
