"""Tree rollouts (BranchGRPO): collection with a model, reward fusion, depth-wise advantages, pruning."""
