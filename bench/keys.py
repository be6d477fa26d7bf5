"""Summary keys of the recovery, scaling and in-flight-step targets, each null with its reason.

Every key is taken from one benchmark JSON of the output folder (written by one dated run of
``bench.run``); a key whose input is missing or failed is ``None`` and ``null_reasons`` says why,
so a report never shows a number that was not measured.
"""

from __future__ import annotations

from typing import Any

#: Which benchmark JSON file (without ``.json``) feeds each key.
SOURCES = {
    "recovery_injob_s_2gpu": "recovery_2gpu",
    "recovery_inprocess_s_2gpu": "recovery_2gpu",
    "hang_detect_s": "recovery",
    "recovery_inprocess_s_1b": "recovery_1b",
    "recovery_injob_s_1b": "recovery_1b",
    "hang_detect_s_1b": "recovery_1b",
    "hang_detect_s_2gpu": "recovery_2gpu",
    "scaling_efficiency_2gpu": "throughput",
    "mfu_1b_2gpu": "throughput",
    "worst_inflight_step_pct": "ckpt_stall",
}


def _scenario(rec: dict[str, Any], name: str, field: str, in_process: bool = False,
              source: str = "recovery"):
    """``(value, reason)`` of one recovery scenario's figure."""
    if not rec:
        need = " (bench.recovery --gpus 2, on a 2-GPU machine)" if source.endswith("2gpu") else ""
        return None, f"no {source}.json in this run{need}"
    sc = rec.get("scenarios", {}).get(name)
    if sc is None:
        return None, f"scenario {name!r} did not run"
    if field not in sc:
        return None, f"scenario {name!r}: {sc.get('error') or sc.get('state', 'no figures')}"
    if in_process and sc.get("restart_kind") != "in-process":
        # An in-process fault that ft_launcher had to handle is an in-job recovery, not this one.
        return None, f"scenario {name!r} recovered by a {sc.get('restart_kind')} restart, not in-process"
    return sc[field], None


def throughput_rows(t: dict[str, Any], preset: str, gpus: int,
                    compile_on: bool | None = None) -> list[dict[str, Any]]:
    """Succeeded throughput rows of ``preset`` on ``gpus`` GPUs (``compile_on``: None = any)."""
    return [x for x in t.get("runs", []) if x.get("kind") == "throughput"
            and x.get("preset") == preset and x.get("gpus", 1) == gpus
            and x.get("state") == "Succeeded" and x.get("tokens_per_s")
            and (compile_on is None or x.get("compile", "compile=on" in x["name"]) == compile_on)]


def per_gpu_tokens(row: dict[str, Any]) -> float:
    """Tokens/s per GPU of a throughput row (rows of older runs are all one GPU)."""
    return row.get("tokens_per_s_per_gpu", row["tokens_per_s"] / row.get("gpus", 1))


def throughput_keys(t: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """``mfu_1b_2gpu`` and ``scaling_efficiency_2gpu`` (eager 1b, 2 GPUs against 1, one run)."""
    vals: dict[str, Any] = {}
    why: dict[str, str] = {}
    if not t:
        for k in ("mfu_1b_2gpu", "scaling_efficiency_2gpu"):
            vals[k], why[k] = None, "no throughput JSON in this run"
        return vals, why
    two = throughput_rows(t, "1b", 2)
    vals["mfu_1b_2gpu"] = max((x["mfu"] for x in two), default=None)
    if not two:
        why["mfu_1b_2gpu"] = "no succeeded 1b throughput run on 2 GPUs (bench.throughput --gpus 2)"
    # Eager against eager: compile changes the step, not the scaling.
    one, two = throughput_rows(t, "1b", 1, False), throughput_rows(t, "1b", 2, False)
    if one and two:
        vals["scaling_efficiency_2gpu"] = per_gpu_tokens(two[0]) / per_gpu_tokens(one[0])
    else:
        vals["scaling_efficiency_2gpu"] = None
        why["scaling_efficiency_2gpu"] = ("needs succeeded eager 1b throughput runs on 1 and 2 GPUs "
                                          f"in one run (found {len(one)} and {len(two)})")
    return vals, why


def worst_inflight(ck: dict[str, Any]) -> tuple[float | None, str | None]:
    """Worst step while a write is in flight, % over quiet steps, for the shipped overlap mode."""
    if not ck:
        return None, "no ckpt_stall JSON in this run"
    # The overlap re-run (ckpt_stall_overlap.json) when there is one: it is rerun alone after
    # changes to the overlapped path, so it is the newer figure; else the main run's.
    ov = ck.get("overlap_b") or ck.get("overlap")
    if ov is None:
        return None, "ckpt_stall ran without the overlap mode (--modes ...,overlap)"
    return 100 * ov["slowdown_max"], None


def round_two_keys(loaded: dict[str, dict[str, Any]], ck: dict[str, Any]) -> dict[str, Any]:
    """The keys, plus ``null_reasons`` for those that are ``None``.

    Args:
        loaded: Benchmark JSON by file name (``recovery``, ``recovery_2gpu``, ``throughput``);
            ``{}`` where the file is absent.
        ck: :func:`bench.summary.ckpt_figures` of this run's ``ckpt_stall`` JSON.
    """
    rec, rec2 = loaded.get("recovery", {}), loaded.get("recovery_2gpu", {})
    rec1b = loaded.get("recovery_1b", {})
    out: dict[str, Any] = {}
    why: dict[str, str] = {}

    def put(key: str, pair: tuple[Any, str | None]) -> None:
        out[key] = pair[0]
        if pair[1]:
            why[key] = pair[1]

    put("recovery_injob_s_2gpu", _scenario(rec2, "kill", "total_s", source="recovery_2gpu"))
    put("recovery_inprocess_s_2gpu", _scenario(rec2, "raise", "total_s", in_process=True,
                                                  source="recovery_2gpu"))
    put("hang_detect_s", _scenario(rec, "hang", "detection_s"))
    put("recovery_inprocess_s_1b", _scenario(rec1b, "raise", "total_s", in_process=True,
                                             source="recovery_1b"))
    put("recovery_injob_s_1b", _scenario(rec1b, "kill", "total_s", source="recovery_1b"))
    put("hang_detect_s_1b", _scenario(rec1b, "hang", "detection_s", source="recovery_1b"))
    put("hang_detect_s_2gpu", _scenario(rec2, "hang", "detection_s", source="recovery_2gpu"))
    vals, reasons = throughput_keys(loaded.get("throughput", {}))
    out.update(vals)
    why.update(reasons)
    put("worst_inflight_step_pct", worst_inflight(ck))
    out["null_reasons"] = why
    return out


def run_records(loaded: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The machine and date of every benchmark JSON the summary read (one dated run each)."""
    return {name: {k: d.get("machine", {}).get(k) for k in ("date", "gpu", "gpu_count", "torch",
                                                          "nvidia_resiliency_ext")}
            | {"gpus": d.get("gpus", 1)}
            for name, d in loaded.items() if d}
