"""Step time, traffic, memory and losses of shardwrap against FSDP1, FSDP2, DeepSpeed and DDP.

Run from the repository root::

    PYTHONPATH=$PWD python benchmarks/bench_step.py            # 5m and 30m GPTs
    PYTHONPATH=$PWD python benchmarks/bench_step.py --quick    # 5m only, fewer steps

Every implementation trains the same GPT (same seed, same per-rank batches, AdamW, one
dtype) on ``--world-size`` gloo ranks on CPU. Each implementation has its own pair of
processes, all alive at once; the orchestrator runs one step of one implementation at a
time, round-robin (rotating the order every round), so drift of a shared machine hits all
alike. The first ``--warmup`` rounds are not timed. Writes ``bench_step.json`` and
``bench_step.png`` (``--out``), and prints the table.
"""

from __future__ import annotations

import argparse
import os
import platform
import queue
import sys
import tempfile
import time

import torch.multiprocessing as mp

if __package__ in (None, ""):  # run as a script (`make bench`): make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import gpt, report  # noqa: E402
from benchmarks.cli import comma_list  # noqa: E402
from benchmarks.impls import EXPERIMENTS, IMPLS, deepspeed_available  # noqa: E402
from benchmarks.worker import WorkerConfig, run  # noqa: E402

READY_TIMEOUT_S = 900.0  # twenty processes importing torch and building models on 2 cores
STEP_TIMEOUT_S = 600.0
DEFAULT_IMPLS = [i for i in IMPLS if i not in EXPERIMENTS]
# glibc's malloc moves its mmap and trim thresholds up to the largest block a process has
# freed, so whether a worker's heap hands freed memory back to the kernel every step (and
# takes a page fault per 4 KiB to get it back) depends on the history of its frees, not
# on the work its implementation does (benchmarks/RESULTS.md, run 13). --fixed-malloc
# pins both thresholds in every worker, for every implementation alike.
FIXED_MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=134217728"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="5m,30m", help=f"comma list of {list(gpt.SIZES)}")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first rounds")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--impls", default=",".join(DEFAULT_IMPLS), help="comma list")
    parser.add_argument("--quick", action="store_true", help="--sizes 5m --steps 3 --warmup 1")
    parser.add_argument("--out", default="benchmarks/out", help="folder for JSON and PNG")
    parser.add_argument(
        "--fixed-malloc",
        action="store_true",
        help="pin glibc's mmap and trim thresholds in every worker (FIXED_MALLOC_TUNABLES)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.steps, args.warmup = "5m", 3, 1
    args.sizes = comma_list(parser, "--sizes", args.sizes, gpt.SIZES, "size")
    args.impls = comma_list(parser, "--impls", args.impls, IMPLS, "implementation")
    if args.world_size < 1 or args.steps < 1 or args.warmup < 0 or args.micro_batch < 1:
        parser.error("--world-size, --steps and --micro-batch must be >= 1, --warmup >= 0")
    return args


class Pool:
    """The worker processes of one model size, and the steps they report."""

    def __init__(self, ctx, impls: list[str], size: str, args, tmp: str) -> None:
        self.results = ctx.Queue()
        self.commands: dict[tuple[str, int], object] = {}
        self.procs: dict[str, list] = {}
        self.runs: dict[str, dict] = {
            i: {"family": IMPLS[i].family, "stage": IMPLS[i].stage, "steps": [], "finals": {}}
            for i in impls
        }
        self._pending: dict[tuple[str, str], dict[int, object]] = {}
        for impl in impls:
            init_file = os.path.join(tmp, f"{impl}.rendezvous")
            self.procs[impl] = []
            for rank in range(args.world_size):
                config = WorkerConfig(
                    impl, size, rank, args.world_size, args.micro_batch, args.dtype, init_file
                )
                self.commands[(impl, rank)] = ctx.Queue()
                proc = ctx.Process(
                    target=run, args=(config, self.commands[(impl, rank)], self.results)
                )
                proc.start()
                self.procs[impl].append(proc)
        self.world_size = args.world_size

    def live(self) -> list[str]:
        return [i for i, r in self.runs.items() if "error" not in r]

    def send(self, impl: str, command: str, index) -> None:
        for rank in range(self.world_size):
            self.commands[(impl, rank)].put((command, index))

    def collect(self, impl: str, kind: str, timeout: float) -> list | None:
        """Every rank's ``kind`` message for ``impl`` (None if it failed meanwhile)."""
        deadline = time.monotonic() + timeout
        while len(self._pending.get((impl, kind), {})) < self.world_size:
            if "error" in self.runs[impl]:
                return None
            try:
                name, rank, got, payload = self.results.get(
                    timeout=max(0.1, deadline - time.monotonic())
                )
            except queue.Empty:
                self.fail(impl, f"no {kind!r} from every rank within {timeout:.0f}s")
                return None
            if got == "error":
                self.fail(name, payload)
            else:
                self._pending.setdefault((name, got), {})[rank] = payload
        by_rank = self._pending.pop((impl, kind))
        return [by_rank[r] for r in range(self.world_size)]

    def fail(self, impl: str, message: str) -> None:
        if "error" in self.runs[impl]:
            return
        print(f"  {impl}: FAILED\n{message}", file=sys.stderr, flush=True)
        self.runs[impl]["error"] = message
        for proc in self.procs[impl]:
            proc.kill()

    def close(self) -> None:
        for procs in self.procs.values():
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()


def run_size(ctx, size: str, impls: list[str], args) -> dict:
    """All rounds of all implementations for one model size; raw measurements."""
    with tempfile.TemporaryDirectory() as tmp:
        pool = Pool(ctx, impls, size, args, tmp)
        try:
            started = time.monotonic()
            for impl in impls:
                pool.collect(impl, "ready", READY_TIMEOUT_S)
            print(
                f"  {size}: {len(pool.live())} ready in {time.monotonic() - started:.0f}s",
                flush=True,
            )
            for round_index in range(args.warmup + args.steps):
                order = impls[round_index % len(impls) :] + impls[: round_index % len(impls)]
                for impl in order:
                    if impl not in pool.live():
                        continue
                    pool.send(impl, "step", round_index)
                    steps = pool.collect(impl, "step", STEP_TIMEOUT_S)
                    if steps is not None:
                        pool.runs[impl]["steps"].append(_merge_step(steps))
                print(f"  {size}: round {round_index + 1}/{args.warmup + args.steps}", flush=True)
            for impl in pool.live():
                pool.send(impl, "finish", None)
                finals = pool.collect(impl, "final", STEP_TIMEOUT_S)
                if finals is not None:
                    pool.runs[impl]["finals"] = finals
        finally:
            for impl in pool.live():
                pool.send(impl, "finish", None)
            pool.close()
    return pool.runs


def _merge_step(per_rank: list[dict]) -> dict:
    """One step across ranks: it ends when the slowest rank ends; the loss is their mean."""
    return {
        "index": per_rank[0]["index"],
        "seconds": max(s["seconds"] for s in per_rank),
        "rank_seconds": [s["seconds"] for s in per_rank],
        "loss": sum(s["loss"] for s in per_rank) / len(per_rank),
        "collectives": [s["collectives"] for s in per_rank],
        "profile": [s["profile"] for s in per_rank],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    impls = list(args.impls)
    if any(IMPLS[i].family == "deepspeed" for i in impls):
        ok, why = deepspeed_available()
        if not ok:
            print(f"note: skipping DeepSpeed ({why}); install the 'bench' extra", flush=True)
            impls = [i for i in impls if IMPLS[i].family != "deepspeed"]
    if args.fixed_malloc:  # read when a process starts: set before the forkserver exists
        os.environ["GLIBC_TUNABLES"] = FIXED_MALLOC_TUNABLES
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "benchmarks.worker"])
    os.makedirs(args.out, exist_ok=True)
    elem = 4 if args.dtype == "float32" else 2
    results = {
        "command": " ".join(["python", "benchmarks/bench_step.py", *sys.argv[1:]]),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
        "args": vars(args),
        "sizes": {},
    }
    for size in args.sizes:
        num_params = gpt.num_params(gpt.SIZES[size])
        raw = run_size(ctx, size, impls, args)
        runs = {i: {**r, "finals": r["finals"]} for i, r in raw.items()}
        summary = report.summarize_size(
            {"impls": runs},
            warmup=args.warmup,
            world=args.world_size,
            elem=elem,
            num_params=num_params,
        )
        results["sizes"][size] = {"num_params": num_params, "summary": summary}
        print(report.table(size, num_params, summary))
        print(report.ratio_matrix(summary))
        print(report.comm_detail(summary), flush=True)
        table = summary.get("sw_full_shard", {}).get("shardwrap_profile_table")
        if table:
            print("shardwrap.profile, sw_full_shard, last step, rank 0:\n" + table, flush=True)
    report.write_json(os.path.join(args.out, "bench_step.json"), results)
    report.write_chart(os.path.join(args.out, "bench_step.png"), results)
    print(f"wrote {args.out}/bench_step.json and {args.out}/bench_step.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
