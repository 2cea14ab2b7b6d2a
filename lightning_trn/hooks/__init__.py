"""Every hook into Lightning's internals, in one place. At import: `registration` (the registries and the connector
hooks) and `throughput` (the peak-FLOPs and compute-dtype lookups). During Neuron runs only: the internals listed in
`registry`, installed at setup and restored at teardown (`logging`, `loop_shortcuts`, `metric_states`, `host_copies`,
`loaders`). Each is version-guarded; every run that is not a Neuron one gets Lightning's own code."""
