"""Ways to run the lean forward's frozen linear layers, and the choice among them per row count.

A decode step multiplies one row by every weight; verifying N drafted tokens multiplies N rows by
the same weights. Both are memory-bound (each weight is read once), but which kernel reads the
weights fastest changes with N, with the dtype and with the CPU (docs/performance.md). So the
runtime times every candidate path on the machine it runs on, per site (q|k|v, o, gate|up, down,
lm_head, each over every layer's weight in turn so that the weights stream from memory as in a
forward) and per row count, and keeps the fastest within a memory budget (`choose_plan`).

Paths (every one computes the same product to round-off; `check_parity` and
tests/eval/test_linear_paths.py hold them to it):
  gemv_t  x @ W_t with W_t (in, out) contiguous: aten::mm, MKL's GEMV for one row.
  linear  F.linear(x, W) with W (out, in): aten::linear, MKL's GEMM with B transposed.
  tall    (W @ xᵀ)ᵀ on W (out, in): the same product as a GEMM with `out` rows and N columns, which
          MKL runs as a row-batched GEMV (W read once for N rows).
  rows    one GEMV per row on W_t: the weight is re-read from cache when it fits (N <= ROWS_MAX).
  dnnl    oneDNN's inner product on a copy blocked for it (`mkldnn._reorder_linear_weight`); fp32,
          or bf16 where oneDNN supports it.

Layouts: "t" (in, out), "rm" (out, in), "dnnl" (blocked). A layer keeps only the layouts its plan
uses, plus one plain layout ("t" or "rm") for `Linear.weight_t`; an "rm" layout taken unchanged from
the source model shares its memory and costs nothing (`Linear.layout_bytes`).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F

from eval.runtime.clock import device_clock, on_cuda

MAX_ROWS = 64  # row counts above this (prefill) use the path chosen for the largest measured size
ROWS_MAX = 4  # the `rows` path is a candidate up to this many rows
PLAIN_LAYOUTS = ("t", "rm")
DEFAULT_CANDIDATES = ("gemv_t", "linear", "tall", "rows", "dnnl")


@dataclass(frozen=True)
class Path:
    name: str
    layout: str
    bind: Callable  # (weight in this layout, bias or None) -> (x (N, in) -> (N, out))
    max_rows: int = MAX_ROWS
    min_rows: int = 1


def _gemv_t(w: torch.Tensor, bias):
    if bias is None:
        return lambda x: x @ w
    return lambda x: torch.addmm(bias, x, w)


def _linear(w: torch.Tensor, bias):
    return lambda x: F.linear(x, w, bias)


def _tall(w: torch.Tensor, bias):
    # The result is copied back to rows: a transposed view would carry a column-major layout into
    # the residual stream, and the next tall product on a column-major input runs ~5x slower.
    if bias is None:
        return lambda x: (w @ x.t()).t().contiguous()
    column = bias[:, None]
    return lambda x: torch.addmm(column, w, x.t()).t().contiguous()


def _rows(w: torch.Tensor, bias):
    one = _gemv_t(w, bias)
    return lambda x: one(x) if x.shape[0] == 1 else torch.cat([one(x[i:i + 1]) for i in range(x.shape[0])])


def _dnnl(w: torch.Tensor, bias):
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


PATHS: dict[str, Path] = {
    "gemv_t": Path("gemv_t", "t", _gemv_t),
    "linear": Path("linear", "rm", _linear),
    "tall": Path("tall", "rm", _tall),
    "rows": Path("rows", "t", _rows, max_rows=ROWS_MAX, min_rows=2),  # one row: gemv_t
    "dnnl": Path("dnnl", "dnnl", _dnnl),
}


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN can block this weight (CPU; fp32, or bf16 where oneDNN runs bf16)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def available(path: str, weight: torch.Tensor) -> bool:
    return PATHS[path].layout != "dnnl" or can_pack(weight)


def build_layout(layout: str, weight: torch.Tensor) -> torch.Tensor:
    """weight: (out, in). Returns it in `layout` (a new tensor, except "rm" of a contiguous weight)."""
    weight = weight.detach()
    if layout == "t":
        return weight.t().contiguous()
    if layout == "rm":
        return weight.contiguous()
    if layout == "dnnl":
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 8)
    raise ValueError(f"unknown weight layout {layout!r} (one of t, rm, dnnl)")


def default_plan(row_major: bool, packed: bool) -> dict[int, str]:
    """The fixed rule used before any measurement: one row through the stored plain layout (GEMV on
    W_t, or F.linear when in > out keeps W row-major), several rows through oneDNN when packed."""
    one = "linear" if row_major else "gemv_t"
    return {1: one, 2: "dnnl" if packed else one}


def table(plan: Mapping[int, str], beyond: str | None = None) -> list[str]:
    """Path name per row count 0..MAX_ROWS (index MAX_ROWS also serves every larger count): the path
    of the nearest measured size whose path takes that many rows (the smaller size on a tie); past
    the largest measured size, `beyond` when given."""
    sizes = sorted(plan)
    out = []
    for n in range(MAX_ROWS + 1):
        rows = max(n, 1)
        fits = [s for s in sizes if PATHS[plan[s]].min_rows <= rows <= PATHS[plan[s]].max_rows]
        if beyond is not None and (rows > sizes[-1] or not fits):
            out.append(beyond)
        else:
            out.append(plan[min(fits, key=lambda s: (abs(s - rows), s))] if fits else "gemv_t")
    return out


# -- measuring --------------------------------------------------------------------------------------
def _input(n: int, features: int, dtype: torch.dtype, device, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, generator=generator).to(device=device, dtype=dtype)


def parity_error(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias=None, reference=None) -> float:
    """max |out - x Wᵀ| / bound, with the float64 product as reference and bound = tolerance x
    (|x| |W|ᵀ + |bias|), the scale of a dot product's round-off; <= 1 passes. The tolerance allows
    a few ulps of the dtype per sqrt(in) terms: a wrong kernel is off by orders of magnitude more.
    reference: (product, scale) from `_reference`, to share between paths."""
    product, scale = reference if reference is not None else _reference(x, weight.double(), bias)
    tolerance = 8 * torch.finfo(out.dtype).eps * math.sqrt(weight.shape[1])
    return float(((out.double() - product).abs() / (tolerance * scale + 1e-30)).max())


def _reference(x: torch.Tensor, w64: torch.Tensor, bias=None) -> tuple[torch.Tensor, torch.Tensor]:
    x64 = x.double()
    product, scale = x64 @ w64.t(), x64.abs() @ w64.abs().t()
    if bias is not None:
        product, scale = product + bias.double(), scale + bias.double().abs()
    return product, scale


PARITY_SIZES = (1, 2, 3, 4, 8, 16, 64)  # row counts checked (kernels change regime at these), with the largest measured


def check_parity(linear, paths: Iterable[str], sizes: Sequence[int]) -> dict[str, float]:
    """Worst `parity_error` of each path on `linear` over the row counts of `sizes` that are in
    PARITY_SIZES, the largest, and each path's smallest (builds missing layouts for the check)."""
    weight, held = linear.weight_t.t(), set(linear.layouts)
    w64 = weight.double()
    wanted = {n for n in sizes if n in PARITY_SIZES} | {max(sizes)} | {PATHS[p].min_rows for p in paths}
    checks = {}
    for n in sorted(wanted):
        x = _input(n, weight.shape[1], weight.dtype, weight.device, seed=n)
        checks[n] = (x, _reference(x, w64, linear.bias))
    errors = {}
    for name in paths:
        path = PATHS[name]
        fn = path.bind(linear.layout(path.layout), linear.bias)
        errors[name] = max(parity_error(fn(x), x, weight, linear.bias, reference) for n, (x, reference) in checks.items()
                           if path.min_rows <= n <= path.max_rows)
    linear.release(set(linear.layouts) - held)
    return errors


def timer(device=None) -> Callable[[], float]:
    """The clock for comparing paths: on CUDA, `eval.runtime.clock.device_clock` (synchronised); on the CPU
    with one torch thread, the thread's CPU time (time other jobs take on a shared machine does not
    count); with several threads, wall time."""
    if on_cuda(device):
        return device_clock(device)
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def clock_name(device=None) -> str:
    """What `timer(device)` reads, for reports."""
    if on_cuda(device):
        return "wall (CUDA synchronised)"
    return "thread CPU time" if torch.get_num_threads() == 1 else "wall"


STREAM_BYTES = 64 * 2**20  # a site is timed over enough layers to stream at least this much (beyond caches)


@torch.no_grad()
def measure_sites(sites: Mapping[str, Sequence], sizes: Sequence[int], candidates: Mapping[str, Sequence[str]],
                  repeats: int = 5, keep_within: float = 1.3) -> dict[str, dict[str, dict[int, float]]]:
    """Seconds to run each candidate path over every layer of each site, per row count.

    Each round times every candidate and size in turn (load on a shared machine hits all alike);
    the minimum over `repeats` rounds is kept. After the first round a candidate is timed again at
    a size only while within `keep_within` of the best there. A site is timed over its first layers
    up to STREAM_BYTES (so the weights come from memory, not cache) and scaled to all its layers.
    Layouts a candidate needs are built for the measurement and released afterwards unless a layer
    already held them. candidates: {site: paths}. Returns {site: {path: {n: seconds}}}."""
    clock = timer(next(iter(sites.values()))[0].weight_t.device)
    times: dict[str, dict[str, dict[int, float]]] = {}
    for site, linears in sites.items():
        weight = linears[0].weight_t
        per_layer = weight.numel() * weight.element_size()
        used = linears[:max(1, min(len(linears), math.ceil(STREAM_BYTES / per_layer)))]
        names = list(candidates[site])
        held = [set(linear.layouts) for linear in used]
        fns = {p: [PATHS[p].bind(linear.layout(PATHS[p].layout), linear.bias) for linear in used] for p in names}
        x = _input(max(sizes), weight.shape[0], weight.dtype, weight.device)
        best = {p: {n: math.inf for n in sizes if PATHS[p].min_rows <= n <= PATHS[p].max_rows} for p in names}
        for round_ in range(repeats):
            for n in sizes:
                rows = x[:n]
                contenders = [p for p in names if n in best[p]]
                if round_:
                    fastest = min(best[p][n] for p in contenders)
                    contenders = [p for p in contenders if best[p][n] <= keep_within * fastest]
                for p in contenders:
                    start = clock()
                    for fn in fns[p]:
                        fn(rows)
                    best[p][n] = min(best[p][n], clock() - start)
        del fns
        for linear, keep in zip(used, held):
            linear.release(set(linear.layouts) - keep)
        scale = len(linears) / len(used)
        times[site] = {p: {n: t * scale for n, t in row.items()} for p, row in best.items()}
    return times


# -- choosing ---------------------------------------------------------------------------------------
@dataclass
class SiteChoice:
    layouts: tuple[str, ...]
    plan: dict[int, str]  # measured size -> path
    beyond: str  # the path for row counts past the largest measured size


def _site_options(times: Mapping[str, Mapping[int, float]], sizes: Sequence[int], weights: Mapping[int, float],
                  layout_bytes: Mapping[str, int]) -> list[tuple[float, int, SiteChoice]]:
    """Every set of layouts for one site: (weighted cost, bytes, choice)."""
    layouts = sorted({PATHS[p].layout for p in times})
    options = []
    for mask in range(1, 1 << len(layouts)):
        chosen = tuple(layout for i, layout in enumerate(layouts) if mask >> i & 1)
        usable = [p for p in times if PATHS[p].layout in chosen]
        plan, cost = {}, 0.0
        for n in sizes:
            candidates = [p for p in usable if n in times[p]]
            if not candidates:
                break
            plan[n] = min(candidates, key=lambda p: times[p][n])
            cost += weights[n] * times[plan[n]][n]
        else:
            wide = [p for p in usable if PATHS[p].max_rows >= MAX_ROWS]
            if not wide:
                continue
            beyond = min(wide, key=lambda p: times[p][sizes[-1]])
            kept = set(chosen)
            if not kept & set(PLAIN_LAYOUTS):  # weight_t needs a plain layout: the cheaper one
                kept.add(min(PLAIN_LAYOUTS, key=lambda layout: layout_bytes[layout]))
            options.append((cost, sum(layout_bytes[layout] for layout in kept), SiteChoice(chosen, plan, beyond)))
    return options


def choose_plan(times: Mapping[str, Mapping[str, Mapping[int, float]]], layout_bytes: Mapping[str, Mapping[str, int]],
                budget_bytes: float) -> dict[str, SiteChoice]:
    """The fastest path per site and row count whose layouts fit in `budget_bytes` in all.

    Cost of a choice = sum over row counts of its seconds divided by the whole model's best seconds
    at that count; one row (every plain decode step, and the unit verification is priced in) weighs
    as much as all other row counts together. Starts from the fastest choice per site and, while
    over budget, takes the step (another layout set at one site) that saves memory at the least
    cost per byte. layout_bytes: {site: {layout: bytes held}} (0 for an "rm" shared with the source).
    """
    sizes = sorted({n for site in times.values() for path in site.values() for n in path})
    best_total = {n: sum(min(t[n] for t in site.values() if n in t) for site in times.values()) for n in sizes}
    weights = {n: (max(len(sizes) - 1, 1) if n == 1 else 1.0) / best_total[n] for n in sizes}
    options = {site: _site_options(paths, sizes, weights, layout_bytes[site]) for site, paths in times.items()}
    current = {site: min(opts, key=lambda o: (o[0], o[1])) for site, opts in options.items()}
    while sum(o[1] for o in current.values()) > budget_bytes:
        steps = [((opt[0] - current[site][0]) / (current[site][1] - opt[1]), site, opt)
                 for site, opts in options.items() for opt in opts if opt[1] < current[site][1]]
        if not steps:
            break
        _, site, opt = min(steps, key=lambda s: s[0])
        current[site] = opt
    return {site: option[2] for site, option in current.items()}


def select_paths(model, sizes: Sequence[int], candidates: Sequence[str] = DEFAULT_CANDIDATES, repeats: int = 5,
                 budget: float = 3.0, trim: bool = True) -> dict:
    """Measure, choose and install the path per site and row count on `model` (a LeanLlama).

    sizes: the row counts the runtime will run (1 is always added; above MAX_ROWS dropped). A model
    without weight copies (`LeanConfig.weight_copies`) chooses among the paths on its own layout.
    budget: weight copies the chosen layouts may hold in all (layouts shared with the source model
    count 0; the default rule holds up to 2: a plain copy plus oneDNN's). Candidates whose output
    on the site's first layer is off the float64 product by more than round-off (`parity_error`)
    are dropped. trim=False keeps the default rule's layouts too (to measure before and after).
    Returns the report: sizes, per-site times (ms), the choice, parity errors, memory."""
    start = time.perf_counter()
    sites = model.linear_sites()
    if not model.config.weight_copies:  # the target's weights in place: only paths on their (out, in) layout
        candidates = [p for p in candidates if PATHS[p].layout == "rm"]
    sizes = sorted({1, *(int(n) for n in sizes if 1 <= int(n) <= MAX_ROWS)})
    parity, usable = {}, {}
    for site, linears in sites.items():
        names = [p for p in candidates if available(p, linears[0].weight_t)]
        parity[site] = check_parity(linears[0], names, sizes)
        usable[site] = [p for p in names if parity[site][p] <= 1.0]
        if not usable[site]:
            raise RuntimeError(f"linear paths: no candidate matches the reference product at {site} ({parity[site]})")
    times = measure_sites(sites, sizes, usable, repeats)
    layout_bytes = {site: {layout: sum(linear.layout_bytes(layout) for linear in linears)
                           for layout in ("t", "rm", "dnnl")} for site, linears in sites.items()}
    one_copy = sum(linear.weight_stored.numel() * linear.weight_stored.element_size()
                   for linears in sites.values() for linear in linears)
    held_before = held_bytes(sites)
    choice = choose_plan(times, layout_bytes, budget * one_copy)
    default = {}
    for site, linears in sites.items():
        rule = table(default_plan(linears[0].row_major, "dnnl" in linears[0].layouts))
        default[site] = {n: rule[n] for n in sizes}
        for linear in linears:
            linear.use(choice[site].plan, choice[site].beyond, trim=trim)

    def matmul_ms(plans: Mapping[str, Mapping[int, str]]) -> dict[int, float]:
        return {n: 1e3 * sum(times[site].get(plans[site][n], {}).get(n, math.nan) for site in sites) for n in sizes}

    return {
        "sizes": sizes,
        "candidates": {site: list(names) for site, names in usable.items()},
        "chosen": {site: {n: c.plan[n] for n in sizes} for site, c in choice.items()},
        "beyond": {site: c.beyond for site, c in choice.items()},
        "layouts": {site: list(c.layouts) for site, c in choice.items()},
        "default": default,
        "matmul_ms": {"default": matmul_ms(default), "chosen": matmul_ms({s: c.plan for s, c in choice.items()})},
        "times_ms": {site: {p: {n: 1e3 * t for n, t in row.items()} for p, row in paths.items()}
                     for site, paths in times.items()},
        "parity_error": parity,
        "memory_mb": {"one_copy": one_copy / 2**20, "budget": budget * one_copy / 2**20,
                      "held_before": held_before / 2**20, "held_after": held_bytes(sites) / 2**20},
        "seconds": time.perf_counter() - start,
    }


# A drafter's linear layer -> the role on the target whose measured paths it takes: the same name,
# or the nearest role in shape (fc maps wider features onto the hidden size, as down_proj does).
FOLLOWS = {"fc": "down_proj"}


def follow(sites: Mapping[str, Sequence], reference: Mapping[str, Sequence]) -> dict[str, str]:
    """Run each linear layer of `sites` (a drafter's, by role) through the paths measured for the
    same role on `reference` (the target's `linear_sites()`): a draft head's layer has the target
    layer's shapes, or nearly, and runs right after a target forward, so the kernel that streams the
    target's weights fastest per row count is the one to take, where the defaults can be ~3x slower
    (a one-row bf16 GEMV). A layer keeps its default rule where the reference was not measured
    (`runtime.linear_paths=default`) or holds another dtype, or where a path does not run on it.
    Returns {site: reference role followed}."""
    followed = {}
    for site, linears in sites.items():
        role = site if site in reference else FOLLOWS.get(site)
        source = reference.get(role, [None])[0] if role else None
        if source is None or source.plan is None:
            continue
        if any(linear.weight_stored.dtype != source.weight_stored.dtype or
               not all(available(p, linear.weight_t) for p in set(source.plan.values()) | {source.beyond} - {None})
               for linear in linears):
            continue
        for linear in linears:
            linear.use(source.plan, source.beyond)
        followed[site] = role
    return followed


def held_bytes(sites: Mapping[str, Sequence]) -> int:
    return sum(linear.layout_bytes(layout) for linears in sites.values() for linear in linears
               for layout in linear.layouts)


def force_path(model, path: str) -> None:
    """Run every row count of every linear layer through `path` (benchmarks, tests)."""
    if path not in PATHS:
        raise ValueError(f"unknown linear path {path!r} (one of {sorted(PATHS)})")
    for linears in model.linear_sites().values():
        for linear in linears:
            if not available(path, linear.weight_t):
                raise ValueError(f"linear path {path!r} is not available for {linear.weight_t.dtype} on this machine")
            linear.use({1: path}, None if PATHS[path].max_rows >= MAX_ROWS else "gemv_t", trim=False)
