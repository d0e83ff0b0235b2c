"""What sweeps (``dpivon.search``) and benchmarks (``dpivon.study``) share: both run many
calls of the one training function from a YAML file, on Ray, tracked in MLflow.

`run_file` (the YAML keys and checks both files have), `storage` (a run folder on a local
disk or an object store), `folder_lock` (one driver per folder), `state_file` (the state a
resumed driver reads back), `ray_cluster` (connecting to Ray) and `provenance` (what a parent
run records of the code).
Import the submodules directly; this package imports nothing.
"""
