"""GRPO: online preference training on the policy's own completions (`objective=grpo`).

`losses.py` holds the formulas (advantages, the four loss variants) and the objective head the
backward modes run, `rewards.py` the reward functions, `rollout.py` the sampling of groups on the
batched decoder, `loop.py` the training loop around them (train/job.py starts it).
"""
