"""The device logic both of Lightning's APIs share: the strategies' core (runtime, device, moves keeping ties,
prefetching, portable checkpoints), data parallelism, the device loader, the precision core with stochastic rounding,
and the checkpoint IO. The Trainer's half (`lightning_trn.pytorch`) and Fabric's (`lightning_trn.fabric`) build on it
and differ only where the two APIs differ."""
