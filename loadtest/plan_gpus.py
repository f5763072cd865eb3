"""`python -m loadtest plan` for a TensorRT-LLM spec: how to split its GPUs, from roofline step times.

    python -m loadtest plan --config configs/h200x8-intra-node.yaml --workload long-prompt-gpu \\
        --model-config configs/models/Llama-3.1-8B-Instruct.json --gpu H200 [--front build/front-bench/front.json]

The GPU budget is the spec's (every role's TP x PP x instances); the engine limits are its roles'. Step times
are estimated from the GPU's datasheet (disagg.planner.roofline), not measured: each figure printed is as
good as those efficiencies. The model's shape comes from the checkpoint's config.json, or `--model-config`
where the checkpoint is not at hand; the GPU from NVML, or `--gpu`. With `--front` (`bench front`'s rows, measured
on a host like the one that will serve), it also says what the front needs at the recommended deployment's
tokens/s: CPU cores, and the instances each of its Python models needs (disagg.planner.front_cost). A spec with `pools` (replicas, a class of
hardware per pool) is refused: plan each pool's hardware as a spec of its own.
"""
from __future__ import annotations

import argparse

from disagg.placement.inventory import inventory
from disagg.placement.plan import DTYPE_BYTES
from disagg.planner import roofline
from disagg.planner.front_cost import front_cost, shares
from disagg.planner.gpu_plan import PRUNE_MARGIN, GpuOption, gpu_plan, length_moments, tp_sizes
from disagg.planner.plan import Traffic
from disagg.planner.simulate import Deployment, EngineLimits
from disagg.spec import DeploymentSpec, SpecError, load_spec, model_config_for


def load(a: argparse.Namespace) -> tuple[DeploymentSpec, dict]:
    spec = load_spec(a.config, a.model_config)
    if spec.pools:
        raise SpecError("pools", "the roofline planner plans one kind of GPU for the spec's own devices; pools add replicas "
                        "and hardware classes: plan each pool's hardware as a spec of its own, with roles.<role>.node")
    config = model_config_for(spec)
    for role in spec.roles.values():
        if role.pp > 1:
            raise SpecError(f"roles.{role.name}.pp", f"{role.pp}: the roofline planner models tensor parallelism only (pp: 1)")
    return spec, config


NVML_NAMES = {"NVIDIA H200": "H200", "NVIDIA H100 80GB HBM3": "H100", "NVIDIA A100-SXM4-80GB": "A100"}


def accelerator(name: str | None) -> roofline.Accelerator:
    if name is None:
        found = inventory()
        if found is None or not found.gpus:
            raise SystemExit(f"error: --gpu: no GPU to read here; name one of {', '.join(roofline.ACCELERATORS)}")
        name = NVML_NAMES.get(found.gpus[0].name, found.gpus[0].name)
    if name not in roofline.ACCELERATORS:
        raise SystemExit(f"error: --gpu: {name!r} has no datasheet figures here (known: {', '.join(roofline.ACCELERATORS)})")
    return roofline.ACCELERATORS[name]


def spec_option(spec: DeploymentSpec) -> tuple[Deployment, dict[str, int]]:
    p, d = spec.roles["prefill"], spec.roles["decode"]
    return Deployment(prefill=p.instances, decode=d.instances), {"prefill": p.tp, "decode": d.tp}


def whole_nodes(spec: DeploymentSpec) -> dict[str, int]:
    """Per role, the GPUs of its node where prefill and decode run on nodes of their own (each then takes whole
    nodes), else 1."""
    if spec.roles["prefill"].node == spec.roles["decode"].node:
        return {"prefill": 1, "decode": 1}
    return {name: sum(r.tp * r.pp * r.instances for r in spec.roles.values() if r.node == role.node)
            for name, role in spec.roles.items()}


def _row(o: GpuOption) -> str:
    p = o.at_rate
    return (f"{str(o):<36} {o.limits.max_batch_size:>5} {o.limits.max_num_tokens:>6} | {o.bound:>7.1f} {o.goodput:>8.1f} | "
            f"{p.ttft_p50_s * 1e3:>11.0f} {p.itl_p95_s * 1e3:>10.1f} {p.attainment:>10.0%}")


def run(a: argparse.Namespace, traffic: Traffic) -> int:
    spec, config = load(a)
    gpu = accelerator(a.gpu)
    model = roofline.ModelShape.of(config, DTYPE_BYTES[spec.model.dtype])
    gpus = sum(r.tp * r.pp * r.instances for r in spec.roles.values())
    limits = {name: EngineLimits(r.max_batch_size, r.max_num_tokens, r.enable_chunked_context, r.tokens_per_block)
              for name, r in spec.roles.items()}
    free = {name: r.kv_cache_free_gpu_mem_fraction for name, r in spec.roles.items()}
    link = "NVLink" if spec.kv_transfer.nvlink else "one RDMA NIC per GPU"
    node_gpus = whole_nodes(spec)
    print(f"plan: {spec.name}: {gpus} x {gpu.name}, {model.weight_bytes / 1e9:.1f} GB of weights, KV handoff over {link}; "
          f"step times from the datasheet (roofline estimate, not measured)", flush=True)
    if max(node_gpus.values()) > 1:
        print(f"plan: prefill and decode on nodes of their own: each role takes whole nodes "
              f"({node_gpus['prefill']} GPUs for prefill, {node_gpus['decode']} for decode)")
    for tp in tp_sizes(model, gpu, gpus, min(free.values())):
        s = roofline.steps(model, tp, gpu)
        print(f"plan: TP{tp} steps: decode at batch 1 / 64 / 256 with 4k-token contexts {s.decode_s(1, 4096) * 1e3:.1f} / "
              f"{s.decode_s(64, 4096) * 1e3:.1f} / {s.decode_s(256, 4096) * 1e3:.1f} ms; a 4k-token prompt {s.prefill_s(4096) * 1e3:.0f} ms")
    mine = spec_option(spec)
    plan = gpu_plan(model, gpu, gpus, limits, free, traffic, spec.kv_transfer.nvlink, node_gpus, keep=mine)
    print(f"{'deployment':<36} {'batch':>5} {'tokens':>6} | {'bound':>7} {'goodput':>8} | "
          f"at {traffic.rate:g} req/s: {'p50 TTFT ms':>11} {'p95 ITL ms':>10} {'attainment':>10}")
    for o in plan.options:
        print(_row(o))
    if plan.pruned:
        print(f"plan: {plan.pruned} more options not simulated: their throughput bound (req/s) is over "
              f"{PRUNE_MARGIN:.0%} below the best goodput")
    best = plan.options[0]
    # the spec's own batch limit: its max_batch_size, or what the KV pool holds of the longest requests
    own = max((o for o in plan.options if (o.deployment, o.tp) == mine), key=lambda o: o.limits.max_batch_size, default=None)
    agg = max((o for o in plan.options if o.deployment.aggregated), key=lambda o: o.goodput, default=None)
    batch = f", decode batch limit {best.limits.max_batch_size}" if not best.deployment.aggregated else \
        f", max_num_tokens {best.limits.max_num_tokens}"
    print(f"plan: recommended {best}{batch}: {best.goodput:.1f} req/s within the SLOs ({best.goodput / gpus:.2f} per GPU)")
    if own is not None:
        print(f"plan: this spec's {own}, decode batch limit {own.limits.max_batch_size}: {own.goodput:.1f} req/s "
              f"({own.goodput / best.goodput:.0%} of the recommended)")
    if agg is None:
        print("plan: aggregated serving cannot match the recommended split: its throughput bound is below that goodput")
    elif agg is not best:
        ratio = f"{best.goodput / agg.goodput:.2f}x" if agg.goodput else "more than"
        print(f"plan: best aggregated, {agg} with chunked prefill, max_num_tokens {agg.limits.max_num_tokens}: "
              f"{agg.goodput:.1f} req/s; the recommended split gives {ratio} its goodput")
    else:
        print("plan: aggregated serving does at least as well as any split for this workload")
    if a.front:
        print_front(spec, a.front, best, traffic)
    return 0


def print_front(spec: DeploymentSpec, source, best: GpuOption, traffic: Traffic) -> None:
    """The front the recommended deployment needs at its goodput, at the CPU per token `bench front` measured."""
    cost = front_cost(source, "tensorrt_llm_bls" if spec.orchestrator.bls else "ensemble")
    output, _ = length_moments(traffic.output_bins)
    tokens_per_s = best.goodput * output
    breakdown = ", ".join(f"{name} {ms:.2f}" for name, ms in shares(cost.ms_per_token))
    print(f"plan: the front at {best.goodput:.1f} req/s x {output:.0f} output tokens = {tokens_per_s:.0f} tokens/s, "
          f"through {cost.path} at {cost.total_ms:.2f} ms of CPU per token ({breakdown}; measured at {cost.streams} streams, {cost.source}, "
          f"on that host's cores): {cost.cores(tokens_per_s):.1f} cores busy")
    given = {"preprocessing": 1, "postprocessing": 1}  # the repository's pre/postprocessing run one instance each
    for model, needed in sorted(cost.instances(tokens_per_s).items()):
        has = given.get(model, spec.orchestrator.instances)
        advice = "" if has >= needed else (
            f": short, set orchestrator.instances: {needed}" if model not in given else
            ": short, and it runs one instance: serve through tensorrt_llm_bls (orchestrator.bls: true)")
        print(f"plan:   {model}: one core at most per instance, needs at least {needed}, this spec gives it {has}{advice}")
