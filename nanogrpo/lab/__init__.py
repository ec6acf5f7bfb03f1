"""The studies: the KL exact-gradient checker, toy policies, the ablation grids, and the pipelines run as one
command (the RLVRR keyword ablation, the research agent)."""
