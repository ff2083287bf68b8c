# SPDX-License-Identifier: Apache-2.0
"""Plots and ratio tables from kvcache's benchmark JSON (Google Benchmark --benchmark_out).

    /usr/bin/python3 bench/plot.py bench/results          # reads *.json there, writes PNGs and tables.md

Every figure comes from the counters the benchmark programs put in their JSON, so a ratio shown
here is the one measured in one run. A file that is missing (a benchmark not built, or not run)
skips its plot and its table instead of failing the others.
"""

import json
import math
import pathlib
import re
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402


def load(directory, stem):
    path = directory / f"{stem}.json"
    if not path.exists():
        print(f"plot.py: {path} not found; skipping its plots and tables", file=sys.stderr)
        return None
    with path.open() as f:
        return json.load(f)


def runs(data, prefix):
    """Benchmark entries whose name starts with prefix (aggregates, if any, left out)."""
    if data is None:
        return []
    return [b for b in data["benchmarks"] if b["name"].startswith(prefix) and b.get("run_type", "iteration") == "iteration"]


def dtype_of(entry):
    return "bf16" if "/bf16/" in entry["name"] else "float"


def fmt(value, digits=3):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if value >= 100:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}"


def fmt_time_us(us):
    if us >= 1e6:
        return f"{us / 1e6:.3g} s"
    if us >= 1e3:
        return f"{us / 1e3:.3g} ms"
    return f"{us:.3g} µs"


# ------------------------------------------------------------------------------------------------
# cache_bench: KvCache against ConcatKvCache.


def plot_cache_vs_concat(cache, out):
    generate = runs(cache, "generate/")
    steps = runs(cache, "decode_step/")
    if not generate:
        return None
    dtypes = sorted({dtype_of(b) for b in generate}, key=lambda d: d != "float")
    prefills = sorted({int(b["P"]) for b in generate})
    fig, axes = plt.subplots(len(dtypes), len(prefills), figsize=(6 * len(prefills), 4.5 * len(dtypes)), squeeze=False)
    for row, dtype in enumerate(dtypes):
        for col, p in enumerate(prefills):
            ax = axes[row][col]
            g = sorted((b for b in generate if dtype_of(b) == dtype and int(b["P"]) == p), key=lambda b: b["N"])
            s = sorted((b for b in steps if dtype_of(b) == dtype and int(b["P"]) == p), key=lambda b: b["N"])
            n = [b["N"] for b in g]
            ax.plot(n, [b["cache_us_per_token"] for b in g], "o-", color="tab:blue", label="KvCache, mean over the loop")
            if s:
                ax.plot([b["N"] for b in s], [b["cache_us_per_token"] for b in s], "s--", color="tab:blue", alpha=0.6,
                        label="KvCache, N-th token")
            full = [b for b in g if b["concat_full_loop"] == 1]
            derived = [b for b in g if b["concat_full_loop"] == 0]
            ax.plot(n, [b["concat_us_per_token"] for b in g], "o-", color="tab:red",
                    label="ConcatKvCache, mean over the loop\n(hollow: the middle token's, measured)")
            if derived:  # hollow markers over the line: the mean is the middle token's cost, not a full loop
                ax.plot([b["N"] for b in derived], [b["concat_us_per_token"] for b in derived], "o", color="tab:red",
                        markerfacecolor="white")
            if s:
                ax.plot([b["N"] for b in s], [b["concat_us_per_token"] for b in s], "s--", color="tab:red", alpha=0.6,
                        label="ConcatKvCache, N-th token")
            ax.set_xscale("log", base=2)
            ax.set_xticks(n, [str(int(x)) for x in n])
            ax.set_yscale("log")
            ax.set_xlabel("generated tokens N")
            ax.set_ylabel("time per generated token (µs)")
            ax.set_title(f"{dtype}, prefill P = {p}")
            ax.grid(True, which="both", alpha=0.3)
            if row == 0 and col == 0:
                ax.legend(fontsize=8)
    model = (cache.get("context") or {}).get("kvcache_model", "")
    fig.suptitle(f"Cache updates per generated token, every layer ({model})")
    fig.tight_layout()
    path = out / "cache_vs_concat.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table_cache_vs_concat(cache):
    generate = runs(cache, "generate/")
    steps = {(dtype_of(b), int(b["P"]), int(b["N"])): b for b in runs(cache, "decode_step/")}
    if not generate:
        return ""
    lines = [
        "| type | P | N | KvCache per token | ConcatKvCache per token | concat/cache (loop) | concat total | how | "
        "concat/cache at N-th token |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for b in sorted(generate, key=lambda b: (dtype_of(b) != "float", b["P"], b["N"])):
        key = (dtype_of(b), int(b["P"]), int(b["N"]))
        step = steps.get(key)
        how = "full loop" if b["concat_full_loop"] == 1 else "N × middle token"
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {fmt_time_us(b['cache_us_per_token'])} | "
            f"{fmt_time_us(b['concat_us_per_token'])} | **{fmt(b['concat_over_cache'])}×** | "
            f"{fmt_time_us(b['concat_total_ms'] * 1e3)} | {how} | "
            f"{fmt(step['concat_over_cache']) + '×' if step else '–'} |")
    checks = [b for b in generate if b["concat_full_loop"] == 1]
    if checks:
        lines.append("")
        lines.append("Check of the derivation where both were measured (N × middle token ÷ full loop): " + ", ".join(
            f"{dtype_of(b)} P={int(b['P'])} N={int(b['N'])}: {b['concat_total_ms_derived'] / b['concat_total_ms']:.2f}"
            for b in sorted(checks, key=lambda b: (dtype_of(b) != "float", b["P"], b["N"]))))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# cache_bench: update against memcpy, flatness, ring.


def table_micro(cache):
    lines = []
    chunks = runs(cache, "prefill_chunk/")
    if chunks:
        lines += ["| prefill chunk | type | through update() | memcpy | update ÷ memcpy speed |", "|---|---|---:|---:|---:|"]
        for b in chunks:
            lines.append(f"| {int(b['T'])} tokens × {int(b['layers'])} layers | {dtype_of(b)} | {b['update_GBps']:.1f} GB/s | "
                         f"{b['memcpy_GBps']:.1f} GB/s | **{b['update_over_memcpy']:.2f}** |")
        lines.append("")
    for b in runs(cache, "token_flat/"):
        lines += [
            "| single-token update | layers | at history " + str(int(b["near_history"])) + " | at history " +
            str(int(b["far_history"])) + " | ratio |",
            "|---|---:|---:|---:|---:|",
            f"| KvCache, {dtype_of(b)} | {int(b['layers'])} | {b['near_ns_per_token']:.0f} ns | "
            f"{b['far_ns_per_token']:.0f} ns | **{b['far_over_near']:.3f}** |",
            "",
        ]
    for b in runs(cache, "ring_decode/"):
        at = sorted(int(k[len("us_per_token_at_"):]) for k in b if k.startswith("us_per_token_at_"))
        lines += ["| RingKvCache, window " + str(int(b["window"])) + ", " + dtype_of(b) + " | " +
                  " | ".join(f"position {p:,}" for p in at) + " |", "|---|" + "---:|" * len(at)]
        lines.append(f"| per token, {int(b['layers'])} layers | " + " | ".join(f"{b[f'us_per_token_at_{p}']:.2f} µs" for p in at) + " |")
        lines.append("| bytes() | " + " | ".join(f"{b[f'bytes_at_{p}'] / 2**20:.0f} MiB" for p in at) + " |")
        dense = [k for k in b if k.startswith("dense_bytes_at_")]
        lines.append("")
        lines.append(f"Last ÷ first position: **{b['last_over_first']:.3f}**; slowest ÷ fastest: "
                     f"**{b['slowest_over_fastest']:.3f}**." + (
                         f" A KvCache holding all {int(dense[0][len('dense_bytes_at_'):]):,} positions would need "
                         f"{b[dense[0]] / 2**30:.1f} GiB." if dense else ""))
        lines.append("")
    return "\n".join(lines)


def plot_ring(cache, out):
    ring = runs(cache, "ring_decode/")
    if not ring:
        return None
    b = ring[0]
    at = sorted(int(k[len("us_per_token_at_"):]) for k in b if k.startswith("us_per_token_at_"))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(at, [b[f"us_per_token_at_{p}"] for p in at], "o-", color="tab:green", label="update per token (µs)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(at, [f"{p:,}" for p in at])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("position in the sequence")
    ax.set_ylabel("µs per token, all layers")
    ax2 = ax.twinx()
    ax2.plot(at, [b[f"bytes_at_{p}"] / 2**20 for p in at], "s--", color="tab:gray", label="RingKvCache bytes()")
    dense_keys = [k for k in b if k.startswith("dense_bytes_at_")]
    if dense_keys:  # bytes per position of a KvCache that keeps them all, from the benchmark's own counter
        per_position = b[dense_keys[0]] / int(dense_keys[0][len("dense_bytes_at_"):])
        ax2.plot(at, [per_position * p / 2**20 for p in at], ":", color="tab:gray", label="KvCache of every position")
    ax2.set_yscale("log")
    ax2.set_ylabel("MiB")
    handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="center left")
    ax.set_title(f"RingKvCache decode, window {int(b['window'])}, {dtype_of(b)}")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path = out / "ring.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------
# model_bench: end to end.


def table_model(model):
    entries = sorted(runs(model, "model_generate/"), key=lambda b: b["N"])
    if not entries:
        return ""
    lines = ["| N | cached tokens/s | uncached tokens/s | speedup | uncached total | how |", "|---:|---:|---:|---:|---:|---|"]
    for b in entries:
        how = "full loop" if b["uncached_full_loop"] == 1 else "Simpson's rule over 3 measured steps"
        lines.append(f"| {int(b['N'])} | {b['cached_tokens_per_s']:,.0f} | {b['uncached_tokens_per_s']:,.1f} | "
                     f"**{fmt(b['cached_over_uncached'])}×** | {fmt_time_us(b['uncached_total_ms'] * 1e3)} | {how} |")
    checks = [b for b in entries if b["uncached_full_loop"] == 1]
    if checks:
        lines.append("")
        lines.append("Check of the derivation where both were measured (Simpson ÷ full loop): " + ", ".join(
            f"N={int(b['N'])}: {b['uncached_total_ms_derived'] / b['uncached_total_ms']:.2f}" for b in checks))
    return "\n".join(lines)


def plot_model(model, out):
    entries = sorted(runs(model, "model_generate/"), key=lambda b: b["N"])
    if not entries:
        return None
    n = [b["N"] for b in entries]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(n, [b["cached_tokens_per_s"] for b in entries], "o-", color="tab:blue", label="KvCache")
    ax.plot(n, [b["uncached_tokens_per_s"] for b in entries], "-", color="tab:red")
    for b in entries:
        ax.plot(b["N"], b["uncached_tokens_per_s"], "o", color="tab:red",
                markerfacecolor="tab:red" if b["uncached_full_loop"] == 1 else "white")
    ax.plot([], [], "o-", color="tab:red", label="no cache (hollow: derived)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(n, [str(int(x)) for x in n])
    ax.set_yscale("log")
    ax.set_xlabel("generated tokens N")
    ax.set_ylabel("tokens per second")
    ax.set_title("Reference model, greedy generation")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "model.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------
# attention_bench: decode attention bandwidth against the machine's read bandwidth.
#
# Read from whatever the attention benchmark reports, leaning on names as little as possible:
# the rate is the counter `bytes_per_second` (else the first counter whose name says bytes per
# second); the history length S is the argument `S:<n>` in the name (else a counter named like
# S, else the last number in the name); an entry is a read-bandwidth baseline when its name says
# read/memory/bandwidth/stream/memcpy and not attention; `threads:<n>` in a name picks the panel.

RATE_KEYS = re.compile(r"bytes_per_second|bytes_per_s|GBps|bandwidth", re.IGNORECASE)
LENGTH_KEYS = ("S", "history", "keys", "kv_tokens", "tokens", "length", "seq")
BASELINE = re.compile(r"read|memory|bandwidth|stream|memcpy", re.IGNORECASE)
SUFFIXES = ("/manual_time", "/real_time", "/process_time")


def bare_name(entry):
    name = entry.get("run_name") or entry["name"]
    for suffix in SUFFIXES:
        name = name.replace(suffix, "")
    return name


def rate_of(entry):
    if isinstance(entry.get("bytes_per_second"), (int, float)):
        return float(entry["bytes_per_second"])
    for key, value in entry.items():
        if RATE_KEYS.search(key) and isinstance(value, (int, float)):
            return value * (1e9 if "GBps" in key else 1.0)
    return None


def named_arg(entry, arg):
    match = re.search(rf"(?:^|/){re.escape(arg)}:(\d+)(?:/|$)", bare_name(entry))
    return int(match.group(1)) if match else None


def length_of(entry):
    s = named_arg(entry, "S")
    if s is not None:
        return s
    for key in LENGTH_KEYS:
        if isinstance(entry.get(key), (int, float)):
            return int(entry[key])
    numbers = re.findall(r"(\d+)", bare_name(entry))
    return int(numbers[-1]) if numbers else None


def series_name(entry):
    """The name without its S and threads arguments: one line per remaining combination."""
    parts = [p for p in bare_name(entry).split("/") if not re.fullmatch(r"(S|threads):\d+", p)]
    return "/".join(parts)


def attention_points(attention):
    """{threads: ({series: [(S, rate)]} for attention, {series: [(S, rate)]} for baselines)}."""
    panels = {}
    for entry in runs(attention, ""):
        if entry["name"].startswith("DecodeLimit"):
            continue  # plotted against their limits (plot_decode_limit)
        rate = rate_of(entry)
        if rate is None:
            continue
        is_baseline = BASELINE.search(entry["name"]) and "attention" not in entry["name"].lower()
        threads = named_arg(entry, "threads") or 1
        series, baseline = panels.setdefault(threads, ({}, {}))
        (baseline if is_baseline else series).setdefault(series_name(entry), []).append((length_of(entry), rate))
    return panels


def plot_attention(attention, out):
    if attention is None:
        return None
    panels = attention_points(attention)
    if not any(series for series, _ in panels.values()):
        print("plot.py: attention_bench.json has no attention entry with a bytes-per-second counter; no plot",
              file=sys.stderr)
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False, sharey=True)
    for ax, threads in zip(axes[0], sorted(panels)):
        series, baseline = panels[threads]
        for name, points in sorted(series.items()):
            points = sorted(p for p in points if p[0] is not None)
            ax.plot([p[0] for p in points], [p[1] / 1e9 for p in points], "o-", label=name, alpha=0.85)
        for (name, points), style in zip(sorted(baseline.items()), ["--", ":", "-.", (0, (5, 1))] * 4):
            points = sorted(p for p in points if p[0] is not None)
            if len(points) > 1:
                ax.plot([p[0] for p in points], [p[1] / 1e9 for p in points], color="black", linestyle=style,
                        linewidth=2, label=f"{name} (plain read, measured)")
            elif points:
                ax.axhline(points[0][1] / 1e9, color="black", linestyle=style, label=f"{name} (plain read, measured)")
        xs = sorted({p[0] for pts in series.values() for p in pts if p[0] is not None})
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x:,}" for x in xs])
        ax.set_xlabel("history length S (keys)")
        ax.set_ylabel("K + V bytes read per second (GB/s)")
        ax.set_title(f"threads = {threads}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    # The panels share their y axis: scale it to the largest rate of any panel, from zero.
    top = max(p[1] for series, baseline in panels.values() for group in (series, baseline) for pts in group.values()
              for p in pts)
    axes[0][0].set_ylim(0, top / 1e9 * 1.08)
    fig.suptitle("Decode attention (T = 1) against the plain read bandwidth of the same bytes")
    fig.tight_layout()
    path = out / "attention_bandwidth.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table_attention(attention):
    if attention is None:
        return ""
    panels = attention_points(attention)
    ratios = {}  # (threads, series, S) -> "vs_read" or "vs_read / vs_buffer", where the benchmark reports them
    for entry in runs(attention, ""):
        if isinstance(entry.get("vs_read"), (int, float)) and not entry["name"].startswith("DecodeLimit"):
            text = f"{entry['vs_read']:.2f}"
            if isinstance(entry.get("vs_buffer"), (int, float)):
                text += f" / {entry['vs_buffer']:.2f}"
            ratios[(named_arg(entry, "threads") or 1, series_name(entry), length_of(entry))] = text
    lengths = sorted({p[0] for series, baseline in panels.values() for group in (series, baseline)
                      for pts in group.values() for p in pts if p[0] is not None})
    if not lengths:
        return ""
    lines = ["| threads | benchmark | " + " | ".join(f"S = {s:,}" for s in lengths) + " |",
             "|---:|---|" + "---:|" * len(lengths)]
    for threads in sorted(panels):
        series, baseline = panels[threads]
        for group in (baseline, series):
            for name, points in sorted(group.items()):
                by_length = dict(points)
                cells = []
                for s in lengths:
                    if s not in by_length:
                        cells.append("–")
                        continue
                    ratio = ratios.get((threads, name, s))
                    cells.append(f"{by_length[s] / 1e9:.1f}" + (f" ({ratio})" if ratio is not None else ""))
                lines.append(f"| {threads} | {name} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("GB/s of K and V read per second (mean over the benchmark's calls); in brackets, the benchmark's own "
                 "`vs_read` / `vs_buffer`: the median time of a plain read of the same K and V bytes / of an equally "
                 "large twin cache over the median time of an attention call, all timed in turn on every iteration.")
    return "\n".join(lines)


# threads_bench: one decode call per layer, through many layers, at 1 and 2 threads and with the
# automatic choice (threads:0); `us_per_call` and `bytes_per_call` are its counters.


def table_threads(threads):
    rows = {}  # (name without its arguments, S) -> {threads: us per call}, and the bytes per call
    sizes = {}
    for entry in runs(threads, ""):
        s, t = named_arg(entry, "S"), named_arg(entry, "threads")
        if s is None or t is None or not isinstance(entry.get("us_per_call"), (int, float)):
            continue
        key = (series_name(entry), s)
        rows.setdefault(key, {})[t] = entry["us_per_call"]
        sizes[key] = entry.get("bytes_per_call")
    if not rows:
        return ""
    lines = ["| benchmark | S | K+V per call | 1 thread | 2 threads | automatic | 2 threads ÷ 1 | automatic ÷ faster |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for (name, s), by_threads in sorted(rows.items()):
        one, two, auto = (by_threads.get(t) for t in (1, 2, 0))
        size = f"{sizes[(name, s)] / 2**20:.1f} MiB" if sizes.get((name, s)) else "–"
        cells = [f"{v:.1f} µs" if v is not None else "–" for v in (one, two, auto)]
        ratio = f"{two / one:.2f}" if one and two else "–"
        versus = f"{auto / min(one, two):.2f}" if one and two and auto else "–"
        lines.append(f"| {name} | {s:,} | {size} | " + " | ".join(cells) + f" | {ratio} | {versus} |")
    lines.append("")
    lines.append("Microseconds per layer's attention call, each layer over its own KvCache, so that K and V come "
                 "from memory; automatic is `AttentionOptions{}` (threads = 0).")
    return "\n".join(lines)


# attention_bench's DecodeLimit rows: each decode call against the limit it cannot beat, the larger
# of reading its stored bytes (the fastest read form) and doing its multiply-adds at the measured
# rate, for every stored format, H_q over 8 kv heads, S, threads and D.


def limit_rows(attention):
    rows = []
    for entry in runs(attention, "DecodeLimit<"):
        if not isinstance(entry.get("vs_limit"), (int, float)):
            continue
        fmt_name = re.match(r"DecodeLimit<([^>]+)>", entry["name"]).group(1)
        rows.append({"format": fmt_name, "H_q": named_arg(entry, "H_q"), "S": named_arg(entry, "S"),
                     "threads": named_arg(entry, "threads"), "D": named_arg(entry, "D"), "entry": entry})
    return rows


def plot_decode_limit(attention, out):
    rows = [r for r in limit_rows(attention) if r["D"] == 128]
    if not rows:
        return None
    formats = list(dict.fromkeys(r["format"] for r in rows))
    longest = max(r["S"] for r in rows)
    cols = min(3, len(formats))
    fig, axes = plt.subplots((len(formats) + cols - 1) // cols, cols, figsize=(5.2 * cols, 4.2 * ((len(formats) + cols - 1) // cols)),
                             squeeze=False, sharey=True)
    for ax, name in zip(axes.flat, formats):
        for threads, color in ((1, "tab:blue"), (2, "tab:orange")):
            pts = sorted((r["H_q"] // 8, r["entry"]) for r in rows
                         if r["format"] == name and r["threads"] == threads and r["S"] == longest)
            if not pts:
                continue
            g = [p[0] for p in pts]
            ax.plot(g, [p[1]["ns_per_key"] for p in pts], "o-", color=color, label=f"call, {threads} thread(s)")
            ax.plot(g, [p[1]["ns_per_key_read"] for p in pts], "--", color=color, alpha=0.7,
                    label=f"read limit, {threads}")
            ax.plot(g, [p[1]["ns_per_key_multiply_add"] for p in pts], ":", color=color, alpha=0.7,
                    label=f"multiply-add limit, {threads}")
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4, 8], ["1", "2", "4", "8"])
        ax.set_xlabel("query heads per kv head (G)")
        ax.set_ylabel("ns per key of one kv head")
        ax.set_title(name)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(formats):]:
        ax.axis("off")
    fig.suptitle(f"Decode (T = 1, D = 128, 8 kv heads, S = {longest:,}): time per key against the two limits")
    fig.tight_layout()
    path = out / "decode_limit.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table_decode_limit(attention):
    rows = limit_rows(attention)
    if not rows:
        return ""
    cells = {}
    for r in rows:
        e = r["entry"]
        kind = "read" if e.get("limit_is_read", 1) >= 0.5 else "multiply-add"
        cells[(r["format"], r["D"], r["S"], r["threads"], r["H_q"])] = f"{e['vs_limit']:.2f} {'R' if kind == 'read' else 'M'}"
    heads = sorted({r["H_q"] for r in rows})
    lines = ["| format | D | S | threads | " + " | ".join(f"H_q = {h}" for h in heads) + " |",
             "|---|---:|---:|---:|" + "---:|" * len(heads)]
    for key in sorted({(r["format"], r["D"], r["S"], r["threads"]) for r in rows}, key=lambda k: (k[0], k[1], k[2], k[3])):
        lines.append(f"| {key[0]} | {key[1]} | {key[2]:,} | {key[3]} | " +
                     " | ".join(cells.get(key + (h,), "–") for h in heads) + " |")
    lines.append("")
    lines.append("`vs_limit` of each decode call (8 kv heads): the limit's time over the median call's, 1.00 at the "
                 "limit. R: the limit is reading the stored bytes (the fastest of a plain read, a read asking for lines "
                 "ahead and K and V read together, medians); M: the call's 2 H_q S D multiply-adds at the rate "
                 "independent multiply-add chains reach on the same threads.")
    return "\n".join(lines)


def table_prefill(attention):
    """Causal prefill rows of attention_bench: flop rate and the ratio to the multiply-add peak."""
    if attention is None:
        return ""
    rows = [e for e in runs(attention, "") if "Prefill" in e["name"] and isinstance(e.get("vs_multiply_add_peak"),
                                                                                      (int, float))]
    if not rows:
        return ""
    lines = ["| benchmark | GFLOP/s | vs multiply-add peak |", "|---|---:|---:|"]
    for e in rows:
        lines.append(f"| {bare_name(e)} | {e['flops_per_second'] / 1e9:.1f} | {e['vs_multiply_add_peak']:.2f} |")
    lines.append("")
    lines.append("4 D flops per visible query-key pair and query head; `vs_multiply_add_peak`: the median attention "
                 "call's flop rate over that of independent multiply-add chains (as many as the registers hold, up to 16), "
                 "timed in turn on every iteration.")
    return "\n".join(lines)


def main():
    directory = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results")
    cache = load(directory, "cache_bench")
    model = load(directory, "model_bench")
    attention = load(directory, "attention_bench")
    threads = load(directory, "threads_bench")
    plots = [plot_cache_vs_concat(cache, directory), plot_ring(cache, directory), plot_model(model, directory),
             plot_attention(attention, directory), plot_decode_limit(attention, directory)]
    sections = [
        ("Cache against concat", table_cache_vs_concat(cache)),
        ("Update against memcpy, flatness, ring", table_micro(cache)),
        ("End to end", table_model(model)),
        ("Attention bandwidth", table_attention(attention)),
        ("Decode against its limit", table_decode_limit(attention)),
        ("Causal prefill", table_prefill(attention)),
        ("Automatic threads", table_threads(threads)),
    ]
    tables = directory / "tables.md"
    with tables.open("w") as f:
        for title, body in sections:
            if body:
                f.write(f"### {title}\n\n{body}\n\n")
    for path in plots:
        if path:
            print(f"plot.py: wrote {path}")
    print(f"plot.py: wrote {tables}")


if __name__ == "__main__":
    main()
