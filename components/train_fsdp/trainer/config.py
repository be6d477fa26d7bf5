"""Trainer configuration: dataclasses loaded from YAML and overridden with ``--set section.key=value``.

Unknown keys and wrong types are :class:`UserError` (one line naming the key). A config is named by
a YAML path or by a bundled preset (``tiny``, ``125m``, ``1b``, ``8b``) in ``configs/``.
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kfp_nvrx.components.errors import UserError

PRESETS_DIR = Path(__file__).parent / "configs"


@dataclass
class ModelConfig:
    """Built-in Llama-style decoder (RMSNorm, RoPE, SwiGLU, SDPA) or a user factory."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 0  # 0 = same as n_heads
    ffn_multiple_of: int = 32
    ffn_dim_multiplier: float = 1.0
    max_seq_len: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    factory: str = ""  # "pkg.module:fn" -> fn(model_cfg) returns an nn.Module (tokens -> logits)


@dataclass
class DataConfig:
    """Token shards written by ``kfp-nvrx prepare-data``."""

    path: str = ""
    split: str = "train"
    seq_len: int = 64
    batch_size: int = 4  # sequences per rank per step


@dataclass
class TrainConfig:
    """Optimisation loop."""

    steps: int = 40
    seed: int = 1234
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    activation_checkpointing: bool = False
    compile: bool = False
    log_every: int = 10
    device: str = "auto"  # auto | cpu | cuda
    step_sleep: float = 0.0  # seconds slept per step (drills: makes tiny runs long enough to fault)
    # Bitwise-reproducible steps: deterministic kernels, math SDPA, fixed cuBLAS workspace. A run
    # with faults then ends with exactly the weights of a fault-free run (costs step time on GPU).
    deterministic: bool = False


@dataclass
class CheckpointConfig:
    """DCP checkpoints under ``<run_dir>/checkpoints/step_XXXXXXXX``."""

    interval: int = 10  # steps between saves; 0 disables periodic saves
    keep: int = 3
    async_save: bool = True
    finalize_timeout: float = 300.0  # seconds a save may take before the run fails loudly
    save_final: bool = True
    load_step: int = -1  # -1 = newest committed checkpoint
    init_from: str = ""  # warm start: model.safetensors (or an export dir) used when no checkpoint exists
    # auto | overlap | blocking | nvrx. overlap/blocking: the state is staged into persistent pinned,
    # shared host buffers; overlap copies on a side stream during the next forward/backward and the
    # optimizer step waits for it (GPU-side); blocking waits in save(). nvrx: NVRx's own staging.
    # auto = overlap on CUDA, blocking on CPU.
    staging: str = "auto"
    write_threads: int = 4  # files per rank written in parallel by the NVRx writer (staged saves)


@dataclass
class ResilienceConfig:
    """NVRx settings: ft_launcher flags, rank monitor and opt-in in-process restart."""

    monitor: str = "sections"  # sections | heartbeats | off
    initial_heartbeat_timeout: float = 600.0
    heartbeat_timeout: float = 300.0
    setup_timeout: float = 600.0
    step_timeout: float = 300.0
    checkpoint_timeout: float = 600.0
    out_of_section_timeout: float = 300.0
    learn_timeouts: bool = True  # calculate_and_set_*_timeouts after `learn_after` steps
    learn_after: int = 5
    safety_factor: float = 5.0
    # Seconds no learned timeout goes below: NVRx learns safety_factor x the longest gap seen,
    # under a second for fast steps, and a GC pause or a slow shared-storage read must not kill
    # a healthy rank. Hang detection after learning takes max(this, learned) + check interval.
    min_learned_timeout: float = 10.0
    workload_check_interval: float = 1.0
    max_restarts: int = 3
    restart_policy: str = "auto"  # auto (= any-failed) | any-failed | min-healthy (NVRx <= 0.5)
    workers_stop_timeout: float = 15.0
    in_process: bool = False
    in_process_max_iterations: int = 3
    soft_timeout: float = 60.0
    hard_timeout: float = 90.0
    barrier_timeout: float = 120.0
    pg_timeout: float = 600.0  # collective timeout (gloo/NCCL); must exceed hard_timeout
    # Recovery latency (issue 6). last_call_wait: seconds the in-process wrapper waits after the
    # first fault report for other ranks' concurrent reports before it restarts; they only enrich
    # the logged attribution (NVRx default 1 s, half of its restart time on the H200). >= 0.
    last_call_wait: float = 0.1
    # ft_launcher polling period, seconds: --monitor-interval (how soon a failed worker is seen;
    # every agent also polls the rendezvous store at this rate) and, with NVRx >= 0.7,
    # --ft-gpu-memory-poll-interval (restarted workers wait for the failed ones' GPU memory to be
    # released, polled every 2 s by default). > 0.
    launcher_poll_interval: float = 0.1

    def __setattr__(self, name: str, value: Any) -> None:
        # Range checks of the recovery-latency fields, on every assignment (YAML, --set, Python).
        if name == "last_call_wait" and not value >= 0:
            raise UserError(f"resilience.{name}", f"must be >= 0, got {value}")
        if name == "launcher_poll_interval" and not 0 < value <= 60:
            raise UserError(f"resilience.{name}", f"must be > 0 and <= 60 seconds, got {value}")
        super().__setattr__(name, value)


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


_CHOICES = {
    "resilience.monitor": ("sections", "heartbeats", "off"),
    "resilience.restart_policy": ("auto", "any-failed", "min-healthy"),
    "checkpoint.staging": ("auto", "overlap", "blocking", "nvrx"),
    "train.device": ("auto", "cpu", "cuda"),
    "data.split": ("train", "val"),
}
_POSITIVE = {
    "model.vocab_size", "model.dim", "model.n_layers", "model.n_heads", "model.max_seq_len",
    "data.seq_len", "data.batch_size", "train.steps", "checkpoint.keep",
    "checkpoint.finalize_timeout", "checkpoint.write_threads", "resilience.initial_heartbeat_timeout",
    "resilience.heartbeat_timeout", "resilience.setup_timeout", "resilience.step_timeout",
    "resilience.checkpoint_timeout", "resilience.out_of_section_timeout",
    "resilience.safety_factor", "resilience.workload_check_interval",
    "resilience.min_learned_timeout",
    "resilience.workers_stop_timeout", "resilience.soft_timeout", "resilience.hard_timeout",
    "resilience.barrier_timeout", "resilience.pg_timeout", "resilience.in_process_max_iterations",
    "train.log_every",
}
_NON_NEGATIVE = {
    "model.n_kv_heads", "train.lr", "train.warmup_steps", "train.weight_decay", "train.grad_clip",
    "checkpoint.interval", "resilience.max_restarts", "resilience.learn_after", "train.seed",
    "train.step_sleep", "train.min_lr_ratio",
}


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Checks ``value`` against the annotated type (ints may stand for floats, not bools)."""
    if typ is bool:
        if isinstance(value, bool):
            return value
    elif typ is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif typ is str:
        if isinstance(value, str):
            return value
        word = {False: "off", True: "on"}.get(value) if isinstance(value, bool) else None
        if word is not None and word in _CHOICES.get(key, ()):
            return word  # YAML 1.1 reads a bare `off` as false
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in _CHOICES:
            return str(value)
    name = getattr(typ, "__name__", str(typ))
    raise UserError(key, f"expected {name}, got {value!r} ({type(value).__name__})")


def _apply(section_obj: Any, section: str, values: dict[str, Any]) -> None:
    hints = typing.get_type_hints(type(section_obj))
    for key, value in values.items():
        dotted = f"{section}.{key}"
        if key not in hints:
            known = ", ".join(sorted(hints))
            raise UserError(dotted, f"unknown key; known keys of '{section}': {known}")
        setattr(section_obj, key, _coerce(dotted, value, hints[key]))


def _parse_scalar(text: str) -> Any:
    """Parses the right-hand side of ``--set`` as a YAML scalar (``3``, ``1e-3``, ``true``, ``x``)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return text if isinstance(value, (dict, list, types.NoneType)) else value


def parse_override(item: str) -> tuple[str, str, Any]:
    """Splits ``section.key=value`` into its parts; raises UserError when malformed."""
    if "=" not in item or "." not in item.split("=", 1)[0]:
        raise UserError("--set", f"expected section.key=value, got {item!r}")
    lhs, rhs = item.split("=", 1)
    section, key = lhs.strip().split(".", 1)
    return section, key, _parse_scalar(rhs.strip())


def resolve_config_path(name_or_path: str) -> Path:
    """A bundled preset name (``tiny``) or a YAML path -> the file to read."""
    preset = PRESETS_DIR / f"{name_or_path}.yaml"
    if os.sep not in name_or_path and preset.is_file():
        return preset
    path = Path(name_or_path)
    if not path.is_file():
        presets = ", ".join(sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")))
        raise UserError("--config", f"{name_or_path!r} is neither a preset ({presets}) nor a file")
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
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError("--config", f"{path} is not valid YAML ({' '.join(str(err).split())})") from None
    if not isinstance(raw, dict):
        raise UserError("--config", f"{path} must hold a mapping of sections")
    cfg = Config()
    sections = {f.name for f in dataclasses.fields(Config)}
    for section, values in raw.items():
        if section not in sections:
            raise UserError(str(section), f"unknown section; known: {', '.join(sorted(sections))}")
        if not isinstance(values, dict):
            raise UserError(section, "must be a mapping of key: value")
        _apply(getattr(cfg, section), section, values)
    for item in overrides:
        section, key, value = parse_override(item)
        if section not in sections:
            raise UserError(f"--set {section}", f"unknown section; known: {', '.join(sorted(sections))}")
        _apply(getattr(cfg, section), section, {key: value})
    validate(cfg)
    return cfg


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Rebuilds a Config from :meth:`Config.to_dict` output (e.g. a checkpoint's config.json)."""
    cfg = Config()
    for section, values in raw.items():
        _apply(getattr(cfg, section), section, values)
    return cfg


def validate(cfg: Config) -> None:
    """Range and consistency checks; raises UserError naming the first bad field."""
    for section in dataclasses.fields(Config):
        obj = getattr(cfg, section.name)
        for f in dataclasses.fields(obj):
            dotted = f"{section.name}.{f.name}"
            value = getattr(obj, f.name)
            if dotted in _POSITIVE and not value > 0:
                raise UserError(dotted, f"must be > 0, got {value}")
            if dotted in _NON_NEGATIVE and value < 0:
                raise UserError(dotted, f"must be >= 0, got {value}")
            if dotted in _CHOICES and value not in _CHOICES[dotted]:
                raise UserError(dotted, f"must be one of {', '.join(_CHOICES[dotted])}, got {value!r}")
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
    r = cfg.resilience
    if r.in_process and r.hard_timeout <= r.soft_timeout:
        raise UserError("resilience.hard_timeout", "must exceed resilience.soft_timeout")
