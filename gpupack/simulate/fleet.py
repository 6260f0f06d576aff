"""The embedded scenario behind `gpupack simulate` with no arguments.

A mixed inference fleet (H100, A100-40GB, L4 and T4 nodes) serving a few dozen models of very
different sizes, modelled on a real inference platform:

- small text models (classifiers, NER, embeddings, rerankers, speech): 1-4 GB, 5-25% of the SMs;
- 7B-class LLMs: ~14 GB of fp16 weights plus KV cache (20 GB requested), or ~7 GB quantized (9 GB);
  a 13B fp16 model (32 GB) and a 70B model served on 4 whole H100s;
- diffusion models (SD 1.5, SDXL, ControlNet): 5-12 GB and most of a GPU's SMs while generating;
- two classes: `online` (latency-sensitive serving) and `offline` (batch embedding, nightly
  summarisation, bulk image generation). The two never share a GPU.

Memory needs are realistic orders of magnitude (weights + runtime + cache), SM shares are what a
serving engine sustains at its target load; they are illustrative, not measurements.

Two allocations of the same pods, in the same seeded order, on the same fleet:
- `whole-card`: every replica gets whole GPUs (what the stock NVIDIA device plugin does), on a GPU
  model with enough memory;
- `gpupack`: replicas ask for GPU memory and SM share (`gpupack.io/gpu-mem`, `gpupack.io/gpu-sm`)
  and gpupack's default policy packs them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from gpupack.core.model import GPU, ClusterState, ContainerRequest, Node, PodRequest
from gpupack.core.policies import DEFAULT_POLICY, get_policy, schedule


@dataclass(frozen=True)
class GpuModel:
    name: str
    mem_mib: int
    sms: int


H100 = GpuModel("H100-80GB", 81559, 132)
A100 = GpuModel("A100-40GB", 40960, 108)
L4 = GpuModel("L4", 23034, 58)
T4 = GpuModel("T4", 15360, 40)

# (GPU model, GPUs per node, node count)
FLEET: tuple[tuple[GpuModel, int, int], ...] = ((H100, 8, 2), (A100, 8, 3), (L4, 4, 4), (T4, 4, 4))


@dataclass(frozen=True)
class Service:
    name: str
    kind: str
    mem_gib: float  # per GPU
    sm_pct: int  # per GPU
    replicas: int
    pod_class: str = "online"
    gpus: int = 1
    whole: bool = False  # needs whole GPUs even under gpupack (tensor-parallel LLM)


GIB = 1024
SERVICES: tuple[Service, ...] = (
    # small text and speech models
    Service("sentiment-distilbert", "classifier", 1.2, 5, 6),
    Service("toxicity-roberta", "classifier", 2.0, 10, 4),
    Service("intent-classifier", "classifier", 1.0, 5, 6),
    Service("ner-bert-base", "classifier", 1.5, 10, 4),
    Service("lang-id", "classifier", 0.8, 5, 3),
    Service("spam-filter", "classifier", 1.0, 5, 3),
    Service("embed-e5-base", "embedding", 1.5, 10, 6),
    Service("embed-bge-large", "embedding", 2.5, 15, 4),
    Service("reranker-minilm", "embedding", 1.5, 10, 4),
    Service("reranker-bge-large", "embedding", 3.0, 20, 3),
    Service("whisper-small", "speech", 3.0, 20, 3),
    Service("whisper-large-v3", "speech", 10.0, 40, 3),
    # 7B-class LLMs: fp16 (~14 GB weights + KV cache) and quantized (~7 GB)
    Service("llama-2-7b-chat-fp16", "llm", 20.0, 60, 4),
    Service("mistral-7b-instruct-fp16", "llm", 20.0, 60, 4),
    Service("qwen2-7b-fp16", "llm", 20.0, 50, 3),
    Service("codellama-7b-fp16", "llm", 20.0, 50, 2),
    Service("llama-2-7b-awq", "llm", 9.0, 35, 6),
    Service("mistral-7b-gptq", "llm", 9.0, 35, 6),
    Service("gemma-7b-int8", "llm", 11.0, 40, 3),
    Service("phi-2", "llm", 6.0, 25, 4),
    Service("llama-2-13b-fp16", "llm", 32.0, 80, 2),
    Service("llama-2-70b-tp4", "llm", 76.0, 100, 1, gpus=4, whole=True),
    # diffusion
    Service("sd-1.5", "diffusion", 5.0, 50, 4),
    Service("sdxl-base", "diffusion", 12.0, 70, 3),
    Service("sdxl-controlnet", "diffusion", 14.0, 70, 2),
    # offline class: batch work that must not share a GPU with online serving
    Service("batch-embed-e5", "embedding", 2.0, 30, 6, "offline"),
    Service("nightly-summarise-7b-awq", "llm", 9.0, 50, 6, "offline"),
    Service("bulk-sdxl-render", "diffusion", 12.0, 80, 4, "offline"),
    Service("batch-whisper-transcribe", "speech", 10.0, 50, 3, "offline"),
    Service("eval-llama-7b-fp16", "llm", 20.0, 70, 2, "offline"),
)

SEED = 7


def build_fleet() -> ClusterState:
    st = ClusterState()
    for model, per_node, count in FLEET:
        for i in range(count):
            name = f"{model.name.lower()}-{i}"
            gpus = [GPU(f"{name}-gpu{j}", j, model.name, model.mem_mib, model.sms) for j in range(per_node)]
            st.add_node(Node(name, gpus))
    return st


def _pods(sharing: bool) -> list[tuple[Service, PodRequest]]:
    out = []
    for svc in SERVICES:
        mem = int(svc.mem_gib * GIB)
        fits = frozenset(m.name for m, _, _ in FLEET if m.mem_mib >= mem)
        for r in range(svc.replicas):
            key = f"{svc.pod_class}/{svc.name}-{r}"
            if sharing and not svc.whole:
                c = ContainerRequest("server", svc.gpus, mem_mib=mem, milli=svc.sm_pct * 10)
            else:
                c = ContainerRequest("server", svc.gpus)
            out.append((svc, PodRequest(key, svc.pod_class, (c,), gpu_models=fits)))
    random.Random(SEED).shuffle(out)
    return out


def _place(sharing: bool) -> dict[str, float | None]:
    st = build_fleet()
    policy = get_policy(DEFAULT_POLICY if sharing else "bestfit", seed=SEED)
    pods = _pods(sharing)
    for _, pod in pods:
        policy.observe(pod)
    placed = 0
    mem_req = sm_req = 0.0
    for svc, pod in pods:
        d = schedule(st, pod, policy)
        if d.placed:
            placed += 1
            mem_req += svc.mem_gib * GIB * svc.gpus
            sm_req += svc.sm_pct * svc.gpus
    used = [g for n in st.nodes.values() for g in n.gpus if not g.empty]
    total_gpus = sum(len(n.gpus) for n in st.nodes.values())
    demand = sum(s.gpus * s.replicas for s in SERVICES)
    # Whole cards: one (or more) per replica, whatever it uses. gpupack: what it used, if all fit.
    needed: float | None = (
        float(demand) if not sharing else (float(len(used)) if placed == len(pods) else None)
    )
    return {
        "gpus_needed": needed,
        "gpus_in_fleet": total_gpus,
        "gpus_used": len(used),
        "gpus_needed_whole_card": demand,
        "pods": len(pods),
        "pods_placed": placed,
        "pods_placed_pct": 100.0 * placed / len(pods),
        "mem_util_pct": 100.0 * mem_req / sum(g.mem_mib for g in used) if used else 0.0,
        "sm_util_pct": sm_req / len(used) if used else 0.0,
    }


def run_fleet_scenario() -> dict:
    modes = {"whole-card": _place(False), "gpupack": _place(True)}
    fleet = ", ".join(f"{count}x{per}x {m.name}" for m, per, count in FLEET)
    return {
        "title": f"{len(SERVICES)} services, {modes['gpupack']['pods']} replicas on {fleet} "
        f"({modes['gpupack']['gpus_in_fleet']} GPUs)",
        "policy": DEFAULT_POLICY,
        "modes": modes,
    }


def format_table(result: dict) -> str:
    rows = [
        ("GPUs needed for every replica", "gpus_needed", "{:.0f}"),
        ("GPUs used on this fleet", "gpus_used", "{:.0f}"),
        ("pods placed", "pods_placed", "{:.0f}"),
        ("pods placed %", "pods_placed_pct", "{:.1f}"),
        ("GPU memory used % (of used GPUs)", "mem_util_pct", "{:.1f}"),
        ("SM share used % (of used GPUs)", "sm_util_pct", "{:.1f}"),
    ]
    modes = result["modes"]
    first = next(iter(modes.values()))
    lines = [
        result["title"],
        f"whole-card allocation would need {first['gpus_needed_whole_card']} GPUs for every replica; "
        f"the fleet has {first['gpus_in_fleet']}.",
        "",
        f"{'':<34}" + "".join(f"{m:>14}" for m in modes),
    ]
    for label, key, fmt in rows:
        lines.append(
            f"{label:<34}"
            + "".join(f"{'n/a' if v[key] is None else fmt.format(v[key]):>14}" for v in modes.values())
        )
    return "\n".join(lines)
