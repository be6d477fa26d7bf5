"""The recovery part of the benchmark report: 1b and 125m side by side, and the p5 projection."""

from __future__ import annotations

import math
from typing import Any

from bench.common import median
from bench.projection import (
    GPUS_PER_P5,
    MEMORY_PATHS,
    NODE_TCP_GB_S,
    TCP_FLOW_GB_S,
    fsx_gb_per_s,
    job_mtbf_s,
    recovery_paths,
)
from bench.recovery_sweep import fault_rows

NODE_MTBF_DAYS = 30.0
PROJECTION_NODES = (16, 128)
PARTS = (("detection_s", "detection"), ("launcher_s", "restart"), ("start_s", "start"),
         ("load_s", "load"), ("first_step_s", "first step"))


def _cell(x: dict[str, Any], key: str) -> str:
    v = x.get(key)
    return "—" if v is None else f"{v:.2f}"


def recovery_lines(by_preset: dict[str, dict[str, Any]]) -> list[str]:
    """Markdown: one row per (fault, preset), the total split into its parts."""
    if not any(r.get("scenarios") for r in by_preset.values()):
        return []
    lines = ["", "## Recovery (fault → end of the first step of the next incarnation)", "",
             "Restart: the launcher (stop, rendezvous, spawn; in-process: NVRx's wrapper). Start: "
             "the new worker's interpreter, imports, checks, CUDA context, process group and "
             "model build. Load: from the node-local host copy (`memory`) or the files (`disk`).",
             "", "| fault | preset | kind | total s | " + " | ".join(p for _, p in PARTS)
             + " | loaded from | resumed from |", "|---" * (6 + len(PARTS)) + "|"]
    names = []
    for r in by_preset.values():
        names += [n for n in r.get("scenarios", {}) if n not in names]
    for name in names:
        for preset, r in by_preset.items():
            x = r.get("scenarios", {}).get(name)
            if x is None:
                continue
            if "total_s" not in x:
                lines.append(f"| {name} | {preset} | {x.get('kind')} | "
                             f"{str(x.get('error', x.get('state')))[:80]} |" + " |" * 7)
                continue
            src = {True: "memory", False: "disk"}.get(x.get("from_memory"), "—")
            mark = " †" if x.get("bytecode") is False else ""
            lines.append(f"| {name}{mark} | {preset} | {x['kind']} | **{x['total_s']:.2f}** | "
                         + " | ".join(_cell(x, k) for k, _ in PARTS)
                         + f" | {src} | {x.get('resumed_from')} |")
    if any(x.get("bytecode") is False for r in by_preset.values()
           for x in r.get("scenarios", {}).values()):
        lines += ["", "† a new worker on an image without bytecode (PYTHONDONTWRITEBYTECODE=1, no .pyc "
                  "shipped): it compiles torch and sympy from source, +3 to +5 s of imports."]
    boots = [(f"{name} ({preset})", x["boot"]) for preset, r in by_preset.items()
             for name, x in r.get("scenarios", {}).items() if x.get("boot")]
    if boots:
        lines += ["", "The new incarnation's start in parts (seconds, the trainer's `boot`):", ""]
        lines += [f"- {n}: " + ", ".join(f"{k} {v:.2f}" for k, v in b.items()) for n, b in boots]
    return lines


def sweep_lines(sweeps: dict[str, dict[str, Any]], drill: dict[str, Any]) -> list[str]:
    """Markdown: every fault of the recovery sweeps, its recovery split into its parts, and the
    bitwise resume of each fault kind (``kfp-nvrx drill --config 125m``, ``drill_125m.json``)."""
    lines: list[str] = []
    for preset, sw in sweeps.items():
        if not sw.get("runs"):
            continue
        m = sw.get("machine", {})
        origin = (f"merged from {len(sw['parts'])} parts (below)" if len(sw.get("parts", [])) > 1
                  else f"commit {sw.get('commit') or m.get('commit', '?')}")
        lines += ["", f"## Recovery sweep, {preset} (`bench.recovery_sweep`, seed {sw.get('seed')})",
                  "", f"{m.get('gpu', '?')}, driver {m.get('driver', '?')}, NVRx "
                  f"{m.get('nvidia_resiliency_ext', '?')}, {m.get('date', '?')}, {origin}"
                  f"{', ' + ' '.join(sw['set']) if sw.get('set') else ''}. Fault steps drawn per kind "
                  "over runs of >= 100 steps, snapshots every "
                  f"{sw['runs'][0]['interval']} steps; one row per fault (a two-fault run has two). "
                  "Parts as in the recovery table above; total = fault → end of the first step "
                  "after it.", ""]
        if len(sw.get("parts", [])) > 1:  # a sweep merged from leases: run = part:index
            lines += [f"- part {i}: {q.get('gpu', '?')}, {q.get('date', '?')}, commit "
                      f"{q.get('commit', '?')}{', ' + ' '.join(q['set']) if q.get('set') else ''}"
                      f"{'. ' + q['note'] if q.get('note') else ''}"
                      for i, q in enumerate(sw["parts"], 1)] + [""]
        lines += ["| run | fault | total s | " + " | ".join(p for _, p in PARTS)
                  + " | loaded from | resumed from | steps redone | run |",
                  "|---" * (7 + len(PARTS)) + "|"]
        for _kind, run, x in fault_rows(sw["runs"]):
            fault = x["fault"]
            ref = f"{run['part']}:{run['index']}" if "part" in run else run["index"]
            if "total_s" not in x:
                lines.append(f"| {ref} | {fault} | {x.get('error', '—')} |"
                             + " |" * (5 + len(PARTS)))
                continue
            src = "nothing" if x.get("resumed_from") is None else \
                {True: "memory", False: "disk"}.get(x.get("from_memory"), "?")
            lines.append(f"| {ref} | {fault} | **{x['total_s']:.2f}** | "
                         + " | ".join(_cell(x, k) for k, _ in PARTS)
                         + f" | {src} | {x.get('resumed_from')} | {run['steps_redone']} | "
                         f"{run['state']}, {run['restarts']} restart(s) / {run['faults']} |")
    rows = drill.get("rows", [])
    if rows:
        lines += ["", "## Bitwise resume (`kfp-nvrx drill --config 125m --device cuda`)", "",
                  drill.get("setup", ""), "", "| scenario | outcome | restarts | steps redone | "
                  "recovery s | bitwise = reference |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['scenario']} | {r['state']} | "
                  f"{', '.join(f'{k} {n}' for k, n in r['restarts'].items()) or 0} | {r['steps_redone']} | "
                  f"{', '.join(f'{v:.1f}' for v in r['recovery_s'])} | "
                  f"{ {True: 'yes', False: '**no**'}.get(r['bitwise'], 'n/a')} |" for r in rows]
    return lines


#: The durable write's share of the time (``checkpoint.persist_duty``'s default).
PERSIST_DUTY = 0.25


def cost_at(costs: dict[float, float], tau: float) -> float:
    """The measured cost per snapshot at the measured interval nearest ``tau`` (log distance)."""
    near = min(costs, key=lambda measured: abs(math.log(max(measured, 1e-3) / max(tau, 1e-3))))
    return costs[near]


def best_two_tier(costs: dict[float, float], recovery: float, redone_fixed: float | None,
                  mtbf: float) -> tuple[float, float, float]:
    """(interval, goodput, cost per snapshot) at the best snapshot interval.

    ``redone_fixed``: seconds of work redone per failure when the state comes from the durable
    tier (its lag does not shrink with the snapshot interval); None: from the snapshots (half an
    interval on average).
    """
    best = (0.0, 0.0, 0.0)
    for i in range(400):  # a log grid from 1 s to the MTBF: the measured costs are steps
        tau = math.exp(math.log(mtbf) * i / 399)
        delta = cost_at(costs, tau)
        redone = tau / 2 if redone_fixed is None else redone_fixed
        g = max(0.0, tau / (tau + delta) * (1 - (recovery + redone) / mtbf))
        if g > best[1]:
            best = (tau, g, delta)
    return best


def peer_figures(peer: dict[str, Any]) -> dict[str, float]:
    """From ``peer_restore.json``: one rank's copy rate (median GB/s) and a round's cost (s)."""
    rates = (peer.get("transfer") or {}).get("gb_per_s") or []
    cost = (peer.get("round_beside_training") or {}).get("excess_per_round_s")
    if not rates or cost is None:
        return {}
    return {"rank_gb_per_s": median(rates), "round_cost_s": max(0.0, float(cost))}


def projection(kill: dict[str, Any] | None, state_gb_per_gpu: float | None,
               save_cost_s: float | dict[float, float] | None,
               duty: float = PERSIST_DUTY, peer: dict[str, float] | None = None) -> dict[str, Any]:
    """Goodput at 16 and 128 p5 nodes by recovery path (FSx SCRATCH_2 for the durable tier).

    ``save_cost_s``: seconds one snapshot costs the run, every wait it causes included, by the
    snapshot interval it was measured at (``bench.snapshots``); a number: the same at every
    interval. The interval recommended is the best one for those measured costs. A path that
    recovers from host memory (its own or a peer's) redoes half a snapshot interval; one that
    reads the durable tier redoes its lag: half its period (the write time over ``duty``) plus a
    write, whose time is the state of every node over FSx's aggregate throughput.

    ``peer`` (:func:`peer_figures`): with it, replication is on (the default,
    ``checkpoint.replicas=2``): every snapshot also costs a round's measured cost, on every
    path, and a replaced node is restored from its peer (:data:`PEER_PATH`).
    """
    if not kill or "total_s" not in kill or not state_gb_per_gpu or not save_cost_s:
        return {}
    costs = save_cost_s if isinstance(save_cost_s, dict) else {1.0: float(save_cost_s)}
    peer = peer or {}
    if peer:
        costs = {k: v + peer["round_cost_s"] for k, v in costs.items()}
    out: dict[str, Any] = {"node_mtbf_days": NODE_MTBF_DAYS, "save_cost_s": costs,
                           "state_gb_per_gpu": state_gb_per_gpu, "persist_duty": duty,
                           "fsx_gb_per_s": {"burst": fsx_gb_per_s(True),
                                            "baseline": fsx_gb_per_s(False)},
                           "peer": {**peer, "tcp_flow_gb_per_s": TCP_FLOW_GB_S,
                                    "node_tcp_gb_per_s": NODE_TCP_GB_S} if peer else {},
                           "nodes": {}}
    for nodes in PROJECTION_NODES:
        mtbf = job_mtbf_s(nodes, NODE_MTBF_DAYS)
        write_s = nodes * GPUS_PER_P5 * state_gb_per_gpu / fsx_gb_per_s(True)
        lag_s = write_s / duty / 2 + write_s
        rows = {}
        for path, rec in recovery_paths(nodes, kill["total_s"], kill["load_s"], state_gb_per_gpu,
                                        peer.get("rank_gb_per_s")).items():
            from_memory = path in MEMORY_PATHS
            tau, g, delta = best_two_tier(costs, rec, None if from_memory else lag_s, mtbf)
            rows[path] = {"recovery_s": rec, "best_interval_s": tau, "best_goodput": g,
                          "cost_per_snapshot_s": delta,
                          "redone_s": tau / 2 if from_memory else lag_s}
        out["nodes"][str(nodes)] = {"job_mtbf_s": mtbf, "durable_write_s": write_s,
                                    "durable_lag_s": lag_s, "paths": rows}
    return out


def _peer_words(peer: dict[str, Any]) -> str:
    if not peer:
        return ""
    return (f"; from a peer, the replaced node's ranks first fetch their copies at the measured "
            f"{peer['rank_gb_per_s']:.2f} GB/s a rank (gloo over TCP; capped at "
            f"{peer['tcp_flow_gb_per_s']:.2f} GB/s a flow and {peer['node_tcp_gb_per_s']:.1f} GB/s "
            "a node, AWS's TCP limits: the copies do not use EFA). Replication on (the default): "
            f"every snapshot also costs a round, {peer['round_cost_s']:.3f} s measured beside 1b "
            "training")


def projection_lines(p: dict[str, Any]) -> list[str]:
    """Markdown of :func:`projection`."""
    if not p:
        return []
    fsx = p["fsx_gb_per_s"]
    costs = ", ".join(f"{float(k):g} s: {v:.3f} s" for k, v in sorted(
        p["save_cost_s"].items(), key=lambda kv: float(kv[0])))
    lines = ["", f"## Goodput projection on p5 nodes (one failure per node per "
             f"{p['node_mtbf_days']:.0f} days; 8 GPUs x {p['state_gb_per_gpu']:.2f} GB of state "
             f"per node; FSx for Lustre SCRATCH_2 1.2 TiB: {fsx['burst']:.2f} GB/s burst, "
             f"{fsx['baseline']:.2f} GB/s baseline for all nodes together)", "",
             "Recovery = the measured 1b in-job restart (kill), its load replaced where the state "
             "comes from FSx" + _peer_words(p.get("peer") or {}) + ". Cost per snapshot = the "
             "measured median excess of a snapshot's step and the next one (which runs beside its "
             "copies)" + (", plus a replication round's measured cost" if p.get("peer") else "")
             + f", at the measured interval nearest the one recommended ({costs}). "
             "Work redone = half a snapshot interval from host memory; from FSx, the durable "
             f"tier's lag: half its period (a write in flight {p.get('persist_duty', 1):.0%} of "
             "the time) plus one write of every node's state.", "",
             "| nodes | job MTBF h | recovery path | recovery s | best snapshot interval s | "
             "cost per snapshot s | redone s | best goodput |", "|---|---|---|---|---|---|---|---|"]
    for nodes, n in p["nodes"].items():
        for path, row in n["paths"].items():
            # From the volume, the snapshots' interval changes nothing but their cost.
            memory = path in MEMORY_PATHS
            tau = f"{row['best_interval_s']:.0f}" if memory else "—"
            cost = f"{row.get('cost_per_snapshot_s', 0):.3f}" if memory else "—"
            lines.append(f"| {nodes} | {n['job_mtbf_s'] / 3600:.1f} | {path} | "
                         f"{row['recovery_s']:.1f} | {tau} | {cost} | {row.get('redone_s', 0):.0f} "
                         f"| {row['best_goodput']:.4%} |")
    return lines
