"""Adapters from other ecosystems onto the environment protocol (nanogrpo/envs/__init__.py)."""
