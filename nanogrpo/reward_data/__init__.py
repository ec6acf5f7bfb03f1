"""Reward data from references, built once, offline: `python -m nanogrpo.reward_data SUBCOMMAND`.

The graders of seeds 003 and 004 read fields that nobody writes by hand at scale: `key_points`
(rewards/keywords.py), `style_spec` (rewards/style.py), `rubric` (rewards/rubric.py) and the labels a
rubric probe trains on (rewards/probe). This package drafts them with an LLM from each row's reference,
checks every draft against the reference, and writes JSONL that train.py reads as is:

  keypoints  key points and 1-3 word keywords per key point (two requests a row; --one-level: one)
  style      a declarative style spec (length range, markdown elements, phrases) with LLM weights;
             --python-checks adds LLM-written Python checks, run only in a sandboxed subprocess
  rubric     rubric criteria with weights, hard and soft, from the prompt and the reference
  label      criterion-satisfaction labels of given responses from a judge: `python -m rewards.probe train` input
  filter     drop rows whose own reference scores below a threshold on the configured graders
  baseline   keywords by TF-IDF over the corpus or at random, at a share of the reference (no LLM)

docs/REWARD_DATA.md has the whole data path, with commands.
"""
