"""The resident peak of one rank training with ``DiskOffload`` (``--offload nvme``).

[Note: the resident peak under disk offload]
With the master shards, the gradients handed to the optimizer and the Adam state in mapped
files, and every place that touches them releasing the pages it used (base/pages.py), a
rank's resident set no longer grows with the model: it is what one or two units at a time
and one optimizer sub-group at a time need, on top of the process itself. For a decoder
(one unit per layer, the embedding and the head units of their own), with ``U`` a layer's
parameters, ``E`` the head's (``V h``), ``N`` ranks, ``c`` bytes per compute element (2
for bf16), ``b`` per master element (4), ``k`` Adam states, ``S`` the sub-group size,
``L`` layers, ``T`` tokens per rank and step, ``h`` the hidden size, ``V`` the vocabulary::

    process       torch, gloo and Python (measured: PROCESS_BYTES)
    backward through a layer (the highest point of forward and backward, ZeRO-3,
    activation checkpointing in every layer), with X = max(U, E) the unit before it:
      gathered      (2 + 1/N) U c     the layer computing, the one prefetched, the cast
                                      shard that prefetch gathers from
      gradients     2 U c             its local gradients and their flat copy
      in flight     X c + X/N (c + b) the previous unit's reduction: its flat copy, the
                                      reduced chunk, and the fp32 gradient pages written
      activations   L T h c + 64 T h c   the layers' saved inputs; one layer recomputed,
                                      with its activations' gradients and attention's buffers
    backward through the head:
      gathered      E c + (1 + 1/N) U c   the head, the layer prefetched and its cast shard
      gradients     2 E c             its local gradients and their flat copy
      activations   L T h c + T V (c + 3 b)   saved inputs; logits, their fp32 loss copy,
                                      its gradient and the softmax's
    optimizer step:
      sub-group     S b (2 + k)       its master, gradient and state pages (S at most P/N)
      temporaries   min(S, X / N) b   Adam's per-tensor denominator (sqrt(exp_avg_sq) + eps)
                                      for the largest piece it steps
      kept          (U + E) c         reduce-scatter inputs kept for the next step, one of
                                      each unit size (runtime/schedule.py's ScratchPool)

peak = process + the highest of the three. The model's size enters only through ``U``,
``E`` and ``L``; the files hold ``P b (2 + k) / N`` bytes per rank on disk. Measured
against ``benchmarks/bench_beyond_ram.py`` in benchmarks/RESULTS.md (-5% to +2% at
0.2-2.5B parameters).
"""

from __future__ import annotations

from dataclasses import dataclass

# A CPU rank's resident set with shardwrap imported, gloo up and the first step's lazily
# made state (one intra-op thread), calibrated on the benchmark machine (x86-64 Linux,
# torch 2.13, glibc with a fixed 1 MiB mmap threshold; see bench_beyond_ram.py).
PROCESS_BYTES = 340 * 2**20
LAYER_ACTIVATIONS = 64  # elements per token and hidden unit a recomputed layer holds


@dataclass(frozen=True, slots=True)
class DiskRunShape:
    """What the resident peak of a disk-offloaded ZeRO-3 decoder run depends on."""

    num_params: int
    world_size: int
    layer_params: int  # U: the parameters of one layer (the unit per layer)
    hidden: int
    layers: int
    tokens_per_rank: int
    vocab: int  # 0: no head unit of its own (the head is counted as a layer)
    sub_group_size: int
    compute_bytes: int = 2  # bf16
    master_bytes: int = 4  # fp32
    num_states: int = 2  # Adam, AdamW
    process_bytes: int = PROCESS_BYTES

    def __post_init__(self) -> None:
        for name in ("num_params", "world_size", "layer_params", "hidden", "layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        for name in ("tokens_per_rank", "vocab", "sub_group_size", "num_states", "process_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class ResidentPeak:
    """One rank's resident peak: the bytes of each moment's terms, with their formulas."""

    process: int
    moments: tuple[tuple[str, tuple[tuple[str, int, str], ...]], ...]  # (moment, its terms)
    disk_bytes: int  # the files of one rank

    def moment_bytes(self, moment: str) -> int:
        terms = dict(self.moments)[moment]
        return self.process + sum(num_bytes for _, num_bytes, _ in terms)

    @property
    def total(self) -> int:
        return max(self.moment_bytes(moment) for moment, _ in self.moments)

    def describe(self) -> str:
        return ", ".join(
            f"{moment} {self.moment_bytes(moment) / 2**30:.2f}" for moment, _ in self.moments
        )

    def format(self) -> str:
        """Every term with its formula, moment by moment (GiB)."""
        lines = [f"  process {self.process / 2**30:.3f} GiB (measured, PROCESS_BYTES)"]
        for moment, terms in self.moments:
            lines.append(
                f"  {moment}: {self.moment_bytes(moment) / 2**30:.3f} GiB with the process"
            )
            lines.extend(
                f"    {name:<12} {num_bytes / 2**30:7.3f} GiB  {formula}"
                for name, num_bytes, formula in terms
            )
        lines.append(f"  peak {self.total / 2**30:.3f} GiB per rank")
        lines.append(f"  on disk {self.disk_bytes / 2**30:.3f} GiB per rank (P b (2 + k) / N)")
        return "\n".join(lines)


def resident_peak(shape: DiskRunShape) -> ResidentPeak:
    """One rank's resident peak under ``DiskOffload``; see [Note: the resident peak under
    disk offload]."""
    moments = [("backward through a layer", _layer_terms(shape))]
    if shape.vocab:
        moments.append(("backward through the head", _head_terms(shape)))
    moments.append(("optimizer step", _step_terms(shape)))
    b, k = shape.master_bytes, shape.num_states
    return ResidentPeak(
        process=shape.process_bytes,
        moments=tuple(moments),
        disk_bytes=-(-shape.num_params // shape.world_size) * b * (2 + k),
    )


Terms = tuple[tuple[str, int, str], ...]


def _layer_terms(shape: DiskRunShape) -> Terms:
    u, n, c, b = shape.layer_params, shape.world_size, shape.compute_bytes, shape.master_bytes
    t, h = shape.tokens_per_rank, shape.hidden
    x = max(u, shape.vocab * h)
    return (
        ("gathered", 2 * u * c + -(-u // n) * c, f"(2 + 1/N) U c, U = {u:,}, N = {n}"),
        ("gradients", 2 * u * c, f"2 U c = 2 x {u:,} x {c}"),
        ("in flight", x * c + -(-x // n) * (c + b), f"X c + X/N (c + b), X = {x:,}"),
        (
            "activations",
            shape.layers * t * h * c + LAYER_ACTIVATIONS * t * h * c,
            f"L T h c + {LAYER_ACTIVATIONS} T h c, L = {shape.layers}, T = {t:,}, h = {h:,}",
        ),
    )


def _head_terms(shape: DiskRunShape) -> Terms:
    u, n, c, b = shape.layer_params, shape.world_size, shape.compute_bytes, shape.master_bytes
    t, v = shape.tokens_per_rank, shape.vocab
    e = v * shape.hidden
    return (
        ("gathered", e * c + u * c + -(-u // n) * c, f"E c + (1 + 1/N) U c, E = V h = {e:,}"),
        ("gradients", 2 * e * c, "2 E c"),
        (
            "activations",
            shape.layers * t * shape.hidden * c + t * v * (c + 3 * b),
            f"L T h c + T V (c + 3b), V = {v:,}",
        ),
    )


def _step_terms(shape: DiskRunShape) -> Terms:
    b, c, k = shape.master_bytes, shape.compute_bytes, shape.num_states
    # A sub-group holds at most the rank's shard.
    s = min(shape.sub_group_size, -(-shape.num_params // shape.world_size))
    u, e = shape.layer_params, shape.vocab * shape.hidden
    piece = min(s, -(-max(u, e) // shape.world_size))
    return (
        ("sub-group", s * b * (2 + k), f"S b (2 + k) = {s:,} x {b} x {2 + k}"),
        ("temporaries", piece * b, f"min(S, X/N) b = {piece:,} x {b}"),
        ("kept", (u + e) * c, f"(U + E) c = {u + e:,} x {c}"),
    )


__all__ = ["PROCESS_BYTES", "DiskRunShape", "ResidentPeak", "resident_peak"]
