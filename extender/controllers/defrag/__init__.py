"""`gpupack defrag`: plan (pure, gpupack.core.defrag) and, with --apply, evict-and-repack safely.

Modules: `snapshot` (cluster objects -> ClusterState), `eligibility` (which pods may move),
`window`, `lease`, `events`, `metrics`, `reservations` (node annotation writes), `executor`
(the move loop), `cli` (argument parsing and output).
"""
