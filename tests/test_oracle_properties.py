"""Property tests: random deployments x random capability records x random rankings.

Explicit requests are never substituted and are refused exactly when a check fails; auto
returns the first backend without reasons and never one with a reason; the error names
every failing field; the check never raises; selection is deterministic.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle_doubles import StubBackend

from moelora.activations import Activation
from moelora.backends.base import CHECKS, Capabilities, Gating, Reason, check, check_table
from moelora.backends.reference import CAPABILITIES as REFERENCE_CAPS
from moelora.config import AddInputs, DeviceFacts, LoRAConfig, MoEShape, ParallelConfig
from moelora.deployment import AUTO, Deployment, LoRASharding, ParallelMode
from moelora.device import TARGETS, target
from moelora.errors import UnsupportedDeploymentError
from moelora.oracle import select
from moelora.quantization import QuantConfig, Quantization
from moelora.routing import RoutingConfig, RoutingMethod

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
PACKAGES = ["torch", "triton", "flashinfer"]


def subset(values):
    return st.frozensets(st.sampled_from(list(values)))


@st.composite
def devices(draw) -> DeviceFacts:
    base = target(draw(st.sampled_from(sorted(TARGETS))))
    packages = draw(subset(PACKAGES)) | {"torch"}
    return DeviceFacts(base.kind, base.name, base.compute_capability, packages, draw(st.booleans()))


@st.composite
def deployments(draw) -> Deployment:
    experts = draw(st.sampled_from([4, 8, 16, 64, 128, 256, 1024, 2048]))
    hidden = draw(st.sampled_from([64, 100, 2048, 2880]))
    inter = draw(st.sampled_from([32, 48, 96, 768, 1856, 2048]))
    shape = MoEShape(
        experts,
        draw(st.integers(1, min(experts, 8))),
        hidden,
        inter,
        draw(st.sampled_from(list(Activation))),
        has_bias=draw(st.booleans()),
        dtype=draw(st.sampled_from(DTYPES)),
    )
    tp = draw(st.sampled_from([t for t in (1, 2, 4, 8) if inter % t == 0]))
    ep = draw(st.sampled_from([e for e in (1, 2, 4, 8) if experts % e == 0]))
    rank = draw(st.sampled_from([8, 16, 64, 256]))
    can_shard = tp > 1 and rank % tp == 0 and hidden % tp == 0
    lora = LoRAConfig(
        enabled=draw(st.booleans()),
        max_rank=rank,
        num_slots=draw(st.sampled_from([1, 4, 8, 64])),
        targets=draw(st.sampled_from([("gate_proj", "up_proj", "down_proj"), ("q_proj",)])),
        add_inputs=draw(st.sampled_from(list(AddInputs))),
    )
    device = draw(devices())
    return Deployment(
        shape=shape,
        routing=RoutingConfig(draw(st.sampled_from(list(RoutingMethod)))),
        device=device,
        parallel=ParallelConfig(tp, ep, can_shard and draw(st.booleans())),
        lora=lora,
        cuda_graphs=device.kind == "cuda" and draw(st.booleans()),
        # FP8 experts run unsharded (Deployment refuses them under tp or ep)
        quantization=QuantConfig(
            draw(st.sampled_from(list(Quantization))) if tp * ep == 1 else Quantization.NONE
        ),
    )


CCS = [None, (8, 0), (9, 0), (10, 0), (10, 9)]


@st.composite
def capabilities(draw) -> Capabilities:
    limit = st.none() | st.sampled_from([4, 16, 128, 1023])
    add_inputs = st.dictionaries(st.sampled_from(list(LoRASharding)), subset(AddInputs))
    return Capabilities(
        devices=draw(subset(["cuda", "cpu"])),
        min_compute_capability=draw(st.sampled_from(CCS)),
        max_compute_capability=draw(st.sampled_from(CCS)),
        cpu_needs_interpreter=draw(st.booleans()),
        packages=draw(subset(PACKAGES)),
        dtypes=draw(subset(DTYPES)),
        activations=draw(subset(Activation)),
        gating=draw(subset(Gating)),
        routing_methods=draw(subset(RoutingMethod)),
        expert_bias=draw(st.booleans()),
        quantizations=draw(
            st.dictionaries(st.sampled_from(list(Quantization)), st.sampled_from(CCS))
        ),
        parallel_modes=draw(subset(ParallelMode)),
        lora=draw(st.booleans()),
        runs_without_lora=draw(st.booleans()),
        max_rank=draw(limit),
        max_slots=draw(limit),
        lora_add_inputs=draw(add_inputs),
        intermediate_align=draw(st.sampled_from([1, 8, 16, 128])),
        hidden_align=draw(st.sampled_from([1, 8, 16, 128])),
        max_experts=draw(limit),
        max_groups=draw(limit),
        cuda_graph_safe=draw(st.booleans()),
    )


PERMISSIVE = dataclasses.replace(REFERENCE_CAPS, cuda_graph_safe=True, packages=frozenset())
FIELDS = [f.name for f in dataclasses.fields(Capabilities)]


@st.composite
def near_permissive(draw) -> Capabilities:
    """A record accepting everything except up to two fields taken from a random record, so
    that accepts and refusals both occur often (fully random records nearly always refuse)."""
    random_record = draw(capabilities())
    taken = draw(st.lists(st.sampled_from(FIELDS), max_size=2, unique=True))
    return dataclasses.replace(PERMISSIVE, **{f: getattr(random_record, f) for f in taken})


@st.composite
def registries(draw) -> dict[str, StubBackend]:
    records = draw(st.lists(near_permissive() | capabilities(), min_size=1, max_size=4))
    return {f"b{i}": StubBackend(f"b{i}", cap) for i, cap in enumerate(records)}


def with_backend(dep: Deployment, name: str) -> Deployment:
    return Deployment(
        dep.shape,
        dep.routing,
        dep.device,
        dep.parallel,
        dep.lora,
        dep.cuda_graphs,
        name,
        quantization=dep.quantization,
    )


@SETTINGS
@given(near_permissive() | capabilities(), deployments())
def test_check_never_raises_and_matches_its_table(cap, dep):
    reasons = check(cap, dep)
    table = check_table(cap, dep)
    assert [name for name, _ in table] == [name for name, _ in CHECKS]
    assert reasons == [r for _, rs in table for r in rs]
    assert all(isinstance(r, Reason) and r.field and r.needed for r in reasons)


def expected_order(registry, dep) -> list[str]:
    """The order the oracle documents: registry order, except that on a CPU a backend that
    would run through Triton's interpreter comes after every backend that runs natively."""
    interpreted = [n for n, b in registry.items()
                   if dep.device.kind == "cpu" and b.capabilities.cpu_needs_interpreter]  # fmt: skip
    return [n for n in registry if n not in interpreted] + interpreted


@SETTINGS
@given(registries(), deployments(), st.data())
def test_explicit_request_is_honoured_or_refused_never_substituted(registry, dep, data):
    name = data.draw(st.sampled_from(list(registry)))
    dep = with_backend(dep, name)
    reasons = check(registry[name].capabilities, dep)
    accepting = [
        n for n in expected_order(registry, dep) if not check(registry[n].capabilities, dep)
    ]
    if not reasons:
        chosen = select(dep, registry)
        assert (chosen.name, chosen.how) == (name, "explicit")
        return
    with pytest.raises(UnsupportedDeploymentError) as err:
        select(dep, registry)
    assert err.value.requested == name
    assert err.value.reasons == {name: reasons}
    assert err.value.accepting == accepting
    for reason in reasons:  # every failing field and its value are named
        assert f"{reason.field} = {reason.value}" in str(err.value)


@SETTINGS
@given(registries(), deployments())
def test_auto_returns_the_first_backend_without_reasons(registry, dep):
    verdicts = {n: check(registry[n].capabilities, dep) for n in expected_order(registry, dep)}
    accepting = [n for n, reasons in verdicts.items() if not reasons]
    if not accepting:
        with pytest.raises(UnsupportedDeploymentError) as err:
            select(dep, registry)
        assert err.value.reasons == verdicts
        return
    chosen = select(dep, registry)
    assert chosen.name == accepting[0] and chosen.how == AUTO
    assert verdicts[chosen.name] == []
    assert dict(chosen.others) == {n: tuple(r) for n, r in verdicts.items() if n != chosen.name}


@SETTINGS
@given(registries(), deployments(), st.randoms(use_true_random=False))
def test_selection_is_deterministic_and_explicit_ignores_ranking(registry, dep, rnd):
    def outcome(reg, d):
        try:
            chosen = select(d, reg)
        except UnsupportedDeploymentError as err:
            return ("refused", str(err))
        return (chosen.name, chosen.log_line())

    assert outcome(registry, dep) == outcome(registry, dep)
    shuffled_names = list(registry)
    rnd.shuffle(shuffled_names)
    shuffled = {n: registry[n] for n in shuffled_names}
    for name in registry:  # an explicit verdict does not depend on the ranking
        explicit = with_backend(dep, name)
        assert outcome(registry, explicit)[0] == outcome(shuffled, explicit)[0]
