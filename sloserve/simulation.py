"""Assemble a simulated fleet from names, feed it a workload, and turn what happened into
the same per-request records the bench client writes, so one report serves both.

It sits above `sim/` and `cluster/`: it puts the fleet controller (router + migration
policies) in charge of simulated instances, which only know the controller's interface
(`sloserve.fleet_view`)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional, Sequence

from sloserve.core.records import RequestRecord, error_kind_for_status
from sloserve.timeline import FleetTimeline
from sloserve.cluster.assembly import build_controller
from sloserve.cluster.controller import FleetController
from sloserve.cluster.migration import MoveCosts, make_migration_policy
from sloserve.cluster.routers import RouterOptions, make_router
from sloserve.cluster.spec import FleetSpec
from sloserve.core.config import CacheConfig, ModelConfig, PoolSettings, SchedulerConfig
from sloserve.kv.tiers import DISK, STORE, KVTiers
from sloserve.cluster.experts import make_expert_placer
from sloserve.cluster.stages import make_stage_policy
from sloserve.sched.clocks import make_clock_policy
from sloserve.sim.catalog import get_model
from sloserve.sim.clocking import ClockControl
from sloserve.sim.cost import CostModel, Profile, ProfiledCostModel, RooflineCostModel
from sloserve.sim.experts import ExpertParallelCostModel, ExpertPopularity
from sloserve.sim.hardware import DEFAULT_LINK, get_hardware, get_link
from sloserve.sim.instance import SimInstance, kv_blocks_for
from sloserve.sim.kv_store import SimKVStore
from sloserve.sim.pipeline import PipelineCostModel
from sloserve.sim.power import get_power
from sloserve.sim.prompts import SyntheticPrompt
from sloserve.sim.simulator import SimResult, Simulator
from sloserve.core.types import DEFAULT_QOS, QoSClass, Request, SamplingParams, StructuredOutput
from sloserve.workload.types import WorkloadRequest

if TYPE_CHECKING:
    from sloserve.cluster.predict import PredictionBook
    from sloserve.sim.fluid import FluidFleet, ResponseCurve

@dataclass(slots=True)  # slots: setting a field it does not have (one of its spec's) fails
class FleetConfig:
    """A simulated fleet: the controller's side (`fleet`, the FleetSpec the real fleet runs too),
    then what only a simulated fleet has: hardware, model, links, cost model, start times."""

    fleet: FleetSpec = field(default_factory=FleetSpec)
    hardware: str = "h100-80g"
    model: str = "llama-3.1-8b"
    tp: int = 1
    scheduler: SchedulerConfig = field(default_factory=lambda: SchedulerConfig(max_num_batched_tokens=2048,
                                                                               max_num_seqs=256))
    cache: CacheConfig = field(default_factory=CacheConfig)
    profile: Optional[str] = None  # a `sloserve profile` file: price steps with it instead of the roofline
    num_blocks: Optional[int] = None  # override the pool size derived from device memory
    max_model_len: Optional[int] = None
    dtype_bytes: int = 2
    fast_forward: bool = True
    online_predictor: bool = True  # completed requests update the predictor as the run goes
    # The link KV crosses between instances, for migration and P/D hand-offs (sim/hardware.py
    # LINKS; default InfiniBand NDR: instances on different hosts, one 400 Gb/s NIC per GPU; pass
    # e.g. nvlink-h100 for instances in one NVLink domain).
    link: str = DEFAULT_LINK
    # Autoscaling (sim/scaling.py): instances ready at time 0 (default: the spec's fewest; a P/D
    # fleet's (P, D), default its `pd_min`), start times, and the demand the scalers read.
    initial_instances: Optional[int] = None
    pd_initial: Optional[tuple[int, int]] = None
    cold_start_s: float = 120.0
    warm_start_s: Optional[float] = None
    keep_alive_s: float = 0.0
    demand_step_s: float = 60.0
    scaling_history: Optional[object] = None  # a workload.series.Series of demand before the run (predictive)
    scaling_future: Optional[object] = None  # a Series of the run's own demand from its start (the oracle only)
    # The fleet's shared KV store (kv/tiers.py, sim/kv_store.py): its size (0: none) and the link
    # each instance reaches it over. Per-instance host and disk tiers are sized in `cache`.
    kv_store_gib: float = 0.0
    kv_store_link: str = DEFAULT_LINK
    # Energy (sched/clocks, sim/power.py): a clock policy name ("max", "slo-slack", "energy-min")
    # prices every step at the SM clock it picks and books the fleet's joules; None: no energy books.
    clock_policy: Optional[str] = None
    # Mixture-of-experts placement (cluster/experts, sim/experts.py): a policy name ("static",
    # "replicate-hot", "offload-cold", "rebalance") makes each instance an expert-parallel group of
    # `tp` GPUs whose experts it places; popularity per layer is log-normal with this skew, drifting
    # with time constant `expert_drift_s` (0: fixed), in epochs of `expert_epoch_s`.
    experts: Optional[str] = None
    expert_skew: float = 0.6
    expert_drift_s: float = 1800.0
    expert_epoch_s: float = 60.0
    expert_interval_s: float = 600.0  # how often `rebalance` re-places
    expert_redundant: int = 1  # extra expert copies per GPU per layer (replicate-hot, rebalance)
    expert_offload: float = 0.25  # share of each layer's experts offload-cold keeps in host memory
    expert_seed: int = 0
    # Pipeline parallelism (sim/pipeline.py, cluster/stages): each instance is `pp` stages of `tp`
    # GPUs; a stage policy ("even", "profiled", "dynamic") partitions the layers and may move them
    # at the end of each `stage_window_s` when the stages have been unbalanced by more than
    # `stage_threshold`, moving weights over `stage_link`.
    pp: int = 1
    stages: str = "even"
    stage_window_s: float = 30.0
    stage_threshold: float = 0.05
    stage_link: str = "nvlink-h100"

    def with_fleet(self, **changes: Any) -> "FleetConfig":
        """This fleet with `changes` to its spec (a new `pd` brings its P + D instances)."""
        if "pd" in changes:
            return replace(self, fleet=self.fleet.with_pd(changes.pop("pd"), **changes))
        return replace(self, fleet=replace(self.fleet, **changes))

    def fixed(self, **changes: Any) -> "FleetConfig":
        """This fleet without autoscaling (its bounds and capacities dropped), with `changes` to its
        spec; a result without `pd` also drops what only a hand-off uses (pool overrides, the decode
        router unless mixed instances hand off). What planning measures a fleet's parts on."""
        out = self.with_fleet(autoscale=None, min_instances=None, pd_min=None, pd_capacity=None, **changes)
        out.pd_initial = None
        if out.fleet.pd is None:
            out = out.with_fleet(prefill_pool=PoolSettings(), decode_pool=PoolSettings(),
                                 decode_router=out.fleet.decode_router if out.fleet.mixed_handoff != "never" else None)
        return out

    def validate(self) -> None:
        """ValueError (one line) on a fleet the simulator cannot run: the controller's settings by
        FleetSpec.validate (the real fleet's check), then what only the simulator has."""
        spec = self.fleet
        if spec.pd_transfer == "live":
            raise ValueError("--pd-transfer live is the real fleet's (pre-copy while the prefill instance decodes); "
                             "the simulator sends pipelined or blocking")
        spec.validate()
        if self.tp < 1:
            raise ValueError("--tp must be >= 1")
        get_link(self.link)
        get_link(self.kv_store_link)
        if self.kv_store_gib < 0:
            raise ValueError("--kv-store-gib must be >= 0")
        self.scheduler.validate()
        self.cache.validate()
        if self.experts is not None:
            make_expert_placer(self.experts, redundant=self.expert_redundant, offload_share=self.expert_offload,
                               interval_s=self.expert_interval_s)
            if not get_model(self.model).num_experts:
                raise ValueError(f"--experts places the experts of a mixture-of-experts model; {self.model} has none")
            if self.profile or self.clock_policy is not None:
                raise ValueError("--experts prices steps with its own roofline: drop --profile and --clock-policy")
        if self.pp < 1:
            raise ValueError("--pp must be >= 1")
        if self.pp > 1:
            make_stage_policy(self.stages, window_s=self.stage_window_s, threshold=self.stage_threshold)
            get_link(self.stage_link)
            if spec.pd is not None or self.experts is not None or self.clock_policy is not None or self.profile:
                raise ValueError("--pp prices steps with its own stage model: drop --pd, --experts, --clock-policy "
                                 "and --profile")
        if self.clock_policy is not None:
            make_clock_policy(self.clock_policy)
            get_power(self.hardware)
            if self.profile:
                raise ValueError("--clock-policy needs the roofline cost model; drop --profile")
        if spec.pd is not None:
            for role in ("prefill", "decode"):
                pool_config(self, role).scheduler.validate()
        if spec.autoscale is not None and spec.pd is not None:
            bounds = spec.pool_bounds
            if self.pd_initial is not None and not all(
                    low <= n <= high for (low, high), n in zip(bounds.values(), self.pd_initial)):
                raise ValueError(f"pd_initial {self.pd_initial} must lie between {bounds['prefill'][0]}:"
                                 f"{bounds['decode'][0]} and {spec.pd_text}")
            if spec.pd_capacity is None or not all(c > 0 for c in spec.pd_capacity):
                raise ValueError("autoscaling a P/D fleet needs the capacity of one prefill and one decode instance")
        elif spec.autoscale is not None:
            if spec.capacity_rps is None or not spec.capacity_rps > 0:
                raise ValueError("autoscaling needs the capacity of one instance (capacity_rps > 0)")


def scaling_spec(cfg: FleetConfig):
    """The simulator's scaling books for `cfg` (None: a fixed fleet); a P/D fleet scales each pool
    apart, from its fewest (or `pd_initial`) at time 0."""
    spec = cfg.fleet
    if spec.autoscale is None:
        return None
    from sloserve.sim.scaling import ScalingSpec

    if spec.pd is not None:
        p_cap, d_cap = spec.pd_capacity  # type: ignore[misc]
        lows = {pool: low for pool, (low, _) in spec.pool_bounds.items()}
        return ScalingSpec(p_cap, 1, spec.scaling_interval_s, cfg.cold_start_s, cfg.warm_start_s, cfg.keep_alive_s,
                           cfg.demand_step_s, pool_capacity={"prefill": p_cap, "decode": d_cap},
                           pool_initial=dict(zip(("prefill", "decode"), cfg.pd_initial)) if cfg.pd_initial else lows)
    initial = spec.fewest if cfg.initial_instances is None else cfg.initial_instances
    return ScalingSpec(spec.capacity_rps, initial, spec.scaling_interval_s, cfg.cold_start_s,  # type: ignore[arg-type]
                       cfg.warm_start_s, cfg.keep_alive_s, cfg.demand_step_s)


def controller_of(cfg: FleetConfig, predictions: Optional["PredictionBook"] = None) -> FleetController:
    """The simulated fleet's controller: cluster.assembly's, as the real fleet builds it."""
    return build_controller(cfg.fleet, predictions=predictions, history=cfg.scaling_history,
                            future=cfg.scaling_future)


def pool_config(cfg: FleetConfig, role: str) -> FleetConfig:
    """The fleet's settings as one pool of it runs them (a `mixed` instance keeps them all)."""
    pool = {"prefill": cfg.fleet.prefill_pool, "decode": cfg.fleet.decode_pool}.get(role)
    if pool is None or pool == PoolSettings():
        return cfg
    return replace(cfg, tp=pool.tp or cfg.tp, scheduler=pool.apply(cfg.scheduler))


def fleet_gpus(cfg: FleetConfig) -> int:
    """Devices the fleet occupies: each instance's tensor-parallel degree, summed."""
    return sum(pool_config(cfg, role).tp for role in fleet_roles(cfg)) * cfg.pp


def fleet_roles(cfg: FleetConfig) -> list[str]:
    return list(cfg.fleet.roles)


def build_cost_model(cfg: FleetConfig) -> tuple[CostModel, ModelConfig, int]:
    """The cost model, the model's shape, and KV blocks per instance."""
    model = get_model(cfg.model)
    hw = get_hardware(cfg.hardware)
    if cfg.pp > 1:
        roofline = pipeline_cost(cfg, hw, model)
    elif cfg.experts is not None:
        roofline = expert_parallel_cost(cfg, hw, model)
    else:
        roofline = RooflineCostModel(hw, model, cfg.tp, cfg.dtype_bytes, block_size=cfg.cache.block_size)
    cost: CostModel = roofline
    if cfg.profile:  # a profile times no swaps: price them over the hardware's host link
        cost = ProfiledCostModel(Profile.load(cfg.profile), swap_s_per_block=roofline.swap_time(1))
    blocks = cfg.num_blocks or kv_blocks_for(hw.mem_bytes, roofline.weight_bytes(), model, cfg.cache.block_size,
                                             cfg.tp * cfg.pp, cfg.scheduler.max_num_batched_tokens,
                                             cfg.scheduler.max_num_seqs,
                                             cfg.dtype_bytes)
    return cost, model, blocks


def pipeline_cost(cfg: FleetConfig, hw, model: ModelConfig) -> RooflineCostModel:
    """An instance of `cfg.pp` stages of `cfg.tp` GPUs whose layers `cfg.stages` partitions."""
    policy = make_stage_policy(cfg.stages, window_s=cfg.stage_window_s, threshold=cfg.stage_threshold)
    return PipelineCostModel(hw, model, cfg.tp, cfg.pp, policy, get_link(cfg.stage_link), cfg.dtype_bytes,
                             block_size=cfg.cache.block_size)


def expert_parallel_cost(cfg: FleetConfig, hw, model: ModelConfig) -> ExpertParallelCostModel:
    """An instance of `cfg.tp` GPUs whose experts `cfg.experts` places (and re-places, if it does)
    as their popularity drifts; placed first from the popularity at time 0 (a calibration run)."""
    placer = make_expert_placer(cfg.experts, redundant=cfg.expert_redundant,  # type: ignore[arg-type]
                                offload_share=cfg.expert_offload, interval_s=cfg.expert_interval_s)
    popularity = ExpertPopularity(model.num_layers, model.num_experts, cfg.expert_skew, cfg.expert_drift_s,
                                  cfg.expert_epoch_s, cfg.expert_seed)
    return ExpertParallelCostModel(hw, model, cfg.tp, placer.place(popularity.current, cfg.tp), popularity,
                                   replace=lambda seen: placer.place(seen, cfg.tp), replace_every_s=placer.interval_s,
                                   dtype_bytes=cfg.dtype_bytes, block_size=cfg.cache.block_size)


def block_bytes(cfg: FleetConfig, model: ModelConfig) -> float:
    """Bytes of one KV block of the whole model (each tensor-parallel device holds 1/tp of it)."""
    return cfg.cache.block_size * model.kv_bytes_per_token(cfg.dtype_bytes)


def host_blocks_for(cfg: FleetConfig, model: ModelConfig) -> int:
    """Host swap blocks per instance (none unless preemption may swap): the swap space is per
    device, as vLLM's --swap-space, and each device holds 1/tp of every block."""
    if cfg.scheduler.preemption_mode == "recompute":
        return 0
    return cfg.cache.host_blocks(block_bytes(cfg, model) / cfg.tp)


def kv_tiers_for(cfg: FleetConfig, model: ModelConfig, cost: CostModel, store: Optional[SimKVStore]) -> Optional[KVTiers]:
    """One instance's lower prefix-cache tiers (None without any), and their copy prices on `cost`:
    host memory over the swap link, the host's NVMe, the shared store over `kv_store_link` (each
    tensor-parallel rank pulls its shard over its own NIC)."""
    per_block = block_bytes(cfg, model)
    host = int(cfg.cache.host_tier_gib * 2**30 // per_block)
    disk = int(cfg.cache.disk_tier_gib * 2**30 // per_block)
    if not (host or disk or store is not None):
        return None
    if not cfg.cache.enable_prefix_caching:
        raise ValueError("KV tiers hold the prefix cache: they need prefix caching on")
    cost.tier_s_per_block = {DISK: per_block / get_hardware(cfg.hardware).disk_bandwidth,
                             STORE: per_block / cfg.tp / get_link(cfg.kv_store_link)}
    return KVTiers(host, disk, store, write_back=cfg.cache.tier_write_back)


def shared_store_for(cfg: FleetConfig) -> Optional[SimKVStore]:
    if not cfg.kv_store_gib > 0:
        return None
    return SimKVStore(int(cfg.kv_store_gib * 2**30 // block_bytes(cfg, get_model(cfg.model))))


def make_predictions(cfg: FleetConfig) -> Optional["PredictionBook"]:
    """The run's prediction book (one per run: online updates must not leak across runs)."""
    predictor = cfg.fleet.resolved_predictor
    if predictor is None:
        return None
    from sloserve.cluster.predict import PredictionBook, load_predictor

    return PredictionBook(load_predictor(predictor), online=cfg.online_predictor)  # type: ignore[arg-type]


def build_fleet(cfg: FleetConfig, predictions: Optional["PredictionBook"] = None) -> Simulator:
    """The simulated fleet; with `predictions`, predictive routers read the requests' length
    distributions from it."""
    cfg.validate()
    roles = fleet_roles(cfg)
    instances = sim_instances(cfg, roles, shared_store_for(cfg))
    model = get_model(cfg.model)
    return Simulator(instances, controller_of(cfg, predictions), move_costs(cfg, model), cfg.fleet.migration_interval_s,
                     roles=roles, pd_transfer=cfg.fleet.pd_transfer, num_layers=model.num_layers,
                     scaling=scaling_spec(cfg))


def build_fluid(cfg: FleetConfig, curve: "ResponseCurve", ttft_s: float, tick_s: float = 1.0, drain_s: float = 10.0,
                seed: int = 0) -> "FluidFleet":
    """The fleet at flow level (sim/fluid.py): `cfg`'s autoscaling through the same controller and
    scaling books as build_fleet, requests priced by `curve` (planning.response_curve)."""
    from sloserve.sim.fluid import FluidFleet
    from sloserve.sim.scaling import SimScaling

    cfg.validate()
    if cfg.fleet.autoscale is None or cfg.fleet.pd is not None:
        raise ValueError("the fluid fleet runs an autoscaled colocated fleet (--autoscale, no --pd)")
    return FluidFleet(controller_of(cfg), SimScaling(scaling_spec(cfg), fleet_roles(cfg)), curve, ttft_s, tick_s,
                      drain_s, seed)


def sim_instances(cfg: FleetConfig, roles: Sequence[str], store: Optional[SimKVStore],
                  first_id: int = 0) -> list[SimInstance]:
    """One simulated engine per role, each priced with its pool's settings, numbered from `first_id`."""
    instances = []
    for i, role in enumerate(roles, start=first_id):
        pool = pool_config(cfg, role)
        cost, model, blocks = build_cost_model(pool)
        context = min(pool.max_model_len or model.max_position_embeddings, blocks * pool.cache.block_size)
        clock = None if cfg.clock_policy is None else \
            ClockControl(make_clock_policy(cfg.clock_policy), get_power(pool.hardware), cost, gpus=pool.tp)
        instances.append(SimInstance(i, cost, blocks, context, pool.scheduler, pool.cache,
                                     fast_forward=pool.fast_forward, num_host_blocks=host_blocks_for(pool, model),
                                     tiers=kv_tiers_for(pool, model, cost, store), clock=clock))
    return instances


def build_mixed_fleet(groups: Sequence[FleetConfig], router: str = "least-requests",
                      router_seed: int = 0) -> Simulator:
    """One colocated fleet of one model whose instances come in groups on different hardware
    (each group a FleetConfig: its `instances` on its `hardware` at its `tp`), behind one
    router: a heterogeneous deployment. Groups of zero instances are left out; no migration,
    autoscaling or disaggregation (build_fleet has those, for one group)."""
    groups = [g for g in groups if g.fleet.instances > 0]
    if not groups:
        raise ValueError("a fleet needs at least one instance")
    if len({g.model for g in groups}) != 1:
        raise ValueError("the groups of one fleet must serve one model: " + ", ".join(sorted({g.model for g in groups})))
    instances: list[SimInstance] = []
    for g in groups:
        if g.fleet.pd is not None or g.fleet.autoscale is not None or g.fleet.migration != "none" \
                or g.kv_store_gib > 0:
            raise ValueError("a mixed fleet's groups take no P/D, autoscaling, migration or shared store")
        g.validate()
        instances.extend(sim_instances(g, ["mixed"] * g.fleet.instances, None, first_id=len(instances)))
    return Simulator(instances, FleetController(make_router(router, RouterOptions(seed=router_seed)),
                                                make_migration_policy("none")))


def move_costs(cfg: FleetConfig, model: ModelConfig) -> MoveCosts:
    """What a migration costs in this fleet. With tensor parallelism each of the tp devices
    sends its 1/tp of every block over its own link, at the same time (pools of different
    degrees: the smaller one's links bound the copy)."""
    tp = min(pool_config(cfg, role).tp for role in set(fleet_roles(cfg)))
    return MoveCosts.uniform(model.kv_bytes_per_token(cfg.dtype_bytes), get_link(cfg.link) * tp)


# What a simulated request under a token mask carries: the cost model prices the mask per row
# (sim/cost.MaskCost); nothing compiles it.
SIMULATED_MASK = StructuredOutput("json_object")


def sim_requests(stream: Iterable[WorkloadRequest], classes: Optional[dict[str, QoSClass]] = None,
                 predictions: Optional["PredictionBook"] = None, token_gaps: bool = False) -> Iterator[Request]:
    """Workload requests as scheduler requests: ending at their recorded output length.

    With `predictions`, each request also carries a predicted output length, made from what a
    real front end would have: the prompt text where the workload has it (ShareGPT, ServeGen),
    otherwise only the prompt's token count (Azure and Mooncake traces carry no text). With
    `token_gaps`, each keeps every gap between its tokens (the records' ITL; memory per token)."""
    classes = classes or {}
    for i, w in enumerate(stream):
        prompt = w.prompt_token_ids if w.prompt_token_ids is not None else SyntheticPrompt(
            max(1, w.prompt_len), i, w.hash_ids, w.hash_block_size or 512)
        # A simulated request ends at its recorded length (no EOS is ever sampled); a constrained
        # one may not ignore EOS, which changes nothing here.
        params = SamplingParams(max_tokens=max(1, w.output_len), ignore_eos=not w.structured, temperature=0.0,
                                structured=SIMULATED_MASK if w.structured else None)
        request = Request(w.request_id or f"sim-{i}", prompt, params, arrival_time=w.arrival_s,
                          qos=classes.get(w.qos_class, DEFAULT_QOS), tenant=w.tenant,
                          token_gaps=[] if token_gaps else None)
        if predictions is not None:
            predictions.annotate(request, w.prompt_text)
        yield request


def record_of(index: int, request: Request, error: Optional[str] = None) -> RequestRecord:
    """What a client would have recorded (per-token gaps only if the request kept them: TPOT comes
    from E2E and TTFT either way)."""
    arrival = request.arrival_time
    rec = RequestRecord(index=index, request_id=request.request_id, tenant=request.tenant,
                        qos_class=request.qos.name, scheduled_s=arrival, dispatch_s=arrival, send_s=arrival,
                        prompt_len=request.num_prompt_tokens, output_len=request.sampling_params.max_tokens or 0)
    if error is not None:
        rec.http_status, rec.error = 400, error
        rec.error_kind = error_kind_for_status(400)
        return rec
    rec.http_status = 200
    rec.ttft_s = request.first_token_time - arrival
    rec.e2e_s = request.finished_time - arrival
    rec.prompt_tokens = request.num_prompt_tokens
    rec.output_tokens = rec.num_chunks = request.num_output_tokens
    if request.token_gaps is not None:
        rec.itl_s = list(request.token_gaps)
    rec.finish_reason = request.finish_reason.value if request.finish_reason else None
    return rec


def simulate(sim: Simulator, requests: Iterable[Request],
             on_progress: Optional[Callable[[float, int], None]] = None,
             predictions: Optional["PredictionBook"] = None, timeline: Optional[FleetTimeline] = None,
             met: Optional[Callable[[RequestRecord], bool]] = None) -> tuple[list[RequestRecord], SimResult]:
    """Run the fleet; one record per request, in arrival order. With `predictions`, every
    completed request's length is fed back to the predictor as it finishes (online adaptation
    in simulated time: a later arrival sees what earlier completions taught it). With
    `timeline`, the run is recorded into it (`met(record)`: whether a request met its SLO)."""
    index: dict[str, int] = {}

    def numbered() -> Iterator[Request]:
        for i, r in enumerate(requests):
            index[r.request_id] = i
            yield r

    records: list[Optional[RequestRecord]] = []

    def keep(request: Request, error: Optional[str]) -> None:
        i = index[request.request_id]
        records.extend([None] * (i + 1 - len(records)))
        records[i] = rec = record_of(i, request, error)
        if predictions is not None:
            predictions.observe(request, completed=error is None)
        if timeline is not None and error is None:
            timeline.finished(rec.qos_class, rec.ttft_s, rec.tpot_s, met(rec) if met is not None else True)

    result = sim.run(numbered(), on_progress=on_progress, on_done=keep, timeline=timeline)
    return [r for r in records if r is not None], result
