"""``--stage ppo`` (in progress): PPO with a critic. Today its objective: GAE, returns,
whitening, the clipped value loss and the dual-clip policy term, as verl computes them."""
