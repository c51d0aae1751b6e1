"""``--stage grpo``: colocated GRPO with DAPO's options: flags, task, loss, batches, prompt
data, rule rewards and the rollout at its own layout."""
