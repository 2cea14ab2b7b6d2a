"""Every hook into Lightning's internals, in one place. At import (`lightning_trn.registration` calls it):
`throughput` (the peak-FLOPs and compute-dtype lookups). During Neuron runs only: the internals listed in `registry`,
installed at setup and restored at teardown (`logging`, `loop_shortcuts`, `metric_states`, `host_copies`, `loaders`).
Each is version-guarded; every run that is not a Neuron one gets Lightning's own code. What a strategy tells these
hooks is one typed object, `contract.HookContract`.

Layering: `hooks` sits below the strategies (`lightning_trn.pytorch`, `lightning_trn.fabric`) and imports neither."""
