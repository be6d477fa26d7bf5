"""Trainer configuration: dataclasses loaded from YAML and overridden with ``--set section.key=value``.

Unknown keys and wrong types are :class:`UserError` (one line naming the key). A config is named by
a YAML path or by a bundled preset (``tiny``, ``125m``, ``1b``, ``8b``) in ``configs/``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kfp_nvrx.components.core.config_text import parse_set_value, read_config_file
from kfp_nvrx.components.core.settings import (
    check_setting,
    coerce_setting,
    non_negative,
    one_of,
    positive,
    registered,
    setting,
)
from kfp_nvrx.components.core.store_kinds import DEFAULT_KIND, store_kinds
from kfp_nvrx.components.errors import UserError

PRESETS_DIR = Path(__file__).parent / "configs"
class Section:
    """A config section; it never holds a value its declaration forbids.

    Every assignment is type-checked and checked against its field's constraint (:func:`setting`).
    """

    section: ClassVar[str] = ""

    def __setattr__(self, key: str, value: Any) -> None:
        declared = self.__dataclass_fields__.get(key)  # type: ignore[attr-defined]
        if declared is not None:
            dotted = f"{self.section}.{key}"
            value = coerce_setting(dotted, value, _hints(type(self))[key], declared.metadata)
            check_setting(dotted, value, declared.metadata)
        super().__setattr__(key, value)


@dataclass
class ModelConfig(Section):
    """Built-in Llama-style decoder (RMSNorm, RoPE, SwiGLU, SDPA) or a user factory."""

    section: ClassVar[str] = "model"
    # 2^24: beyond the largest vocabularies in use (~1M), and an embedding table of that many
    # rows already takes gigabytes; a typo such as 2**70 must not reach every worker.
    vocab_size: int = setting(256, gt=0, le=2**24)
    dim: int = positive(64)
    n_layers: int = positive(2)
    n_heads: int = positive(4)
    n_kv_heads: int = non_negative(0)  # 0 = same as n_heads
    ffn_multiple_of: int = positive(32)
    ffn_dim_multiplier: float = positive(1.0)
    max_seq_len: int = positive(128)
    norm_eps: float = positive(1e-5)
    rope_theta: float = positive(10000.0)
    factory: str = ""  # "pkg.module:fn" -> fn(model_cfg) returns an nn.Module (tokens -> logits)


@dataclass
class DataConfig(Section):
    """Token shards written by ``kfp-nvrx prepare-data``."""

    section: ClassVar[str] = "data"
    path: str = ""
    split: str = one_of("train", "val")
    seq_len: int = positive(64)
    batch_size: int = positive(4)  # sequences per rank per step


@dataclass
class TrainConfig(Section):
    """Optimisation loop."""

    section: ClassVar[str] = "train"
    steps: int = positive(40)
    # torch.manual_seed takes up to 2**64 - 1; a signed 64-bit bound also fits numpy and JSON.
    seed: int = setting(1234, ge=0, le=2**63 - 1)
    lr: float = non_negative(3e-3)
    min_lr_ratio: float = setting(0.1, ge=0, le=1)
    warmup_steps: int = non_negative(4)
    weight_decay: float = non_negative(0.1)
    beta1: float = setting(0.9, ge=0, lt=1)  # AdamW refuses betas outside [0, 1)
    beta2: float = setting(0.95, ge=0, lt=1)
    grad_clip: float = non_negative(1.0)
    activation_checkpointing: bool = False
    compile: bool = False
    log_every: int = positive(10)
    device: str = one_of("auto", "cpu", "cuda")
    # Seconds slept per step: makes tiny drill runs long enough to fault mid-run.
    step_sleep: float = non_negative(0.0)
    # A diagnostic: every step event also says where the step's time went (`parts`: the loop's
    # thread between marks, the GPU's span), to tell a thread that waited from slower kernels.
    # It costs time itself: at 1b on an H100 the step after each snapshot took 0.53 s with it
    # against 0.30 s without (docs/benchmarks/NOTES.md), so time nothing with it on.
    step_parts: bool = False
    # Bitwise-reproducible steps: deterministic kernels, math SDPA, fixed cuBLAS workspace. A run
    # with faults then ends with exactly the weights of a fault-free run (costs step time on GPU).
    deterministic: bool = False


@dataclass
class CheckpointConfig(Section):
    """DCP checkpoints in the run's store (volume: ``<run_dir>/checkpoints/step_XXXXXXXX``)."""

    section: ClassVar[str] = "checkpoint"
    # Two tiers, two paces. A snapshot (the host-memory recovery tier: pinned banks under
    # /dev/shm) every `interval` steps, or every `interval_s` seconds when that is > 0; it never
    # waits for the store. The durable write to the store takes the newest snapshot not yet
    # written, at most every `persist_interval_s` seconds and in flight at most `persist_duty` of
    # the time (1: whenever the writer is free); a snapshot taken while a write is in flight
    # supersedes the one waiting, never queues.
    interval: int = non_negative(10)  # steps between snapshots; 0 disables periodic saves
    interval_s: float = non_negative(0.0)
    persist_interval_s: float = non_negative(0.0)
    # A write in flight costs the steps beside it a little (the writer reads the banks and
    # competes for memory bandwidth and cores): writes back to back would cost every step that.
    persist_duty: float = setting(0.25, gt=0, le=1)
    keep: int = positive(3)
    # Copies of each rank's newest snapshot in host memory, its own included: every other copy
    # is held by the same local rank of another node (the next ones by node order), sent in the
    # background after the snapshot is sealed, so a lost node restores from a peer, not the
    # volume. 1: no copies elsewhere (a lost node's ranks, and then every rank, read the store).
    replicas: int = positive(2)
    async_save: bool = True
    finalize_timeout: float = positive(300.0)  # seconds a save may take before the run fails
    save_final: bool = True
    load_step: int = setting(-1, ge=-1)  # -1 = newest committed checkpoint
    init_from: str = ""  # warm start: model.safetensors (or an export dir) used when no checkpoint exists
    # overlap/blocking: the state is staged into persistent pinned, shared host buffers; overlap
    # copies on a side stream during the next forward/backward and the optimizer step waits for
    # it (GPU-side); blocking waits in save(). nvrx: NVRx's own staging. auto = overlap on CUDA,
    # blocking on CPU.
    staging: str = one_of("auto", "overlap", "blocking", "nvrx")
    write_threads: int = positive(4)  # files per rank written in parallel by the NVRx writer
    # Where the checkpoints live: a kind of the checkpoint-store registry (.store_kinds; volume =
    # <run_dir>/checkpoints on the run dir's volume). Recorded in config.yaml by the first start;
    # a resume must keep it (its checkpoints are in that store), and readers open the recorded one.
    store: str = registered(DEFAULT_KIND, store_kinds)
    # Keys a resume may change from the run's config.yaml record, comma-separated: model (every
    # model key), model.<key>, data.path, train.seed. Empty: a resume with other values of
    # those is refused (the checkpoints were trained with the recorded ones).
    allow_changes: str = ""


@dataclass
class ResilienceConfig(Section):
    """NVRx settings: ft_launcher flags, rank monitor and opt-in in-process restart."""

    section: ClassVar[str] = "resilience"
    monitor: str = one_of("sections", "heartbeats", "off")
    initial_heartbeat_timeout: float = positive(600.0)
    heartbeat_timeout: float = positive(300.0)
    setup_timeout: float = positive(600.0)
    step_timeout: float = positive(300.0)
    checkpoint_timeout: float = positive(600.0)
    out_of_section_timeout: float = positive(300.0)
    # The step and heartbeat timeouts are learned from `learn_after` steady steps (not an
    # incarnation's first two, not next to a save or commit, not while the staging buffers pin).
    learn_timeouts: bool = True
    learn_after: int = non_negative(5)
    safety_factor: float = positive(5.0)
    # Seconds no learned timeout goes below: safety_factor x a sub-second step is under a second,
    # and a GC pause or a stall on shared storage must not kill a healthy rank (long phases such
    # as saves and the final writer wait heartbeat on their own). Hang detection after learning
    # takes max(this, learned) + the rank monitor's check interval: 4 s + 0.25 s keeps it within
    # 5 s of the last heartbeat, and a 3 s stall of a sub-second step stays under it.
    min_learned_timeout: float = positive(4.0)
    # Seconds an incarnation's first two steps (allocations, autotuning, a compile, the first
    # step after a restore) may take at least, and all a fresh run's first step may take (nothing
    # is measured yet): their bound is max(this, safety_factor x the longest such step the run
    # measured, persisted in checkpoints). Later steps are bounded by the run's rhythm: learned,
    # restored, or safety_factor x this incarnation's steps after its first (see
    # trainer/rhythm.py). Raise it when a first step compiles for longer (train.compile).
    first_steps_timeout: float = positive(120.0)
    workload_check_interval: float = positive(0.25)
    max_restarts: int = non_negative(3)
    # auto (= any-failed) | any-failed | min-healthy (NVRx <= 0.5)
    restart_policy: str = one_of("auto", "any-failed", "min-healthy")
    workers_stop_timeout: float = positive(15.0)
    # Seconds a stopped node's workers may spend saving the newest state before they exit (a pod
    # asked to stop: Kueue preemption, a drain, a deleted pod, a cancelled launch-local). Added to
    # ft_launcher's --term-timeout and the pod's grace period; 0: no save on a stop.
    stop_save_timeout: float = non_negative(60.0)
    in_process: bool = False
    # Each agent keeps a warm process (torch, NVRx and the trainer imported; CUDA untouched) that
    # forks its workers, so an in-job restart skips 2-3 s of imports: a kill at 1b on an H100 came
    # back in 5.41 s with it, loading 13.25 GB from host memory (8.4 s cold, nothing loaded), and
    # snapshots beside its forked workers stalled 0.45 % of step time against 0.41 % cold, one
    # run each on one machine (docs/benchmarks/NOTES.md). Costs a Python process per node.
    warm_start: bool = True
    in_process_max_iterations: int = positive(3)
    soft_timeout: float = positive(60.0)
    hard_timeout: float = positive(90.0)
    barrier_timeout: float = positive(120.0)
    pg_timeout: float = positive(600.0)  # collective timeout (gloo/NCCL); must exceed hard_timeout
    # Seconds the in-process wrapper waits after the first fault report for other ranks' reports
    # before it restarts. Those only enrich the logged attribution, and every second here is a
    # second of recovery (NVRx's default of 1 s: the figures in docs/benchmarks/NOTES.md).
    last_call_wait: float = non_negative(0.1)
    # The in-process restart's abort: NCCL communicators aborted and torn down on a thread while
    # the next ones are made (NCCL's teardown waits up to a second for its proxy threads), torch's
    # process groups forgotten at once. Off: NVRx's AbortTorchDistributed, which waits for it
    # (at 1b on an H100 the wrapper's part of a restart took 0.18-0.20 s with it, 1.09-1.21 s
    # without; docs/benchmarks/NOTES.md).
    quick_abort: bool = True
    # ft_launcher polling period, seconds: --monitor-interval (how soon a failed worker is seen;
    # every agent also polls the rendezvous store at this rate) and, with NVRx >= 0.7,
    # --ft-gpu-memory-poll-interval (restarted workers wait for the failed ones' GPU memory to be
    # released, polled every 2 s by default).
    launcher_poll_interval: float = setting(0.1, gt=0, le=60)


@dataclass
class Config:
    """The whole trainer configuration."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML/JSON-serialisable)."""
        return dataclasses.asdict(self)


def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


#: A section class's declared types, read once per class. Typed as a plain callable: mypy takes
#: a dataclass type for unhashable (its instances are) and refuses it as a cache key.
_hints: Callable[[type], dict[str, Any]] = functools.cache(_type_hints)


def _apply(section_obj: Any, section: str, values: dict[str, Any]) -> None:
    known = [f.name for f in dataclasses.fields(section_obj)]
    for key, value in values.items():
        if key not in known:
            raise UserError(f"{section}.{key}", f"unknown key; known keys of '{section}': "
                            f"{', '.join(sorted(known))}")
        setattr(section_obj, key, value)  # Section.__setattr__ checks type and constraint


def parse_override(item: str) -> tuple[str, str, str]:
    """Splits ``section.key=value`` into its parts (the value as text); raises UserError when malformed."""
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise UserError("overrides", f"expected section.key=value, got {item!r}")
    lhs, rhs = item.split("=", 1)
    section, key = lhs.strip().split(".", 1)
    return section, key, rhs.strip()


def resolve_config_path(name_or_path: str) -> Path:
    """A bundled preset name (``tiny``) or a YAML path -> the file to read."""
    preset = PRESETS_DIR / f"{name_or_path}.yaml"
    if os.sep not in name_or_path and preset.is_file():
        return preset
    path = Path(name_or_path)
    if not path.is_file():
        presets = ", ".join(sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")))
        raise UserError("config", f"{name_or_path!r} is neither a preset ({presets}) nor a file")
    return path


def load_config(name_or_path: str, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Loads a preset or YAML file, applies ``--set`` overrides and validates the result.

    Args:
        name_or_path: Preset name or YAML path.
        overrides: ``section.key=value`` strings, applied in order.

    Returns:
        The validated config.

    Raises:
        UserError: On unknown sections/keys, wrong types or out-of-range values.
    """
    path = resolve_config_path(name_or_path)
    raw = read_config_file(path) or {}
    if not isinstance(raw, dict):
        raise UserError("config", f"{path} must hold a mapping of sections")
    cfg = Config()
    sections = {f.name for f in dataclasses.fields(Config)}
    for section, values in raw.items():
        if section not in sections:
            raise UserError(str(section), f"unknown section; known: {', '.join(sorted(sections))}")
        if not isinstance(values, dict):
            raise UserError(section, "must be a mapping of key: value")
        _apply(getattr(cfg, section), section, values)
    for item in overrides:  # applied in order: a key set twice keeps the last (CLI convention)
        section, key, text = parse_override(item)
        if section not in sections:
            raise UserError("overrides", f"unknown section {section!r} in {item!r}; known: "
                            f"{', '.join(sorted(sections))}")
        obj = getattr(cfg, section)
        if key in obj.__dataclass_fields__:  # unknown keys: _apply names them
            text = parse_set_value(f"{section}.{key}", text, _hints(type(obj))[key])
        _apply(obj, section, {key: text})
    validate(cfg)
    return cfg


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Rebuilds a Config from :meth:`Config.to_dict` output (e.g. a checkpoint's config.json)."""
    cfg = Config()
    for section, values in raw.items():
        _apply(getattr(cfg, section), section, values)
    return cfg


def validate(cfg: Config) -> None:
    """Checks between fields (each field's own constraint is checked when it is set)."""
    m = cfg.model
    if not m.factory:
        if m.dim % m.n_heads:
            raise UserError("model.dim", f"must be divisible by model.n_heads ({m.n_heads})")
        kv = m.n_kv_heads or m.n_heads
        if m.n_heads % kv:
            raise UserError("model.n_kv_heads", f"must divide model.n_heads ({m.n_heads})")
        if (m.dim // m.n_heads) % 2:
            raise UserError("model.dim", "head dim (dim / n_heads) must be even for RoPE")
    elif ":" not in m.factory:
        raise UserError("model.factory", f"expected 'pkg.module:function', got {m.factory!r}")
    if cfg.data.seq_len > m.max_seq_len:
        raise UserError("data.seq_len", f"{cfg.data.seq_len} exceeds model.max_seq_len ({m.max_seq_len})")
    if not 0 <= cfg.train.min_lr_ratio <= 1:
        raise UserError("train.min_lr_ratio", f"must be within [0, 1], got {cfg.train.min_lr_ratio}")
    check_allow_changes(cfg.checkpoint.allow_changes)
    r = cfg.resilience
    if r.in_process and r.hard_timeout <= r.soft_timeout:
        raise UserError("resilience.hard_timeout", "must exceed resilience.soft_timeout")


#: Keys of the recorded config a resume must keep (they decide the weights and the data order);
#: ``checkpoint.allow_changes`` lists the ones a user changes on purpose. ``model.`` = all.
#: The resume check itself is :func:`.run_record.check_resume`.
GUARDED_KEYS = ("model.", "data.path", "train.seed")


def check_allow_changes(text: str) -> list[str]:
    """The keys ``checkpoint.allow_changes`` names; each must be a guarded key (or ``model``).

    Raises:
        UserError: Naming ``checkpoint.allow_changes`` and the key that is no guarded key.
    """
    keys = [k.strip() for k in text.split(",") if k.strip()]
    for key in keys:
        if not (key == "model" or key.startswith(GUARDED_KEYS) or key in GUARDED_KEYS):
            raise UserError("checkpoint.allow_changes", f"{key!r} is not a key a resume guards; "
                            "name model, model.<key>, data.path or train.seed (comma-separated)")
    return keys
