"""Turn the raw per-step measurements into the table, the JSON file and the chart."""

from __future__ import annotations

import json
import statistics

MIB = 1024 * 1024
PEER_FAMILIES = ("fsdp1", "fsdp2", "deepspeed")


# ----------------------------------------------------------------- theory
def comm_theory(stage: int, num_params: int, world: int, elem: int) -> dict[str, int]:
    """Bytes one rank sends into each collective per step (its input), ZeRO's schedule.

    Replicated data parallel all-reduces every gradient; ZeRO-1/2 reduce-scatter them and
    all-gather the updated shard once; ZeRO-3 all-gathers it twice (forward and backward).
    Padding, the root unit kept gathered through backward, and (shardwrap) the last unit of
    forward kept gathered into backward are not in the theory.
    """
    full = elem * num_params
    if stage == 0:
        return {"all_reduce": full}
    gathers = 2 if stage == 3 else 1
    return {"reduce_scatter": full, "all_gather": gathers * full // world}


WIRE_FACTOR = {  # ring algorithms: bytes on the wire per input byte, N ranks
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: n - 1,
    "send": lambda n: 1.0,  # point-to-point: the bytes sent are the bytes on the wire
}


def wire_bytes(by_kind: dict[str, int], world: int) -> float:
    return sum(WIRE_FACTOR.get(k, lambda n: 1.0)(world) * b for k, b in by_kind.items())


def state_theory(stage: int, num_params: int, world: int, elem: int) -> int:
    """Per-rank bytes of parameters + gradients + two Adam moments (4 tensors' worth)."""
    per = elem * num_params
    sharded = {0: 0, 1: 2, 2: 3, 3: 4}[stage]  # how many of the four are sharded
    return (4 - sharded) * per + sharded * per // world


# ---------------------------------------------------------------- summary
def summarize_size(raw: dict, *, warmup: int, world: int, elem: int, num_params: int) -> dict:
    """Per-implementation medians, ratios, bytes and losses for one model size."""
    rows: dict[str, dict] = {}
    for name, run in raw["impls"].items():
        if run.get("error"):
            rows[name] = {"error": run["error"]}
            continue
        timed = [s["seconds"] for s in run["steps"] if s["index"] >= warmup]
        last = run["steps"][-1]
        comm = {k: b for k, (_, b) in last["collectives"][0].items() if b}
        counts = {k: c for k, (c, _) in last["collectives"][0].items()}
        theory = comm_theory(run["stage"], num_params, world, elem)
        states = [f["model_state"] for f in run["finals"]]
        state_total = max(s["params"] + s["grads"] + s["optimizer_state"] for s in states)
        rows[name] = {
            "family": run["family"],
            "stage": run["stage"],
            "step_seconds": [s["seconds"] for s in run["steps"]],
            "median_s": statistics.median(timed),
            "min_s": min(timed),
            "losses": [s["loss"] for s in run["steps"]],
            "comm_bytes": comm,
            "comm_counts": counts,
            "comm_theory": theory,
            # On the wire: collectives and point-to-point sends compare alike.
            "comm_ratio": wire_bytes(comm, world) / wire_bytes(theory, world),
            "wire_theory": wire_bytes(theory, world),
            "wire_bytes": wire_bytes(comm, world),
            "shardwrap_profile": last["profile"][0] if last["profile"][0] else None,
            "model_state": states,
            "state_bytes_max_rank": state_total,
            "state_theory": state_theory(run["stage"], num_params, world, elem),
            "state_vs_16p_over_n": state_total / (4 * elem * num_params / world),
            "peak_rss": [f["peak_rss"] for f in run["finals"]],
            "baseline_rss": [f["baseline_rss"] for f in run["finals"]],
            "num_threads": [f.get("num_threads") for f in run["finals"]],
            "shardwrap_profile_table": run["finals"][0].get("profile_table"),
            "peak_rss_over_baseline": max(f["peak_rss"] - f["baseline_rss"] for f in run["finals"]),
        }
    _add_ratios(rows)
    _add_loss_diffs(rows)
    return rows


def _add_ratios(rows: dict[str, dict]) -> None:
    ok = {n: r for n, r in rows.items() if "median_s" in r}
    peers = {n: r for n, r in ok.items() if r["family"] in PEER_FAMILIES}
    for row in ok.values():
        ratios = {n: row["median_s"] / p["median_s"] for n, p in peers.items()}
        for name, other in ok.items():  # stock DDP, eager or with compiled blocks
            if other["family"] == "ddp":
                ratios[name] = row["median_s"] / other["median_s"]
        same_stage = [p["median_s"] for p in peers.values() if p["stage"] == row["stage"]]
        if same_stage:
            ratios["fastest_peer_same_stage"] = row["median_s"] / min(same_stage)
        zero3 = [p["median_s"] for p in peers.values() if p["stage"] == 3]
        if zero3:
            ratios["fastest_peer_zero3"] = row["median_s"] / min(zero3)
        row["ratios"] = ratios


def _add_loss_diffs(rows: dict[str, dict]) -> None:
    reference = rows.get("ddp", {}).get("losses")
    for row in rows.values():
        if "losses" in row and reference:
            diffs = [abs(a - b) for a, b in zip(row["losses"], reference, strict=True)]
            row["max_abs_loss_diff_vs_ddp"] = max(diffs)


# ------------------------------------------------------------------ output
def table(size: str, num_params: int, rows: dict[str, dict]) -> str:
    head = (
        f"{'impl':<20}{'median ms':>10}{'min ms':>8}{'xDDP':>7}{'xpeerS':>7}{'xpeerZ3':>8}"
        f"{'wire MiB':>9}{'theory':>8}{'ratio':>6}{'state MiB':>10}{'theory':>8}"
        f"{'/16P/N':>7}{'RSS MiB':>8}{'+RSS':>6}{'dLoss':>9}"
    )
    lines = [f"== {size}: {num_params / 1e6:.2f}M parameters ==", head]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"{name:<20}FAILED: {r['error'].strip().splitlines()[-1][:80]}")
            continue
        ratios = r["ratios"]
        lines.append(
            f"{name:<20}{1e3 * r['median_s']:>10.1f}{1e3 * r['min_s']:>8.1f}"
            f"{ratios.get('ddp', float('nan')):>7.2f}"
            f"{ratios.get('fastest_peer_same_stage', float('nan')):>7.2f}"
            f"{ratios.get('fastest_peer_zero3', float('nan')):>8.2f}"
            f"{r['wire_bytes'] / MIB:>9.2f}"
            f"{r['wire_theory'] / MIB:>8.2f}{r['comm_ratio']:>6.2f}"
            f"{r['state_bytes_max_rank'] / MIB:>10.2f}{r['state_theory'] / MIB:>8.2f}"
            f"{r['state_vs_16p_over_n']:>7.2f}{max(r['peak_rss']) / MIB:>8.0f}"
            f"{r['peak_rss_over_baseline'] / MIB:>6.0f}"
            f"{r.get('max_abs_loss_diff_vs_ddp', float('nan')):>9.1e}"
        )
    return "\n".join(lines)


def comm_detail(rows: dict[str, dict]) -> str:
    lines = [
        "collectives in the last step, rank 0: kind: count x MiB measured vs MiB theory"
        " [shardwrap.profile: MiB, ms from issue to end of wait]"
    ]
    for name, r in rows.items():
        if "error" in r:
            continue
        kinds = sorted(set(r["comm_bytes"]) | set(r["comm_theory"]))
        parts = []
        for k in kinds:
            part = (
                f"{k}: {r['comm_counts'].get(k, 0)}x {r['comm_bytes'].get(k, 0) / MIB:.2f}"
                f" vs {r['comm_theory'].get(k, 0) / MIB:.2f}"
            )
            ledger = (r.get("shardwrap_profile") or {}).get(k)
            if ledger:
                part += f" [{ledger['bytes'] / MIB:.2f}, {1e3 * ledger['seconds']:.1f} ms]"
            parts.append(part)
        lines.append(f"  {name:<20}" + "; ".join(parts))
    return "\n".join(lines)


def ratio_matrix(rows: dict[str, dict]) -> str:
    """Median step time of each shardwrap strategy over each peer's."""
    ok = {n: r for n, r in rows.items() if "ratios" in r}
    peers = [n for n, r in ok.items() if r["family"] != "shardwrap"]
    lines = [
        "step-time ratio, shardwrap / peer (medians)",
        f"{'':<20}" + "".join(f"{p:>20}" for p in peers),
    ]
    for name, r in ok.items():
        if r["family"] == "shardwrap":
            lines.append(f"{name:<20}" + "".join(f"{r['ratios'][p]:>20.2f}" for p in peers))
    return "\n".join(lines)


def write_json(path: str, results: dict) -> None:
    with open(path, "w") as out:
        json.dump(results, out, indent=1, default=str)


def write_chart(path: str, results: dict) -> None:
    try:
        import matplotlib
    except ImportError:  # the bench extra (make bench) brings it; the tables are printed
        print(f"no chart ({path}): matplotlib is not installed (pip install '.[bench]')")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(results["sizes"])
    fig, axes = plt.subplots(1, len(sizes), figsize=(7 * len(sizes), 5), squeeze=False)
    colors = {"shardwrap": "C0", "fsdp1": "C1", "fsdp2": "C2", "deepspeed": "C3", "ddp": "C7"}
    for ax, size in zip(axes[0], sizes, strict=True):
        rows = {n: r for n, r in results["sizes"][size]["summary"].items() if "median_s" in r}
        names = list(rows)
        medians = [1e3 * rows[n]["median_s"] for n in names]
        ax.barh(names, medians, color=[colors[rows[n]["family"]] for n in names])
        for y, n in enumerate(names):
            ratio = rows[n]["ratios"].get("ddp")
            if ratio is not None:
                ax.text(medians[y], y, f" {ratio:.2f}x DDP", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, 1.25 * max(medians))
        ax.set_xlabel("median step time (ms), 2 ranks, gloo, CPU")
        ax.set_title(f"{size} ({results['sizes'][size]['num_params'] / 1e6:.1f}M params)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
