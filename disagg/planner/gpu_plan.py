"""How to split a budget of GPUs between prefill and decode: every TP size per role and instance count that
uses the whole budget, with decode batch limits, and aggregated serving at each TP size and chunked-prefill
token budget, each simulated under the traffic with roofline step times (disagg.planner.roofline).

DistServe's placement search, over the choices a TensorRT-LLM deployment makes: the TP of each role's
engines, how many instances of each, and the runtime batch limit of decode. Every option uses the whole
budget, so goodputs compare as deployments of the same node or pool. Options are simulated in order of their
throughput bound (the rate their engines could sustain with no SLO at all); one whose bound is PRUNE_MARGIN
or more below the best goodput found cannot win and is not simulated (a finite run can pass a little above
what its deployment sustains for ever, so the margin). Each run covers SIMULATED_SECONDS of arrivals, long
against a TTFT target of a second or so, so a queue that grows shows.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from tqdm import tqdm

from disagg.planner import roofline
from disagg.planner.plan import SIMULATED_REQUESTS, Planner, Prediction, Traffic, best_first, predict
from disagg.planner.roofline import Accelerator, ModelShape
from disagg.planner.simulate import Deployment, EngineLimits

TP_SIZES = (1, 2, 4, 8)
AGGREGATED_TOKEN_BUDGETS = (2048, 8192)  # chunked prefill's tokens per step (TensorRT-LLM's default: 8192)
SIMULATED_SECONDS = 120.0
PRUNE_MARGIN = 0.1


@dataclass(frozen=True)
class GpuOption:
    deployment: Deployment
    tp: dict[str, int]  # per role: "prefill" and "decode", or "aggregated"
    limits: EngineLimits  # decode's, or aggregated's
    bound: float  # requests/s its engines sustain at most, SLOs aside
    goodput: float  # requests/s
    at_rate: Prediction

    def __str__(self) -> str:
        d = self.deployment
        if d.aggregated:
            return f"aggregated {d.aggregated} x TP{self.tp['aggregated']}"
        return f"prefill {d.prefill} x TP{self.tp['prefill']} + decode {d.decode} x TP{self.tp['decode']}"


@dataclass(frozen=True)
class GpuPlan:
    options: tuple[GpuOption, ...]  # simulated, best first
    pruned: int  # options not simulated: their bound was PRUNE_MARGIN below the best goodput when their turn came


@dataclass(frozen=True)
class _Candidate:
    planner: Planner
    deployment: Deployment
    tp: dict[str, int]
    limits: EngineLimits
    bound: float


def tp_sizes(model: ModelShape, gpu: Accelerator, gpus: int, free_fraction: float) -> list[int]:
    """TP sizes an engine can use: dividing the heads and KV heads, within the budget, with room for KV."""
    return [tp for tp in TP_SIZES if tp <= gpus and model.heads % tp == 0 and model.kv_heads % tp == 0
            and roofline.kv_capacity_tokens(model, tp, gpu, free_fraction) > 0]


def _batch_limits(top: int, capacity: int, longest: int) -> list[int]:
    """Decode batch limits to try: 64 and the engine's, none whose longest requests overflow the KV pool."""
    top = max(1, min(top, capacity // longest))
    return sorted({b for b in (64,) if b < top} | {top})


def length_moments(bins: tuple[tuple[float, int, int], ...]) -> tuple[float, float]:
    """E[n] and E[n * (n + 1) / 2] of lengths drawn uniformly within weighted bins."""
    total = sum(w for w, _, _ in bins)
    mean = sum(w * (lo + hi) / 2 for w, lo, hi in bins) / total
    square = sum(w * (((hi - lo + 1) ** 2 - 1) / 12 + ((lo + hi) / 2) ** 2) for w, lo, hi in bins) / total
    return mean, (square + mean) / 2


def _bound(steps: dict[str, roofline.StepModel], deployment: Deployment, batch: int, traffic: Traffic) -> float:
    """Requests/s the engines sustain at most: prompts back to back without their steps' fixed cost, and each
    decode token at a full decode step's share, or, where one engine also prefills, riding along a prompt's
    step if that is cheaper."""
    prompt, pairs = length_moments(traffic.prompt_bins)
    output, _ = length_moments(traffic.output_bins)
    context = prompt + output / 2

    def prompt_s(model: roofline.StepModel) -> float:
        return model.prompt.per_token_s * prompt + model.prompt.per_attended_s * pairs

    def decode_s(model: roofline.StepModel, beside_prompts: bool) -> float:
        per_token = model.decode_s(batch, context) / batch
        if beside_prompts:
            per_token = min(per_token, model.prompt.per_token_s + model.decode.per_attended(batch) * context)
        return (output - 1) * per_token

    if deployment.aggregated:
        return deployment.aggregated / (prompt_s(steps["aggregated"]) + decode_s(steps["aggregated"], True))
    return min(deployment.prefill / prompt_s(steps["prefill"]), deployment.decode / max(decode_s(steps["decode"], False), 1e-9))


def _candidates(model: ModelShape, gpu: Accelerator, gpus: int, limits: dict[str, EngineLimits], free_fraction: dict[str, float],
                traffic: Traffic, nvlink: bool, node_gpus: dict[str, int], requests: int) -> list[_Candidate]:
    longest = max(b[2] for b in traffic.prompt_bins) + max(b[2] for b in traffic.output_bins)
    found = []
    decode_tps = tp_sizes(model, gpu, gpus, free_fraction["decode"])
    for tp_p in tp_sizes(model, gpu, gpus, free_fraction["prefill"]):
        for tp_d in decode_tps:
            steps = {"prefill": roofline.steps(model, tp_p, gpu), "decode": roofline.steps(model, tp_d, gpu)}
            capacity = roofline.kv_capacity_tokens(model, tp_d, gpu, free_fraction["decode"])
            for prefill in range(1, gpus // tp_p):
                decode, left = divmod(gpus - prefill * tp_p, tp_d)
                if left or not decode or (prefill * tp_p) % node_gpus["prefill"] or (decode * tp_d) % node_gpus["decode"]:
                    continue
                deployment = Deployment(prefill=prefill, decode=decode)
                for batch in _batch_limits(limits["decode"].max_batch_size, capacity, longest):
                    engine = replace(limits["decode"], max_batch_size=batch)
                    planner = Planner(steps, {"prefill": limits["prefill"], "decode": engine},
                                      roofline.handoff(model, tp_p, tp_d, gpu, nvlink), requests=requests, seconds=SIMULATED_SECONDS)
                    found.append(_Candidate(planner, deployment, {"prefill": tp_p, "decode": tp_d}, engine,
                                            _bound(steps, deployment, batch, traffic)))
    for tp in decode_tps:
        if gpus % tp:
            continue
        steps = {"aggregated": roofline.steps(model, tp, gpu)}
        capacity = roofline.kv_capacity_tokens(model, tp, gpu, free_fraction["decode"])
        batch = _batch_limits(limits["decode"].max_batch_size, capacity, longest)[-1]
        deployment = Deployment(aggregated=gpus // tp)
        for budget in AGGREGATED_TOKEN_BUDGETS:
            engine = EngineLimits(batch, max(budget, batch), True, limits["decode"].tokens_per_block)
            planner = Planner(steps, {"aggregated": engine}, lambda _: 0.0, requests=requests, seconds=SIMULATED_SECONDS)
            found.append(_Candidate(planner, deployment, {"aggregated": tp}, engine, _bound(steps, deployment, batch, traffic)))
    return found


def gpu_plan(model: ModelShape, gpu: Accelerator, gpus: int, limits: dict[str, EngineLimits], free_fraction: dict[str, float],
             traffic: Traffic, nvlink: bool, node_gpus: dict[str, int] | None = None,
             keep: tuple[Deployment, dict[str, int]] | None = None,
             requests: int = SIMULATED_REQUESTS, progress: bool = True) -> GpuPlan:
    """Every option for `gpus` GPUs that could win, best first, and those of `keep` (a deployment and its TP per
    role) whatever their bound. `limits`: the spec's prefill and decode engine limits (batch size, tokens per
    step, chunking); `free_fraction`: each role's kv_cache_free_gpu_mem_fraction; `node_gpus`: per role, a
    number of GPUs it takes a multiple of (whole nodes, where roles run on nodes of their own; default 1)."""
    nodes = {"prefill": 1, "decode": 1, **(node_gpus or {})}
    candidates = sorted(_candidates(model, gpu, gpus, limits, free_fraction, traffic, nvlink, nodes, requests),
                        key=lambda c: -c.bound)
    found: list[GpuOption] = []
    for c in tqdm(candidates, desc="plan", disable=not progress, leave=False):
        if found and c.bound < max(o.goodput for o in found) * (1 - PRUNE_MARGIN) and (c.deployment, c.tp) != keep:
            continue
        found.append(GpuOption(c.deployment, c.tp, c.limits, c.bound, c.planner.goodput(c.deployment, traffic),
                               predict(c.planner.run(c.deployment, traffic, traffic.rate), traffic)))
    ranked = best_first(found, lambda o: (o.limits.max_batch_size, o.limits.max_num_tokens))
    return GpuPlan(tuple(ranked), len(candidates) - len(found))
