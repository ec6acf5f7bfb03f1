"""The KL studies: the exact-gradient checker, toy policies, and the ablation grids."""
