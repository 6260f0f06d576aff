"""placeholder"""
from gpupack.core.policies import FGD, POLICIES


class GpupackPolicy(FGD):
    name = "gpupack"
POLICIES["gpupack"] = GpupackPolicy
def fast_scores(policy, cl, idx, f, milli, whole, cpu):
    return cl.frag[idx] - cl.frag_after(idx, f, milli, whole, cpu)
