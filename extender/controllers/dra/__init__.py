"""gpupack allocates DRA claims itself: pods gated by `gpupack.io/dra-allocate` have their
gpu.gpupack.io claims allocated (node and GPU chosen by gpupack's policy) before kube-scheduler sees
them; the scheduler then honours the allocation (docs/dra.md, "gpupack allocates")."""
